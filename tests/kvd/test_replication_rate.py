"""Replication at a bounded rate (``[cluster].replication_rate``;
kvd/node/replication.py): a round sends at most its share of the blocks
the peer does not hold, a request past it its first blocks' worth,
the next rounds the rest, and a copy built that way is the same as one sent
at once. The option is validated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from kvd.cluster_config import ClusterConfig, ConfigError
from kvd.node.replication_rounds import collect

BS = 16


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=BS, kv_blocks=64,
                                             host_kv_blocks=0, max_model_len=512, num_threads=1))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(1, 101)), params)       # 100 tokens: 6 full blocks and 4 tokens
    eng.add_request("b", list(range(201, 241)), params)     # 40 tokens: 2 full blocks and 8 tokens
    eng.step()                                               # both prefilled
    return eng


def test_a_round_sends_its_share_and_the_next_rounds_the_rest(engine):
    tickets = {"a": "t", "b": "t"}
    whole, _, _, spent_whole = collect(engine, {}, set(), {}, tickets, exact=True)
    assert whole["rows"] and whole["counts"] == (100, 40) and spent_whole == 0       # no budget: nothing counted
    sent, rounds, tokens = {}, [], {"a": [], "b": []}
    while True:
        msg, _, _, spent = collect(engine, sent, set(), {}, tickets, exact=True, budget=4)
        if msg is None:
            break
        assert spent <= 4
        rounds.append(dict(zip(msg["request_ids"], msg["counts"])))
        off = 0
        for rid, start, count in zip(msg["request_ids"], msg["starts"], msg["counts"]):
            assert start == len(tokens[rid])                   # where the holder's copy ends
            tokens[rid].extend(msg["token_ids"][off:off + count])
            off += count
            sent[rid] = len(tokens[rid])
    # 4 blocks' worth of a's 100 tokens, then the rest of a (3 more blocks, the last partial) and b's
    # first block, then b's other 2
    assert rounds == [{"a": 64}, {"a": 36, "b": 16}, {"b": 24}], rounds
    assert tokens["a"] == list(range(1, 101)) and tokens["b"] == list(range(201, 241))
    msg, _, _, spent = collect(engine, sent, set(), {}, tickets, exact=True, budget=4)
    assert msg is None and spent == 0                        # all there: nothing more to send


@pytest.mark.parametrize("rate", [-1.0, float("nan"), float("inf")])
def test_a_bad_rate_is_a_config_error(rate):
    with pytest.raises(ConfigError, match="replication_rate"):
        ClusterConfig(replication_rate=rate)


def test_a_bad_rate_flag_exits_2_with_one_line():
    out = subprocess.run([sys.executable, "-m", "kvd.cli", "node", "--name", "n1", "--replication-rate", "-5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "replication_rate" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
