"""tools/kl_divergence.py: the per-position figures it averages."""

from __future__ import annotations

import math

import torch

from tools.kl_divergence import compare


def test_identical_distributions_have_no_divergence_and_agree():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    got = compare(logits, logits.clone(), torch.tensor([0, 1, 2, 3, 4]))
    assert torch.equal(got["kl"], torch.zeros(5, dtype=torch.float64)) and got["same"].all()
    assert torch.equal(got["nll_exact"], got["nll_native"])


def test_kl_is_exact_minus_native_cross_entropy_and_top1_counts_swaps():
    exact = torch.tensor([[math.log(0.75), math.log(0.25)], [0.0, 0.0]])
    native = torch.tensor([[math.log(0.25), math.log(0.75)], [0.0, 0.0]])
    got = compare(exact, native, torch.tensor([0, 1]))
    want = 0.75 * math.log(3) + 0.25 * math.log(1 / 3)                 # sum p log(p / q)
    assert abs(float(got["kl"][0]) - want) < 1e-6 and float(got["kl"][1]) == 0.0
    assert got["same"].tolist() == [False, True]                          # the top token swapped
    assert abs(float(got["nll_exact"][0]) + math.log(0.75)) < 1e-6
    assert abs(float(got["nll_native"][0]) + math.log(0.25)) < 1e-6
