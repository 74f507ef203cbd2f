"""No value a request may carry stops the engine: every sampling parameter at
its extremes shares one batch with greedy requests, which complete with their
reference tokens; a temperature too small to divide by is greedy; a value the
engine cannot represent is refused at ``add_request``; and a request that
fails inside a step fails alone, with an error naming it."""

from __future__ import annotations

import random

import pytest
import torch

from engine.sampling import sample
from engine.request import GREEDY_TEMPERATURE, InvalidParam, RequestOutput, SamplingParams

MAX_TOKENS = 8


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def random_(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


# parameters whose draw can only be the row's maximum: their tokens are the greedy ones
AS_GREEDY = [random_(temperature=t) for t in (1e-300, 5e-324, 1e-46, -0.0, GREEDY_TEMPERATURE / 2)] + [
    random_(temperature=2.0, top_k=1), random_(temperature=2.0, top_p=1e-300),
    random_(temperature=2.0, min_p=1.0), random_(temperature=1e-300, top_k=10**9, seed=2**63 - 1),
    greedy(min_p=1e-300), greedy(top_k=2**31 - 1, top_p=1e-300)]
# every other extreme: any token, but a token, and the request completes
ANY = [random_(temperature=2.0), random_(temperature=GREEDY_TEMPERATURE), random_(temperature=1.0, top_p=1.0),
       random_(temperature=2.0, top_k=10**9), random_(temperature=2.0, top_k=2**31 - 1),
       random_(temperature=2.0, min_p=1e-300), random_(temperature=2.0, seed=0),
       random_(temperature=2.0, seed=2**63 - 1, top_k=2, top_p=1e-300),
       random_(temperature=2.0, repetition_penalty=1e-300), random_(temperature=2.0, repetition_penalty=2.0),
       random_(temperature=2.0, logit_bias=((5, 100.0), (6, -100.0), (7, 100.0))),
       random_(temperature=2.0, min_tokens=MAX_TOKENS, logit_bias=((0, -100.0),), min_p=0.5, top_k=3),
       greedy(repetition_penalty=1e-300), greedy(logit_bias=((9, -100.0),), repetition_penalty=2.0)]


def engine_on(make_tiny, path: str):
    """``executor``: the plan executor decodes and hands back its greedy ids, the C++
    sampler draws; ``torch``: the torch model and the torch sampler."""
    if path == "executor":
        eng = make_tiny()
        assert eng.runner.fused is not None and eng.runner.sampler is not None
        return eng
    eng = make_tiny(decode_kernel="torch")
    eng.runner.sampler = None
    return eng


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    """Add every request, step until none is left; each request's outputs merged into one."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    got: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 10 * MAX_TOKENS * len(requests), "the engine stopped making progress"
        for out in engine.step():
            got[out.request_id] = got[out.request_id].merge(out) if out.request_id in got else out
    return got


@pytest.mark.parametrize("path", ["executor", "torch"])
def test_extreme_parameters_in_one_batch_with_greedy_requests(make_tiny, path):
    ps = prompts(4, seed=1)
    ref_engine = engine_on(make_tiny, path)
    ref = [ref_engine.generate([p], greedy())[0] for p in ps]
    eng = engine_on(make_tiny, path)
    reqs = {f"greedy-{i}": (p, greedy()) for i, p in enumerate(ps)}
    reqs |= {f"as-greedy-{j}": (ps[j % len(ps)], p) for j, p in enumerate(AS_GREEDY)}
    reqs |= {f"any-{j}": (ps[j % len(ps)], p) for j, p in enumerate(ANY)}
    got = run(eng, reqs)
    assert set(got) == set(reqs)
    for rid, out in got.items():
        assert out.error is None and out.finished and out.finish_reason == "length", (rid, out)
        assert len(out.new_token_ids) == MAX_TOKENS, rid
    for i in range(len(ps)):
        assert got[f"greedy-{i}"].new_token_ids == ref[i]
    for j, p in enumerate(AS_GREEDY):
        assert got[f"as-greedy-{j}"].new_token_ids == ref[j % len(ps)], p
    vocab = eng.model.config.vocab_size
    assert all(0 <= t < vocab for out in got.values() for t in out.new_token_ids)
    assert eng.stats.finished["error"] == 0
    eng.check_integrity()
    assert eng.pool.stats()["device"]["request_owned"] == 0


@pytest.mark.parametrize("values,param", [
    ({"top_k": 2**63}, "top_k"), ({"top_k": 2**31}, "top_k"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"logit_bias": ((49152, 1.0),)}, "logit_bias"),
])
def test_a_value_the_engine_cannot_represent_is_refused_and_queues_nothing(make_tiny, values, param):
    eng = make_tiny()
    assert eng.model.config.vocab_size == 49152
    with pytest.raises(InvalidParam) as exc:
        eng.add_request("r", [1, 2, 3], SamplingParams(**values))
    assert exc.value.param == param
    assert not eng.has_unfinished() and not eng.requests
    assert eng.generate([[1, 2, 3]], greedy()) == [make_tiny().generate([[1, 2, 3]], greedy())[0]]


@pytest.mark.parametrize("path", ["executor", "torch"])
def test_a_request_whose_logits_cannot_be_sampled_fails_alone(make_tiny, path):
    """No parameter makes a row unsampleable any more, so the fault is injected: the
    logits row of request ``bad`` turns NaN (as a numerical fault in the model would)
    in the steps after its first. It ends with an error naming it; the batch goes on."""
    ps = prompts(3, seed=2)
    ref = [engine_on(make_tiny, path).generate([p], greedy())[0] for p in ps]
    eng = engine_on(make_tiny, path)
    poison_row(eng, "bad", after_tokens=2)
    reqs = {f"g{i}": (p, greedy()) for i, p in enumerate(ps)}
    reqs["bad"] = (ps[0], random_(temperature=0.7, seed=3))
    got = run(eng, reqs)
    assert [got[f"g{i}"].new_token_ids for i in range(3)] == ref
    bad = got["bad"]
    assert bad.finished and bad.finish_reason == "error" and len(bad.new_token_ids) == 2
    assert "request bad" in bad.error and "no finite weight" in bad.error
    assert eng.stats.finished["error"] == 1
    eng.check_integrity()
    assert eng.pool.stats()["device"]["request_owned"] == 0
    assert eng.generate([ps[1]], greedy()) == [ref[1]]          # and the engine serves on


def test_a_request_whose_stop_check_raises_fails_alone(make_tiny):
    """A fault in one request's stop conditions or detokenizer (injected: the output
    processor raises for request ``bad`` at its third token) fails that request alone."""
    ps = prompts(3, seed=3)
    ref = [make_tiny().generate([p], greedy())[0] for p in ps]
    eng = make_tiny()
    append = eng.outputs.append

    def faulty(req, token):
        if req.request_id == "bad" and len(req.output_ids) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return append(req, token)

    eng.outputs.append = faulty
    reqs = {f"g{i}": (p, greedy()) for i, p in enumerate(ps)} | {"bad": (ps[2], greedy())}
    got = run(eng, reqs)
    assert [got[f"g{i}"].new_token_ids for i in range(3)] == ref
    assert got["bad"].finish_reason == "error" and "request bad" in got["bad"].error
    assert "UnicodeDecodeError" in got["bad"].error
    eng.check_integrity()
    assert eng.pool.stats()["device"]["request_owned"] == 0


def poison_row(eng, request_id: str, after_tokens: int) -> None:
    """Make ``request_id``'s logits row NaN once it has ``after_tokens`` tokens, on
    whichever path computes its logits (the executor's decode step or the torch model)."""
    runner = eng.runner
    pick = runner._pick

    def poisoned(requests, sampled, logits, *rest):
        for row, i in enumerate(sampled):
            if requests[i].request_id == request_id and len(requests[i].output_ids) >= after_tokens:
                logits[row] = float("nan")
        return pick(requests, sampled, logits, *rest)

    runner._pick = poisoned


def test_logits_do_not_overflow_at_the_smallest_random_temperature(make_tiny):
    """At GREEDY_TEMPERATURE (the smallest that samples) the weights are
    e^((l - max) / T) <= 1: finite, and the draw is a token of the row."""
    eng = make_tiny()
    x = torch.randn(2, 49152, generator=torch.Generator().manual_seed(5)) * 30
    x[1, :100] = float("-inf")
    p = random_(temperature=GREEDY_TEMPERATURE, seed=1)
    for kernel in (eng.runner.sampler, None):
        got = sample(x.clone(), [p, p], [None, None], [0, 0], kernel=kernel)
        assert got == x.argmax(dim=-1).tolist()            # a gap of > 1e-5 nats is certainty
