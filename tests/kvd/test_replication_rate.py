"""Replication at a bounded rate (``[cluster].replication_rate``;
kvd/node/replication.py): a round sends at most its share of the blocks
the peer does not hold, a request past it its first full blocks (no tail),
the next rounds the rest, and a copy built that way is the same as one sent
at once. The option is validated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from kvd.cluster_config import ClusterConfig, ConfigError
from kvd.node.replication import _collect

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
    whole, _, _, spent_whole = _collect(engine, {}, set(), {}, tickets, exact=True)
    assert spent_whole == 7 + 3 and whole["counts"] == (7, 3) and whole["tails"] == (4, 8)
    sent, rounds, tokens = {}, [], {"a": [], "b": []}
    while True:
        msg, _, _, spent = _collect(engine, sent, set(), {}, tickets, exact=True, budget=4)
        if msg is None:
            break
        assert spent <= 4
        rounds.append(dict(zip(msg["request_ids"], msg["counts"])))
        off = 0
        for i, (rid, start, count) in enumerate(zip(msg["request_ids"], msg["starts"], msg["counts"])):
            tail = msg["tails"][i] if msg["tails"] else 0
            n = count * BS - (BS - tail if tail else 0)
            assert start == len(tokens[rid]) - len(tokens[rid]) % BS      # where the holder's copy ends
            del tokens[rid][start:]
            tokens[rid].extend(msg["token_ids"][off:off + n])
            off += n
            sent[rid] = len(tokens[rid])
    # 4 of a's 7 blocks (full ones, no tail), then a's other 3 (its partial last one with its tail) and
    # b's first (full) block, then b's other 2
    assert rounds == [{"a": 4}, {"a": 3, "b": 1}, {"b": 2}], rounds
    assert tokens["a"] == list(range(1, 101)) and tokens["b"] == list(range(201, 241))
    msg, _, _, spent = _collect(engine, sent, set(), {}, tickets, exact=True, budget=4)
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
