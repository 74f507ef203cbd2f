"""Log probabilities (engine/logprobs.py): the sampled and top tokens' logprobs
are log_softmax of the very float32 logits the engine samples from, before the
sampling parameters adjust them; prompt logprobs are those of a whole-sequence
prefill, with a cached prefix too; asking for them changes no token."""

from __future__ import annotations

import pytest
import torch

from engine.request import InvalidParam, SamplingParams, TokenLogprobs

from .test_logit_adjustments import next_logits, prompts
from .test_sampling_extremes import engine_on, run

MAX_TOKENS = 8


def spy_logits(engine) -> list[tuple[list[str], torch.Tensor]]:
    """Record (request ids, a copy of the logits) of every row the runner samples, as
    ``_pick`` receives them (before anything adjusts them)."""
    seen = []
    pick = engine.runner._pick

    def recording(requests, sampled, logits, *rest):
        seen.append(([requests[i].request_id for i in sampled], logits.float().clone()))
        return pick(requests, sampled, logits, *rest)
    engine.runner._pick = recording
    return seen


def check_entry(entry: TokenLogprobs, logits: torch.Tensor, k: int) -> None:
    """``entry`` against log_softmax(``logits``) [V] in float64: its token's logprob and its top k."""
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert abs(entry.logprob - float(ref[entry.token_id])) <= 1e-5
    assert len(entry.top) == k
    best = torch.topk(ref, k).values.tolist()
    for (token, lp), want in zip(entry.top, best):
        assert abs(lp - float(ref[token])) <= 1e-5 and abs(lp - want) <= 1e-5


@pytest.mark.parametrize("path", ["executor", "torch"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_k=40, seed=3),
                                      dict(temperature=0.7, seed=5, logit_bias={"300": 5.0},
                                           repetition_penalty=1.3)])
def test_logprobs_are_log_softmax_of_the_sampled_logits(make_tiny, path, sampling):
    eng = engine_on(make_tiny, path)
    seen = spy_logits(eng)
    ps = prompts(3, seed=11)
    params = SamplingParams.from_dict(dict(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, **sampling))
    got = run(eng, {f"r{i}": (p, params) for i, p in enumerate(ps)})
    rows: dict[str, list[torch.Tensor]] = {}
    for rids, logits in seen:
        for rid, row in zip(rids, logits):
            rows.setdefault(rid, []).append(row)
    for rid, out in got.items():
        assert len(out.logprobs) == len(out.new_token_ids) == MAX_TOKENS
        for entry, token, logits in zip(out.logprobs, out.new_token_ids, rows[rid]):
            assert entry.token_id == token
            check_entry(entry, logits, 5)
    # the same tokens as a run that asks for none (greedy and seeded alike)
    plain = run(engine_on(make_tiny, path),
                {f"r{i}": (p, SamplingParams.from_dict(dict(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)))
                 for i, p in enumerate(ps)})
    for rid, out in got.items():
        assert out.new_token_ids == plain[rid].new_token_ids
        assert plain[rid].logprobs is None and plain[rid].prompt_logprobs is None


def test_logprobs_of_raw_logits_match_a_whole_sequence_prefill(make_tiny):
    """Independent of the engine's own tensors: token j's logprobs against the logits
    after prompt + the first j tokens, from one prefill (another kernel: 1e-4)."""
    eng = engine_on(make_tiny, "torch")
    p = prompts(1, seed=4)[0]
    out = run(eng, {"a": (p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2,
                                            logit_bias=((7, 50.0),)))})["a"]
    assert out.new_token_ids == [7] * 5                       # the bias decides the token...
    for j, entry in enumerate(out.logprobs):                  # ...but the logprobs are the model's own
        ref = torch.log_softmax(next_logits(eng.model, p + out.new_token_ids[:j]).double(), dim=-1)
        assert abs(entry.logprob - float(ref[7])) <= 1e-4
        assert [t for t, _ in entry.top] == torch.topk(ref, 2).indices.tolist()


def prompt_reference(model, ids: list[int], k: int) -> list[tuple[float, list[int]]]:
    """(logprob of ids[j], top-k ids) at every position j >= 1, from one prefill."""
    out = []
    for j in range(1, len(ids)):
        ref = torch.log_softmax(next_logits(model, ids[:j]).double(), dim=-1)
        out.append((float(ref[ids[j]]), torch.topk(ref, k).indices.tolist()))
    return out


@pytest.mark.parametrize("chunk", [0, 16])
def test_prompt_logprobs_with_a_cached_prefix_and_in_chunks(make_tiny, chunk):
    eng = make_tiny(prefill_chunk_tokens=chunk)
    p = prompts(1, seed=9)[0] * 3                                   # 24..90 tokens: several blocks
    first = run(eng, {"warm": (p, SamplingParams(max_tokens=2, temperature=0.0))})["warm"]
    asked = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    out = run(eng, {"again": (p, asked)})["again"]
    assert out.new_token_ids == first.new_token_ids
    assert len(out.prompt_logprobs) == len(p) - 1
    for entry, token, (lp, top) in zip(out.prompt_logprobs, p[1:], prompt_reference(eng.model, p, 3)):
        assert entry.token_id == token and abs(entry.logprob - lp) <= 1e-4
        assert [t for t, _ in entry.top] == top
    # it computed its whole prompt (no cached prefix gives logits); a plain request after it hits the cache
    assert out.num_cached_tokens == 0
    hit = run(eng, {"plain": (p, SamplingParams(max_tokens=2, temperature=0.0))})["plain"]
    assert hit.num_cached_tokens > 0 and hit.prompt_logprobs is None


def test_prompt_logprobs_come_once_with_the_first_token(make_tiny):
    eng = make_tiny()
    p = prompts(1, seed=2)[0]
    eng.add_request("r", p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False, False]
    assert all(e.top == () for e in outs[0].prompt_logprobs)


def test_logprob_bounds_are_refused():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, 21, 2.0, True):
            with pytest.raises(InvalidParam) as e:
                SamplingParams.from_dict({name: bad})
            assert e.value.param == name
        assert getattr(SamplingParams.from_dict({name: 20}), name) == 20


def test_token_logprobs_round_trip_their_json_and_refuse_bad_values():
    import orjson
    entry = TokenLogprobs(5, -0.25, ((5, -0.25), (9, -2.0)))
    assert TokenLogprobs.from_json(orjson.loads(orjson.dumps(entry))) == entry
    for bad in ({"token_id": 5, "logprob": 0.5, "top": []}, {"token_id": -1, "logprob": -1.0, "top": []},
                {"token_id": 5, "logprob": -1.0, "top": [[1, -1.0]] * 21}, {"token_id": 5, "logprob": -1.0},
                [5, -1.0, []]):
        with pytest.raises(ValueError):
            TokenLogprobs.from_json(bad)
