"""Iteration-level scheduling over the MemPool: admission, chunked prefill, decode, preemption.

Pure Python (no torch). Each call to :meth:`Scheduler.schedule` picks the work
of one engine step: a prefill part (requests computing a run of their
uncomputed tokens) and a decode part (one token for every other running
request).

The policy (vLLM's, with one rule that keeps it live: a request off the
device holds no device block):

0. Prefilled requests (their prompt's KV computed by another instance and
   imported into reserved blocks, ``add_prefilled``) join the running set
   while sequence slots last; they decode in the next decode step.
1. Swapped requests come back first, oldest arrival first, each when its
   blocks fit on device together with the blocks the running requests'
   next decode step needs (``_next_blocks``): a request brought back is not
   the next step's victim. While any request is swapped out, nothing is
   admitted.
2. Admission: waiting requests FCFS while sequence slots, the token budget
   and blocks last, the blocks counted as for 1.: ``MemPool.match`` finds the
   cached prefix (locked for the request), ``alloc_mem`` gets the blocks of
   the whole sequence. A prefix with blocks in the host tier is swapped in,
   or cut before them and recomputed, as ``host_hit_policy`` says
   (MemServe's caching cost model, engine/memory/caching_cost.py). A
   request that needs prompt logprobs matches nothing (as in vLLM): every
   prompt position's logits must be computed.
3. Decode: every running request whose prefill is done, oldest first. A
   request crossing a block boundary needs one new block; when the pool is
   dry, the most recently arrived running request (decoding or prefilling)
   is preempted, then the next, until the older ones fit, and the request
   itself when none is left. Preempted by swap, a request's whole block
   table goes to the host tier (``MemPool.swap_out_request``: its cached
   prefix blocks are copied, their lock released); by recompute (or when
   the host tier is full) its blocks are freed and it waits first in line
   to prefill prompt and outputs again.

Why this always makes progress: a request that is swapped out or waiting
pins no device block (were a swapped request to keep its prefix locked,
many of them, each pinning a block or two, could leave no room for any one
of them to come back, and every step would swap one in and out again).
The oldest running request can take every block of its juniors, and a
request never needs more than the device tier holds (``add`` refuses one
whose prompt + max_tokens would, as ``LLMEngine.check_request`` does
first); so, short of blocks pinned outside the scheduler (a transfer's
grant, a reservation), the oldest running request always gets its next
block, and with no request running, the oldest swapped or waiting one
always fits. A victim comes back only when its blocks and the next step's
fit, so it is not preempted again by the step that brought it back.

**Chunked prefill** (``prefill_chunk_tokens > 0``, the default): every step
decodes (3.) and then gives at most ``prefill_chunk_tokens`` prompt tokens to
the unfinished prefills, oldest first, and to newly admitted requests (2.,
skipped in a step that preempted), so a long prompt is computed over several
steps while every running request still gets one token per step: a 4K-token
prompt delays each stream's next token by one chunk's compute instead of the
whole prompt's (tools/bench/engine/bench_chunked_prefill.py). Decode tokens do not count
against the chunk: the decode part runs in its own call (the one-call decoder
where there is one), so the chunk bounds what the prefill adds to a step. A
request keeps the blocks it was admitted with while its prompt is computed
chunk by chunk (``Request.prefilling``) and samples its first token in the
step that computes its last chunk.

**Unchunked** (``prefill_chunk_tokens = 0``): a step is prefill or decode,
never both. If anything was admitted (2.; the first request always fits the
``max_num_batched_tokens`` budget), the step is a prefill of the admitted
requests' whole prompts; otherwise it decodes (3.).

Preemption never fails a request, and every path returns its blocks exactly
once: that is what ``MemPool.check_integrity`` verifies in the tests.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.memory.caching_cost import CachingCostModel
from engine.request import Request, RequestStatus

HOST_HIT_POLICIES = ("cost", "swap", "recompute")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    preemption_mode: str = "swap"        # "swap" | "recompute"
    enable_prefix_caching: bool = True
    prefill_chunk_tokens: int = 0        # 0: whole prompts, in steps of their own
    host_hit_policy: str = "swap"        # host-tier blocks of a hit: "cost" | "swap" | "recompute"
    caching_cost: CachingCostModel | None = None   # decides for "cost"

    def __post_init__(self) -> None:
        if self.host_hit_policy not in HOST_HIT_POLICIES:
            raise ValueError(f"host_hit_policy must be one of {', '.join(HOST_HIT_POLICIES)}, "
                             f"got {self.host_hit_policy!r}")
        if self.host_hit_policy == "cost" and self.caching_cost is None:
            raise ValueError("host_hit_policy 'cost' needs a caching_cost model")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0 (0 turns chunked prefill off)")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")


@dataclass
class ScheduledBatch:
    """One step's work.

    ``prefill[i]`` computes ``prefill_lens[i]`` tokens, ``all_ids[num_computed:
    num_computed + prefill_lens[i]]``, and samples a token only when they reach
    the end of ``all_ids`` (its last chunk). ``decode``: one token each.
    ``preempted``: requests this schedule took off the device.
    ``host_blocks_swapped_in`` / ``host_blocks_recomputed``: host-tier blocks
    of the admitted requests' prefix hits that admission swapped in, or cut
    off to be recomputed (``host_hit_policy``)."""

    prefill: list[Request] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    host_blocks_swapped_in: int = 0
    host_blocks_recomputed: int = 0


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    """Owns the waiting/running/swapped queues. Not thread-safe: the engine thread calls it."""

    def __init__(self, config: SchedulerConfig, pool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.prefilled: deque[Request] = deque()
        # borrowed KV (engine/borrowing.py): set by a node that may borrow, else None
        self.borrowing = None
        self.refused: list[Request] = []        # taken off the queue: nothing can hold them (_unservable)
        self.held: dict[str, float] = {}        # request id -> until when (monotonic) no step decodes it (hold)

    # ------------------------------------------------------------------ queues
    def add(self, req: Request) -> None:
        """Queue a new request last. Raises ValueError (nothing queued) when its
        prompt + max_tokens need more blocks than the device tier has: it could
        never run, and at the head of the queue it would stop every later one
        (``LLMEngine.check_request`` refuses it before, as a bad parameter)."""
        need = blocks_needed(len(req.prompt_ids) + req.params.max_tokens, self.config.block_size)
        can_borrow = self.borrowing.cap if self.borrowing is not None else 0
        if need > self.pool.capacity() + can_borrow:
            raise ValueError(f"request {req.request_id} needs {need} KV blocks; the device tier has "
                             f"{self.pool.capacity()}" + (f", and it borrows at most {can_borrow}" if can_borrow else ""))
        self.waiting.append(req)

    def add_prefilled(self, req: Request) -> None:
        """Queue a request whose blocks hold its computed tokens
        (``num_computed``) already: it joins ``running`` when a slot is free."""
        self.prefilled.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.prefilled)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.prefilled)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of whatever queue holds it (no memory released)."""
        self.held.pop(req.request_id, None)
        for queue in (self.waiting, self.swapped, self.prefilled):
            if req in queue:
                queue.remove(req)
                return
        if req in self.running:
            self.running.remove(req)

    def hold(self, request_id: str, until: float) -> None:
        """Leave ``request_id`` out of every decode step until ``until``
        (monotonic) or its end, whichever comes first: it keeps its slot and
        blocks and computes nothing meanwhile (a pair hands it off from here:
        no token is computed past the one its partner resumes from)."""
        self.held[request_id] = until

    def _is_held(self, req: Request) -> bool:
        until = self.held.get(req.request_id)
        if until is not None and until <= time.monotonic():
            del self.held[req.request_id]
            until = None
        return until is not None

    # --------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step; None when there is nothing to run."""
        while self.prefilled and len(self.running) < self.config.max_num_seqs:
            req = self.prefilled.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        if self.config.prefill_chunk_tokens:
            return self._schedule_chunked()
        if self.swapped and self._swap_in_ready():
            pass  # swapped requests rejoin running and decode below
        elif self.waiting and not self.swapped:
            admission = self._admit(self.config.max_num_batched_tokens, chunked=False)
            if admission.prefill:
                return admission
        if not self.running:
            return None
        batch = self._decode_batch()
        return batch if batch.decode or batch.preempted else None      # every running request held

    def _schedule_chunked(self) -> ScheduledBatch | None:
        """Decode every running request whose prefill is done, and give the
        chunk's tokens to the unfinished prefills (oldest first), then to
        newly admitted requests."""
        if self.swapped:
            self._swap_in_ready()
        batch = self._decode_batch()
        budget = min(self.config.prefill_chunk_tokens, self.config.max_num_batched_tokens)
        for req in sorted((r for r in self.running if r.prefilling), key=lambda r: r.arrival):
            if budget == 0:
                break
            n = min(req.num_tokens - req.num_computed, budget)
            batch.prefill.append(req)
            batch.prefill_lens.append(n)
            budget -= n
        if budget and self.waiting and not self.swapped and not batch.preempted:
            admission = self._admit(budget, chunked=True)
            batch.prefill += admission.prefill
            batch.prefill_lens += admission.prefill_lens
            batch.host_blocks_swapped_in = admission.host_blocks_swapped_in
            batch.host_blocks_recomputed = admission.host_blocks_recomputed
        if not (batch.prefill or batch.decode or batch.preempted):
            return None
        return batch

    def _swap_in_ready(self) -> bool:
        """Bring swapped requests back, oldest first, while each one's blocks
        fit with what the running requests' next decode step needs (its own
        next block included): one brought back is not that step's victim.
        True if any came back."""
        moved = False
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            table = len(req.host_block_ids)
            need = table + self._next_blocks(self.running) + self._grows(req, table)
            if self.pool.available() < need:
                break
            ids = self.pool.swap_in_private(req.host_block_ids)
            if ids is None:
                break
            self.swapped.popleft()
            req.block_ids = ids                          # all private: the prefix lock went at swap-out
            req.host_block_ids = []
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            moved = True
        return moved

    def _admit(self, budget: int, chunked: bool) -> ScheduledBatch:
        """Admit waiting requests FCFS while ``budget`` prompt tokens, sequence
        slots and blocks last: a batch of the admitted (``prefill``) and the
        tokens each computes this step (``prefill_lens``), with the host-hit
        counts. Unchunked, a request's uncached tokens are computed whole (the
        first always fits); chunked, the last one admitted may get a part of
        them. Blocks are allocated for the whole sequence either way."""
        cfg, bs = self.config, self.config.block_size
        out = ScheduledBatch()
        admitted, lens = out.prefill, out.prefill_lens
        skipped: list[Request] = []                      # waiting for a creditor: back at the head after
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            req = self.waiting[0]
            tokens = req.all_ids
            hit = None
            swapped = recomputed = 0
            # a request that needs prompt logprobs computes its whole prompt: a cached prefix has no logits
            if cfg.enable_prefix_caching and not req.needs_prompt_logprobs:
                # leave at least one token to compute: it yields the next logits
                hit = self.pool.match(tokens[:-1])
                hit, recomputed = self._reusable_part(hit, tokens)
                swapped = sum(ref.tier != "device" for ref in hit.blocks)
            cached_ids = self._device_ids_of(hit) if hit is not None else []
            if cached_ids is None:                       # host-tier prefix, no room to swap in
                self.pool.release(hit)
                break
            num_cached = len(cached_ids) * bs
            new_tokens = len(tokens) - num_cached
            if not chunked and admitted and new_tokens > budget:
                if hit is not None:
                    self.pool.release(hit)
                break
            num_fresh = blocks_needed(len(tokens), bs) - len(cached_ids)
            # room for the running requests' next decode step too (this one's and the
            # others admitted with it included): a request admitted into the last free
            # blocks would be that step's victim, its prefill wasted
            others = self._next_blocks(self.running, ahead=int(chunked))
            headroom = others + int(len(tokens) % bs == 0)
            fresh = self.pool.alloc_mem(num_fresh) if self.pool.available() >= num_fresh + headroom else None
            # borrowing, its own next tokens take no block beyond those it gets now (its local
            # chunks, whole; the rest remote): only the others' step needs room
            if fresh is None and (local := self._borrow_for(req, self.pool.available() - others)) is not None:
                if hit is not None:                      # a borrowing request computes its whole sequence
                    self.pool.release(hit)
                hit, cached_ids, num_cached, swapped, recomputed = None, [], 0, 0, 0
                new_tokens = len(tokens)
                fresh = self.pool.alloc_mem(local)
                if fresh is None:
                    self.borrowing.release(req)
            if fresh is None:
                if hit is not None:
                    self.pool.release(hit)
                if self._unservable(req):                # no creditor lends what it can only borrow
                    self.refused.append(self.waiting.popleft())
                    continue
                if self.borrowing is not None and self.borrowing.refused(req):
                    skipped.append(self.waiting.popleft())   # a remote "no" does not hold the queue
                    continue
                break
            self.waiting.popleft()
            out.host_blocks_swapped_in += swapped
            out.host_blocks_recomputed += recomputed
            req.prefix = hit
            req.block_ids = cached_ids + fresh
            req.num_computed = num_cached
            if not req.output_ids:                       # a recompute keeps its first count
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.prefilling = True
            self.running.append(req)
            admitted.append(req)
            lens.append(min(new_tokens, budget) if chunked else new_tokens)
            budget -= lens[-1]
        self.waiting.extendleft(reversed(skipped))
        return out

    def _borrow_for(self, req: Request, free_blocks: int) -> int | None:
        """The local blocks ``req`` needs once the rest of its sequence is borrowed
        (engine/borrowing.py), or None: nothing borrowed, it waits. A prefill computed for
        another node never borrows (its KV leaves whole)."""
        if self.borrowing is None or req.kv_out is not None:
            return None
        return self.borrowing.admit(req, len(req.prompt_ids) + req.params.max_tokens, free_blocks)

    def _unservable(self, req: Request) -> bool:
        """Whether ``req`` can run only on borrowed blocks and no creditor has lent them
        for ``KVBorrowing.give_up_s``: it goes to ``refused`` (the engine fails it)."""
        need = blocks_needed(len(req.prompt_ids) + req.params.max_tokens, self.config.block_size)
        return self.borrowing is not None and need > self.pool.capacity() and self.borrowing.given_up(req)

    def _borrow_to_grow(self, req: Request) -> bool:
        return (self.borrowing is not None and req.kv_out is None
                and self.borrowing.grow(req, len(req.prompt_ids) + req.params.max_tokens))

    def _borrows(self, req: Request) -> bool:
        return self.borrowing is not None and self.borrowing.holds(req)

    def _reusable_part(self, hit, tokens: list[int]):
        """(the part of a locked prefix ``hit`` of ``tokens`` the request reuses,
        the number of host blocks it leaves to recompute), as
        ``host_hit_policy`` decides: the leading blocks worth their swap-in.
        Either ``hit`` itself or a shorter lock that replaced it (``hit`` is
        then released: the caller owns exactly one lock either way)."""
        on_host = [ref.tier != "device" for ref in hit.blocks]
        policy = self.config.host_hit_policy
        if policy == "swap" or not any(on_host):
            return hit, 0
        if policy == "recompute":
            keep = on_host.index(True)
        else:
            keep = self.config.caching_cost.reuse_blocks(on_host, len(tokens), self.config.block_size)
        if keep == len(on_host):
            return hit, 0
        return self.pool.shorten(hit, tokens, keep), sum(on_host[keep:])

    def _device_ids_of(self, hit) -> list[int] | None:
        """Device block ids for a locked prefix hit, swapping host-tier blocks in
        (one copy). None when the device tier has no room for them."""
        host = [ref for ref in hit.blocks if ref.tier != "device"]
        moved = iter(())
        if host:
            new_ids = self.pool.swap_in(host)
            if new_ids is None:
                return None
            moved = iter(new_ids)
        return [ref.block_id if ref.tier == "device" else next(moved) for ref in hit.blocks]

    def _grows(self, req: Request, table: int, ahead: int = 0) -> int:
        """1 if ``req``'s next decode step, ``ahead`` steps from now, needs a
        block past its ``table`` blocks, else 0. A prefilling request's next
        decode computes the token its prefill samples, at position
        ``num_tokens``; a decoding one's computes position ``num_computed``."""
        pos = req.num_tokens if req.prefilling else req.num_computed + ahead
        return int(pos >= table * self.config.block_size and not self._borrows(req))

    def _next_blocks(self, reqs: list[Request], ahead: int = 0) -> int:
        """Blocks the next decode step of ``reqs`` (running: their tables on
        device) takes, ``ahead`` steps from now: ``ahead`` 1 once this step's
        decode has its blocks (``_decode_batch``), as chunked admission runs."""
        return sum(self._grows(r, len(r.block_ids), ahead) for r in reqs)

    def _decode_batch(self) -> ScheduledBatch:
        bs = self.config.block_size
        preempted: list[Request] = []
        batch: list[Request] = []
        # oldest first; victims come from the newest end of `running`
        queue = sorted(self.running, key=lambda r: r.arrival)
        while queue:
            req = queue.pop(0)
            if req.prefilling or (self.held and self._is_held(req)):   # holds its blocks already; a victim
                continue
            if req.num_computed < len(req.block_ids) * bs or self._borrows(req):   # or in its remote part
                batch.append(req)
                continue
            while True:
                new = self.pool.alloc_mem(1)
                if new is not None:
                    req.block_ids.append(new[0])
                    batch.append(req)
                    break
                if self._borrow_to_grow(req):            # its next positions in a creditor's blocks
                    batch.append(req)
                    break
                victim = queue.pop() if queue else req
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return ScheduledBatch(decode=batch, preempted=preempted)

    def _preempt(self, req: Request) -> None:
        """Give back every device block ``req`` holds: swap its whole block
        table to the host tier (its prefix lock released: a swapped request
        pins nothing on device, so it can always come back), or, in recompute
        mode or when the host tier is short, drop its KV for recompute. It
        queues by arrival: swapped requests come back, and preempted ones are
        readmitted, oldest first."""
        req.num_preemptions += 1
        if self.config.preemption_mode == "swap" and req.block_ids and not self._borrows(req):
            host = self.pool.swap_out_request(req.block_ids, req.prefix)
            if host is not None:
                req.block_ids = []
                req.prefix = None                        # released by swap_out_request
                req.host_block_ids = host
                req.status = RequestStatus.SWAPPED
                self._queue_by_arrival(self.swapped, req)
                return
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        """Free ``req``'s KV and queue it, by arrival, to compute it again."""
        self.release_memory(req)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        self._queue_by_arrival(self.waiting, req)

    def recompute(self, req: Request) -> None:
        """Take ``req`` off wherever it is and queue it to compute its KV again (its
        blocks and loans returned): a request whose borrowed KV was lost."""
        self.remove(req)
        req.num_preemptions += 1
        self._requeue(req)

    @staticmethod
    def _queue_by_arrival(queue: deque[Request], req: Request) -> None:
        """Insert ``req`` before the first request of ``queue`` that arrived after it."""
        for i, other in enumerate(queue):
            if other.arrival > req.arrival:
                queue.insert(i, req)
                return
        queue.append(req)

    # ------------------------------------------------------------ caching
    def cache_computed(self, req: Request) -> None:
        """Index ``req``'s full blocks of computed tokens while it still runs
        (after each prefill chunk), so a request sharing its prompt that
        arrives meanwhile hits them instead of computing them again: its
        lookup then covers those blocks, which stay locked until it retires
        (``MemPool.cache_running``; nothing changes when another request
        indexed the same tokens first)."""
        if not self.config.enable_prefix_caching or req.prefix is None:
            return
        lock = self.pool.cache_running(req.all_ids[:req.num_computed], req.block_ids, req.prefix)
        if lock is not None:
            req.prefix = lock

    # ------------------------------------------------------------ retirement
    def release_memory(self, req: Request, cache: bool = False) -> None:
        """Return every block ``req`` holds. With ``cache``, its full blocks of
        computed tokens go into the prefix cache first (MemPool.insert)."""
        bs, n_prefix, ids = self.config.block_size, req.num_prefix_blocks, req.block_ids
        keep = n_prefix                                  # the cache's own blocks, locked via prefix
        if cache and self.config.enable_prefix_caching and ids:
            n_full = min(req.num_computed // bs, len(ids))
            # insert skips positions already cached by these very blocks and
            # frees private duplicates; newly indexed blocks now belong to the cache
            self.pool.insert(req.all_ids[:n_full * bs], ids[:n_full])
            keep = max(n_full, n_prefix)
        if ids[keep:]:
            self.pool.free_mem(ids[keep:])
        if req.host_block_ids:
            self.pool.free_mem(req.host_block_ids, tier="host")
            req.host_block_ids = []
        if req.prefix is not None:
            self.pool.release(req.prefix)
            req.prefix = None
        req.block_ids = []
        if self.borrowing is not None:
            self.borrowing.release(req)
