"""rManager (Infinite-LLM §4.3): this node's KV blocks as a lender and a
borrower sees them, a view on MemPool (the only door to KV memory).

Pure and synchronous: no I/O, no clock of its own (every call that needs
the time takes ``now``, monotonic seconds). Every call runs where the
pool's owner runs it (the engine thread).

Blocks of the device tier are, for the rManager::

    free ───── lend (FCFS, <= cap) ───────────────────────▶ lent to debtor D
      ▲          a LENT region (region.py) per loan,            │  renew (D's own loans only):
      │          its deadline the loan's lease                  │  lease = now + lease_s
      ├──────── give_back (D returns it): region.commit ◀───────┤
      └──────── expire (lease over, D silent): region.cancel ◀──┘

    owned: blocks of this node's own requests (used, not cached, not lent)

A loan takes blocks as this node's own requests do (MemPool
``lendable``): free ones first, then unlocked cached blocks, which lending
evicts least recently used first; blocks a running request holds or that
are pinned (locked in the prefix index) are never lent.

A loan asks for ``blocks`` at once; the answer is a ``Loan`` or a refusal
(a reason string) given at once: lending is off (cap 0), the debtor would
pass the cap, or the tier has fewer lendable blocks. A refusal changes
nothing (no cached block evicted). Loans are served first
come, first served: the rManager never queues or reorders them.

A loan's blocks accept writes and queries only from the debtor they were
lent to (``access``); anything else is refused and counted
(``counts["forbidden"]``) and changes nothing.

As a debtor, the rManager only books what this node borrowed from whom
(``borrowed``): the blocks live on the creditor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.memory.mempool import MemPool
from engine.memory.region import Purpose, Region, RegionState


@dataclass(eq=False)
class Loan:
    """Blocks lent to ``debtor``: the LENT ``region`` holds them; its
    deadline is the lease's end (monotonic)."""

    loan_id: str
    debtor: str
    region: Region

    @property
    def blocks(self) -> int:
        return len(self.region.block_ids)

    @property
    def expires(self) -> float:
        assert self.region.deadline is not None
        return self.region.deadline


@dataclass(frozen=True)
class Borrowed:
    """Blocks this node borrowed: ``blocks`` on ``creditor`` under ``loan_id``."""

    loan_id: str
    creditor: str
    blocks: int


class RManager:
    """The loans of one MemPool's ``tier`` (module docstring).

    ``lend_cap``: most blocks lent at once, all debtors together (0:
    lending off). ``lease_s``: how long a loan lives without a renewal."""

    def __init__(self, pool: MemPool, lend_cap: int, lease_s: float, tier: str = "device") -> None:
        if not isinstance(lend_cap, int) or isinstance(lend_cap, bool) or lend_cap < 0:
            raise ValueError(f"lend_cap must be an int >= 0, got {lend_cap!r}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.pool = pool
        self.lend_cap = lend_cap
        self.lease_s = lease_s
        self.tier = tier
        self.loans: dict[str, Loan] = {}             # by loan id, in grant order
        self.borrowed: dict[str, Borrowed] = {}      # as a debtor, by loan id
        self.counts = {"granted": 0, "refused": 0, "returned": 0, "expired": 0, "forbidden": 0}

    # ---------------------------------------------------------------- views
    def lent_blocks(self) -> int:
        return sum(loan.blocks for loan in self.loans.values())

    def lent_per_debtor(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for loan in self.loans.values():
            out[loan.debtor] = out.get(loan.debtor, 0) + loan.blocks
        return out

    def borrowed_per_creditor(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.borrowed.values():
            out[b.creditor] = out.get(b.creditor, 0) + b.blocks
        return out

    def owned_blocks(self) -> int:
        """Blocks of ``tier`` this node's own requests hold (not cached, not lent)."""
        return self.pool.stats()[self.tier]["request_owned"] - self.lent_blocks()

    def can_lend(self) -> int:
        """Most blocks one loan could get now: under the cap and lendable
        (free, or cached and unlocked)."""
        return max(0, min(self.lend_cap - self.lent_blocks(), self.pool.lendable(self.tier)))

    # --------------------------------------------------------- as a creditor
    def lend(self, debtor: str, blocks: int, loan_id: str, now: float) -> Loan | str:
        """Lend ``blocks`` lendable blocks to ``debtor`` under the new id
        ``loan_id``, leased until ``now + lease_s``; or the reason why not
        (then nothing changed). Raises ValueError on a bad argument or a
        loan id in use (the caller's bug)."""
        if not debtor or not isinstance(blocks, int) or blocks < 1:
            raise ValueError(f"lend: debtor {debtor!r}, blocks {blocks!r}")
        if loan_id in self.loans:
            raise ValueError(f"lend: loan id {loan_id!r} in use")
        if self.lend_cap == 0:
            return self._refuse("lending is off on this node (lend_kv_blocks = 0)")
        lent = self.lent_blocks()
        if lent + blocks > self.lend_cap:
            return self._refuse(f"over the lending cap: {lent} of {self.lend_cap} blocks lent, asked for {blocks}")
        region = self.pool.reserve_region((), blocks, self.tier, Purpose.LENT, deadline=now + self.lease_s)
        if region is None:
            return self._refuse(f"{self.pool.lendable(self.tier)} lendable blocks, asked for {blocks}")
        loan = self.loans[loan_id] = Loan(loan_id, debtor, region)
        self.counts["granted"] += 1
        return loan

    def renew(self, debtor: str, loan_ids: tuple[str, ...] | list[str], now: float) -> int:
        """``debtor`` is alive and still holds ``loan_ids``: their leases
        run until ``now + lease_s``. Ids that are not this debtor's loans
        are ignored (a stranger cannot keep a loan alive). Returns how many
        were renewed."""
        renewed = 0
        for loan_id in loan_ids:
            loan = self.loans.get(loan_id)
            if loan is not None and loan.debtor == debtor:
                loan.region.deadline = now + self.lease_s
                renewed += 1
        return renewed

    def give_back(self, debtor: str, loan_id: str) -> str | None:
        """``debtor`` returns ``loan_id``: its blocks are freed. The reason
        it cannot (not a loan of that debtor: nothing changed), else None."""
        loan = self.access(loan_id, debtor)
        if isinstance(loan, str):
            return loan
        del self.loans[loan_id]
        loan.region.commit()
        self.counts["returned"] += 1
        return None

    def expire(self, now: float) -> list[Loan]:
        """End every loan whose lease ran out before ``now``: its blocks are
        freed. Returns those loans."""
        dead = [loan for loan in self.loans.values() if loan.region.expired(now)]
        for loan in dead:
            del self.loans[loan.loan_id]
            loan.region.cancel()
            self.counts["expired"] += 1
        return dead

    def access(self, loan_id: str, debtor: str | None) -> Loan | str:
        """The gate of every write and query to a loan's blocks: the loan
        when ``debtor`` is the one it was lent to, else the reason (counted
        as forbidden; nothing changed)."""
        loan = self.loans.get(loan_id)
        if loan is None or loan.debtor != debtor or loan.region.state is not RegionState.RESERVED:
            self.counts["forbidden"] += 1
            return f"no loan {loan_id!r} of this node to {debtor!r}"
        return loan

    def still_lent(self, loan: Loan) -> bool:
        """Whether ``loan`` (one ``access`` gave) is still out as it was: not returned,
        expired or reissued. Counts nothing: for a caller that checked ``access`` once and
        serves the same loan again (kvd/node/ring_lane.py)."""
        return self.loans.get(loan.loan_id) is loan and loan.region.state is RegionState.RESERVED

    def write(self, loan_id: str, debtor: str | None, start: int, payload: Any, layers: tuple[int, int]) -> str | None:
        """``debtor`` writes layers ``[l0, l1)`` of its loan's blocks
        ``[start, start + n)`` (``Region.fill_blocks``); the reason it may
        not (nothing written), else None."""
        loan = self.access(loan_id, debtor)
        if isinstance(loan, str):
            return loan
        try:
            loan.region.fill_blocks(start, payload, layers)
        except ValueError as exc:
            return str(exc)
        return None

    def _refuse(self, why: str) -> str:
        self.counts["refused"] += 1
        return why

    # ----------------------------------------------------------- as a debtor
    def note_borrowed(self, creditor: str, loan_id: str, blocks: int) -> None:
        """This node now holds ``blocks`` on ``creditor`` under ``loan_id``."""
        if loan_id in self.borrowed:
            raise ValueError(f"note_borrowed: loan id {loan_id!r} already booked")
        self.borrowed[loan_id] = Borrowed(loan_id, creditor, blocks)

    def note_returned(self, loan_id: str) -> Borrowed | None:
        """This node gave ``loan_id`` back (or lost it with its creditor)."""
        return self.borrowed.pop(loan_id, None)

    def loans_from(self, creditor: str) -> list[str]:
        """The ids of this node's loans on ``creditor`` (to renew or to give back)."""
        return [b.loan_id for b in self.borrowed.values() if b.creditor == creditor]

    # ------------------------------------------------------------ reporting
    def report(self) -> dict[str, Any]:
        """What a heartbeat carries and ``kvctl`` shows: the cap, blocks
        lent per debtor, borrowed per creditor, lendable (free or evictable
        cached) and owned blocks, counts."""
        return {"lend_cap": self.lend_cap, "free": self.pool.lendable(self.tier),
                "owned": self.owned_blocks(), "lent": self.lent_per_debtor(),
                "borrowed": self.borrowed_per_creditor(), "counts": dict(self.counts)}
