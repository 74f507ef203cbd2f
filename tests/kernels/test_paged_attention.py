"""Attention over paged KV in the plan executor's arithmetic (kernels/paged_attention.py,
csrc/paged_attention.cpp, csrc/attention_rows.h).

The kernel of this host is exercised, never skipped; every build this CPU runs and the
portable one must give its bits. Shapes cross the arithmetic's pieces: 16 keys per score
batch (8 on AVX2), 128 keys per chunk, 64 rows per pass, 16-token blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import window_mask
from kernels.paged_attention import PagedAttention
from kernels.quant_linear import VARIANTS, host_variant, runs_here

H, KVH, HD, BS = 9, 3, 64, 16          # SmolLM2's heads
BUILDS = [v for v in VARIANTS if v == "portable" or runs_here(v)]


@pytest.fixture(scope="module")
def host() -> PagedAttention:
    assert host_variant() is not None, "this CPU has no kernel build (needs AVX2, FMA and F16C)"
    kernel = PagedAttention.create()
    assert kernel is not None and kernel.variant == host_variant(), "the host's kernel did not build or load"
    return kernel


def paged(length: int, seed: int, dtype: torch.dtype = torch.float32, hd: int = HD):
    """A sequence of ``length`` random keys and values in scattered blocks of a cache of
    ``dtype``: (k_cache, v_cache, table [blocks], keys [length, KVH, hd] and values as
    the cache holds them, widened)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-length // BS)
    table = torch.randperm(blocks + 7, generator=g)[:blocks]
    k_cache = torch.zeros(blocks + 7, BS, KVH, hd, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = (torch.randn(length, KVH, hd, generator=g) * 2).to(dtype)
    v = torch.randn(length, KVH, hd, generator=g).to(dtype)
    for p in range(length):
        k_cache[table[p // BS], p % BS] = k[p]
        v_cache[table[p // BS], p % BS] = v[p]
    return k_cache, v_cache, table, k.float(), v.float()


def rows(q_starts_lens_ctx: list[tuple[int, int, int]], tables: list[torch.Tensor]):
    width = max(len(t) for t in tables)
    return (torch.tensor(q_starts_lens_ctx, dtype=torch.int64),
            torch.stack([torch.cat((t, t.new_zeros(width - len(t)))) for t in tables]))


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Causal GQA attention in float64, the queries being the last positions (``window``:
    kernels/attention.py's sliding-window mask)."""
    t, s = q.shape[0], k.shape[0]
    mask = window_mask(torch.arange(s - t, s).unsqueeze(1), torch.arange(s).unsqueeze(0), window)
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.double().transpose(0, 1),
                                       v.double().transpose(0, 1), attn_mask=mask, scale=q.shape[2] ** -0.5,
                                       enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,prefix", [(1, 0), (7, 0), (33, 0), (130, 0), (300, 0), (1, 257), (45, 200)])
def test_matches_dense_attention(host, t, prefix, dtype):
    """Within 5e-6 of float64 on outputs of magnitude ~1 (torch's own fp32 SDPA is off by
    up to 2.6e-6 on these inputs), over an fp32 or a float16 cache (read widened)."""
    k_cache, v_cache, table, k, v = paged(prefix + t, seed=t + prefix, dtype=dtype)
    q = torch.randn(t, H, HD, generator=torch.Generator().manual_seed(1))
    out = host.attend(q, k_cache, v_cache, *rows([(0, t, prefix + t)], [table]), HD ** -0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert (out.double() - dense(q, k, v)).abs().max() < 5e-6


def test_a_row_has_the_same_bits_however_its_rows_are_grouped(host):
    """The contract: a query row's output depends on its query, position and keys alone --
    the same bits computed as one row of a 300-row prefill, in a chunk of 7 after a cached
    prefix, as a decode row beside other sequences, and with one thread or two."""
    L = 300
    k_cache, v_cache, table, _, _ = paged(L, seed=3)
    q = torch.randn(L, H, HD, generator=torch.Generator().manual_seed(4))
    whole = host.attend(q, k_cache, v_cache, *rows([(0, L, L)], [table]), HD ** -0.5)
    for start, n in [(0, 7), (7, 64), (128, 1), (129, 171)]:          # a prompt in chunks
        chunk = host.attend(q[start:start + n], k_cache, v_cache, *rows([(0, n, start + n)], [table]), HD ** -0.5)
        assert torch.equal(chunk, whole[start:start + n])
    # decode rows: position p of this sequence among rows of another one
    other_k, other_v, other_table, _, _ = paged(90, seed=5)
    both_k, both_v = torch.cat((k_cache, other_k)), torch.cat((v_cache, other_v))
    moved = other_table + k_cache.shape[0]
    for p in (0, 15, 16, 127, 128, 255, 299):
        qs = torch.stack((torch.randn(H, HD), q[p], torch.randn(H, HD)))
        out = host.attend(qs, both_k, both_v, *rows([(0, 1, 90), (1, 1, p + 1), (2, 1, 50)], [moved, table, moved]),
                          HD ** -0.5)
        assert torch.equal(out[1], whole[p])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(host.attend(q, k_cache, v_cache, *rows([(0, L, L)], [table]), HD ** -0.5), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", BUILDS)
def test_every_build_gives_the_hosts_bits(host, build):
    """AVX-512 scores 16 keys at a time, AVX2 8, the portable build one: the same tree
    of additions, so the same bits (a prefill on one node, its decode on another)."""
    k_cache, v_cache, table, _, _ = paged(261, seed=6, dtype=torch.float16)
    q = torch.randn(261, H, HD, generator=torch.Generator().manual_seed(7))
    args = (q, k_cache, v_cache, *rows([(0, 261, 261)], [table]), HD ** -0.5)
    assert torch.equal(PagedAttention.load(build).attend(*args), host.attend(*args))


def test_head_sizes_past_64_and_views_into_wider_rows(host):
    """hd 128 (another register path); queries read in place from a qkv row."""
    hd = 128
    k_cache, v_cache, table, k, v = paged(70, seed=8, hd=hd)
    qkv = torch.randn(70, (H + 2 * KVH) * hd, generator=torch.Generator().manual_seed(9))
    q = qkv[:, :H * hd].view(70, H, hd)
    out = host.attend(q, k_cache, v_cache, *rows([(0, 70, 70)], [table]), hd ** -0.5)
    assert (out.double() - dense(q, k, v)).abs().max() < 5e-6
    assert torch.equal(out, host.attend(q.contiguous(), k_cache, v_cache, *rows([(0, 70, 70)], [table]), hd ** -0.5))


def test_shapes_it_does_not_take_and_contradictions(host):
    k_cache, v_cache, table, _, _ = paged(20, seed=10)
    q = torch.randn(20, H, HD)
    seqs = rows([(0, 20, 20)], [table])
    assert host.attend(q[:, :, :40], k_cache[..., :40].contiguous(), v_cache[..., :40].contiguous(), *seqs, 1.0) is None
    assert host.attend(q.double(), k_cache, v_cache, *seqs, 1.0) is None
    with pytest.raises(ValueError, match="block id"):         # rows past the step's T
        host.attend(q, k_cache, v_cache, *rows([(5, 20, 20)], [table]), 1.0)
    with pytest.raises(ValueError, match="block id"):         # a block outside the cache
        host.attend(q, k_cache, v_cache, *rows([(0, 20, 20)], [table + 100]), 1.0)
    with pytest.raises(ValueError, match="seqs must be int64"):
        host.attend(q, k_cache, v_cache, seqs[0].int(), seqs[1], 1.0)


@pytest.mark.parametrize("window", [1, 8, 100, 128, 129, 300])
@pytest.mark.parametrize("t,prefix", [(1, 0), (33, 0), (300, 0), (1, 257), (45, 200)])
def test_a_sliding_window_matches_dense_attention(host, t, prefix, window):
    """A sliding layer's rows attend to their last ``window`` keys (window_mask): within
    5e-6 of float64, the chunk holding the window's start cut there."""
    k_cache, v_cache, table, k, v = paged(prefix + t, seed=t + prefix + window)
    q = torch.randn(t, H, HD, generator=torch.Generator().manual_seed(2))
    out = host.attend(q, k_cache, v_cache, *rows([(0, t, prefix + t)], [table]), HD ** -0.5, window=window)
    assert (out.double() - dense(q, k, v, window)).abs().max() < 5e-6


def test_a_windowed_row_has_the_same_bits_however_its_rows_are_grouped(host):
    """The first chunk of a window is cut at its start, the others sit at the fixed places:
    a row's bits depend on its position alone -- in a whole prefill, in chunks, and as a
    decode row beside a longer sequence whose window starts elsewhere; blocks before every
    row's window are never read (may hold any id)."""
    L, W = 300, 100
    k_cache, v_cache, table, _, _ = paged(L, seed=11)
    q = torch.randn(L, H, HD, generator=torch.Generator().manual_seed(12))
    whole = host.attend(q, k_cache, v_cache, *rows([(0, L, L)], [table]), HD ** -0.5, window=W)
    for start, n in [(0, 7), (7, 121), (128, 1), (250, 50)]:
        left = table.clone()
        left[:max(0, start - W + 1) // BS] = 10 ** 6               # blocks no row of the chunk reads
        chunk = host.attend(q[start:start + n], k_cache, v_cache, *rows([(0, n, start + n)], [left]), HD ** -0.5,
                            window=W)
        assert torch.equal(chunk, whole[start:start + n])
    for p in (0, 99, 100, 127, 128, 228, 229, 299):
        qs = torch.stack((torch.randn(H, HD), q[p]))
        out = host.attend(qs, k_cache, v_cache, *rows([(0, 1, L), (1, 1, p + 1)], [table, table]), HD ** -0.5,
                          window=W)
        assert torch.equal(out[1], whole[p])
    # a window wider than the context is every key: the global layer's bits
    assert torch.equal(host.attend(q, k_cache, v_cache, *rows([(0, L, L)], [table]), HD ** -0.5, window=L),
                       host.attend(q, k_cache, v_cache, *rows([(0, L, L)], [table]), HD ** -0.5))


@pytest.mark.parametrize("build", BUILDS)
def test_every_build_gives_the_hosts_windowed_bits(host, build):
    k_cache, v_cache, table, _, _ = paged(261, seed=13)
    q = torch.randn(261, H, HD, generator=torch.Generator().manual_seed(14))
    args = (q, k_cache, v_cache, *rows([(0, 261, 261)], [table]), HD ** -0.5)
    assert torch.equal(PagedAttention.load(build).attend(*args, window=77), host.attend(*args, window=77))


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_a_bad_window_is_refused(host, window):
    k_cache, v_cache, table, _, _ = paged(20, seed=10)
    with pytest.raises(ValueError, match="window"):
        host.attend(torch.randn(20, H, HD), k_cache, v_cache, *rows([(0, 20, 20)], [table]), 1.0, window=window)
