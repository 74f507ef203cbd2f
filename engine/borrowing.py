"""Borrowed KV on the serving path (Infinite-LLM §4.3-4.4): which requests hold
KV in blocks other nodes lent, when the scheduler borrows, and what happens
when a loan is lost.

When the scheduler cannot admit the request at the head of the queue (its
whole sequence, prompt + max_tokens, needs more free blocks than this
MemPool has), it asks ``KVBorrowing.admit``: the request keeps its first
whole 128-key chunks in local blocks (as many as fit beside the running
requests' next step) and borrows the rest, one loan sized for every
position after them, through ``borrow`` (the node's debtor,
kvd/node/lending.py). The loan becomes the sequence's open remote part
(engine/dist_attention.py ``RemoteKV``): each step's K/V of those positions
is written into it and attention over them is computed there. Only when no
creditor lends does the request wait (and a node that was told no waits
``retry_s`` before it asks again); while it waits for a creditor, requests
queued behind it that fit in local blocks are admitted (a remote "no" does
not hold the queue, only a local shortage does); a request that
fits only on borrowed blocks (longer than the whole MemPool) and finds no
creditor for ``give_up_s`` fails with that reason. A running request
whose decode needs a block when none is free, its local blocks ending at a
chunk boundary, borrows the rest of its sequence the same way (``grow``)
before the scheduler preempts anything.

A request with remote parts:

- holds no local block past its local part: the scheduler neither
  allocates blocks for its remote positions nor counts them in a step's
  growth; its prefix-cache entries are its local full blocks only (it is
  admitted without a cached prefix; release_memory indexes ``block_ids``,
  which are local);
- is preempted by recompute (its loans returned), never swapped;
- is not replicated and never computed for another node (a prefill leg
  waits for local blocks): the KV a replica or a decode node would need is
  not all here;
- returns its loans when it ends, however it ends (``release``);
- may have its remote part brought home into local blocks while it runs
  (engine/recall.py, DGFM's recall; ``detach``), and goes on as a local request.

A loan lost (its creditor dead, silent past the layer's deadline, or
refusing) raises ``RemoteKVError`` in the step; ``lost`` names the step's
requests that have remote parts, which the engine preempts by recompute:
their KV is computed again from their tokens, into local blocks or a new
loan, and their streams go on with the same tokens.

Pure and synchronous: ``borrow`` and ``give_back`` are the node's (they
block the engine thread for at most the node's request deadline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.dist_attention import Lender, RemoteKV, RemotePart
from engine.request import Request
from kernels.dist_attention import KEY_CHUNK

# Seconds a node waits, after no creditor lent, before it asks again.
RETRY_S = 1.0
# Seconds a request that fits only on borrowed blocks waits for a creditor before it fails.
GIVE_UP_S = 10.0


@dataclass(frozen=True)
class Loan:
    """Blocks borrowed for one request: ``loan_id``, and ``lender(request_id, lo)``, the
    ``Lender`` of a remote part from chunk ``lo`` in them."""

    loan_id: str
    blocks: int
    lender: Callable[[str, int], Lender]


class KVBorrowing:
    """The requests of one engine with remote parts (module docstring).

    ``borrow(blocks)``: a loan of that many blocks, or None when no one lends them;
    ``give_back(loan_id)``: return a loan (without waiting for the answer); ``cap``: most
    blocks borrowed at once, all requests together."""

    def __init__(self, block_size: int, cap: int, borrow: Callable[[int], Loan | None],
                 give_back: Callable[[str], None], remote_kv: RemoteKV, retry_s: float = RETRY_S,
                 give_up_s: float = GIVE_UP_S) -> None:
        if KEY_CHUNK % block_size:
            raise ValueError(f"borrowing KV needs a block size that divides {KEY_CHUNK}, got {block_size}")
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap!r}")
        self.block_size, self.cap = block_size, cap
        self.borrow, self.give_back, self.remote_kv, self.retry_s = borrow, give_back, remote_kv, retry_s
        self.give_up_s = give_up_s
        self.loans: dict[str, list[Loan]] = {}          # request id -> its loans
        self._refused_since: dict[str, float] = {}      # request id -> when no creditor first lent for it
        self._awaiting_creditor: set[str] = set()       # request ids whose last want was a creditor's "no"
        self._next_try = 0.0
        self.counts = {"borrowed": 0, "refused": 0, "returned": 0, "lost": 0, "recalled": 0}

    def holds(self, req: Request) -> bool:
        """Whether ``req`` has KV in remote parts."""
        return req.request_id in self.loans

    def borrowed_blocks(self) -> int:
        return sum(loan.blocks for loans in self.loans.values() for loan in loans)

    def admit(self, req: Request, total_tokens: int, free_blocks: int) -> int | None:
        """Give ``req`` (whose ``total_tokens`` need more than ``free_blocks`` blocks) a
        remote part after its first whole chunks that fit in ``free_blocks``: the number of
        local blocks it then needs, or None (nothing borrowed: it waits)."""
        local_chunks = free_blocks // (KEY_CHUNK // self.block_size)
        return self._lend_after(req, local_chunks, total_tokens)

    def grow(self, req: Request, total_tokens: int) -> bool:
        """A running ``req`` whose local blocks end at a chunk boundary and that needs one
        more block, none free: give it a remote part from there on (True), or not (False:
        the scheduler preempts, as without borrowing)."""
        per_chunk = KEY_CHUNK // self.block_size
        if self.holds(req) or len(req.block_ids) % per_chunk:
            return False
        return self._lend_after(req, len(req.block_ids) // per_chunk, total_tokens) is not None

    def _lend_after(self, req: Request, local_chunks: int, total_tokens: int) -> int | None:
        """Borrow every block of ``req``'s ``total_tokens`` after its first ``local_chunks``
        chunks, as its open remote part: its local blocks, or None (nothing borrowed)."""
        per_chunk = KEY_CHUNK // self.block_size
        remote = -(-total_tokens // self.block_size) - local_chunks * per_chunk
        if local_chunks < 1 or remote < 1 or self.borrowed_blocks() + remote > self.cap:
            self._awaiting_creditor.discard(req.request_id)    # it waits for this node's memory
            return None
        if time.monotonic() < self._next_try:
            return None
        loan = self.borrow(remote)
        if loan is None:
            self.counts["refused"] += 1
            self._next_try = time.monotonic() + self.retry_s
            self._refused_since.setdefault(req.request_id, time.monotonic())
            self._awaiting_creditor.add(req.request_id)
            return None
        self._refused_since.pop(req.request_id, None)
        self._awaiting_creditor.discard(req.request_id)
        self.counts["borrowed"] += 1
        self.loans[req.request_id] = [loan]
        self.remote_kv.add(req.request_id, [RemotePart(local_chunks, None, loan.lender(req.request_id, local_chunks))])
        return local_chunks * per_chunk

    def refused(self, req: Request) -> bool:
        """Whether ``req`` waits for a creditor, not for this node's memory: its last
        attempt had the local blocks and the cap but a creditor said no (or it waits
        ``retry_s`` after that no). The scheduler admits the requests behind it that fit
        in local blocks meanwhile; once its local part no longer fits, it holds the queue
        again, as without borrowing."""
        return req.request_id in self._awaiting_creditor

    def given_up(self, req: Request) -> bool:
        """Whether no creditor has lent for ``req`` for ``give_up_s`` seconds."""
        since = self._refused_since.get(req.request_id)
        return since is not None and time.monotonic() - since >= self.give_up_s

    def release(self, req: Request) -> None:
        """``req`` ends or is preempted: its remote parts are gone, its loans returned."""
        self.remote_kv.drop(req.request_id)
        self._refused_since.pop(req.request_id, None)
        self._awaiting_creditor.discard(req.request_id)
        for loan in self.loans.pop(req.request_id, []):
            self.counts["returned"] += 1
            self.give_back(loan.loan_id)

    def detach(self, req: Request, loan_id: str) -> None:
        """``req``'s remote part on loan ``loan_id`` came home (engine/recall.py): the part
        and the loan leave it, without giving the loan back (the caller does)."""
        self.remote_kv.drop(req.request_id)
        self.loans[req.request_id] = [loan for loan in self.loans.get(req.request_id, []) if loan.loan_id != loan_id]
        if not self.loans[req.request_id]:
            del self.loans[req.request_id]
        self.counts["recalled"] += 1

    def lost(self, reqs: list[Request]) -> list[Request]:
        """Of a step that failed on a remote part, the requests to compute again (those
        with remote parts); counted as lost."""
        out = [r for r in reqs if self.holds(r)]
        self.counts["lost"] += len(out)
        return out

    def stats(self) -> dict:
        return {"requests": len(self.loans), "blocks": self.borrowed_blocks(), **self.counts}
