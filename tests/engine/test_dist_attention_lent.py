"""The creditor's side of a remote part (engine/dist_attention.py, ``LentKV``): ``step_from``,
a RemoteAttend's contiguous positions written a block's run at a time, leaves the caches and
returns the partials of ``step`` bit for bit, and refuses what ``step`` refuses (nothing
written)."""

from __future__ import annotations

import pytest
import torch

from engine.dist_attention import LentKV
from engine.memory.kv_cache import KVCache
from engine.memory.mempool import MemPool
from engine.memory.region import Purpose
from kernels.paged_attention import PagedAttention

LAYERS, KVH, H, HD, BS = 2, 3, 9, 64, 16


@pytest.fixture(scope="module")
def kernel() -> PagedAttention:
    kernel = PagedAttention.create()
    if kernel is None:
        pytest.skip("no paged attention kernel on this CPU")
    return kernel


def lent_part(kernel: PagedAttention, dtype: torch.dtype) -> tuple[MemPool, LentKV]:
    """A pool whose 24 lent blocks (after 5 of others) hold chunks 1.. of a sequence."""
    kv = KVCache(LAYERS, KVH, HD, block_size=BS, device_blocks=40, host_blocks=0, dtype=dtype)
    pool = MemPool(40, 0, block_size=BS, storage=kv)
    assert pool.reserve_region((), num_blocks=5, purpose=Purpose.LENT) is not None
    region = pool.reserve_region((), num_blocks=24, purpose=Purpose.LENT)
    g = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        for cache in pool.layer_caches(layer):
            cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    return pool, LentKV(pool, list(reversed(region.block_ids)), 1, kernel, HD ** -0.5, [None, 200])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("first, rows", [(400, 1), (131, 40), (128, 1), (150, 0)])
def test_step_from_is_step(kernel, dtype, first, rows):
    (pool_a, a), (pool_b, b) = lent_part(kernel, dtype), lent_part(kernel, dtype)
    g = torch.Generator().manual_seed(first)
    ctx = max(first + rows, 150)
    q = torch.randn(max(rows, 1), H, HD, generator=g)
    k, v = torch.randn(rows, KVH, HD, generator=g), torch.randn(rows, KVH, HD, generator=g)
    for layer in range(LAYERS):
        want = a.step(layer, q, ctx, torch.arange(first, first + rows), k, v)
        got = b.step_from(layer, q, ctx, first, k, v)
        assert all(torch.equal(x, y) for x, y in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))
        assert all(torch.equal(x, y) for x, y in zip(pool_a.layer_caches(layer), pool_b.layer_caches(layer)))


def test_step_from_refuses_what_the_part_does_not_hold(kernel):
    pool, lent = lent_part(kernel, torch.float32)
    q, k, v = torch.randn(1, H, HD), torch.randn(1, KVH, HD), torch.randn(1, KVH, HD)
    before = [c.clone() for c in pool.layer_caches(0)]
    for layer, ctx, first, kk, vv in ((0, 200, 100, k, v),                 # position 100: the debtor's own
                                      (0, 200, 200, k, v),                 # past the sequence
                                      (0, 600, 599, k, v),                 # 24 blocks end at key 512
                                      (LAYERS, 200, 199, k, v),            # no such layer
                                      (0, 200, 199, k[:, :1], v[:, :1]),   # one K/V head, the part holds 3
                                      (0, 200, 198, torch.randn(2, KVH, HD), v)):     # k and v disagree
        with pytest.raises(ValueError):
            lent.step_from(layer, q, ctx, first, kk, vv)
    assert all(torch.equal(x, y) for x, y in zip(pool.layer_caches(0), before))
