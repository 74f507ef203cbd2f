"""DGFM carried out (Infinite-LLM §4.5): every ``interval_s`` the coordinator plans the
recall-and-swap moves of the debt ledger's cycles (dgfm.py) and has each move's debtor
bring its KV home from the creditor (the node's ``recall`` command, kvd/node/recall.py).

One round::

    ledger (last heartbeats) ─▶ dgfm.plan(debt graph, min_blocks) ─▶ cycles
    per cycle, in dgfm.ordered's order:  A recalls from B ─▶ B from C ─▶ C from A
                                         (room on A)        (the room A's recall freed on B) ...

A recall takes on its debtor the blocks its KV fills so far and frees the whole loan
on its creditor, where the next move of the cycle lands; so around a cycle each node
gets back the loan it lent and takes home what its own KV fills, and no node lends
more than before: no cap is passed. A move that fails (no room on its debtor, a
creditor gone, a request that ended) leaves both nodes as they were and stops its
cycle for this round (the moves after it would find no room); the cycle, if it is
still in the ledger, is planned again on a later round. The ledger is loose (as old
as the last heartbeats): the node, not the ledger, decides whether a recall fits.

``counts`` (in ``kvctl ledger`` and /metrics): rounds run, moves done and failed,
loan blocks recalled and local blocks their KV took on the debtors (``blocks_home``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from kvd.coordinator import dgfm
from kvd.coordinator.ledger import DebtLedger
from transports import TransportError

log = logging.getLogger("kvd.dgfm")

Recall = Callable[[str, str, int], Awaitable[dict[str, Any]]]    # (debtor, creditor, blocks) -> the node's result


class DGFMRounds:
    """DGFM's periodic task over ``ledger``; ``recall(debtor, creditor, blocks)`` asks the
    debtor to bring at least ``blocks`` loan blocks home from the creditor (raises
    ValueError, TransportError or TimeoutError when it cannot); ``nodes()``: the live
    nodes' names (the ledger keeps only theirs)."""

    def __init__(self, ledger: DebtLedger, recall: Recall, nodes: Callable[[], Any], interval_s: float,
                 min_blocks: int) -> None:
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and interval_s >= 0):
            raise ValueError(f"interval_s must be a finite number >= 0, got {interval_s!r}")
        if not isinstance(min_blocks, int) or min_blocks < 1:
            raise ValueError(f"min_blocks must be an int >= 1, got {min_blocks!r}")
        self.ledger, self.recall, self.nodes = ledger, recall, nodes
        self.interval_s, self.min_blocks = interval_s, min_blocks
        self.counts = ledger.dgfm_counts         # shown with the ledger
        self.last: list[dict[str, Any]] = []     # the last round's moves and how each went

    async def run(self) -> None:
        """Until cancelled: a round every ``interval_s`` (0: none). A round that fails is
        logged; the next one runs."""
        if not self.interval_s:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.round()
            except Exception as exc:  # noqa: BLE001 -- a bug in one round must not end the task
                log.warning("DGFM round failed: %s", exc)

    async def round(self) -> list[dict[str, Any]]:
        """Plan and carry out this round's moves (module docstring); each move's outcome."""
        self.ledger.retain(self.nodes())
        free = {e.node: e.free for e in self.ledger.entries.values()}
        outcomes: list[dict[str, Any]] = []
        for cycle in dgfm.cycles(dgfm.plan(self.ledger.debt_graph(), self.min_blocks)):
            for i, mv in enumerate(dgfm.ordered(cycle, free)):
                outcome = {"debtor": mv.debtor, "creditor": mv.creditor, "blocks": mv.blocks, "cycle": list(mv.cycle)}
                try:
                    got = await self.recall(mv.debtor, mv.creditor, mv.blocks)
                except (ValueError, TransportError, TimeoutError) as exc:
                    self.counts["moves_failed"] += 1
                    outcomes.append({**outcome, "ok": False, "reason": str(exc) or type(exc).__name__})
                    outcomes.extend({"debtor": m.debtor, "creditor": m.creditor, "blocks": m.blocks,
                                     "cycle": list(m.cycle), "ok": False, "reason": "skipped: a move before failed"}
                                    for m in dgfm.ordered(cycle, free)[i + 1:])
                    log.info("DGFM: %s could not recall from %s: %s", mv.debtor, mv.creditor, exc)
                    break
                self.counts["moves_done"] += 1
                self.counts["loan_blocks"] += int(got.get("loan_blocks", 0))
                self.counts["blocks_home"] += int(got.get("blocks_home", 0))
                outcomes.append({**outcome, "ok": True, "loan_blocks": got.get("loan_blocks", 0),
                                 "blocks_home": got.get("blocks_home", 0)})
        self.counts["rounds"] += 1
        if outcomes:
            self.last = outcomes
        return outcomes
