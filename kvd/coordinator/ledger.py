"""The global debt ledger (Infinite-LLM's gManager, §4.4): every node's free
device blocks, its lending cap, the blocks it lent per debtor and borrowed
per creditor, as its heartbeats report them.

Pure bookkeeping (no I/O, no asyncio, no torch), fed by the coordinator
daemon with each accepted heartbeat and told when a node leaves or dies.

Loose coherence: the ledger is as old as each node's last heartbeat and
never tracks single allocations. It only recommends creditors; the debtor
then asks them itself (kvd/node/lending.py), and a creditor's rManager has
the last word (first come, first served, under its cap). A creditor that
said no (the debtor names it in its next ``CreditorQuery.exclude``) is not
recommended again until its next heartbeat: the gManager's "pause
forwarding until resources become available".

The debt graph has an edge debtor -> creditor weighted by the blocks the
creditor reports lent to that debtor (the creditor holds the blocks: its
word counts); DGFM (dgfm.py, carried out by dgfm_rounds.py) removes its cycles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd import protocol

MAX_CANDIDATES = 3


@dataclass
class LedgerEntry:
    """One node's line of the ledger, from its last heartbeat."""

    node: str
    address: str = ""
    free: int = 0                                   # free device blocks
    lend_cap: int = 0                               # [engine].lend_kv_blocks
    lent: dict[str, int] = field(default_factory=dict)       # debtor -> blocks
    borrowed: dict[str, int] = field(default_factory=dict)   # creditor -> blocks
    refused_since_beat: bool = False                # a debtor heard "no" after its last beat

    @property
    def lent_total(self) -> int:
        return sum(self.lent.values())

    @property
    def lendable(self) -> int:
        """Blocks it could lend at its last beat: under its cap, and free."""
        return max(0, min(self.lend_cap - self.lent_total, self.free))


def same_host_cost(a: str, b: str) -> float:
    """The default link cost between two transport URLs: 0 on one host, 1 across hosts."""
    def host(url: str) -> str:
        rest = url.split("://", 1)[-1]
        return rest.rsplit(":", 1)[0] if ":" in rest else rest
    return 0.0 if host(a) == host(b) else 1.0


class DebtLedger:
    """Nodes' ledger lines by name (module docstring). ``link_cost(a, b)``:
    the relative cost of the link between two nodes' addresses."""

    def __init__(self, link_cost: Callable[[str, str], float] = same_host_cost) -> None:
        self.entries: dict[str, LedgerEntry] = {}
        self.link_cost = link_cost
        self.queries = 0
        self.unanswered = 0                          # queries with no candidate
        # DGFM's moves carried out (dgfm_rounds.py): rounds, moves done and failed, loan
        # blocks recalled, local blocks their KV took on the debtors
        self.dgfm_counts = {"rounds": 0, "moves_done": 0, "moves_failed": 0, "loan_blocks": 0, "blocks_home": 0}

    def update(self, address: str, hb: protocol.Heartbeat) -> None:
        """A node's accepted heartbeat: its line, replaced."""
        self.entries[hb.node] = LedgerEntry(node=hb.node, address=address, free=hb.free_blocks.get("device", 0),
                                            lend_cap=hb.lend_cap, lent=dict(hb.lent), borrowed=dict(hb.borrowed))

    def retain(self, nodes) -> None:
        """Keep the lines of ``nodes`` (the registered, live ones) only."""
        for name in [n for n in self.entries if n not in nodes]:
            del self.entries[name]

    def remove(self, node: str) -> None:
        """``node`` left or was declared dead: it lends nothing from now on
        (what others report about it stays until their next beats)."""
        self.entries.pop(node, None)

    def candidates(self, debtor: str, blocks: int, exclude: tuple[str, ...] = ()) -> list[LedgerEntry]:
        """Up to three creditors for ``blocks`` blocks of ``debtor``, best
        first: the cheapest link from the debtor, then the most blocks it
        could lend, then the name (a stable order). Never the debtor, a node
        the ledger does not hold (dead, left, never beat), one in ``exclude``
        (it just said no: paused until its next beat), or one whose cap or
        free blocks fall short. Changes nothing but those pauses."""
        self.queries += 1
        for name in exclude:
            if name in self.entries:
                self.entries[name].refused_since_beat = True
        me = self.entries.get(debtor)
        origin = me.address if me is not None else ""
        fit = [e for e in self.entries.values()
               if e.node != debtor and not e.refused_since_beat and e.lendable >= blocks]
        fit.sort(key=lambda e: (self.link_cost(origin, e.address), -e.lendable, e.node))
        if not fit:
            self.unanswered += 1
        return fit[:MAX_CANDIDATES]

    def debt_graph(self) -> dict[tuple[str, str], int]:
        """(debtor, creditor) -> blocks, from the creditors' reports."""
        return {(debtor, e.node): n for e in self.entries.values() for debtor, n in e.lent.items() if n > 0}

    def describe(self) -> dict[str, Any]:
        """What ``kvctl ledger`` shows: each node's line and the debt graph's edges."""
        return {"nodes": [{"node": e.node, "free": e.free, "lend_cap": e.lend_cap, "lent": dict(e.lent),
                           "borrowed": dict(e.borrowed), "lendable": e.lendable,
                           "paused": e.refused_since_beat} for e in sorted(self.entries.values(),
                                                                           key=lambda e: e.node)],
                "debts": [{"debtor": d, "creditor": c, "blocks": n}
                          for (d, c), n in sorted(self.debt_graph().items())],
                "queries": self.queries, "unanswered": self.unanswered, "dgfm_counts": dict(self.dgfm_counts)}
