"""One arithmetic per token through the engine's features, bit for bit: the bundled model
as served (native weights) gives each request the same tokens *and the same logprob bits*
(the top 20 of every step, log-softmax of its logits) alone; in a batch of 16 with a cold
prefix cache; again with every prefix cached; preempted under KV pressure with swap and
with recompute; and in chunks of 7 prompt tokens. Greedy and seeded requests alike.

A logprob's bits follow from its logits row's: two runs whose logits differ in any bit
of the 20 most likely tokens or of the row's log-sum-exp give different logprobs here
(tests/engine/test_determinism.py checks the logits and K/V themselves, path by path).
"""

from __future__ import annotations

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams

from .test_sampling_extremes import run

pytestmark = pytest.mark.slow

TOKENS, TOP = 24, 20


def params(i: int) -> SamplingParams:
    """Even: greedy; odd: seeded, temperatures 0.7 to 1.0 with top-p or top-k."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    k = i // 2
    return SamplingParams(max_tokens=TOKENS, temperature=(0.7, 0.8, 0.9, 1.0)[k % 4], top_p=0.9 if k % 2 else 1.0,
                          top_k=0 if k % 2 else 40, seed=50 + i, ignore_eos=True, logprobs=TOP)


def engine_like(native_engine, **kw) -> LLMEngine:
    """An engine over ``native_engine``'s model (it keeps no state) with ``kw`` as config."""
    cfg = EngineConfig(**{"model": "smollm2", "dtype": "float32", "kv_blocks": 512, "host_kv_blocks": 64, **kw})
    return LLMEngine(cfg, native_engine.model, native_engine.tokenizer, "smollm2")


def outputs(engine: LLMEngine, prompts: list[list[int]], first: int = 0) -> list[tuple]:
    """Each request's (tokens, every step's logprob and top-20 (id, logprob) pairs)."""
    got = run(engine, {f"r{i}": (p, params(first + i)) for i, p in enumerate(prompts)})
    return [(tuple(got[f"r{i}"].new_token_ids),
             tuple((e.token_id, e.logprob, e.top) for e in got[f"r{i}"].logprobs)) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def alone(native_engine, prompts) -> list[tuple]:
    cold = engine_like(native_engine, enable_prefix_caching=False)
    return [outputs(cold, [p], first=i)[0] for i, p in enumerate(prompts)]


def test_a_batch_of_16_and_cached_prefixes_keep_every_bit(native_engine, prompts, alone):
    warm = engine_like(native_engine)
    batch = (prompts * 2)[:16]
    got = run(warm, {f"r{i}": (p, params(i % len(prompts))) for i, p in enumerate(batch)})
    for i in range(16):
        out = got[f"r{i}"]
        assert (tuple(out.new_token_ids), tuple((e.token_id, e.logprob, e.top) for e in out.logprobs)) \
            == alone[i % len(prompts)], i
    assert outputs(warm, prompts) == alone                    # every prefix cached now
    assert warm.stats.prefix_hit_tokens >= sum(len(p) // 16 * 16 for p in prompts)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_every_bit(native_engine, prompts, alone, mode):
    small = engine_like(native_engine, kv_blocks=24, enable_prefix_caching=False, preemption_mode=mode)
    assert outputs(small, prompts) == alone
    assert small.stats.preemptions > 0
    small.check_integrity()


def test_chunks_of_7_keep_every_bit(native_engine, prompts, alone):
    chunked = engine_like(native_engine, prefill_chunk_tokens=7, enable_prefix_caching=False)
    assert outputs(chunked, prompts) == alone
