"""The token mask kernel (kernels/token_masks.py): llguidance's bitmask layout applied in place,
allowed logits unchanged bit for bit, every other one -inf, on every build and team."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.quant_linear import host_variant, runs_here
from kernels.token_masks import MaskKernel


@pytest.fixture(scope="module")
def builds() -> list[MaskKernel]:
    assert host_variant() is not None, "this CPU has no kernel build (needs AVX2, FMA and F16C)"
    host = MaskKernel.create()
    assert host is not None and host.variant == host_variant(), "the host's mask kernel did not build or load"
    names = [v for v in ("avx512vnni", "avx512", "avx2") if v != host.variant and runs_here(v)]
    return [host, *(MaskKernel.load(v) for v in names), MaskKernel.load("portable")]


def reference(x: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    """numpy's unpacking of the bits: what the kernel must equal."""
    out = x.clone()
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    v = x.shape[1]
    for k, row in enumerate(rows):
        keep = np.zeros(v, dtype=bool)
        n = min(v, bits.shape[1])
        keep[:n] = bits[k, :n]
        out[row][~torch.from_numpy(keep)] = float("-inf")
    return out


@pytest.mark.parametrize("v,words", [(49152, 1536), (1000, 32), (1000, 31), (70, 3), (33, 1)])
def test_masks_equal_the_unpacked_bits_on_every_build_and_team(builds, v, words):
    rng = np.random.default_rng(v + words)
    bitmask = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    bitmask[0, ::2] = -1                              # whole words allowed
    bitmask[1, 1::3] = 0                              # whole words refused
    x = torch.randn(5, v, generator=torch.Generator().manual_seed(v))
    x[4, 3] = float("nan")                            # a row not asked for stays as it is
    rows = [3, 0, 2]
    want = reference(x, rows, bitmask)
    for kernel in builds:
        for threads in (1, 2, 3):
            got = x.clone()
            assert kernel.apply(got, rows, bitmask, num_threads=threads) == [True, True, True]
            assert torch.equal(got[[0, 2, 3]], want[[0, 2, 3]]) and torch.equal(got[1], x[1]), (kernel.variant, v)
            assert torch.isnan(got[4, 3])


def test_a_row_with_no_allowed_token_below_v_is_reported(builds):
    bitmask = np.zeros((2, 4), dtype=np.int32)
    bitmask[1, 3] = 1 << 5                            # token 101: past a vocabulary of 100
    x = torch.randn(2, 100)
    assert builds[0].apply(x, [0, 1], bitmask) == [False, False]
    assert torch.isneginf(x).all()


def test_bad_arguments_are_refused(builds):
    k, x = builds[0], torch.randn(2, 64)
    good = np.full((1, 2), -1, dtype=np.int32)
    for bad in (lambda: k.apply(x.double(), [0], good), lambda: k.apply(x[:, ::2], [0], good),
                lambda: k.apply(x, [2], good), lambda: k.apply(x, [0, 1], good),
                lambda: k.apply(x, [0], good.astype(np.int64)),
                lambda: k.apply(x, [0], np.full((1, 4), -1, np.int32)[:, ::2])):
        with pytest.raises(ValueError):
            bad()
