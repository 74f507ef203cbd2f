"""DistAttention kernels (kernels/dist_attention.py, PagedAttention.partials / combine): a
sequence's KV cut into parts at 128-key chunk boundaries, each part's micro-attention
computed over its own cache, the chunks gathered and combined, gives the unsplit kernel's
output bit for bit; the torch reference agrees with SDPA to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from kernels.dist_attention import KEY_CHUNK, Partials, chunks_of, combine_ref, micro_attention_ref
from kernels.paged_attention import PagedAttention
from kernels.quant_linear import host_variant

from .test_paged_attention import BS, dense, paged, rows


@pytest.fixture(scope="module")
def host() -> PagedAttention:
    assert host_variant() is not None, "this CPU has no kernel build (needs AVX2, FMA and F16C)"
    kernel = PagedAttention.create()
    assert kernel is not None
    return kernel


def lend(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int, seed: int):
    """The keys of chunks [lo, hi) copied into another memory's blocks (a lender's own cache,
    its blocks in another order, the others empty): (k_cache, v_cache, table) of that memory,
    the table's entries outside the part -1 (never read)."""
    bs = k_cache.shape[1]
    first, last = lo * KEY_CHUNK // bs, min(hi * KEY_CHUNK // bs, len(table))
    n = last - first
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(n + 5, generator=g)[:n]
    kc = torch.full((n + 5, *k_cache.shape[1:]), float("nan"), dtype=k_cache.dtype)
    vc = kc.clone()
    kc[ids], vc[ids] = k_cache[table[first:last]], v_cache[table[first:last]]
    own = torch.full_like(table, -1)
    own[first:last] = ids
    return kc, vc, own


def split_attend(kernel, q, k_cache, v_cache, seqs, table, cuts: list[int], window, scale):
    """One sequence's rows attended with its chunks in parts [cuts[i], cuts[i + 1]): every part
    but the first on a memory of its own (``lend``); the gathered chunks combined."""
    T, H, hd = q.shape
    ctx = int(seqs[0, 2])
    total = chunks_of(ctx)
    gather = Partials.empty(T, total, H, hd)
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        kc, vc, own = (k_cache, v_cache, table) if i == 0 else lend(k_cache, v_cache, table, lo, hi, seed=i)
        part = kernel.partials(q, kc, vc, seqs, own.unsqueeze(0), torch.tensor([[lo, hi]]), scale, hi - lo,
                               window=window)
        gather.place(part, slice(None), lo)
    return kernel.combine(gather, seqs, torch.zeros(1, dtype=torch.int64), window=window)


CASES = [   # (rows, context, cuts in chunks, window)
    (1, 3000, [0, 10, 24], None),                # decode row, 2 parts
    (1, 4100, [0, 5, 17, 33], None),             # decode row, 3 parts
    (200, 2600, [0, 8, 21], None),               # prefill rows over both parts
    (300, 1000, [0, 3, 5, 8], None),             # prefill rows in every part, 3 parts
    (1, 3000, [0, 20, 24], 700),                 # window inside the lent part
    (150, 2000, [0, 12, 14, 16], 300),           # prefill under a window, 3 parts
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,ctx,cuts,window", CASES)
def test_parts_give_the_unsplit_bits(host, t, ctx, cuts, window, dtype):
    """2 and 3 parts, prefill and decode rows, GQA, windows, fp32 and float16 caches: the
    same bits as the unsplit kernel; the lenders' blocks outside their part are NaN, so a
    read past a part would show."""
    k_cache, v_cache, table, k, v = paged(ctx, seed=ctx + t, dtype=dtype)
    q = torch.randn(t, 9, 64, generator=torch.Generator().manual_seed(t))
    seqs, tables = rows([(0, t, ctx)], [table])
    assert cuts[-1] == chunks_of(ctx)
    whole = host.attend(q, k_cache, v_cache, seqs, tables, 0.125, window=window)
    split = split_attend(host, q, k_cache, v_cache, seqs, table, cuts, window, 0.125)
    assert torch.equal(split, whole)


def test_several_sequences_and_a_part_per_sequence(host):
    """Two sequences in one call, each with a part of its own; slot 0 of each at its lo."""
    (kc1, vc1, t1, *_), (kc2, vc2, t2, *_) = paged(900, seed=1), paged(400, seed=2)
    # one cache holding both: the second's blocks after the first's
    k_cache, v_cache = torch.cat((kc1, kc2)), torch.cat((vc1, vc2))
    t2 = t2 + kc1.shape[0]
    q = torch.randn(5, 9, 64, generator=torch.Generator().manual_seed(3))
    seqs, tables = rows([(0, 3, 900), (3, 2, 400)], [t1, t2])
    whole = host.attend(q, k_cache, v_cache, seqs, tables, 0.125)
    gather = Partials.empty(5, chunks_of(900), 9, 64)
    cuts = torch.tensor([[0, 4], [0, 2]])
    first = host.partials(q, k_cache, v_cache, seqs, tables, cuts, 0.125, 4)
    gather.place(first, slice(None), 0)
    second = host.partials(q, k_cache, v_cache, seqs, tables, torch.tensor([[4, 8], [2, 4]]), 0.125, 4)
    gather.place(Partials(second.m[:3], second.l[:3], second.o[:3]), slice(0, 3), 4)
    gather.place(Partials(second.m[3:], second.l[3:], second.o[3:]), slice(3, 5), 2)
    assert torch.equal(host.combine(gather, seqs, torch.zeros(2, dtype=torch.int64)), whole)


@pytest.mark.parametrize("hd,kvh,heads", [(64, 3, 9), (32, 1, 4), (80, 2, 2)])
@pytest.mark.parametrize("window", [None, 200])
def test_reference_matches_sdpa(host, hd, kvh, heads, window):
    """The torch reference in 2 parts agrees with float64 SDPA within 1e-5 relative, and with
    the kernel to fp32 rounding."""
    g = torch.Generator().manual_seed(hd)
    k, v = torch.randn(700, kvh, hd, generator=g) * 2, torch.randn(700, kvh, hd, generator=g)
    table = torch.randperm(chunks_of(700) * KEY_CHUNK // BS, generator=g)
    k_cache = torch.zeros(len(table), BS, kvh, hd)
    v_cache = torch.zeros_like(k_cache)
    for p in range(700):
        k_cache[table[p // BS], p % BS], v_cache[table[p // BS], p % BS] = k[p], v[p]
    q = torch.randn(40, heads, hd, generator=torch.Generator().manual_seed(hd))
    seqs, tables = rows([(0, 40, 700)], [table])
    gather = Partials.empty(40, chunks_of(700), heads, hd)
    for lo, hi in ((0, 2), (2, 6)):
        gather.place(micro_attention_ref(q, k_cache, v_cache, seqs, tables, torch.tensor([[lo, hi]]), hd ** -0.5,
                                         hi - lo, window=window), slice(None), lo)
    ref = combine_ref(gather, seqs, torch.zeros(1, dtype=torch.int64), window=window)
    want = dense(q, k, v, window=window)
    assert ((ref.double() - want).abs() / want.abs().clamp(min=1.0)).max() < 1e-5
    kern = host.partials(q, k_cache, v_cache, seqs, tables, torch.tensor([[0, 6]]), hd ** -0.5, 6, window=window)
    assert torch.equal(kern.m == -torch.inf, gather.m == -torch.inf)      # the same slots filled
    assert ((host.combine(kern, seqs, torch.zeros(1, dtype=torch.int64), window=window) - ref).abs().max()
            < 1e-5 * want.abs().max())


def test_bad_arguments_are_refused(host):
    k_cache, v_cache, table, *_ = paged(300, seed=5)
    q = torch.randn(1, 9, 64)
    seqs, tables = rows([(0, 1, 300)], [table])
    with pytest.raises(ValueError):       # a part wider than its slots
        host.partials(q, k_cache, v_cache, seqs, tables, torch.tensor([[0, 3]]), 0.125, 2)
    with pytest.raises(ValueError):       # an empty part
        host.partials(q, k_cache, v_cache, seqs, tables, torch.tensor([[1, 1]]), 0.125, 2)
    bad = tables.clone()
    bad[0, 9] = 10_000                    # a block of the part out of range
    with pytest.raises(ValueError):
        host.partials(q, k_cache, v_cache, seqs, bad, torch.tensor([[0, 3]]), 0.125, 3)
    bad[0, 9] = -1                        # outside the part [0, 1): never read
    assert host.partials(q, k_cache, v_cache, seqs, bad, torch.tensor([[0, 1]]), 0.125, 1) is not None
    gather = Partials.empty(1, 2, 9, 64)
    with pytest.raises(ValueError):       # the row's 3 chunks do not fit 2 slots
        host.combine(gather, seqs, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError):
        host.partials(q, k_cache, v_cache, seqs, tables, torch.tensor([[0, 3]]), 0.125, 3, window=0)


def test_partials_into_a_given_buffer_are_the_same_bits(host):
    """``out``: the partials written into a caller's buffer (garbage before: every element is
    written) equal those of a fresh one; a buffer of another shape or dtype is refused."""
    k_cache, v_cache, table, *_ = paged(900, seed=6)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(6))
    seqs, tables = rows([(0, 3, 900)], [table])
    cut = torch.tensor([[2, 8]])
    want = host.partials(q, k_cache, v_cache, seqs, tables, cut, 0.125, 6, window=300)
    buf = Partials(torch.full((3, 6, 9), float("nan")), torch.full((3, 6, 9), 7.0),
                   torch.full((3, 6, 9, 64), float("nan")))
    got = host.partials(q, k_cache, v_cache, seqs, tables, cut, 0.125, 6, window=300, out=buf)
    assert got is buf
    assert all(torch.equal(a, b) for a, b in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))
    for bad in (Partials(buf.m[:, :5], buf.l[:, :5], buf.o[:, :5]),
                Partials(buf.m.double(), buf.l, buf.o),
                Partials(buf.m, buf.l, torch.empty(3, 9, 6, 64).transpose(1, 2))):     # not contiguous
        with pytest.raises(ValueError, match="out must be"):
            host.partials(q, k_cache, v_cache, seqs, tables, cut, 0.125, 6, out=bad)


def test_a_layout_checked_once_gives_partials_bits_at_every_layer(host):
    """``partials_in`` over one ``part_layout`` (a creditor's, kept for a step's layers): the
    bits of ``partials`` for each layer's caches; a q of other rows, a cache that is not
    contiguous, a layout of bad columns: refused."""
    layers = [paged(600, seed=s) for s in (11, 12)]
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(13))
    seqs, tables = rows([(0, 2, 600)], [layers[0][2]])
    chunks = torch.tensor([[1, 5]])
    layout = host.part_layout(2, seqs, tables, chunks, 4)
    for k_cache, v_cache, *_ in layers:
        want = host.partials(q, k_cache, v_cache, seqs, tables, chunks, 0.125, 4)
        got = host.partials_in(layout, q, k_cache, v_cache, 0.125)
        assert all(torch.equal(a, b) for a, b in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))
    k_cache, v_cache, *_ = layers[0]
    with pytest.raises(ValueError, match="query rows"):
        host.partials_in(layout, q[:1], k_cache, v_cache, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        host.partials_in(layout, q, k_cache.transpose(0, 1), v_cache.transpose(0, 1), 0.125)
    with pytest.raises(ValueError, match="chunks"):
        host.part_layout(2, seqs, tables, torch.tensor([[1, 5, 0]]), 4)
    with pytest.raises(ValueError, match="seqs"):
        host.part_layout(2, seqs.int(), tables, chunks, 4)
