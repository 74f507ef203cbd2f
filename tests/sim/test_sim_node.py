"""A simulated node schedules exactly what the engine schedules: the same
batches (prefill chunks, decodes, preemptions) step by step for one trace."""

from __future__ import annotations

import random

import pytest

from engine.engine import EngineConfig, LLMEngine, build_model
from engine.model.registry import resolve_model
from engine.request import Request, SamplingParams
from kvd.sim.costs import StepCosts
from kvd.sim.events import EventQueue
from kvd.sim.node import SimNode

COSTS = StepCosts(0.004, 2e-4, 1e-7, 0.003, 2e-4, 1e-7, 1e-5, 2e-4, 1e-9)


def trace(n: int, seed: int) -> list[tuple[str, list[int], int]]:
    """(request id, prompt, max_tokens): random prompts, two sharing a 48-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 250) for _ in range(48)]
    out = []
    for i in range(n):
        prompt = [rng.randrange(10, 250) for _ in range(rng.randrange(20, 90))]
        if i in (1, 3):
            prompt = shared + prompt[:20]
        out.append((f"r{i}", prompt, rng.randrange(8, 30)))
    return out


def engine_batches(engine, reqs) -> list[tuple]:
    log = []
    schedule = engine.scheduler.schedule

    def recording():
        b = schedule()
        if b is not None:
            log.append(([(r.request_id, n) for r, n in zip(b.prefill, b.prefill_lens)],
                        [r.request_id for r in b.decode], [r.request_id for r in b.preempted]))
        return b

    engine.scheduler.schedule = recording
    for rid, prompt, max_tokens in reqs:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return log


def sim_batches(config, reqs) -> list[tuple]:
    events = EventQueue()
    node = SimNode("n1", "mixed", config, COSTS, events, lambda *a: None, keep_log=True)
    for i, (rid, prompt, max_tokens) in enumerate(reqs):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        node.scheduler.add(Request(request_id=rid, prompt_ids=prompt, params=params, arrival=i * 1e-6))
    node.wake()
    events.run()
    assert not node.scheduler.has_unfinished()
    node.pool.check_integrity()
    return [(s.prefill, s.decode, s.preempted) for s in node.log]


@pytest.fixture(scope="module")
def tiny():
    source = resolve_model("tiny:7")
    return source.load_weights(), source.load_tokenizer()


@pytest.mark.parametrize("overrides", [
    dict(prefill_chunk_tokens=32, kv_blocks=14, host_kv_blocks=64),            # chunks, swaps
    dict(prefill_chunk_tokens=0, kv_blocks=16, preemption_mode="recompute"),   # whole prompts, recompute
], ids=["chunked-swap", "unchunked-recompute"])
def test_simulated_node_schedules_the_engines_batches(tiny, overrides):
    weights, tokenizer = tiny
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=8, host_hit_policy="swap", **overrides)
    engine = LLMEngine(config, build_model(config, weights), tokenizer, "tiny")
    reqs = trace(7, seed=3)
    real = engine_batches(engine, reqs)
    sim = sim_batches(engine.config, reqs)
    assert any(p for _, _, p in real), "the trace must preempt, or the test shows too little"
    assert sim == real


def test_kv_streamed_out_and_received_costs_the_nodes_own_steps():
    """A prefill leg's step pays for the KV it streams out, the decode node's next
    step for the KV it received: transfer_byte_s a byte (as replication) and
    half a round trip a message."""
    from kvd.sim.node import HAND_OFF

    config = EngineConfig(model="tiny", dtype="float32", kv_blocks=64, block_size=16, prefill_chunk_tokens=0)
    per_token, layers = 1000, 4                                 # KV bytes a token; messages a prompt
    sent = 64 * per_token * COSTS.transfer_byte_s + layers * COSTS.transfer_latency_s / 2
    steps = {}
    for name, streams in (("plain", False), ("leg", True)):
        events = EventQueue()
        node = SimNode(name, "prefill", config, COSTS, events, lambda *a: None, kv_bytes_per_token=per_token,
                       kv_messages=layers, keep_log=True)
        req = Request(request_id="r", prompt_ids=list(range(10, 74)), arrival=0.0,
                      params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        if streams:
            req.kv_out = HAND_OFF
        node.add(req)
        events.run()
        steps[name] = node.log[0].seconds
    assert steps["leg"] - steps["plain"] == pytest.approx(sent)

    events = EventQueue()
    decode = SimNode("d", "decode", config, COSTS, events, lambda *a: None, kv_bytes_per_token=per_token,
                     kv_messages=layers, keep_log=True)
    prompt = list(range(10, 74))
    region, _ = decode.reserve_prompt(prompt, 0)
    req = Request(request_id="r", prompt_ids=prompt, arrival=0.0,
                  params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    decode.add_prefilled(req, region, 123)
    events.run()
    first, second = decode.log[0].seconds, decode.log[1].seconds
    assert first - second == pytest.approx(sent, rel=0.01)
