"""The blocked prefill attention kernel (kernels/prefill_attention.py, csrc/prefill_attention.cpp).

The kernel of this host is exercised, never skipped (AVX2 on the project's
machines); the portable build must give its bits. Shapes cross the kernel's
blocks: 32 query positions per unit, 128 keys per block, 6 (AVX2) or 8
(AVX-512) rows per register tile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native
from kernels.prefill_attention import LIBRARY, PrefillAttention
from kernels.quant_linear import VARIANTS, host_variant

H, KVH, HD = 9, 3, 64            # SmolLM2's heads


@pytest.fixture(scope="module")
def host() -> PrefillAttention:
    assert host_variant() is not None, "this CPU has no kernel build (needs AVX2, FMA and F16C)"
    kernel = PrefillAttention.create()
    assert kernel is not None and kernel.variant == host_variant(), "the host's kernel did not build or load"
    return kernel


@pytest.fixture(scope="module")
def portable() -> PrefillAttention:
    return PrefillAttention.load("portable")


def inputs(t: int, prefix: int, seed: int, h: int = H, kvh: int = KVH, hd: int = HD):
    g = torch.Generator().manual_seed(seed)
    s = prefix + t
    return (torch.randn(t, h, hd, generator=g), torch.randn(s, kvh, hd, generator=g) * 2,
            torch.randn(s, kvh, hd, generator=g))


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention in float64, the queries being the last positions."""
    t, s = q.shape[0], k.shape[0]
    mask = torch.arange(s).unsqueeze(0) <= torch.arange(s - t, s).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.double().transpose(0, 1),
                                       v.double().transpose(0, 1), attn_mask=mask, scale=q.shape[2] ** -0.5,
                                       enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("t,prefix", [(1, 0), (7, 0), (33, 0), (130, 0), (300, 0), (1, 257), (45, 200)])
def test_matches_dense_attention(host, t, prefix):
    """Within 5e-6 of float64 on outputs of magnitude ~1: torch's own fp32 SDPA is
    off by up to 2.6e-6 on these inputs (scores of magnitude ~10 rounded to fp32
    before the exp)."""
    q, k, v = inputs(t, prefix, seed=t + prefix)
    out = host.attend(q, k, v, HD ** -0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert (out.double() - dense(q, k, v)).abs().max() < 5e-6


@pytest.mark.parametrize("h,kvh", [(4, 4), (8, 1)])
def test_other_head_groupings(host, h, kvh):
    q, k, v = inputs(70, 30, seed=3, h=h, kvh=kvh, hd=32)
    assert (host.attend(q, k, v, 32 ** -0.5).double() - dense(q, k, v)).abs().max() < 5e-6


def test_every_build_computes_the_same_bits(host, portable):
    q, k, v = inputs(150, 40, seed=4)
    assert torch.equal(host.attend(q, k, v, HD ** -0.5), portable.attend(q, k, v, HD ** -0.5))


def test_a_token_gets_the_same_bits_however_the_prompt_is_split(host):
    """Cached prefixes and query blocks: rows computed as the tail of a longer
    prompt, or alone after a prefix, equal the full prompt's rows bit for bit."""
    q, k, v = inputs(300, 0, seed=5)
    full = host.attend(q, k, v, HD ** -0.5)
    for cut in (1, 31, 32, 100, 128, 129, 299):
        s = slice(cut, None)
        assert torch.equal(host.attend(q[s], k, v, HD ** -0.5), full[s]), cut
        end = cut + 37                            # a chunk in the middle: its keys stop at its end
        assert torch.equal(host.attend(q[cut:end], k[:end], v[:end], HD ** -0.5), full[cut:end]), cut


def test_thread_count_does_not_change_a_bit(host):
    q, k, v = inputs(200, 20, seed=6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = host.attend(q, k, v, HD ** -0.5)
        torch.set_num_threads(2)
        two = host.attend(q, k, v, HD ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bf16_inputs_are_widened(host):
    q, k, v = (t.bfloat16() for t in inputs(40, 10, seed=7))
    out = host.attend(q, k, v, HD ** -0.5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, host.attend(q.float(), k.float(), v.float(), HD ** -0.5).bfloat16())


def test_views_into_wider_rows_are_read_and_written_in_place(host, portable):
    """q, k and v as views into one fused row (the qkv projection's), and ``out`` as a
    column slice of a wider buffer: the same bits as contiguous copies, on the host's
    build and the portable one; nothing outside the slice is written."""
    q, k, v = inputs(45, 200, seed=9)
    t, s = q.shape[0], k.shape[0]
    fused = torch.full((s, (H + 2 * KVH) * HD), float("nan"))
    fused[s - t:, :H * HD] = q.reshape(t, -1)
    fused[:, H * HD:(H + KVH) * HD] = k.reshape(s, -1)
    fused[:, (H + KVH) * HD:] = v.reshape(s, -1)
    qv = fused[s - t:, :H * HD].view(t, H, HD)
    kv = fused[:, H * HD:(H + KVH) * HD].view(s, KVH, HD)
    vv = fused[:, (H + KVH) * HD:].view(s, KVH, HD)
    assert not qv.is_contiguous() and not kv.is_contiguous()
    for kernel in (host, portable):
        want = kernel.attend(q, k, v, HD ** -0.5)
        wide = torch.full((t, 2 * H * HD), -1.0)
        out = wide[:, H * HD:].view(t, H, HD)
        assert kernel.attend(qv, kv, vv, HD ** -0.5, out=out) is out
        assert torch.equal(out, want) and torch.equal(kernel.attend(qv, kv, vv, HD ** -0.5), want)
        assert (wide[:, :H * HD] == -1.0).all()
    with pytest.raises(ValueError, match="out must be fp32"):
        host.attend(q, k, v, 1.0, out=torch.empty(t, H, HD, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be fp32"):
        host.attend(q, k, v, 1.0, out=torch.empty(t, HD, H).transpose(1, 2))


def test_shapes_it_does_not_take_are_declined(host):
    q, k, v = inputs(10, 0, seed=8, hd=48)        # head_dim not a multiple of 32
    assert host.attend(q, k, v, 1.0) is None
    q, k, v = inputs(10, 0, seed=8)
    assert host.attend(q, k[:5], v[:5], 1.0) is None           # fewer keys than queries
    assert host.attend(q[:, :8], k, v, 1.0) is None            # 8 heads over 3 KV heads
    assert host.attend(q, k, v[:, :2], 1.0) is None            # k and v disagree


def test_every_variant_compiles():
    """Builds this CPU cannot run are still compiled here."""
    for variant, (_, flags) in VARIANTS.items():
        assert native.build(LIBRARY, flags).exists(), variant
