"""A request held for a handoff (``Scheduler.hold``, engine/exact_copy.py
``hold``): no step decodes it while held, the others go on; a step with
every running request held runs nothing; the hold ends at its deadline or
with the request; a request that is not decoding is not held."""

from __future__ import annotations

import time

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.exact_copy import hold
from engine.prefill_alone import PrefillAlone
from engine.request import SamplingParams


@pytest.fixture(params=[0, 256], ids=["unchunked", "chunked"])
def engine(request):
    eng = LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=64,
                                             host_kv_blocks=0, max_model_len=512, num_threads=1,
                                             prefill_chunk_tokens=request.param))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(1, 30)), params)
    eng.add_request("b", list(range(40, 70)), params)
    eng.step()                                                 # both prefilled: one token each
    return eng


def tokens(eng, rid: str) -> int:
    return len(eng.requests[rid].output_ids)


def test_a_held_request_computes_nothing_while_the_others_decode(engine):
    assert hold(engine, "a", 60.0) == 1                        # the tokens it made
    steps = engine.stats.steps
    for _ in range(3):
        outs = engine.step()
        assert [o.request_id for o in outs] == ["b"]
    assert (tokens(engine, "a"), tokens(engine, "b")) == (1, 4) and engine.stats.steps == steps + 3
    assert hold(engine, "b", 60.0) == 4
    assert engine.step() == [] and engine.stats.steps == steps + 3    # every running request held: no step


def test_a_hold_ends_at_its_deadline_or_with_its_request(engine):
    hold(engine, "a", 0.05)
    engine.step()
    assert tokens(engine, "a") == 1
    time.sleep(0.06)
    engine.step()
    assert tokens(engine, "a") == 2 and "a" not in engine.scheduler.held
    hold(engine, "b", 60.0)
    engine.abort_request("b")
    assert "b" not in engine.scheduler.held


def test_only_a_decoding_request_is_held(engine):
    assert hold(engine, "nope", 1.0) is None
    engine.add_request("c", list(range(100, 130)), SamplingParams(max_tokens=4, temperature=0.0))
    assert hold(engine, "c", 1.0) is None                      # waiting for its prefill
    assert "c" not in engine.scheduler.held


def test_the_pair_rule_runs_a_prompt_alone_and_releases_its_holds_after():
    """``PrefillAlone`` (engine/prefill_alone.py): while a prompt is
    computed, every decode whose copy is complete is held (no step runs it
    with a chunk); one whose copy is incomplete decodes in the prompt's
    steps; once the prompt is done the rule's holds end, a handoff's stays."""
    eng = LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=64,
                                             host_kv_blocks=0, max_model_len=512, num_threads=1,
                                             prefill_chunk_tokens=32))
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for rid, start in (("a", 1), ("b", 40), ("c", 80)):
        eng.add_request(rid, list(range(start, start + 20)), params)
    while any(not eng.requests[rid].output_ids for rid in "abc"):
        eng.step()
    eng.pair_rule = rule = PrefillAlone(lambda req: req.request_id != "c")    # c's copy is incomplete
    eng.add_request("p", list(range(200, 300)), params)                           # four chunks
    eng.step()
    assert {"a", "b"} <= eng.scheduler.held.keys() and rule.holding == {"a", "b"}
    rule.taken("b")                                                               # a handoff holds b now
    made = {rid: tokens(eng, rid) for rid in "abc"}
    while eng.requests["p"].prefilling:
        eng.step()
    assert (tokens(eng, "a"), tokens(eng, "b")) == (made["a"], made["b"]) and tokens(eng, "c") > made["c"]
    assert rule.counts["mixed_steps"] >= 3 and rule.counts["mixed_held"] == 0 and rule.counts["prompt_holds"] == 2
    eng.step()                                                                    # no prompt left: a decodes again
    eng.step()
    assert tokens(eng, "a") > made["a"] and tokens(eng, "b") == made["b"] and "b" in eng.scheduler.held
    assert rule.counts["prompt_releases"] == 1 and not rule.holding


def test_the_pair_rule_gives_a_decode_back_when_the_partner_takes_a_prompt_too():
    """A held decode the partner can no longer take (it computes a prompt of
    its own: the coordinator moves nothing while both prefill) is released
    at the next step boundary and decodes in the prompt's steps, instead of
    waiting for both nodes' prompts to drain; it is not held again while
    the partner prompts."""
    eng = LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=64,
                                             host_kv_blocks=0, max_model_len=512, num_threads=1,
                                             prefill_chunk_tokens=32))
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(1, 21)), params)
    while not eng.requests["a"].output_ids:
        eng.step()
    partner_prompting = False
    eng.pair_rule = rule = PrefillAlone(lambda req: not partner_prompting)
    eng.add_request("p", list(range(200, 328)), params)                           # four chunks
    eng.step()
    assert "a" in eng.scheduler.held and rule.holding == {"a"}
    made = tokens(eng, "a")
    eng.step()
    assert tokens(eng, "a") == made                                               # held: the chunk ran alone
    partner_prompting = True
    while eng.requests["p"].prefilling:
        eng.step()
    assert tokens(eng, "a") >= made + 2 and "a" not in eng.scheduler.held and not rule.holding
    assert rule.counts["prompt_holds"] == 1 and rule.counts["prompt_releases"] == 1 and rule.counts["mixed_held"] == 0
