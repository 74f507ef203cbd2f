"""The row ops kernel (kernels/row_ops.py): the host's build against the portable one and
against the torch ops LlamaModel.forward runs without it; batch invariance; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.llama import apply_rope, rms_norm
from kernels.quant_linear import host_variant
from kernels.row_ops import RowOps


@pytest.fixture(scope="module")
def host() -> RowOps:
    assert host_variant() is not None, "this CPU has no kernel build (needs AVX2, FMA and F16C)"
    ops = RowOps.create()
    assert ops is not None and ops.variant == host_variant(), "the host's row ops did not build or load"
    return ops


@pytest.fixture(scope="module")
def portable() -> RowOps:
    return RowOps.load("portable")


def test_rms_norm_matches_torch_and_every_build(host, portable):
    x = torch.randn(37, 576) * torch.logspace(-2, 2, 576)
    w = torch.randn(576)
    got = host.rms_norm(x, w, 1e-5)
    assert torch.equal(got, portable.rms_norm(x, w, 1e-5))
    # the mean of squares summed in another order than torch's: fp32 rounding apart
    assert torch.allclose(got, rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    odd = torch.randn(5, 77)                                         # a width with a scalar tail
    assert torch.allclose(host.rms_norm(odd, torch.ones(77), 1e-6), rms_norm(odd, torch.ones(77), 1e-6),
                          rtol=1e-5, atol=1e-6)


def test_silu_mul_matches_torch_and_every_build(host, portable):
    x = torch.randn(23, 2 * 1539) * 8                                # 1539: a scalar tail
    x[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    got = host.silu_mul(x)
    assert torch.equal(got, portable.silu_mul(x))
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_gelu_mul_matches_torch_and_every_build(host, portable):
    x = torch.randn(23, 2 * 1539) * 6                                # 1539: a padded tail
    x[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -12.0])
    got = host.gelu_mul(x)
    assert torch.equal(got, portable.gelu_mul(x))
    gate, up = x.chunk(2, dim=-1)
    # torch's 0.5 x (1 + tanh) cancels for negative x: float64's is the reference
    want = F.gelu(gate.double(), approximate="tanh") * up.double()
    assert torch.allclose(got.double(), want, rtol=2e-6, atol=1e-6)
    # torch's own error there: a rounding of 1 + tanh, times 0.5 x up
    off = (got - F.gelu(gate, approximate="tanh") * up).abs()
    assert (off <= 1e-5 * got.abs() + 1e-7 * (gate * up).abs() + 1e-6).all()


def test_rope_is_apply_rope_bit_for_bit(host, portable):
    from engine.model.config import LlamaConfig
    from engine.model.llama import rope_tables
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=300)
    cos, sin = rope_tables(cfg, torch.float32)
    pos = torch.tensor([0, 1, 7, 150, 299, 3])
    qkv = torch.randn(6, (4 + 2 + 2) * 16)
    got = host.rope(qkv, 6, 16, cos[pos], sin[pos])
    want = apply_rope(qkv[:, :96].view(6, 6, 16), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    assert torch.equal(got, want)
    assert torch.equal(got, portable.rope(qkv, 6, 16, cos[pos], sin[pos]))


def test_a_row_gets_its_bits_in_any_batch_and_thread_count(host):
    x = torch.randn(64, 2 * 1536)
    w = torch.randn(2 * 1536)
    norm, silu, gelu = host.rms_norm(x, w, 1e-5), host.silu_mul(x), host.gelu_mul(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for lo, hi in [(0, 1), (5, 6), (3, 40), (63, 64)]:
            assert torch.equal(host.rms_norm(x[lo:hi], w, 1e-5), norm[lo:hi])
            assert torch.equal(host.silu_mul(x[lo:hi]), silu[lo:hi])
            assert torch.equal(host.gelu_mul(x[lo:hi]), gelu[lo:hi])
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_refused(host):
    with pytest.raises(ValueError, match="fp32"):
        host.rms_norm(torch.randn(3, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        host.rms_norm(torch.randn(3, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="2I"):
        host.silu_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="gelu_mul"):
        host.gelu_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="heads"):
        host.rope(torch.randn(3, 40), 3, 16, torch.ones(3, 16), torch.ones(3, 16))
    with pytest.raises(ValueError, match="cos"):
        host.rope(torch.randn(3, 48), 3, 16, torch.ones(2, 16), torch.ones(3, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_is_the_executors_matmul_on_every_build(host, portable, dtype):
    """RowOps.linear (a prefill's short batches over 16-bit matrices): every build the same
    bits, each row the same alone, within fp32 rounding of x @ w.T."""
    w = (torch.randn(100, 576) * 0.1).to(dtype)
    x = torch.randn(9, 576)
    got = host.linear(x, w)
    assert torch.equal(got, portable.linear(x, w))
    assert torch.equal(host.linear(x[4:5], w)[0], got[4])
    assert torch.allclose(got, x @ w.float().T, rtol=1e-5, atol=1e-4)
    for bad_w in (w[:, :570], w.t(), w.double()):
        with pytest.raises(ValueError):
            host.linear(x[:, :bad_w.shape[1]] if bad_w.dim() == 2 else x, bad_w)
