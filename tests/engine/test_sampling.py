"""Greedy picks exactly what torch.argmax picks, on every kind of row; a random draw
follows the softmax and keeps to top-k and top-p."""

import pytest
import torch

from engine.request import SamplingParams
from engine.sampling import UNSAMPLED, draw_row, greedy, make_generator, sample
from kernels.sampler import RowSampler


def test_greedy_is_torch_argmax_on_ties_nan_inf_and_strided_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 49152, generator=g)
    x[1, [5, 70, 9000]] = 50.0                    # ties: the first index wins
    x[2, [100, 200]] = float("nan")               # NaN counts as the maximum
    x[3] = float("-inf")                          # a row masked whole
    x[4, 3] = float("inf")
    x[5] = 0.0
    for rows in (x, x[::2], x[:, :1000], x[7:8], x.t().contiguous().t()):
        assert greedy(rows) == rows.argmax(dim=-1).tolist()
    assert greedy(x)[1:4] == [5, 100, 0]
    half = x[:4].to(torch.bfloat16)               # another dtype: torch's own argmax
    assert greedy(half) == half.argmax(dim=-1).tolist()


def test_a_draw_follows_the_softmax_and_never_picks_a_masked_token():
    """engine.sampling.draw_row (the torch fallback): 40,000 draws from softmax([log .5,
    log .25, log .125, log .125, -inf]) land within 5 standard deviations of each share, and
    the masked token never comes."""
    g = torch.Generator().manual_seed(1)
    want = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    n = 40_000
    u = torch.rand(n, dtype=torch.float64, generator=g).tolist()
    counts = torch.bincount(torch.tensor([draw_row(want.log(), SamplingParams(), x) for x in u]), minlength=5)
    assert counts[4] == 0
    sigma = (n * want * (1 - want)).sqrt()
    assert ((counts - n * want).abs() <= 5 * sigma + 1e-9).all(), counts


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_top_k_and_top_p_rows_draw_only_their_kept_tokens(path):
    kernel = RowSampler.create() if path == "kernel" else None
    assert path == "torch" or kernel is not None, "the host's sampler did not build or load"
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])

    def draws(p: SamplingParams) -> set[int]:
        return {sample(logits, [p], [None], [0], kernel=kernel)[0] for _ in range(500)}

    torch.manual_seed(2)                                  # unseeded rows draw from torch's generator
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    # softmax: .64, .23, .09, ...: top_p .8 keeps the first two (.64 < .8 <= .87)
    assert draws(SamplingParams(temperature=1.0, top_p=0.8)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_k=3, top_p=0.8)) == {0, 1}
    assert len(draws(SamplingParams(temperature=1.0))) == 6


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_seeded_draw_repeats_and_a_row_without_weight_is_unsampled(path):
    kernel = RowSampler.create() if path == "kernel" else None
    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.9, seed=s, top_p=0.95) for s in range(3)] + [SamplingParams(temperature=0)]
    x = torch.cat([x, x[:1]])
    gens = [make_generator(p) for p in params]
    first = [sample(x, params, gens, [i, i, i, 0], kernel=kernel) for i in range(20)]
    assert first == [sample(x, params, gens, [i, i, i, 0], kernel=kernel) for i in range(20)]
    assert len({row[0] for row in first}) > 10                      # a spread over positions, not one token
    assert {row[3] for row in first} == {greedy(x[3:])[0]}          # the greedy row: argmax
    for bad in (torch.full((1, 8), float("-inf")), torch.tensor([[0.0, float("nan"), 1.0]])):
        # no exception (it would stop the engine): the row alone is UNSAMPLED, the others drawn
        two = torch.cat([bad, torch.zeros_like(bad)])
        p = SamplingParams(seed=1)
        got = sample(two, [p, p], [make_generator(p), make_generator(p)], [0, 0], kernel=kernel)
        assert got[0] == UNSAMPLED and 0 <= got[1] < bad.shape[1]
