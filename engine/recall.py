"""Bringing a request's borrowed KV home (Infinite-LLM §4.5, DGFM's recall): the
engine's half, synchronous, run between two steps.

A request with a remote part (engine/borrowing.py) holds the KV of its positions
from chunk ``lo`` on in a creditor's loan. A recall moves them into blocks of this
MemPool and switches the request's block table from the remote part to them, at a
step boundary, without stopping the request::

    begin (between steps)        the node fetches the loan's       finish (between steps)
    ──────────────────────       first blocks from the creditor    ──────────────────────
    n1 = positions written       (kvd/node/recall.py), while the   alloc local blocks for every
    the part's lender is         request goes on stepping: the     position written by now;
    wrapped by a Recording:      Recording keeps a copy of each    write the fetched blocks, then
    every later K/V write is     K/V the steps send to the part    the recorded K/V over them;
    kept here too                                                  block_ids += them, the part
                                                                   dropped: the loan is free to go

Positions below ``n1`` never change once written, so the fetched blocks hold them
for good; every position written after ``begin`` is in the Recording (in the
cache's dtype, as the part stored it), so the local copy is the creditor's, bit
for bit, and attention over it gives the same tokens. A request that ends, is
preempted or loses its loan between ``begin`` and ``finish`` is left alone
(``finish`` says why); ``abort`` puts the part's own lender back. A later
``begin`` on the same loan replaces an earlier one, whose ``finish`` then fails.

Only a request past its prompt is recalled (a prefilling one holds local blocks
for its local chunks only; the scheduler allocates none for the rest), with one
open remote part (what ``KVBorrowing`` gives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.dist_attention import Lender, PartialsHandle, RemotePart
from kernels.dist_attention import KEY_CHUNK


class Recording:
    """A ``Lender`` that keeps a copy of every K/V write it forwards to ``inner``:
    per layer, (positions, k, v) in write order."""

    def __init__(self, inner: Lender) -> None:
        self.inner = inner
        self.writes: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def start(self, layer: int, q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> PartialsHandle:
        if len(positions):      # copies: k, v may be views of the step's tensors
            self.writes.setdefault(layer, []).append((positions.clone(), k.clone(), v.clone()))
        return self.inner.start(layer, q, ctx, positions, k, v)


@dataclass
class RecallPlan:
    """One recall in flight: loan ``loan_id`` of request ``request_id``, its part from
    chunk ``lo``; ``written``: positions of the part written at ``begin``
    (``fetch_blocks`` blocks to fetch from the creditor)."""

    request_id: str
    loan_id: str
    lo: int
    written: int
    fetch_blocks: int
    recording: Recording = field(repr=False)


def loans_of(engine) -> dict[str, tuple[str, int]]:
    """This engine's loans that requests hold: loan id -> (request id, blocks). Engine thread."""
    borrowing = engine.scheduler.borrowing
    if borrowing is None:
        return {}
    return {loan.loan_id: (rid, loan.blocks) for rid, loans in borrowing.loans.items() for loan in loans}


def _find(engine, loan_id: str):
    """(request, its one remote part) holding ``loan_id``, or the reason there is none."""
    borrowing = engine.scheduler.borrowing
    rid = loans_of(engine).get(loan_id, (None,))[0]
    if borrowing is None or rid is None:
        return f"no request holds loan {loan_id!r}"
    req = engine.requests.get(rid)
    parts = borrowing.remote_kv.parts(rid)
    running = req is not None and any(r is req for r in engine.scheduler.running)
    if not running or len(parts) != 1 or parts[0].hi is not None:
        return f"request {rid} on loan {loan_id!r} is not running on one open remote part"
    return req, parts[0]


def begin(engine, loan_id: str) -> RecallPlan | str:
    """Start recalling ``loan_id``: its part's writes recorded from now on. The plan, or
    the reason not (nothing changed). Engine thread, between steps."""
    found = _find(engine, loan_id)
    if isinstance(found, str):
        return found
    req, part = found
    if req.prefilling:
        return f"request {req.request_id} is still computing its prompt"
    # a Recording left by a recall that never finished (its caller gave up): this one replaces it
    inner = part.lender.inner if isinstance(part.lender, Recording) else part.lender
    written = max(req.num_computed - part.lo * KEY_CHUNK, 0)
    recording = Recording(inner)
    engine.scheduler.borrowing.remote_kv.add(req.request_id, [RemotePart(part.lo, None, recording)])
    bs = engine.config.block_size
    return RecallPlan(req.request_id, loan_id, part.lo, written, -(-written // bs), recording)


def abort(engine, plan: RecallPlan) -> None:
    """Give the part its own lender back (the recall failed). Engine thread."""
    found = _find(engine, plan.loan_id)
    if not isinstance(found, str) and found[1].lender is plan.recording:
        engine.scheduler.borrowing.remote_kv.add(plan.request_id, [RemotePart(plan.lo, None, plan.recording.inner)])


def finish(engine, plan: RecallPlan, fetched: torch.Tensor | None, spare: int) -> int | str:
    """Bring the part home: ``fetched`` [L, 2, plan.fetch_blocks, bs, kvh, hd] (the
    loan's first blocks, None when there were none) and the recorded writes go into
    new local blocks, which join the request's block table; the part and the loan
    leave the request (the caller returns the loan). Needs ``spare`` more free blocks
    than it takes (the running requests' next steps). The local blocks taken, or the
    reason not (the part keeps its own lender; nothing else changed). Engine thread,
    between steps."""
    found = _find(engine, plan.loan_id)
    if isinstance(found, str) or found[1].lender is not plan.recording:
        return found if isinstance(found, str) else f"loan {plan.loan_id!r} changed during its recall"
    req, part = found
    pool, bs = engine.pool, engine.config.block_size
    k0 = part.lo * KEY_CHUNK
    if len(req.block_ids) * bs != k0:
        abort(engine, plan)
        return f"request {req.request_id}'s local blocks do not end where its remote part starts"
    written = max(req.num_computed - k0, 0)
    need = -(-written // bs)
    if pool.available() < need + spare:
        abort(engine, plan)
        return f"{pool.available()} free blocks here, the recall needs {need} and {spare} spare"
    ids = pool.alloc_mem(need) if need else []
    if ids is None:
        abort(engine, plan)
        return f"no {need} free blocks here"
    if fetched is not None and plan.fetch_blocks:
        pool.write_blocks(ids[:plan.fetch_blocks], fetched)
    table = torch.tensor(ids, dtype=torch.int64)
    for layer, writes in plan.recording.writes.items():
        k_cache, v_cache = pool.layer_caches(layer)
        for positions, k, v in writes:              # in write order: a later write of a position wins
            rel = positions - k0
            keep = rel < written
            rel = rel[keep]
            slots = table[rel // bs] * bs + rel % bs
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))
    req.block_ids.extend(ids)
    engine.scheduler.borrowing.detach(req, plan.loan_id)
    return need
