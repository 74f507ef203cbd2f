"""Recovery inside one process: an engine runs a request part way, its full
blocks are replicated into a second engine's host tier as private blocks
(a REPLICA ``Region``, what kvd/node/replication.py does over the wire: no
lookup matches them), the recovery commits them as the request's own KV
(``Region.commit``), and the second engine resumes the request from
the tokens the client already has (``LLMEngine.resume_request``). Greedy and
seeded tokens and text equal an uninterrupted run; pools return to their
baselines."""

from __future__ import annotations

import pytest
import torch

from engine.memory.region import Purpose
from engine.request import InvalidParam, SamplingParams


def run(engine, rid, prompt, params, steps=None):
    """Step ``engine`` (``steps`` times, or to the end); the tokens and text of ``rid``."""
    engine.add_request(rid, prompt, params)
    tokens, text, n = [], "", 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.text
        n += 1
    return tokens, text


def replicate(src, dst, rid, hold, upto_blocks, sent_blocks):
    """Copy blocks [sent_blocks, upto_blocks) of ``rid`` from ``src`` to a hold in ``dst``."""
    req = src.requests[rid]
    layout = src.pool.kv_layout()
    n = upto_blocks - sent_blocks
    out = torch.empty((layout.num_layers, 2, n, *layout.block_shape[2:]), dtype=layout.dtype)
    src.pool.gather_blocks(req.block_ids[sent_blocks:upto_blocks], out, (0, layout.num_layers))
    held = hold or dst.pool.reserve_region((), tier="host", purpose=Purpose.REPLICA)
    assert held.append(out) and held.blocks == upto_blocks
    assert dst.pool.cached_tokens(req.all_ids) == 0          # private: no lookup matches it
    return held


def drain(engine):
    tokens, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.text
    return tokens, text


PARAMS = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=60, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_from_a_replica_equals_an_uninterrupted_run(make_tiny, dtype, params):
    ref_engine, src, dst = (make_tiny(dtype=dtype) for _ in range(3))
    bs = src.config.block_size
    prompt = [5, 9, 200, 17] * 10 + [3, 4, 5]                  # 43 tokens: a partial block
    ref_tokens, ref_text = run(ref_engine, "r", prompt, params)
    base = dst.pool.stats()

    # the source runs 30 steps; its full blocks go to dst in three rounds
    src.add_request("r", prompt, params)
    tokens, text = [], ""
    hold, sent = None, 0
    for step in range(30):
        for out in src.step():
            tokens += out.new_token_ids
            text += out.text
        full = src.requests["r"].num_computed // bs
        if step in (0, 20, 29) and full > sent:
            hold, sent = replicate(src, dst, "r", hold, full, sent), full
    assert tokens == ref_tokens[:30] and sent >= 4
    # src dies here; the recovery commits the hold as the request's KV, dst resumes
    lock = hold.commit((prompt + tokens)[:sent * bs])
    assert lock.num_tokens == sent * bs and not hold.block_ids
    assert dst.resume_request("r", prompt, tokens, params) is None
    hit_before = dst.pool.hit_tokens
    more, more_text = [], ""
    first = True
    while dst.has_unfinished():
        for out in dst.step():
            more += out.new_token_ids
            more_text += out.text
        if first:                                   # admitted: the replica's blocks were the hit
            assert dst.pool.hit_tokens - hit_before == sent * bs
            dst.pool.unlock(lock)
            first = False
    assert tokens + more == ref_tokens
    assert text + more_text == ref_text
    dst.check_integrity()
    after = dst.pool.stats()
    assert after["device"]["request_owned"] == base["device"]["request_owned"] == 0
    assert after["host"]["request_owned"] == 0


def test_resume_without_a_replica_recomputes_and_equals(make_tiny):
    ref_engine, dst = make_tiny(), make_tiny()
    params = PARAMS[1]
    prompt = list(range(40, 90))
    ref_engine.add_request("r", prompt, params)
    pieces = []                                         # one token per step: (token, its text)
    while ref_engine.has_unfinished():
        pieces += [(o.new_token_ids[0], o.text) for o in ref_engine.step()]
    assert dst.resume_request("r", prompt, [t for t, _ in pieces[:17]], params) is None
    more, more_text = drain(dst)
    assert more == [t for t, _ in pieces[17:]]
    assert more_text == "".join(x for _, x in pieces[17:])


def test_resume_replays_stop_conditions(make_tiny):
    """Tokens that already end the request: the replayed output, nothing runs."""
    engine = make_tiny()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, stop_token_ids=(7,))
    out = engine.resume_request("r", [1, 2, 3], [9, 7], params)
    assert out is not None and out.finished and out.finish_reason == "stop"
    assert not engine.has_unfinished() and not engine.requests


@pytest.mark.parametrize("outputs", [[], [10 ** 9], [1] * 5])
def test_resume_refuses_bad_tokens_and_changes_nothing(make_tiny, outputs):
    engine = make_tiny()
    params = SamplingParams(max_tokens=5)
    with pytest.raises(InvalidParam) as err:
        engine.resume_request("r", [1, 2, 3], outputs, params)
    assert err.value.param == "output_token_ids"
    assert not engine.requests and not engine.has_unfinished()


def test_a_replica_short_of_memory_changes_nothing(make_tiny):
    src, dst = make_tiny(), make_tiny(host_kv_blocks=2)
    params = PARAMS[0]
    prompt = list(range(1, 70))
    src.add_request("r", prompt, params)
    src.step()
    before = dst.pool.stats()
    layout = src.pool.kv_layout()
    out = torch.empty((layout.num_layers, 2, 4, *layout.block_shape[2:]), dtype=layout.dtype)
    src.pool.gather_blocks(src.requests["r"].block_ids[:4], out, (0, layout.num_layers))
    assert not dst.pool.reserve_region((), tier="host", purpose=Purpose.REPLICA).append(out)
    assert dst.pool.stats() == before
    dst.check_integrity()


def test_a_hold_is_private_until_committed_and_commits_only_what_it_is_told(make_tiny):
    """Held blocks are request-owned: no lookup matches them, a flush keeps
    them; a commit of fewer tokens than held indexes those only and frees
    the rest; a dropped hold leaves the pool as it was."""
    src, dst = make_tiny(), make_tiny(host_kv_blocks=16)
    prompt = list(range(1, 70))                            # 4 full blocks
    src.add_request("r", prompt, PARAMS[0])
    src.step()
    layout = src.pool.kv_layout()
    out = torch.empty((layout.num_layers, 2, 4, *layout.block_shape[2:]), dtype=layout.dtype)
    src.pool.gather_blocks(src.requests["r"].block_ids[:4], out, (0, layout.num_layers))
    before = dst.pool.stats()
    hold = dst.pool.reserve_region((), tier="host", purpose=Purpose.REPLICA)
    assert hold.append(out)
    assert hold.blocks == 4 and dst.pool.stats()["host"]["request_owned"] == 4
    dst.pool.flush()
    assert dst.pool.cached_tokens(prompt) == 0 and hold.blocks == 4
    lock = hold.commit(prompt[:40])         # 2 whole blocks of the 2.5 given
    assert lock.num_tokens == 32 and dst.pool.cached_tokens(prompt) == 32
    assert dst.pool.stats()["host"]["request_owned"] == 0 and dst.pool.stats()["host"]["cached"] == 2
    dst.pool.unlock(lock)
    dst.pool.flush()
    again = dst.pool.reserve_region((), tier="host", purpose=Purpose.REPLICA)
    assert again.append(out)
    again.cancel()
    assert dst.pool.stats() == before
    dst.check_integrity()
