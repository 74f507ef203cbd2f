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


@pytest.mark.parametrize("chunk", [0, 32])
def test_a_running_requests_prompt_is_a_hit_for_requests_arriving_meanwhile(make_tiny, chunk):
    """The prompt's full blocks are indexed once its prefill ends (or after
    each chunk), not when the request finishes: a request sharing the prompt
    that arrives while the first still decodes computes only its own tail."""
    base = prompts(1, 80, 80, seed=11)[0]                  # 5 full blocks of 16
    later = [base + p for p in prompts(3, 5, 20, seed=12)]
    cold = alone(make_tiny(enable_prefix_caching=False), [base] + later)
    eng = make_tiny(prefill_chunk_tokens=chunk)
    eng.add_request("first", base, GREEDY)
    out: dict[str, list[int]] = {"first": []}
    while eng.scheduler.running[0].prefilling if eng.scheduler.running else True:
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    assert eng.pool.stats()["device"]["cached"] == 5     # indexed while "first" decodes
    hits = eng.stats.prefix_hit_tokens
    for i, p in enumerate(later):
        eng.add_request(f"later{i}", p, GREEDY)
        out[f"later{i}"] = []
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    assert [out["first"]] + [out[f"later{i}"] for i in range(3)] == cold
    assert eng.stats.prefix_hit_tokens - hits == 3 * 80
    eng.check_integrity()
    assert eng.pool.stats()["device"]["request_owned"] == 0


def test_two_running_copies_of_one_prompt_index_it_once(make_tiny):
    """Two requests with the same prompt admitted in one step: the first to
    finish its prefill indexes the blocks; the other keeps its private copy
    until it finishes (then a duplicate, freed). Nothing leaks."""
    base = prompts(1, 64, 64, seed=13)[0]
    cold = alone(make_tiny(enable_prefix_caching=False), [base])[0]
    eng = make_tiny()
    assert eng.generate([base, base], GREEDY) == [cold, cold]
    eng.check_integrity()
    stats = eng.pool.stats()["device"]
    assert stats["request_owned"] == 0 and stats["cached"] == (64 + 24) // 16


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
    # a host tier of 4 blocks takes some victims (2-6 blocks each) and refuses others
    eng = make_tiny(kv_blocks=30, host_kv_blocks=4, enable_prefix_caching=False)
    # the real swap_out_request, observed: (blocks asked, host blocks free then, result)
    swaps = []
    swap_out = eng.pool.swap_out_request

    def observed_swap_out(ids, prefix):
        free = eng.pool.stats()["host"]["free"]
        result = swap_out(ids, prefix)
        swaps.append((len(ids), free, result))
        return result
    eng.pool.swap_out_request = observed_swap_out
    ids = [f"r{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        eng.add_request(rid, p, params)
    out = {rid: [] for rid in ids}
    recomputes = 0
    while eng.has_unfinished():
        before = {rid: r.num_preemptions for rid, r in eng.requests.items()}
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        for r in eng.scheduler.waiting:         # preempted in this step and sent back to prefill
            if r.num_preemptions > before.get(r.request_id, 0):
                assert r.num_computed == 0 and not r.block_ids and not r.host_block_ids
                recomputes += 1
    assert [out[rid] for rid in ids] == ref
    refused = [(n, free) for n, free, result in swaps if result is None]
    assert any(result is not None for _, _, result in swaps), "no request was ever swapped out"
    assert refused, "the host tier never refused a swap: the fallback was not exercised"
    assert all(n > free for n, free in refused)         # refused only for want of host blocks
    assert recomputes == len(refused) == eng.stats.preemptions - sum(r is not None for *_, r in swaps)
    eng.check_integrity()
    assert eng.pool.stats()["host"]["used"] == 0


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


def run_one(eng, prompt, params):
    """(output ids, last RequestOutput) of one request run to completion."""
    rid = f"one-{eng.stats.steps}"
    eng.add_request(rid, prompt, params)
    ids, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                ids += out.new_token_ids
                last = out
    return ids, last


def test_eos_and_min_tokens(make_tiny):
    eng = make_tiny()
    p = prompts(1, 10, 10, seed=13)[0]
    full = eng.generate([p], GREEDY)[0]
    eos = full[3]
    i = full.index(eos)                     # where greedy first samples it (3 for this prompt)
    assert i > 0, "pick a prompt whose greedy output does not start with full[3]"
    # pretend it is the model's EOS: the request stops right there, the EOS included
    eng.outputs.eos_ids = frozenset({eos})
    ids, last = run_one(eng, p, SamplingParams(max_tokens=24, temperature=0.0))
    assert ids == full[:i + 1] and (last.finish_reason, last.stop_reason) == ("stop", None)
    ids, last = run_one(eng, p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert ids == full and last.finish_reason == "length"
    # as a stop token id (EOS ignored) it stops the request too, and is named as the stop reason
    ids, last = run_one(eng, p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=(eos,)))
    assert ids == full[:i + 1] and (last.finish_reason, last.stop_reason) == ("stop", eos)
    # min_tokens = i bans it only where greedy would not pick it: nothing changes
    ids, last = run_one(eng, p, SamplingParams(max_tokens=24, temperature=0.0, min_tokens=i))
    assert ids == full[:i + 1] and last.finish_reason == "stop"
    # min_tokens = m > i: banned for m tokens, then the first one sampled stops the request
    delayed_stops = 0
    for m in range(i + 1, 11):
        for params, reason in ((SamplingParams(max_tokens=24, temperature=0.0, min_tokens=m), None),
                               (SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=(eos,), min_tokens=m), eos)):
            ids, last = run_one(eng, p, params)
            assert len(ids) >= m and eos not in ids[:-1] and ids[:i] == full[:i]
            if ids[-1] == eos:
                assert len(ids) > m and (last.finish_reason, last.stop_reason) == ("stop", reason)
                delayed_stops += 1
            else:
                assert len(ids) == 24 and last.finish_reason == "length"
    # this prompt samples it again soon after a short ban (m = 4, 5): the stop was exercised
    assert delayed_stops >= 2


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


def test_step_time_is_counted_per_step(make_tiny):
    """stats.step_seconds: the wall time of the steps stats.steps counts, no more (an idle
    step, with nothing scheduled, counts in neither)."""
    import time

    eng = make_tiny()
    assert eng.step() == [] and eng.stats.steps == 0 and eng.stats.step_seconds == 0.0
    t = time.perf_counter()
    eng.generate(prompts(2, seed=21), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t
    assert eng.stats.steps >= 5
    assert 0.0 < eng.stats.step_seconds <= wall


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 49152)])
def test_bf16_linear_rows_do_not_depend_on_the_row_count(shape):
    """The bf16 model's linear (llama._linear_batch_invariant): a row's result is the same
    bits alone, in any batch and at any offset in it, on this host's oneDNN kernels (on
    an AVX-512 CPU without BF16 a plain F.linear differs past the last multiple of 4 rows)."""
    import torch

    from engine.model.llama import _linear_batch_invariant

    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
    full = _linear_batch_invariant(x, w)
    for a, b in ((0, 1), (0, 2), (0, 3), (5, 6), (0, 17), (3, 66), (64, 70)):
        assert torch.equal(_linear_batch_invariant(x[a:b], w), full[a:b]), (a, b)
