"""KV cache storage: one layer-major tensor per tier (implements ``KVStorage``).

Layout of each tier (the attention kernels in ``kernels/attention.py`` depend on it)::

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
          │          │   │           └ token slot within the block
          │          │   └ block id (BlockPool ids index this axis)
          │          └ 0 = K, 1 = V
          └ layer

Why layer-major: ``kv[layer, 0]`` is one layer's K cache, contiguous, so
gathering a sequence's blocks ``k_cache[block_table]`` yields
``[n, bs, kvh, hd]`` whose first two axes merge into the sequence axis for
free — decode attention pays one copy per step, as a contiguous cache would.
A request's KV gathers into one contiguous ``[L, 2, n, bs, kvh, hd]`` payload
(one frame on the wire), and for a run of blocks each layer's K or V is a
contiguous slice that can travel as is (``pieces``).

Block ids are the ids of ``BlockPool``; this module does no bookkeeping.
Copies go run by run: ids that follow each other (``BlockPool`` hands out
ascending runs) are one strided slice ``kv[l0:l1, :, a:a+n]`` and one
``copy_``, so a request's KV moves in as many copies as its ids have runs
(one per block only when no two ids follow each other). On CPU ``index_copy_``
on the block axis is a generic scatter, slower than copies by runs and even
than one slice per block (docs/benchmarks.md, design measurements). On a CPU "device" and "host" are both host memory,
kept as separate tensors so that the two budgets stay separate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kernels.weight_arena import huge_page_zeros

TIERS = ("device", "host")


class KVCache:
    """Per-tier KV block tensors of one model (or one pipeline stage)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 block_size: int = 16, device_blocks: int = 0, host_blocks: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 host_device: str | torch.device = "cpu", pin_host: bool = False) -> None:
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("block_size", block_size)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"KVCache.{name} must be a positive int, got {v!r}")
        for name, v in (("device_blocks", device_blocks), ("host_blocks", host_blocks)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"KVCache.{name} must be an int >= 0, got {v!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        # one block's extent in each layer's K and V: [L, 2, bs, kvh, hd], and its bytes
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        self.slice_bytes = block_size * num_kv_heads * head_dim * dtype.itemsize   # one layer's K (or V)
        self._num_blocks = {"device": device_blocks, "host": host_blocks}
        self._devices = {"device": torch.device(device), "host": torch.device(host_device)}
        self._pin_host = pin_host
        self._kv: dict[str, torch.Tensor] = {}
        self._flat: dict[str, np.ndarray] = {}          # byte views of CPU tiers (pieces)
        self._kv["device"] = self._make("device")
        if host_blocks:
            self._kv["host"] = self._make("host")
        # else: allocated lazily on first use (a zero-size tier costs nothing)

    def _make(self, tier: str) -> torch.Tensor:
        shape = (self.num_layers, 2, self._num_blocks[tier], self.block_size,
                 self.num_kv_heads, self.head_dim)
        pin = tier == "host" and self._pin_host and torch.cuda.is_available()
        try:
            if self._devices[tier].type == "cpu" and not pin:
                # decode attention streams every key and value of a sequence: on 2 MiB pages
                # (kernels/weight_arena.py) for the reasons the weights are; every page
                # faulted in now, so the pool is allocated up front (etc/kvd.toml)
                return huge_page_zeros(shape, self.dtype).zero_()
            return torch.zeros(shape, dtype=self.dtype, device=self._devices[tier], pin_memory=pin)
        except (OSError, RuntimeError) as e:            # the OS's (mmap) or torch's refusal
            need = self._num_blocks[tier] * self.bytes_per_block
            knob = "kv_blocks" if tier == "device" else "host_kv_blocks"
            raise MemoryError(f"KV cache, {tier} tier: {self._num_blocks[tier]} blocks of {self.bytes_per_block} "
                              f"bytes ({need / 2**30:.1f} GiB) cannot be allocated ({e}); lower {knob}") from e

    # ----------------------------------------------------------------- access

    def tier(self, name: str) -> torch.Tensor:
        """The tier's tensor: [L, 2, num_blocks, bs, kvh, hd]."""
        if name not in self._num_blocks:
            raise ValueError(f"unknown tier {name!r}; expected one of {TIERS}")
        kv = self._kv.get(name)
        if kv is None:
            kv = self._kv[name] = self._make(name)
        return kv

    def layer(self, layer_idx: int, tier: str = "device") -> torch.Tensor:
        """One layer's K and V caches: [2, num_blocks, bs, kvh, hd] (a view)."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer {layer_idx} out of range [0, {self.num_layers})")
        return self.tier(tier)[layer_idx]

    def num_blocks(self, tier: str) -> int:
        return self.tier(tier).shape[2]

    def nbytes(self, tier: str) -> int:
        return self._num_blocks[tier] * self.bytes_per_block

    @staticmethod
    def blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int,
                          head_dim: int, block_size: int = 16,
                          dtype: torch.dtype = torch.float32) -> int:
        """How many whole blocks fit in ``budget_bytes``."""
        per_block = num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
        return max(0, int(budget_bytes) // per_block)

    # ------------------------------------------------------------- KVStorage

    def _ids(self, tier: str, ids: Sequence[int] | torch.Tensor) -> list[int]:
        """``ids`` as a list of ints, each checked against the tier's size."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1:
                raise ValueError(f"block ids must be 1-D, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        ids = list(ids)
        n = self.num_blocks(tier)
        if ids and (min(ids) < 0 or max(ids) >= n):
            raise IndexError(f"{tier}: block id out of range [0, {n})")
        return ids

    def gather(self, tier: str, ids: Sequence[int] | torch.Tensor, out: torch.Tensor,
               layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Copy layers ``[l0, l1)`` of blocks ``ids`` into ``out``
        [l1-l0, 2, len(ids), bs, kvh, hd] (any device), one copy per run of
        consecutive ids. Returns ``out``."""
        l0, l1 = layers or (0, self.num_layers)
        kv = self.tier(tier)
        for pos, first, n in block_runs(self._ids(tier, ids)):
            out[:, :, pos:pos + n].copy_(kv[l0:l1, :, first:first + n], non_blocking=True)
        return out

    def scatter(self, tier: str, ids: Sequence[int] | torch.Tensor, payload: torch.Tensor,
                layers: tuple[int, int] | None = None) -> None:
        """Write ``payload`` [l1-l0, 2, len(ids), bs, kvh, hd] into layers
        ``[l0, l1)`` of blocks ``ids`` (distinct), one copy per run. No checks
        of the payload beyond torch's own: see :meth:`import_blocks`."""
        l0, l1 = layers or (0, self.num_layers)
        kv = self.tier(tier)
        for pos, first, n in block_runs(self._ids(tier, ids)):
            kv[l0:l1, :, first:first + n].copy_(payload[:, :, pos:pos + n], non_blocking=True)

    def scatter_pieces(self, tier: str, ids: Sequence[int], pieces: Sequence[Any],
                       lengths: Sequence[int], layers: tuple[int, int], skip: int = 0) -> None:
        """Write KV that arrives as pieces into blocks ``ids`` (distinct).

        ``pieces[((l - l0) * 2 + kv) * R + r]`` holds the raw bytes (any
        C-contiguous buffer, e.g. a received frame) of [lengths[r], bs, kvh,
        hd] in this cache's dtype: run ``r`` of layer ``l``'s K (kv=0) or V
        (kv=1); the R runs of one (layer, K|V) laid end to end are positions
        ``[0, sum(lengths))``, of which the first ``skip`` are dropped and the
        rest go to ``ids`` in order. One copy per overlap of a piece with a
        run of ``ids`` (a memcpy on a CPU tier, no torch op per piece). The
        dtype is the caller's to check (bytes carry none). Raises ValueError
        on a count or size that does not fit."""
        l0, l1 = layers
        R = len(lengths)
        ids = self._ids(tier, ids)
        if skip < 0 or skip + len(ids) != sum(lengths) or len(pieces) != (l1 - l0) * 2 * R:
            raise ValueError(f"scatter_pieces: {len(pieces)} pieces of {list(lengths)} blocks "
                             f"for layers [{l0}, {l1}), skip {skip}, {len(ids)} ids")
        sb = self.slice_bytes
        srcs = []
        for i, p in enumerate(pieces):
            try:
                a = np.frombuffer(p, dtype=np.uint8)
            except (TypeError, ValueError) as e:
                raise ValueError(f"scatter_pieces: piece {i} is not a contiguous buffer ({e})") from None
            if a.nbytes != lengths[i % R] * sb:
                raise ValueError(f"scatter_pieces: piece {i} has {a.nbytes} bytes, want "
                                 f"{lengths[i % R]} blocks x {sb}")
            srcs.append(a)
        # plan once: (piece r, offset in it, first destination block, count)
        plan: list[tuple[int, int, int, int]] = []
        starts = [sum(lengths[:r]) for r in range(R)]
        r = 0
        for pos, first, n in block_runs(ids):
            p = skip + pos                                   # source position of this run
            while n:
                while p >= starts[r] + lengths[r]:
                    r += 1
                off = p - starts[r]
                c = min(n, lengths[r] - off)
                plan.append((r, off, first, c))
                p, first, n = p + c, first + c, n - c
        flat = self._flat_bytes(tier)
        N = self.num_blocks(tier)
        kv = self.tier(tier) if flat is None else None
        bs, kvh, hd = self.block_shape[2:]
        for li in range(l1 - l0):
            for k in (0, 1):
                base = ((l0 + li) * 2 + k) * N               # slice index of block 0 of (layer, K|V)
                i0 = (li * 2 + k) * R
                for r, off, first, c in plan:
                    src = srcs[i0 + r][off * sb:(off + c) * sb]
                    if flat is not None:                     # numpy: a memcpy, GIL released
                        flat[(base + first) * sb:(base + first + c) * sb] = src
                    else:
                        kv[l0 + li, k, first:first + c].copy_(
                            torch.from_numpy(src).view(self.dtype).view(c, bs, kvh, hd), non_blocking=True)

    def pieces(self, tier: str, ids: Sequence[int], layers: tuple[int, int]
               ) -> tuple[list[int], list[memoryview]]:
        """Views (no copy) of layers ``[l0, l1)`` of blocks ``ids`` in the
        layout :meth:`scatter_pieces` reads: (run lengths, one flat byte view
        of [n, bs, kvh, hd] per (layer, K|V, run)). The views alias the pool:
        the blocks must stay unchanged (locked) while they are read. CPU tiers
        only (they go on the wire as they are)."""
        flat = self._flat_bytes(tier)
        if flat is None:
            raise ValueError(f"pieces: tier {tier!r} is not in CPU memory")
        l0, l1 = layers
        runs = block_runs(self._ids(tier, ids))
        view = memoryview(flat)
        sb, N = self.slice_bytes, self.num_blocks(tier)
        out = [view[(base + first) * sb:(base + first + n) * sb]
               for base in [(l * 2 + k) * N for l in range(l0, l1) for k in (0, 1)]
               for _, first, n in runs]
        return [n for _, _, n in runs], out

    def _flat_bytes(self, tier: str) -> np.ndarray | None:
        """The tier's bytes as one flat uint8 array sharing its memory (made
        once per tier), or None for a tier outside CPU memory."""
        flat = self._flat.get(tier)
        if flat is None:
            kv = self.tier(tier)
            if kv.device.type != "cpu":
                return None
            flat = self._flat[tier] = kv.view(-1).view(torch.uint8).numpy()
        return flat

    def copy_blocks(self, src_tier: str, src_ids: Sequence[int],
                    dst_tier: str, dst_ids: Sequence[int]) -> None:
        """``dst[dst_ids[i]] = src[src_ids[i]]`` for all i: a gather into one
        staging tensor, then a scatter. ``dst_ids`` must be distinct."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"copy_blocks: {len(src_ids)} sources, {len(dst_ids)} targets")
        if not len(src_ids):
            return
        src_ids, dst_ids = self._ids(src_tier, src_ids), self._ids(dst_tier, dst_ids)
        if src_tier == dst_tier:
            # the two sets may overlap: gather everything before writing
            self.scatter(dst_tier, dst_ids, self.export_blocks(src_tier, src_ids))
            return
        src, dst = self.tier(src_tier), self.tier(dst_tier)
        start = 0
        for i in range(1, len(src_ids) + 1):     # runs consecutive on both sides
            if (i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1
                    or dst_ids[i] != dst_ids[i - 1] + 1):
                n, s0, d0 = i - start, src_ids[start], dst_ids[start]
                dst[:, :, d0:d0 + n].copy_(src[:, :, s0:s0 + n], non_blocking=True)
                start = i

    def export_blocks(self, tier: str, ids: Sequence[int]) -> torch.Tensor:
        """The blocks as one contiguous tensor [L, 2, n, bs, kvh, hd] (a copy)."""
        ids = self._ids(tier, ids)
        out = torch.empty((self.num_layers, 2, len(ids), *self.block_shape[2:]),
                          dtype=self.dtype, device=self.tier(tier).device)
        return self.gather(tier, ids, out)

    def import_blocks(self, tier: str, ids: Sequence[int], payload: object) -> None:
        """Write ``payload`` [L, 2, n, bs, kvh, hd] into blocks ``ids``.

        Raises TypeError / ValueError on a payload that is not a tensor of this
        cache's dtype and block shape, or whose length differs from ``ids``.
        """
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"import_blocks: payload must be a Tensor, got {type(payload).__name__}")
        if payload.dtype != self.dtype:
            raise ValueError(f"import_blocks: dtype {payload.dtype} != cache dtype {self.dtype}")
        L, two, bs, kvh, hd = self.block_shape
        if payload.dim() != 6 or (payload.shape[:2], payload.shape[3:]) != ((L, two), (bs, kvh, hd)):
            raise ValueError(f"import_blocks: shape {tuple(payload.shape)} does not match "
                             f"[{L}, 2, n, {bs}, {kvh}, {hd}]")
        if payload.shape[2] != len(ids):
            raise ValueError(f"import_blocks: {payload.shape[2]} blocks for {len(ids)} ids")
        ids = self._ids(tier, ids)
        if len(set(ids)) != len(ids):
            raise ValueError("import_blocks: block ids must be distinct")
        self.scatter(tier, ids, payload)

    def __repr__(self) -> str:
        return (f"KVCache(L={self.num_layers}, kvh={self.num_kv_heads}, hd={self.head_dim}, "
                f"bs={self.block_size}, device={self._num_blocks['device']}, "
                f"host={self._num_blocks['host']}, dtype={self.dtype})")


def block_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position in ids, first block id, length)`` of each maximal run of
    consecutive ids: ``[7, 8, 9, 2, 3]`` -> ``[(0, 7, 3), (3, 2, 2)]``."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs
