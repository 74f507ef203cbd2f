"""The logprob summary kernel (kernels/logprob_rows.py): torch's log_softmax and topk
within rounding, the same bits on every build, alone or in a batch, on any team."""

from __future__ import annotations

import pytest
import torch

from engine.logprobs import summarize
from kernels.logprob_rows import LogprobKernel
from kernels.quant_linear import host_variant, runs_here

V = 49152


@pytest.fixture(scope="module")
def host() -> LogprobKernel:
    assert host_variant() is not None, "this CPU has no kernel build (needs AVX2, FMA and F16C)"
    kernel = LogprobKernel.create()
    assert kernel is not None and kernel.variant == host_variant(), "the host's logprob kernel did not build or load"
    return kernel


@pytest.fixture(scope="module")
def builds(host) -> list[LogprobKernel]:
    """Every build this CPU runs, the portable one included."""
    names = [v for v in ("avx512vnni", "avx512", "avx2") if v != host.variant and runs_here(v)]
    return [host, *(LogprobKernel.load(v) for v in names), LogprobKernel.load("portable")]


def rows(seed: int) -> torch.Tensor:
    """Flat, peaked and wide rows, a maximum in the tail past the last block, ties at the top."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, V + 37, generator=g) * torch.tensor([0.1, 1, 4, 16, 30, 4, 4, 4])[:, None]
    x[1, -1] = 60.0                                   # the largest in the tail
    x[2, [7, 3000, 40000]] = 50.0                     # a three-way tie at the top: index order
    x[3, 100:200] = float("-inf")                     # masked tokens
    x[5, :] = 1.0                                     # every logit tied
    x[6, 5] = 200.0                                   # one token takes all the mass
    return x


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_top_and_lse_are_torch_log_softmax_and_topk(host, k):
    x = rows(k)
    got = host.summarize(x, range(len(x)), k)
    ref = torch.log_softmax(x.double(), dim=-1)
    for r, s in enumerate(got):
        assert s is not None
        assert s.lse == pytest.approx(float(torch.logsumexp(x[r].double(), -1)), rel=1e-6, abs=1e-6)
        values, ids = torch.topk(ref[r], k)
        assert [i for i, _ in s.top] == sorted(ids.tolist(), key=lambda i: (-float(ref[r, i]), i))
        assert all(abs(v - float(ref[r, i])) <= 1e-5 for i, v in s.top)
    tied = got[2].top if k >= 3 else ()
    assert [i for i, _ in tied[:3]] == [7, 3000, 40000][:len(tied)]


def test_every_build_alone_in_a_batch_and_on_any_team_gives_the_same_bits(builds):
    x = rows(1)
    want = [builds[0].summarize(x[r:r + 1], [0], 5, num_threads=1)[0] for r in range(len(x))]
    for kernel in builds:
        for threads in (1, 2, 3):
            assert kernel.summarize(x, range(len(x)), 5, num_threads=threads) == want, (kernel.variant, threads)
    assert builds[0].summarize(x, [6, 0, 6], 5) == [want[6], want[0], want[6]]


def test_rows_it_cannot_summarize_are_declined_and_answered_by_torch(host):
    x = torch.randn(5, 300)
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")
    x[2, :] = float("-inf")
    x[3, 2:] = float("-inf")                          # two finite logits: a top 5 needs -inf entries
    assert host.summarize(x, range(5), 5)[:4] == [None] * 4 and host.summarize(x, [4], 5)[0] is not None
    assert host.summarize(x, [3], 2)[0] is not None
    answers = summarize(x, range(5), [5] * 5, host).answer(x, [0, 0, 0, 1, 4])
    assert answers[3].logprob == pytest.approx(float(torch.log_softmax(x[3], -1)[1]))
    assert len(answers[3].top) == 5 and answers[3].top[0][0] in (0, 1)


def test_bad_arguments_are_refused(host):
    x = torch.randn(2, 100)
    for bad in (lambda: host.summarize(x.double(), [0], 1), lambda: host.summarize(x[:, ::2], [0], 1),
                lambda: host.summarize(x, [2], 1), lambda: host.summarize(x, [0], host.max_top + 1),
                lambda: host.summarize(x, [0], -1)):
        with pytest.raises(ValueError):
            bad()


def test_a_row_changed_in_place_after_the_summary_answers_from_its_copy(host):
    x = torch.randn(3, 1000)
    want = torch.log_softmax(x, -1)
    pending = summarize(x, [0, 2], [2, 0], host, changed=[2])
    x[2, 9] += 5.0                                    # a logit_bias on row 2, applied after the summary
    a, b = pending.answer(x, [4, 9])
    assert a.logprob == pytest.approx(float(want[0, 4]), abs=1e-5) and len(a.top) == 2 and b.top == ()
    assert b.logprob == pytest.approx(float(want[2, 9]), abs=1e-5)
