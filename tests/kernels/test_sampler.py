"""The C++ sampler (kernels/sampler.py): the host's build against every other build and
against engine.sampling's torch fallback, row invariance, the wide-candidate paths, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from engine.request import SamplingParams
from engine.sampling import draw_row
from kernels.quant_linear import host_variant, runs_here
from kernels.sampler import UNSAMPLED, RowSampler

V = 49152


@pytest.fixture(scope="module")
def host() -> RowSampler:
    assert host_variant() is not None, "this CPU has no kernel build (needs AVX2, FMA and F16C)"
    sampler = RowSampler.create()
    assert sampler is not None and sampler.variant == host_variant(), "the host's sampler did not build or load"
    return sampler


@pytest.fixture(scope="module")
def builds(host) -> list[RowSampler]:
    """Every build this CPU runs, the portable one (the arithmetic's definition) included."""
    names = [v for v in ("avx512vnni", "avx512", "avx2") if v != host.variant and runs_here(v)]
    return [host, *(RowSampler.load(v) for v in names), RowSampler.load("portable")]


def random_rows(n: int, seed: int) -> list[tuple[torch.Tensor, SamplingParams, float]]:
    """Rows of every kind the sampler distinguishes: flat and peaked logits, ties, masked
    (-inf) tokens, short and vocabulary-sized rows; greedy-free parameters of every filter."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        v = rng.choice([1, 5, 17, 64, 1000, V])
        x = torch.randn(v, generator=g) * rng.choice([0.5, 2.0, 5.0, 20.0])
        if rng.random() < 0.3:
            x = x.round()                                       # ties
        if rng.random() < 0.3:
            x[torch.rand(v, generator=g) < 0.5] = float("-inf")   # masked tokens
            x[0] = 1.0
        p = SamplingParams(temperature=rng.choice([0.01, 0.1, 0.7, 1.0, 2.0]),
                           top_k=rng.choice([0, 0, 1, 5, 50, 2000, 40000]),
                           top_p=rng.choice([1.0, 1.0, 0.1, 0.5, 0.9, 0.95, 0.999]))
        out.append((x, p, rng.random()))
    return out


def one(sampler: RowSampler, x: torch.Tensor, p: SamplingParams, u: float, threads: int | None = None) -> int:
    return sampler.sample(x[None], [0], [p.temperature], [p.top_k], [p.top_p], [u], num_threads=threads)[0]


def test_every_build_draws_the_same_token_and_the_torch_fallback_agrees(builds):
    """600 rows of every kind: each build the same token; engine.sampling.draw_row (torch's
    exp, a sorted cumsum) too: the two differ only where u lands within rounding of a token's
    boundary, which none of these rows does."""
    for x, p, u in random_rows(600, seed=0):
        got = {b.variant: one(b, x, p, u) for b in builds}
        assert len(set(got.values())) == 1, (p, u, got)
        assert got[builds[0].variant] == draw_row(x, p, u), (x.shape, p, u)


def test_a_row_draws_the_same_alone_in_a_batch_and_on_any_team(host):
    rows = random_rows(64, seed=1)
    x = torch.full((64, V), float("-inf"))
    for i, (r, _, _) in enumerate(rows):                         # rows of V, their tails masked
        x[i, :r.shape[0]] = r
    params = [p for _, p, _ in rows]
    args = ([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
            [u for _, _, u in rows])
    alone = [one(host, x[i], params[i], args[3][i]) for i in range(64)]
    for threads in (1, 2, 3):
        assert host.sample(x, list(range(64)), *args, num_threads=threads) == alone
    back = list(range(63, -1, -1))                              # rows picked out of order, a strided view
    wide = torch.zeros(64, 2 * V)
    wide[:, :V] = x
    assert host.sample(wide[:, :V], back, *(list(reversed(a)) for a in args)) == alone[::-1]


def test_draws_follow_the_softmax_over_the_kept_tokens(host):
    """40,000 draws land within 5 standard deviations of each share; masked and filtered
    tokens never come."""
    g = torch.Generator().manual_seed(2)
    n = 40_000
    u = torch.rand(n, dtype=torch.float64, generator=g).tolist()
    want = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    x = want.log()[None]
    counts = torch.bincount(torch.tensor(host.sample(x, [0] * n, [1.0] * n, [0] * n, [1.0] * n, u)), minlength=5)
    sigma = (n * want * (1 - want)).sqrt()
    assert counts[4] == 0 and ((counts - n * want).abs() <= 5 * sigma + 1e-9).all(), counts
    # temperature 2 flattens: shares ∝ want ** 0.5; top_k 2 keeps .5 and .25 (renormalised)
    for temp, k, share in ((2.0, 0, want.sqrt() / want.sqrt().sum()), (1.0, 2, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))):
        counts = torch.bincount(torch.tensor(host.sample(x, [0] * n, [temp] * n, [k] * n, [1.0] * n, u)), minlength=5)
        sigma = (n * share * (1 - share)).sqrt()
        assert ((counts - n * share).abs() <= 5 * sigma + 1e-9).all(), (temp, k, counts)


def test_top_k_keeps_every_tie_of_the_kth_and_top_p_the_lower_index_of_a_tie(host):
    x = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.0])
    n = 3000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).tolist()
    k2 = host.sample(x[None], [0] * n, [1.0] * n, [2] * n, [1.0] * n, u)
    assert set(k2) == {0, 2, 3, 4}                               # the 2nd largest is 2.0: all three ties stay
    # weights e^0, e^-1 x3, ...: top_p .5 keeps token 0 (weight before it 0) and token 2, the
    # first of the ties in index order (weight before it .44 of the total); token 3's is .60
    p5 = host.sample(x[None], [0] * n, [1.0] * n, [0] * n, [0.5] * n, u)
    assert set(p5) == {0, 2}
    assert set(host.sample(x[None], [0] * n, [1.0] * n, [0] * n, [0.01] * n, u)) == {0}


def test_rows_the_near_candidates_cannot_decide_widen_them(builds):
    """A peak over a heavy tail (top-p's nucleus reaches deep into the tail: wider candidate
    cuts) and a row whose k-th largest logit sits 200 below the top three (past every cut:
    every token): the same tokens on every build and through the torch fallback."""
    g = torch.Generator().manual_seed(4)
    tail = torch.randn(V, generator=g) - 10.0
    tail[7] = 0.0
    far = torch.randn(V, generator=g) - 200.0
    far[:3] = torch.tensor([0.0, -1.0, -2.0])
    for x, p in ((tail, SamplingParams(temperature=1.0, top_p=0.9)),
                 (tail, SamplingParams(temperature=0.7, top_k=20000, top_p=0.95)),
                 (far, SamplingParams(temperature=0.5, top_k=1000)),
                 (far, SamplingParams(temperature=1.0, top_k=1000, top_p=0.99999))):
        for u in (0.0, 0.3, 0.999999):
            got = {b.variant: one(b, x, p, u) for b in builds}
            assert len(set(got.values())) == 1 and got[builds[0].variant] == draw_row(x, p, u), (p, u, got)


def test_a_row_without_a_finite_weight_is_unsampled_and_bad_arguments_are_refused(host):
    ok = torch.randn(3, 10)
    for bad in (torch.full((10,), float("-inf")), torch.tensor([0.0, float("nan")] + [1.0] * 8),
                torch.tensor([float("inf")] + [1.0] * 9)):
        x = torch.cat([ok, bad[None]])
        got = host.sample(x, [0, 3], [1.0, 1.0], [0, 0], [1.0, 0.9], [0.5, 0.5])
        assert got[1] == UNSAMPLED and 0 <= got[0] < 10
        assert draw_row(bad, SamplingParams(), 0.5) == UNSAMPLED
    assert len(host.sample(ok, [0, 1, 2], [1.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3)) == 3
    args = ([0], [1.0], [0], [1.0], [0.5])
    for logits, bad_args, what in (
            (ok.double(), args, "fp32"), (ok.t(), args, "unit column stride"), (ok[0], args, "fp32 \\[B, V\\]"),
            (ok, ([0], [1.0, 1.0], [0], [1.0], [0.5]), "2 temperatures"),
            (ok, ([3], [1.0], [0], [1.0], [0.5]), "row index"), (ok, ([-1], [1.0], [0], [1.0], [0.5]), "row index"),
            (ok, ([0], [0.0], [0], [1.0], [0.5]), "temperature"), (ok, ([0], [float("nan")], [0], [1.0], [0.5]),
                                                                    "temperature"),
            (ok, ([0], [1e-46], [0], [1.0], [0.5]), "temperature"),          # 0 as the kernel's float
            (ok, ([0], [1.0], [2**63], [1.0], [0.5]), "top_k"),
            (ok, ([0], [1.0], [0], [0.0], [0.5]), "top_p"), (ok, ([0], [1.0], [0], [1.0], [1.0]), "uniform")):
        with pytest.raises(ValueError, match=what):
            host.sample(logits, *bad_args)
    assert host.sample(ok, [], [], [], [], []) == []
