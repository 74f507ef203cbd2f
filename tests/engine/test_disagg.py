"""Disaggregated prefill inside one process: a prefill engine streams a
prompt's KV layer by layer (engine.stream) into a decode engine's
reservation; the decode engine runs the request from there. Greedy and
seeded tokens, text and stop handling equal one engine's, and both pools
return to their baselines."""

from __future__ import annotations

import pytest

from engine.memory.region import Purpose
from engine.request import SamplingParams
from engine.stream import STAGING, stream_in


class ListSink:
    """A KVSink that keeps the staged layers (what kvd's LayerSender sends)."""

    def __init__(self, skip_blocks: int) -> None:
        self.skip_blocks = skip_blocks
        self.view = None
        self.buf = None
        self.ready: list[tuple[int, int]] = []

    def open(self, shape, dtype):
        self.buf, self.view = STAGING.acquire(shape, dtype)
        return self.view

    def layers_ready(self, l0, l1):
        self.ready.append((l0, l1))


def run_disaggregated(prefill, decode, rid, prompt, params):
    """Prefill on ``prefill``, decode on ``decode``; the tokens and text a
    client would see (token 0 from the prefill side, the rest from decode)."""
    res = decode.pool.reserve_region(prompt, purpose=Purpose.PROMPT)
    assert res is not None
    sink = ListSink(res.have_blocks)
    prefill.add_request(rid, prompt, params, kv_out=sink)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    (first,) = outs
    tokens, text = list(first.new_token_ids), first.text
    if not first.handed_off:
        res.cancel()
        return tokens, text, first
    L = prefill.pool.kv_layout().num_layers
    assert sink.ready == [(i, i + 1) for i in range(L)]          # one hand-off per layer, in order
    if res.block_ids:
        for l0, l1 in sink.ready:                                 # as the layers would arrive
            stream_in(decode.pool, res, sink.view[l0:l1], (l0, l1))
    STAGING.release(sink.buf)
    done = decode.add_prefilled(rid, prompt, params, res, first.new_token_ids[0], first.num_cached_tokens)
    assert done is None
    last = first
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
            text += out.text
            last = out
    return tokens, text, last


def reference(engine, prompt, params):
    engine.add_request("ref", prompt, params)
    tokens, text, last = [], "", None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.text
            last = out
    return tokens, text, last


PROMPTS = [list(range(1, 8)), [5, 9, 200, 17] * 13, [3] * 48, list(range(40, 140))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_disaggregated_tokens_equal_one_engine(make_tiny, dtype):
    ref_engine, p, d = (make_tiny(dtype=dtype) for _ in range(3))
    for i, prompt in enumerate(PROMPTS):
        for params in (SamplingParams(max_tokens=12, temperature=0.0),
                       SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234 + i)):
            want = reference(ref_engine, prompt, params)
            got = run_disaggregated(p, d, f"r{i}-{params.temperature}", prompt, params)
            assert got[0] == want[0], (i, params)
            assert got[1] == want[1]
            assert got[2].finish_reason == want[2].finish_reason
    for e in (p, d):
        e.pool.flush()
        e.check_integrity()
        assert e.pool.stats()["device"]["used"] == 0


def test_decode_side_prefix_hit_sends_only_the_rest(make_tiny):
    ref_engine, p, d = (make_tiny() for _ in range(3))
    system = list(range(100, 164))                           # 4 full blocks
    params = SamplingParams(max_tokens=8, temperature=0.0)
    reference(d, system + [7, 8, 9], params)                 # d caches the system prompt
    prompt = system + [11, 12, 13, 14, 15]
    res = d.pool.reserve_region(prompt, purpose=Purpose.PROMPT)
    assert res.have_blocks == 4 and len(res.block_ids) == 1
    res.cancel()
    want = reference(ref_engine, prompt, params)
    got = run_disaggregated(p, d, "hit", prompt, params)
    assert got[0] == want[0] and got[1] == want[1]
    # and the prefill side keeps the prompt in its own cache (PD-Caching-2)
    assert p.pool.cached_tokens(prompt) == 64


def test_first_token_ends_the_request_on_the_prefill_side(make_tiny):
    ref_engine, p, d = (make_tiny() for _ in range(3))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    want = reference(ref_engine, [1, 2, 3], params)
    tokens, text, first = run_disaggregated(p, d, "one", [1, 2, 3], params)
    assert not first.handed_off and first.finish_reason == "length"
    assert (tokens, text) == (want[0], want[1])
    d.check_integrity()
    assert d.pool.stats()["device"]["used"] == 0


def test_stop_strings_span_the_hand_off(make_tiny, tokenizer):
    ref_engine, p, d = (make_tiny() for _ in range(3))
    prompt = [5, 9, 200, 17] * 5
    free = reference(ref_engine, prompt, SamplingParams(max_tokens=10, temperature=0.0))[1]
    stop = free[1:4] if len(free) > 4 else free[-1:]
    params = SamplingParams(max_tokens=10, temperature=0.0, stop=(stop,))
    want = reference(ref_engine, prompt, params)
    got = run_disaggregated(p, d, "stop", prompt, params)
    assert got[:2] == want[:2] and got[2].finish_reason == want[2].finish_reason


def test_reservation_short_of_memory_changes_nothing(make_tiny):
    d = make_tiny(kv_blocks=4, host_kv_blocks=0)
    before = d.pool.stats()
    assert d.pool.reserve_region(list(range(100)), purpose=Purpose.PROMPT) is None            # 7 blocks > 4
    assert d.pool.stats() == before
    res = d.pool.reserve_region(list(range(40)), purpose=Purpose.PROMPT)
    with pytest.raises(ValueError):
        d.add_prefilled("x", list(range(41)), SamplingParams(), res, 1)   # another prompt: cancelled
    assert d.pool.stats()["device"]["used"] == 0
    d.check_integrity()
