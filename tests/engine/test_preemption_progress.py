"""Many requests over a tiny KV pool: preemption always makes progress.

Every request finishes with exactly the tokens it produces alone (greedy and
seeded), in swap and recompute mode, chunked and not, and the scheduler never
spins: no step passes without a token or a prefill while requests wait, and
preemptions stay bounded by the blocks the requests grow by. With prefix
caching on, each request's prompt block is cached (and locked) while it
runs: were a swapped request to keep that lock, the swapped requests' pinned
blocks would leave no room for any of them to come back, and every step
would swap one in and straight out again.
"""

from __future__ import annotations

import random

import pytest

from engine.request import InvalidParam, RequestStatus, SamplingParams

from .conftest import build_engine

BS = 16


def workload(n: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """``n`` distinct prompts of 17-28 tokens (a full block, cached while
    they run), each with 32-35 tokens to generate: 4 blocks at the end, all
    of a 4-block pool. Every other one sampled with a seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(17, 28))]
        max_tokens = rng.randint(32, 35)
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
                  SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, seed=1000 + i, ignore_eos=True))
        out.append((prompt, params))
    return out


@pytest.fixture(scope="module")
def alone_tokens(tiny_weights, tokenizer):
    """Each request of the workload run alone on a roomy engine."""
    eng = build_engine(tiny_weights, tokenizer, enable_prefix_caching=False)
    return [eng.generate([p], sp)[0] for p, sp in workload(16)]


def run_to_completion(eng, work, max_steps: int):
    """Drive ``eng`` over ``work``: (tokens per request, steps that neither
    sampled a token nor computed a prefill chunk while requests were
    unfinished). Fails after ``max_steps``."""
    ids = [f"r{i}" for i in range(len(work))]
    for rid, (p, sp) in zip(ids, work):
        eng.add_request(rid, p, sp)
    out = {rid: [] for rid in ids}
    idle = 0
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        computed = {rid: r.num_computed for rid, r in eng.requests.items()}
        outs = eng.step()
        # progress: a token, or a prefill chunk computed (a recompute's prompt and outputs take several)
        idle += not outs and all(r.num_computed <= computed[rid] for rid, r in eng.requests.items())
        for o in outs:
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
    else:
        s = eng.scheduler
        pytest.fail(f"no end after {max_steps} steps: {len(s.running)} running, {len(s.swapped)} swapped, "
                    f"{len(s.waiting)} waiting, {eng.stats.preemptions} preemptions, "
                    f"{eng.stats.generation_tokens} tokens, pool {eng.pool.stats()['device']}")
    return [out[rid] for rid in ids], idle


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("chunk", [0, 32])
def test_sixteen_streams_over_a_four_block_pool_all_finish_exactly(make_tiny, alone_tokens, mode, chunk):
    work = workload(16)
    eng = make_tiny(kv_blocks=4, host_kv_blocks=128, preemption_mode=mode, prefill_chunk_tokens=chunk,
                    max_model_len=64)
    total = sum(sp.max_tokens for _, sp in work)
    got, idle = run_to_completion(eng, work, max_steps=2 * total)
    assert got == alone_tokens
    # never spins: every step computes something, and each preemption is paid for
    # by a block another request grew into
    assert idle == 0
    assert 0 < eng.stats.preemptions <= eng.stats.generation_tokens // BS + len(work)
    eng.check_integrity()
    for tier in ("device", "host"):
        assert eng.pool.stats()[tier]["request_owned"] == 0
    assert eng.pool.live_hits == 0


def test_a_swapped_request_pins_no_device_block(make_tiny):
    """Swapped out, a request's whole table is on the host tier, its prefix
    lock released: its cached prompt blocks are evictable."""
    eng = make_tiny(kv_blocks=4, host_kv_blocks=64, prefill_chunk_tokens=0, max_model_len=64)
    (p0, _), (p1, _) = workload(2, seed=3)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    eng.add_request("old", p0, params)
    eng.add_request("new", p1, params)
    while not eng.scheduler.swapped:
        eng.step()
    (req,) = eng.scheduler.swapped
    assert req.request_id == "new" and req.status is RequestStatus.SWAPPED
    assert req.block_ids == [] and req.prefix is None
    assert len(req.host_block_ids) == -(-req.num_computed // BS)
    assert eng.pool.live_hits == 1                      # "old"'s lookup only
    old = eng.scheduler.running[0]
    dev = eng.pool.stats()["device"]
    assert dev["used"] - dev["evictable"] == len(old.block_ids)   # nothing else is pinned
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()
    assert eng.pool.stats()["host"]["used"] == 0


def test_a_request_larger_than_the_pool_is_refused_at_admission(make_tiny):
    eng = make_tiny(kv_blocks=4, host_kv_blocks=64, max_model_len=256)
    with pytest.raises(InvalidParam, match="KV blocks"):
        eng.add_request("big", list(range(100, 140)), SamplingParams(max_tokens=40))   # 80 tokens: 5 blocks
    assert not eng.has_unfinished()
    eng.add_request("fits", list(range(100, 140)), SamplingParams(max_tokens=24, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()
