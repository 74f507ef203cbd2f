"""KVCache: layer-major layout, batched copies, export/import round trips."""

import numpy as np
import pytest
import torch

from engine.memory.kv_cache import KVCache

L, KVH, HD, BS = 3, 2, 4, 4


def filled(device_blocks=6, host_blocks=4, dtype=torch.float32) -> KVCache:
    kv = KVCache(L, KVH, HD, BS, device_blocks, host_blocks, dtype)
    for tier in ("device", "host"):
        t = kv.tier(tier)
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape).to(dtype))
    return kv


def test_layout_contract():
    kv = filled()
    dev = kv.tier("device")
    assert dev.shape == (L, 2, 6, BS, KVH, HD) and dev.is_contiguous()
    lay = kv.layer(1)
    assert lay.shape == (2, 6, BS, KVH, HD)
    assert lay.data_ptr() == dev[1].data_ptr()             # a view, not a copy
    # each layer's K cache is contiguous, so a gather of blocks merges into a sequence
    assert lay[0].is_contiguous()
    assert kv.export_blocks("device", [2]).numel() * 4 == kv.bytes_per_block
    assert kv.bytes_per_block == L * 2 * BS * KVH * HD * 4
    assert kv.nbytes("device") == 6 * kv.bytes_per_block
    with pytest.raises(IndexError):
        kv.layer(L)
    with pytest.raises(ValueError):
        kv.tier("gpu")


def test_cpu_tiers_are_zeroed_and_start_on_a_huge_page():
    kv = KVCache(L, KVH, HD, BS, 6, 4, torch.float32)
    for tier in ("device", "host"):
        t = kv.tier(tier)
        assert t.data_ptr() % (2 << 20) == 0             # kernels/weight_arena.huge_page_zeros
        assert not t.any()


def test_a_pool_the_os_refuses_is_a_clear_error():
    with pytest.raises(MemoryError, match="device tier: .* lower kv_blocks"):
        KVCache(1, 1, 1 << 20, 1 << 10, 1 << 20)        # 2^53 bytes: more than any address space


def test_copy_blocks_across_and_within_tiers():
    kv = filled()
    dev, host = kv.tier("device"), kv.tier("host")
    want = dev[:, :, [4, 1]].clone()
    kv.copy_blocks("device", [4, 1], "host", [0, 3])
    assert torch.equal(host[:, :, [0, 3]], want)
    # overlapping copy inside one tier reads the sources before writing
    before = dev.clone()
    kv.copy_blocks("device", [0, 1], "device", [1, 0])
    assert torch.equal(dev[:, :, 0], before[:, :, 1]) and torch.equal(dev[:, :, 1], before[:, :, 0])
    kv.copy_blocks("device", [], "host", [])
    with pytest.raises(ValueError):
        kv.copy_blocks("device", [0], "host", [0, 1])
    with pytest.raises(IndexError):
        kv.copy_blocks("device", [6], "host", [0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_export_import_round_trip_exact(dtype):
    src, dst = filled(dtype=dtype), KVCache(L, KVH, HD, BS, 5, 0, dtype)
    payload = src.export_blocks("device", [5, 0, 3])
    assert payload.shape == (L, 2, 3, BS, KVH, HD) and payload.is_contiguous()
    dst.import_blocks("device", [1, 2, 4], payload)
    assert torch.equal(dst.tier("device")[:, :, [1, 2, 4]], src.tier("device")[:, :, [5, 0, 3]])
    assert not dst.tier("device")[:, :, [0, 3]].any()
    payload.zero_()                                          # export is a copy
    assert src.tier("device")[:, :, 5].any()


def test_import_validation():
    kv = filled()
    good = kv.export_blocks("device", [0, 1])
    with pytest.raises(TypeError):
        kv.import_blocks("device", [0, 1], good.numpy())
    with pytest.raises(ValueError):
        kv.import_blocks("device", [0, 1], good.half())
    with pytest.raises(ValueError):
        kv.import_blocks("device", [0, 1], good[:, :, :, :2])
    with pytest.raises(ValueError):
        kv.import_blocks("device", [0, 1], good.transpose(0, 2).contiguous())
    with pytest.raises(ValueError):
        kv.import_blocks("device", [0], good)
    with pytest.raises(IndexError):
        kv.import_blocks("device", [0, 99], good)


def test_lazy_host_and_budget_helper():
    kv = KVCache(L, KVH, HD, BS, 2, 0)
    assert kv.nbytes("host") == 0
    assert kv.num_blocks("host") == 0
    per = L * 2 * BS * KVH * HD * 2
    assert KVCache.blocks_for_budget(10 * per + 5, L, KVH, HD, BS, torch.bfloat16) == 10
    assert KVCache.blocks_for_budget(0, L, KVH, HD, BS) == 0
    with pytest.raises(ValueError):
        KVCache(0, KVH, HD, BS, 1, 1)
    with pytest.raises(ValueError):
        KVCache(L, KVH, HD, BS, -1, 1)


def test_block_runs():
    from engine.memory.kv_cache import block_runs
    assert block_runs([]) == []
    assert block_runs([7, 8, 9, 2, 3, 5]) == [(0, 7, 3), (3, 2, 2), (5, 5, 1)]
    assert block_runs([4, 3]) == [(0, 4, 1), (1, 3, 1)]


@pytest.mark.parametrize("src_ids,dst_ids", [
    ([0, 1, 2, 3], [4, 5, 0, 1]),          # runs split differently on each side
    ([5, 2, 3, 0], [3, 0, 1, 2]),
    ([1, 2, 3], [3, 2, 1]),                 # descending: one block per run
])
def test_run_wise_copies_match_index_ops(src_ids, dst_ids):
    """gather/scatter/copy_blocks go run by run; they must equal the one-shot index ops."""
    kv = filled(device_blocks=6, host_blocks=6)
    dev, host = kv.tier("device"), kv.tier("host")
    want_host = host.clone()
    want_host.index_copy_(2, torch.tensor(dst_ids), dev.index_select(2, torch.tensor(src_ids)))
    kv.copy_blocks("device", src_ids, "host", dst_ids)
    assert torch.equal(host, want_host)
    # gather of a layer range into a preallocated buffer
    out = torch.empty(2, 2, len(src_ids), BS, KVH, HD)
    kv.gather("device", src_ids, out, layers=(1, 3))
    assert torch.equal(out, dev[1:3].index_select(2, torch.tensor(src_ids)))
    # scatter of a layer range leaves the other layers alone
    before = dev.clone()
    kv.scatter("device", dst_ids, out, layers=(1, 3))
    want = before.clone()
    want[1:3].index_copy_(2, torch.tensor(dst_ids), out)
    assert torch.equal(dev, want)
    with pytest.raises(ValueError):
        kv.import_blocks("device", [1, 1], kv.export_blocks("device", [0, 2]))


@pytest.mark.parametrize("src_ids,dst_ids,skip", [
    ([0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 0, 1], 0),
    ([4, 5, 1, 2, 3], [0, 1, 2], 2),        # the receiver had the first two blocks
    ([5, 3, 1], [4, 5, 0], 0),              # single-block runs on both sides
])
@pytest.mark.parametrize("torch_path", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_round_trip(src_ids, dst_ids, skip, torch_path, dtype, monkeypatch):
    """pieces() aliases the pool per (layer, K|V, run); scatter_pieces() lands them
    in other blocks, dropping the first ``skip`` positions."""
    src, dst = filled(device_blocks=6, dtype=dtype), KVCache(L, KVH, HD, BS, 6, 0, dtype)
    lengths, views = src.pieces("device", src_ids, (1, 3))
    assert sum(lengths) == len(src_ids) and len(views) == 2 * 2 * len(lengths)
    pool = src.tier("device")
    lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
    for v, (l, k, r) in zip(views, [(l, k, r) for l in (1, 2) for k in (0, 1) for r in range(len(lengths))]):
        addr = np.frombuffer(v, dtype=np.uint8).ctypes.data       # a view into the pool, not a copy
        assert lo <= addr < hi and v.nbytes == lengths[r] * src.slice_bytes
    if torch_path:          # the copy a non-CPU tier takes (torch, per piece)
        monkeypatch.setattr(KVCache, "_flat_bytes", lambda self, tier: None)
    dst.scatter_pieces("device", dst_ids, views, lengths, (1, 3), skip=skip)
    got = dst.tier("device")
    want = pool[:, :, src_ids[skip:]]
    assert torch.equal(got[1:3][:, :, dst_ids], want[1:3])
    assert not got[0].any()                                   # other layers untouched
    with pytest.raises(ValueError):
        dst.scatter_pieces("device", dst_ids, views[:-1], lengths, (1, 3), skip=skip)
    with pytest.raises(ValueError, match="bytes"):
        dst.scatter_pieces("device", dst_ids, [v[:-4] for v in views], lengths, (1, 3), skip=skip)
    with pytest.raises(ValueError):
        dst.scatter_pieces("device", dst_ids[:-1], views, lengths, (1, 3), skip=skip)
