"""The engine end to end on a tiny random model: exactness, caching, preemption, stops, leaks."""

from __future__ import annotations

import random

import pytest

from engine.request import InvalidParam, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n: int, lo: int = 5, hi: int = 90, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def alone(engine, ps, params=GREEDY):
    return [engine.generate([p], params)[0] for p in ps]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_of_16_equals_alone(make_tiny, dtype):
    ps = prompts(16)
    ref = alone(make_tiny(dtype=dtype, enable_prefix_caching=False), ps)
    eng = make_tiny(dtype=dtype, enable_prefix_caching=False)
    assert eng.generate(ps, GREEDY) == ref
    eng.check_integrity()
    assert all(len(o) == GREEDY.max_tokens for o in ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_cache_hit_equals_cold(make_tiny, dtype):
    base = prompts(1, 70, 70, seed=3)[0]
    variants = [base + p for p in prompts(6, 3, 40, seed=4)]
    cold = alone(make_tiny(dtype=dtype, enable_prefix_caching=False), variants)
    eng = make_tiny(dtype=dtype)
    eng.generate([base], GREEDY)                       # warm the cache with the shared prefix
    hits_before = eng.stats.prefix_hit_tokens
    assert eng.generate(variants, GREEDY) == cold
    assert eng.stats.prefix_hit_tokens - hits_before >= 6 * 64   # 4 full blocks each
    # a repeat of the same prompts hits even more (their own outputs were cached)
    assert eng.generate(variants, GREEDY) == cold
    eng.check_integrity()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_tokens_and_blocks(make_tiny, mode):
    ps = prompts(12, 20, 60, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = alone(make_tiny(enable_prefix_caching=False), ps, params)
    # 40 blocks cannot hold 12 requests of up to 100 tokens: the scheduler must preempt
    eng = make_tiny(kv_blocks=40, host_kv_blocks=64, preemption_mode=mode, enable_prefix_caching=False)
    assert eng.generate(ps, params) == ref
    assert eng.stats.preemptions > 0
    eng.check_integrity()
    assert eng.pool.stats()["device"]["used"] == 0
    assert eng.pool.stats()["host"]["used"] == 0


def test_swap_falls_back_to_recompute_when_host_is_full(make_tiny):
    ps = prompts(10, 30, 60, seed=6)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = alone(make_tiny(enable_prefix_caching=False), ps, params)
    eng = make_tiny(kv_blocks=30, host_kv_blocks=2, enable_prefix_caching=False)
    assert eng.generate(ps, params) == ref
    eng.check_integrity()


def test_abort_mid_flight_frees_everything(make_tiny):
    eng = make_tiny(kv_blocks=64)
    ps = prompts(6, 20, 60, seed=8)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        eng.step()
    for i in range(0, 6, 2):
        assert eng.abort_request(f"r{i}").finish_reason == "abort"
    assert eng.abort_request("r0") is None              # already gone
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()
    st = eng.pool.stats()["device"]
    assert st["request_owned"] == 0 and st["used"] == st["cached"]


def test_mixed_finish_abort_preempt_keeps_pool_invariants(make_tiny):
    rng = random.Random(11)
    eng = make_tiny(kv_blocks=48, host_kv_blocks=16)
    live = []
    for step in range(300):
        if rng.random() < 0.3:
            rid = f"q{step}"
            p = prompts(1, 5, 70, seed=step)[0]
            eng.add_request(rid, p, SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0,
                                                   ignore_eos=True))
            live.append(rid)
        if live and rng.random() < 0.1:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        eng.step()
        eng.check_integrity()
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()
    assert eng.pool.stats()["device"]["request_owned"] == 0


def test_stop_strings_token_ids_and_lengths(make_tiny, tokenizer):
    eng = make_tiny()
    p = prompts(1, 30, 30, seed=9)[0]
    full = eng.generate([p], GREEDY)[0]
    text = tokenizer.decode(full)
    # stop token id: stops right after that token, which is included in the output ids
    out = eng.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                           stop_token_ids=(full[5],)))[0]
    assert out == full[:full.index(full[5]) + 1]
    # stop string: the text stops before it; generation ends at the token completing it
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        eng.add_request("s", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                               stop=(stop,)))
        pieces, last = [], None
        while eng.has_unfinished():
            for o in eng.step():
                pieces.append(o.text)
                last = o
        assert last.finish_reason == "stop" and last.stop_reason == stop
        assert "".join(pieces) == text[:text.index(stop)]
    # max_tokens
    eng.add_request("m", p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert len(outs) == 3 and outs[-1].finish_reason == "length"
    eng.check_integrity()


def test_eos_and_min_tokens(make_tiny, tokenizer):
    eng = make_tiny()
    p = prompts(1, 10, 10, seed=12)[0]
    full = eng.generate([p], GREEDY)[0]
    eos = full[3]
    # pretend the 4th token is EOS by making it a stop id; min_tokens delays stopping
    out = eng.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                           stop_token_ids=(eos,), min_tokens=10))[0]
    assert len(out) >= 10 and eos not in out[:10]


def test_seeded_sampling_is_reproducible_and_batch_independent(make_tiny):
    eng = make_tiny()
    ps = prompts(4, 10, 30, seed=13)
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = alone(eng, ps[:1], sp)[0]
    batch = eng.generate(ps, [sp] + [SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True)
                                     for i in range(3)])
    assert batch[0] == a
    k1 = eng.generate(ps[:1], SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=5, ignore_eos=True))
    assert k1 == eng.generate(ps[:1], GREEDY.__class__(max_tokens=16, temperature=0.0, ignore_eos=True))


def test_bad_requests_change_nothing(make_tiny):
    eng = make_tiny(max_model_len=128, kv_blocks=64)
    with pytest.raises(InvalidParam) as e:
        eng.add_request("a", list(range(100, 300)), GREEDY)      # prompt beyond the context
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParam) as e:
        eng.add_request("b", [1, 2, 3], SamplingParams(max_tokens=126))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidParam):
        eng.add_request("c", [10**7], GREEDY)                    # token id outside the vocabulary
    with pytest.raises(InvalidParam):
        eng.add_request("d", [], GREEDY)
    assert not eng.has_unfinished() and not eng.requests
    eng.check_integrity()


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("temperature", float("nan")),
                                         ("top_p", 0.0), ("top_k", -5), ("seed", -1), ("stop", ("",)),
                                         ("min_tokens", 99)])
def test_sampling_params_validation(field, value):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
