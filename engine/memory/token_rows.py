"""KV by token rows: the KV of a run of a sequence's tokens, whatever blocks
hold them, as one contiguous ``[L, 2, n, kvh, hd]`` tensor (a pair's copy
grows by a step's new tokens, not by whole blocks: docs/cluster.md, "Pairs
and roles").

A tier ``[L, 2, N, bs, kvh, hd]`` viewed as ``[L, 2, N * bs, kvh, hd]``
puts token slot ``s`` of block ``b`` at row ``b * bs + s``::

    block ids  [7, 8, 3]      tokens [20, 40) of the sequence (bs = 16)
    token 20 = block 8 slot 4 = row 132 ┐ one run: rows [132, 144)
    token 31 = block 8 slot 15 = row 143┘   (block 8 ends; 3 != 8 + 1)
    token 32 = block 3 slot 0 = row 48  ┐ one run: rows [48, 56)
    token 39 = block 3 slot 7 = row 55  ┘

so a run of tokens whose blocks have consecutive ids is one strided slice,
and each run is one ``copy_`` (``row_runs``). Nothing here allocates or
frees a block but ``write_rows``, through the region's pool. Engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.memory.region import Purpose, Region, RegionState


def row_runs(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[tuple[int, int, int]]:
    """(position in the rows, first tier row, length) of each run of tokens
    ``[start, end)`` of a sequence held in ``block_ids`` (module docstring).
    Raises ValueError when the blocks do not reach ``end``."""
    if not 0 <= start <= end <= len(block_ids) * block_size:
        raise ValueError(f"tokens [{start}, {end}) of a sequence in {len(block_ids)} blocks of {block_size}")
    runs: list[tuple[int, int, int]] = []
    tok = start
    while tok < end:
        b, s = divmod(tok, block_size)
        n = min(block_size - s, end - tok)
        row = block_ids[b] * block_size + s
        if runs and runs[-1][1] + runs[-1][2] == row:
            pos, first, m = runs[-1]
            runs[-1] = (pos, first, m + n)
        else:
            runs.append((tok - start, row, n))
        tok += n
    return runs


def _rows(kv: torch.Tensor) -> torch.Tensor:
    """A tier ``[L, 2, N, bs, kvh, hd]`` as ``[L, 2, N * bs, kvh, hd]`` (a view)."""
    return kv.flatten(2, 3)


def gather_rows(pool: Any, tier: str, block_ids: Sequence[int], start: int, end: int, out: torch.Tensor,
                at: int = 0) -> None:
    """Copy the KV of tokens ``[start, end)`` of a sequence held in
    ``block_ids`` (of ``tier``) into rows ``[at, at + end - start)`` of
    ``out`` [L, 2, m, kvh, hd], one copy per run."""
    rows = _rows(pool._storage().tier(tier))
    for pos, first, n in row_runs(block_ids, pool.block_size, start, end):
        out[:, :, at + pos:at + pos + n].copy_(rows[:, :, first:first + n])


def write_rows(region: Region, start: int, rows: torch.Tensor) -> bool:
    """A REPLICA region holding a sequence's tokens ``[0, start)`` grows to
    hold ``[start, start + n)`` too: fresh blocks of its tier for the rows
    past its last block (its last block, partial, is written on), then
    ``rows`` [L, 2, n, kvh, hd] written, one copy per run. False when the
    tier is short of blocks, and then nothing changed. Raises ValueError
    for another purpose or a ``start`` past the region's blocks."""
    if region.purpose is not Purpose.REPLICA:
        raise ValueError(f"write_rows: a {region.purpose.value} region has a fixed size")
    if region.state is not RegionState.RESERVED:
        raise ValueError(f"write_rows: the replica region is {region.state.value}")
    pool, bs, n = region.pool, region.pool.block_size, rows.shape[2]
    if start > len(region.block_ids) * bs:
        raise ValueError(f"write_rows: token {start} past the region's {len(region.block_ids)} blocks")
    need = -(-(start + n) // bs) - len(region.block_ids)
    fresh: list[int] = []
    if need > 0:
        got = pool.alloc_mem(need, region.tier, reclaim=False)   # a copy never takes a copy's blocks
        if got is None:
            return False
        fresh = got
    ids = region.block_ids + fresh
    try:
        tier = _rows(pool._storage().tier(region.tier))
        for pos, first, m in row_runs(ids, bs, start, start + n):
            tier[:, :, first:first + m].copy_(rows[:, :, pos:pos + m])
    except BaseException:
        if fresh:
            pool.free_mem(fresh, region.tier)
        raise
    region.block_ids.extend(fresh)
    return True
