"""Greedy picks exactly what torch.argmax picks, on every kind of row; a random draw
follows the softmax and keeps to top-k and top-p."""

import pytest
import torch

from engine.request import SamplingParams
from engine.sampling import _sample_row, draw, greedy


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
    """engine.sampling.draw (inverse CDF): 40,000 draws from softmax([log .5, log .25,
    log .125, log .125, -inf]) land within 5 standard deviations of each share, and the
    masked token never comes."""
    g = torch.Generator().manual_seed(1)
    want = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    n = 40_000
    counts = torch.bincount(torch.tensor([draw(want.log(), g) for _ in range(n)]), minlength=5)
    assert counts[4] == 0
    sigma = (n * want * (1 - want)).sqrt()
    assert ((counts - n * want).abs() <= 5 * sigma + 1e-9).all(), counts


def test_top_k_and_top_p_rows_draw_only_their_kept_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(2)
    k2 = SamplingParams(temperature=1.0, top_k=2)
    assert {_sample_row(logits, k2, g) for _ in range(500)} == {0, 1}
    # softmax: .64, .23, .09, ...: top_p .8 keeps the first two (.64 < .8 <= .87)
    p8 = SamplingParams(temperature=1.0, top_p=0.8)
    assert {_sample_row(logits, p8, g) for _ in range(500)} == {0, 1}


def test_a_seeded_draw_repeats_and_a_row_without_weight_is_an_error():
    x = torch.randn(49152, generator=torch.Generator().manual_seed(3))
    a = [draw(x, torch.Generator().manual_seed(s)) for s in range(20)]
    assert a == [draw(x, torch.Generator().manual_seed(s)) for s in range(20)]
    assert len(set(a)) > 10                           # a spread, not one token
    for bad in (torch.full((8,), float("-inf")), torch.tensor([0.0, float("nan"), 1.0])):
        with pytest.raises(RuntimeError, match="cannot sample"):
            draw(bad, None)
