"""kernels/gguf_blocks.py: every format's decoder against gguf-py's reference dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels import gguf_blocks
from tools.random_gguf import random_type_blocks

FORMATS = tuple(gguf_blocks.BLOCKS)


def reference(fmt: str, data: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_valid_blocks_dequantize_to_gguf_py_bit_for_bit(fmt):
    per, _ = gguf_blocks.BLOCKS[fmt]
    data = random_type_blocks(fmt, 7, per * 3, torch.Generator().manual_seed(1))
    want = reference(fmt, data)
    got = gguf_blocks.dequantize(fmt, torch.from_numpy(data), per * 3)
    assert got.dtype == torch.float32 and got.shape == (7, per * 3)
    assert torch.equal(got, torch.from_numpy(want))
    assert got.abs().max() > 0.01                   # random scales that give real weights


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_bytes_dequantize_to_gguf_py(fmt):
    """Every bit pattern, fp16 scales that are subnormal, huge, inf or NaN included."""
    per, nbytes = gguf_blocks.BLOCKS[fmt]
    data = np.random.default_rng(2).integers(0, 256, size=(64, 2 * nbytes), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        want = torch.from_numpy(reference(fmt, data))
    got = gguf_blocks.dequantize(fmt, torch.from_numpy(data), 2 * per)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("fmt", FORMATS)
def test_sub_blocks_are_small_integers_and_exact_scales(fmt):
    """The form a repack reads: |q| <= 127, and scale / min exact products of the file's
    fp16 fields and its small integer sub-block scales (checked in float64)."""
    per, _ = gguf_blocks.BLOCKS[fmt]
    data = torch.from_numpy(random_type_blocks(fmt, 4, per * 2, torch.Generator().manual_seed(3)))
    sub = gguf_blocks.decode(fmt, data, per * 2)
    assert sub.size in (16, 32) and sub.q.dtype == torch.int8
    assert sub.scale.shape == (4, per * 2 // sub.size)
    assert torch.equal(sub.scale.double().float(), sub.scale)
    w64 = sub.scale.double().unsqueeze(-1) * sub.q.double().view(4, -1, sub.size)
    if sub.min is not None:
        w64 = w64 - sub.min.double().unsqueeze(-1)
    assert (w64.view(4, -1).float() - sub.dequantize()).abs().max() <= 2.0 ** -20


def test_bytes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_blocks.decode("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 144\]"):
        gguf_blocks.decode("Q4_K", torch.zeros(2, 140, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="no decoder for GGUF type Q4_1"):
        gguf_blocks.decode("Q4_1", torch.zeros(2, 20, dtype=torch.uint8), 32)
