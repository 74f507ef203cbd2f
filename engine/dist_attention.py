"""DistAttention in the engine (Infinite-LLM §4.2, §4.6): a sequence's KV in parts.

A sequence's keys, cut into 128-key chunks (kernels/dist_attention.py), sit in
parts: its first chunks in this engine's MemPool (the local part), the chunks
after them in blocks other engines lend (remote parts, each a range of whole
chunks; the last one open, taking the positions the sequence grows into)::

    keys  0 ........ split*128 ............ hi*128 ..................... ctx
          [ local part: this MemPool ][ remote part 1 ][ remote part 2 ... )
            blocks in req.block_ids     lender A's        lender B's blocks

At every layer of a step the model (engine/model/llama.py) hands the step's
rows to ``DistStep.attend``, which

1. sends each remote part the new K/V of the positions it holds and the query
   rows that reach it, and starts its micro-attention (``Lender.start``: the
   lender writes the K/V into its blocks, then computes);
2. writes the local positions' K/V and computes the local micro-attention
   while the remote ones run (the overlap of §4.6);
3. gathers every part's per-chunk results in chunk order and combines them.

The output is the unsplit kernel's, bit for bit (``PagedAttention.partials``'
contract): tokens and logits equal the single-node engine's, greedy or seeded.

The lender's side is ``LentKV``: the micro-attention over blocks of ITS
MemPool (``MemPool.layer_caches``), callable from any thread: it touches only
the loan's blocks. ``InProcessLender`` runs it on a thread of its own (or in
the caller's) behind the ``Lender`` interface a transport would implement.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.memory.mempool import MemPool
from kernels.attention import store_kv
from kernels.dist_attention import KEY_CHUNK, Partials, chunks_of
from kernels.paged_attention import PagedAttention, PartLayout

# Seconds a layer waits for a remote part's results before the step fails.
REMOTE_DEADLINE_S = 30.0


class RemoteKVError(RuntimeError):
    """A remote part did not answer in time or refused the request."""


class PartialsHandle(Protocol):
    def partials(self, timeout: float) -> Partials:
        """The micro-attention's results [rows, hi - lo, H(, hd)]; raises RemoteKVError
        (refused, or not done within ``timeout`` seconds). They may view the transport's
        buffer (a shared-memory ring's slot): read them before the lender's next ``start``.
        A handle may also have ``partials_into(place, timeout)``: the same results written
        into ``place(chunks)`` (a gather's slots for that many chunks) with no view between
        (kvd/node/remote_attention.py's ``ChannelHandle``)."""


class Lender(Protocol):
    """One remote part of one sequence, as the debtor sees it."""

    def start(self, layer: int, q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> PartialsHandle:
        """Write layer ``layer``'s K/V of ``positions`` (this step's tokens the part holds,
        possibly none) and start the micro-attention of the rows ``q`` [n, H, hd], the
        sequence's last n positions up to ``ctx`` keys, over the part's chunks. Returns at
        once."""


@dataclass(frozen=True)
class RemotePart:
    """Chunks [lo, hi) of a sequence's keys held by ``lender`` (hi None: open-ended, the
    sequence's last part)."""

    lo: int
    hi: int | None
    lender: Lender


class RemoteKV:
    """Which sequences (by request id) have remote parts, and how long a layer waits for a
    part's results. The engine thread's: the runner reads it each step; whoever arranges a
    loan adds and drops the parts."""

    def __init__(self, deadline_s: float = REMOTE_DEADLINE_S) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        self.deadline_s = deadline_s            # a layer's wait for a remote part's results
        self._parts: dict[str, list[RemotePart]] = {}

    def add(self, request_id: str, parts: Sequence[RemotePart]) -> None:
        """Give ``request_id`` remote parts: consecutive, the first at lo >= 1 (chunk 0 stays
        local), each but the last closed (lo < hi), the last one open (hi None) or closed.
        Raises ValueError otherwise (nothing changed)."""
        parts = list(parts)
        if not parts or parts[0].lo < 1:
            raise ValueError("remote parts start after the local part's first chunk")
        for a, b in zip(parts, parts[1:]):
            if a.hi is None or a.hi != b.lo:
                raise ValueError("remote parts must be consecutive, only the last one open")
        if any(p.hi is not None and p.hi <= p.lo for p in parts):
            raise ValueError("a remote part holds no chunk")
        self._parts[request_id] = parts

    def drop(self, request_id: str) -> None:
        self._parts.pop(request_id, None)

    def parts(self, request_id: str) -> list[RemotePart]:
        return self._parts.get(request_id, [])

    def __bool__(self) -> bool:
        return bool(self._parts)


@dataclass
class _Seq:
    """One sequence of a step: rows [start, start + n) at its last n positions of ctx keys."""

    start: int
    n: int
    ctx: int
    split: int                          # chunks [0, split) local (those of them it has reached)
    parts: list[RemotePart]


class DistStep:
    """One step's DistAttention over the sequences of a batch (those without remote parts
    too: all local). Built by the runner, used by every layer of the model's forward."""

    def __init__(self, seqs: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor, parts: list[list[RemotePart]],
                 kernel: PagedAttention, deadline_s: float) -> None:
        """``seqs`` int64 [S, 3] and ``tables`` [S, max_blocks]: the step's rows as
        ``AttentionBatch.paged_rows`` gives them; ``slots`` [T]: each row's local KV slot
        (read only for local positions); ``parts[s]``: sequence s's remote parts; ``deadline_s``:
        a layer's wait for each part's results."""
        self.seqs, self.tables, self.kernel, self.deadline_s = seqs, tables, kernel, deadline_s
        self._seqs = [_Seq(a, n, c, min(p[0].lo, chunks_of(c)) if p else chunks_of(c), p)
                      for (a, n, c), p in zip(seqs.tolist(), parts)]
        self.slots_total = max(chunks_of(s.ctx) for s in self._seqs)
        local = [s for s in self._seqs if s.split > 0]
        self._local = torch.tensor([i for i, s in enumerate(self._seqs) if s.split > 0], dtype=torch.int64)
        self._local_chunks = torch.tensor([[0, s.split] for s in local], dtype=torch.int64).view(-1, 2)
        # rows whose K/V stays here: positions below their sequence's split
        local_rows = [s.start + i for s in self._seqs for i in range(s.n)
                      if s.ctx - s.n + i < s.split * KEY_CHUNK]
        self._local_rows = torch.tensor(local_rows, dtype=torch.int64)
        self._local_slots = slots[self._local_rows]
        # what every layer reads alike, worked out once a step
        self._local_seqs, self._local_tables = self.seqs[self._local], self.tables[self._local]
        self._local_layout = None               # the local part's kernel layout over the whole gather
        self._zero = torch.zeros(len(self._seqs), dtype=torch.int64)
        self._remote = []                       # (seq, part, its query rows, its new K/V rows, their positions)
        for s in self._seqs:
            for part in s.parts:
                if s.ctx <= part.lo * KEY_CHUNK:
                    continue                            # the sequence has not reached it
                k0 = part.lo * KEY_CHUNK
                k1 = s.ctx if part.hi is None else min(part.hi * KEY_CHUNK, s.ctx)
                first_pos = s.ctx - s.n
                mine = slice(s.start + max(k0 - first_pos, 0), s.start + max(k1 - first_pos, 0))
                positions = torch.arange(first_pos + (mine.start - s.start), first_pos + (mine.stop - s.start))
                self._remote.append((s, part, slice(s.start, s.start + s.n), mine, positions))
        self._gather: Partials | None = None
        self._pending: list = []                # the parts started and not yet gathered
        self._rows: tuple | None = None         # (q, k, v, each part's rows of them): start_remote's
        self._into: tuple | None = None         # (gather, each part's slots of it): gather_remote's

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """Attention [T, H, hd] of the step's rows ``q`` [T, H, hd] (fp32, rotated); ``k``,
        ``v`` [T, kvh, hd]: the rows' new K/V, written to the local caches (this layer's
        [N, bs, kvh, hd]) or sent to the part that holds their position. Raises
        RemoteKVError when a part fails or misses its deadline."""
        T, H, hd = q.shape
        k, v = store_kv(k, k_cache.dtype), store_kv(v, k_cache.dtype)
        # 1. the remote parts first: their round trips overlap the local work
        self.start_remote(layer, q, k, v)
        # 2. the local part
        if len(self._local_rows):
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, self._local_slots, k[self._local_rows])
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, self._local_slots, v[self._local_rows])
        # one gather for every layer: the local kernel writes every slot of it (those of the
        # local chunks, the rest emptied), then the remote parts fill theirs
        gather = self._gather = self._gather or Partials.empty(T, self.slots_total, H, hd)
        if len(self._local):
            if self._local_layout is None:
                self._local_layout = self.kernel.part_layout(T, self._local_seqs, self._local_tables,
                                                             self._local_chunks, self.slots_total)
            if self.kernel.partials_in(self._local_layout, q, k_cache, v_cache, scale, window=window,
                                       out=gather) is None:
                raise ValueError("the paged attention kernel does not take this model's heads")
        # 3. the remote results, in place; then the scale-reduce in chunk order
        self.gather_remote(gather)
        return self.kernel.combine(gather, self.seqs, self._zero, window=window)

    @property
    def split(self) -> torch.Tensor:
        """int64 [S]: each sequence's first chunk not in the local part (its chunk count
        when every chunk it has reached is local)."""
        return torch.tensor([s.split for s in self._seqs], dtype=torch.int64)

    def start_remote(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Start layer ``layer``'s micro-attention on every remote part a sequence has
        reached: ``q`` [T, H, hd] the step's rotated query rows, ``k``, ``v`` [T, kvh, hd]
        their new K/V as the caches store them (each part gets its own positions'). Where
        every layer passes the same tensors (the plan executor's buffers), each part's rows
        of them are the same views at every layer."""
        if self._rows is None or self._rows[0] is not q or self._rows[1] is not k or self._rows[2] is not v:
            self._rows = (q, k, v, [(s, part, q[rows], k[mine], v[mine], positions)
                                    for s, part, rows, mine, positions in self._remote])
        self._pending = [(s, part, part.lender.start(layer, qr, s.ctx, positions, kr, vr))
                         for s, part, qr, kr, vr, positions in self._rows[3]]

    def gather_remote(self, gather: Partials) -> None:
        """The results of the parts ``start_remote`` started, each in its sequence's rows of
        ``gather`` at its chunks' slots. Raises RemoteKVError when a part fails or misses
        its deadline."""
        pending, self._pending = self._pending, []
        if self._into is None or self._into[0] is not gather:
            self._into = (gather, {})
        into = self._into[1]                    # (part's index, width) -> its slots of this gather
        for i, (s, part, handle) in enumerate(pending):
            def place(width: int, i: int = i, s: _Seq = s, part: RemotePart = part) -> Partials:
                if (dst := into.get((i, width))) is None:
                    dst = into[(i, width)] = gather.slots(slice(s.start, s.start + s.n), part.lo, width)
                return dst
            if (partials_into := getattr(handle, "partials_into", None)) is not None:
                partials_into(place, self.deadline_s)           # written there by the handle
            else:
                got = handle.partials(self.deadline_s)
                place(got.m.shape[1]).copy_(got)


@dataclass(frozen=True)
class DecodeCall:
    """A one-row decode step's micro-attention on a lent part at any layer, as addresses
    for a native caller (kvd/node/ring_lane.py): layer l writes the step's K and V row at
    ``k_rows[l]`` and ``v_rows[l]`` (``row_bytes`` each, the caches' dtype) and runs the
    paged attention kernel's partials with ``layout`` over the caches at ``k_caches[l]``,
    ``v_caches[l]`` (``num_blocks`` blocks of ``block_size``; float16 when ``kv_half``)
    with window ``windows[l]`` (0: none). The tensors are the part's; the caches' memory is
    the MemPool's, which the loan keeps."""

    k_rows: torch.Tensor            # int64 [layers]
    v_rows: torch.Tensor
    row_bytes: int
    k_caches: torch.Tensor          # int64 [layers]
    v_caches: torch.Tensor
    windows: torch.Tensor           # int64 [layers]
    kv_half: bool
    num_blocks: int
    block_size: int
    layout: PartLayout
    scale: float
    threads: int


class LentKV:
    """The lender's side of one remote part: chunks [lo, hi) of a debtor's sequence in
    ``block_ids`` of ``pool`` (a loan's blocks, logical block j of the part in block_ids[j];
    128 keys a multiple of the block size). ``windows[layer]``: the model's sliding windows.

    ``step`` may run on any thread: it reads and writes only the part's blocks, through
    ``MemPool.layer_caches``. A write or query outside the part is refused (ValueError,
    nothing changed)."""

    def __init__(self, pool: MemPool, block_ids: Sequence[int], lo: int, kernel: PagedAttention, scale: float,
                 windows: Sequence[int | None], threads: int = 0) -> None:
        bs = pool.block_size
        if KEY_CHUNK % bs:
            raise ValueError(f"block size {bs} does not divide a {KEY_CHUNK}-key chunk")
        if lo < 0 or not block_ids:
            raise ValueError("a lent part holds at least one block, from a chunk >= 0")
        self.pool, self.lo, self.kernel, self.scale, self.threads = pool, lo, kernel, scale, threads
        self.windows = list(windows)
        self.first_block = lo * KEY_CHUNK // bs
        self.capacity = len(block_ids) * bs                 # keys the loan holds from lo * KEY_CHUNK
        self.blocks = torch.tensor(block_ids, dtype=torch.int64)
        self.block_list = list(block_ids)
        self._layout: tuple | None = None                   # (ctx, rows, PartLayout): a step's, every layer's
        self._caches: dict[int, tuple] = {}                 # layer -> its K, V caches and their rows' views
        self._native: tuple | None = None                   # (dtype, shape, K and V caches' addresses, windows per layer)

    def step(self, layer: int, q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, into: Callable[[tuple[int, int, int, int]], Partials | None] | None = None
             ) -> Partials:
        """Write ``positions``' K/V into the part's blocks of layer ``layer``, then its
        micro-attention for rows ``q`` [n, H, hd] (the sequence's last n positions of ``ctx``
        keys): Partials [n, chunks in the part up to ctx, ...], written where ``into(shape)``
        says (a reply's buffer; None, or no ``into``: new tensors)."""
        bs, k0 = self.pool.block_size, self.lo * KEY_CHUNK
        end = self._reach(layer, q, ctx)
        if len(positions) and (int(positions.min()) < k0 or int(positions.max()) >= end):
            raise ValueError("a K/V write outside the part")
        k_cache, v_cache = self.pool.layer_caches(layer)
        if len(positions):
            rel = positions - k0
            slots = self.blocks[rel // bs] * bs + rel % bs
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
        return self._attend(layer, q, ctx, end, k_cache, v_cache, into)

    def step_from(self, layer: int, q: torch.Tensor, ctx: int, first: int, k: torch.Tensor, v: torch.Tensor,
                  into: Callable[[tuple[int, int, int, int]], Partials | None] | None = None) -> Partials:
        """``step`` for the positions [first, first + len(k)) (a RemoteAttend's): the same
        checks and result, the K/V written a block's run at a time, with no positions tensor
        built (a creditor's hot path: once per layer per debtor)."""
        bs, k0 = self.pool.block_size, self.lo * KEY_CHUNK
        end, n = self._reach(layer, q, ctx), k.shape[0]
        if n and (first < k0 or first + n > end):
            raise ValueError("a K/V write outside the part")
        caches = self._caches.get(layer)
        if caches is None:
            k_cache, v_cache = self.pool.layer_caches(layer)
            caches = self._caches[layer] = (k_cache, v_cache, k_cache.view(-1, *k_cache.shape[2:]),
                                            v_cache.view(-1, *v_cache.shape[2:]))
        k_cache, v_cache, k_rows, v_rows = caches
        if v.shape != k.shape or k.shape[1:] != k_cache.shape[2:]:      # (no broadcast into the blocks)
            raise ValueError(f"K/V rows of {tuple(k.shape[1:])}, the part's blocks hold {tuple(k_cache.shape[2:])}")
        if n == 1 and k.dtype == v.dtype == k_rows.dtype and k.is_contiguous() and v.is_contiguous():
            # a decode's one row of each cache, as the caches hold it: one copy each
            block, at = divmod(first - k0, bs)
            slot = self.block_list[block] * bs + at
            row = k_rows.stride(0) * k_rows.element_size()
            ctypes.memmove(k_rows.data_ptr() + slot * row, k.data_ptr(), row)
            ctypes.memmove(v_rows.data_ptr() + slot * row, v.data_ptr(), row)
            return self._attend(layer, q, ctx, end, k_cache, v_cache, into)
        row = 0
        while row < n:                                  # k_cache [N, bs, kvh, hd]: a run within one block
            block, at = divmod(first + row - k0, bs)
            run = min(bs - at, n - row)
            k_cache[self.block_list[block], at:at + run] = k[row:row + run]     # converted as .to(dtype)
            v_cache[self.block_list[block], at:at + run] = v[row:row + run]
            row += run
        return self._attend(layer, q, ctx, end, k_cache, v_cache, into)

    def decode_call(self, ctx: int, rows: int, first: int, n: int, dtype: torch.dtype) -> DecodeCall | None:
        """This step's ``DecodeCall``: its layers' K/V rows at position ``first`` and its
        kernel layout (``rows`` query rows over ``ctx`` keys), once a layer of the step has
        run (``step_from``); None unless the step writes one row (``n``) of the caches'
        ``dtype`` inside the part, and every layer's caches are alike and contiguous."""
        if self._layout is None or self._layout[:2] != (ctx, rows) or n != 1:
            return None
        bs, k0 = self.pool.block_size, self.lo * KEY_CHUNK
        if not k0 <= first < min(ctx, k0 + self.capacity):
            return None
        if self._native is None:
            caches = [self.pool.layer_caches(layer) for layer in range(len(self.windows))]
            k0c = caches[0][0]
            if any(c.dtype != k0c.dtype or c.shape != k0c.shape or not c.is_contiguous() for kv in caches for c in kv):
                return None
            self._native = (k0c.dtype, k0c.shape,
                            torch.tensor([k.data_ptr() for k, _ in caches], dtype=torch.int64),
                            torch.tensor([v.data_ptr() for _, v in caches], dtype=torch.int64),
                            torch.tensor([w or 0 for w in self.windows], dtype=torch.int64))
        cache_dtype, shape, k_caches, v_caches, windows = self._native
        if dtype != cache_dtype or cache_dtype not in (torch.float32, torch.float16):
            return None
        block, at = divmod(first - k0, bs)
        row_bytes = math.prod(shape[2:]) * cache_dtype.itemsize
        offset = (self.block_list[block] * bs + at) * row_bytes
        return DecodeCall(k_caches + offset, v_caches + offset, row_bytes, k_caches, v_caches, windows,
                          cache_dtype == torch.float16, shape[0], bs, self._layout[2], self.scale,
                          self.threads or torch.get_num_threads())

    def _reach(self, layer: int, q: torch.Tensor, ctx: int) -> int:
        """Where the part's keys of a sequence of ``ctx`` keys end (they are [lo * KEY_CHUNK,
        that)); raises ValueError for a layer, rows or context the part does not serve."""
        k0 = self.lo * KEY_CHUNK
        end = min(ctx, k0 + self.capacity)
        if not 0 <= layer < len(self.windows):
            raise ValueError(f"layer {layer} out of range")
        if ctx <= k0 or q.shape[0] > ctx:
            raise ValueError(f"{ctx} keys do not reach the part from key {k0}")
        if end < ctx and self.capacity % KEY_CHUNK:
            raise ValueError(f"the sequence passes the part, which ends inside a {KEY_CHUNK}-key chunk")
        return end

    def _attend(self, layer: int, q: torch.Tensor, ctx: int, end: int, k_cache: torch.Tensor,
                v_cache: torch.Tensor, into: Callable[[tuple[int, int, int, int]], Partials | None] | None
                ) -> Partials:
        """The part's micro-attention over its keys [lo * KEY_CHUNK, end) (``step``'s)."""
        bs = self.pool.block_size
        hi = chunks_of(end)
        if self._layout is None or self._layout[:2] != (ctx, q.shape[0]):     # a new step: its layers share it
            table = torch.full((1, -(-ctx // bs)), -1, dtype=torch.int64)
            used = -(-end // bs) - self.first_block
            table[0, self.first_block:self.first_block + used] = self.blocks[:used]
            seqs = torch.tensor([[0, q.shape[0], ctx]], dtype=torch.int64)
            chunks = torch.tensor([[self.lo, hi]], dtype=torch.int64)
            self._layout = (ctx, q.shape[0], self.kernel.part_layout(q.shape[0], seqs, table, chunks, hi - self.lo))
        layout = self._layout[2]
        buffer = into((q.shape[0], hi - self.lo, *q.shape[1:])) if into is not None else None
        out = self.kernel.partials_in(layout, q, k_cache, v_cache, self.scale, window=self.windows[layer],
                                      threads=self.threads, out=buffer)
        if out is None:
            raise ValueError("the paged attention kernel does not take this model's heads")
        return out


class _Done:
    def __init__(self, value: Partials) -> None:
        self.value = value

    def partials(self, timeout: float) -> Partials:
        return self.value


class FuturePartials:
    """A ``PartialsHandle`` over a future of ``LentKV.step``'s result."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def partials(self, timeout: float) -> Partials:
        try:
            return self.future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise RemoteKVError(f"a remote part gave no result within {timeout} s") from None
        except ValueError as exc:
            raise RemoteKVError(f"a remote part refused: {exc}") from exc


class InProcessLender:
    """A ``Lender`` over a ``LentKV`` in this process (another engine's MemPool): on
    ``executor``'s thread (the overlap), or in the caller's when None."""

    def __init__(self, lent: LentKV, executor: concurrent.futures.Executor | None = None) -> None:
        self.lent, self.executor = lent, executor

    def start(self, layer: int, q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> PartialsHandle:
        if self.executor is None:
            try:
                return _Done(self.lent.step(layer, q, ctx, positions, k, v))
            except ValueError as exc:
                raise RemoteKVError(f"a remote part refused: {exc}") from exc
        # the rows and K/V as a wire would carry them: copies, not views of the debtor's tensors
        return FuturePartials(self.executor.submit(self.lent.step, layer, q.contiguous().clone(), ctx, positions.clone(),
                                            k.clone(), v.clone()))
