"""Greedy picks exactly what torch.argmax picks, on every kind of row."""

import torch

from engine.sampling import greedy


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
