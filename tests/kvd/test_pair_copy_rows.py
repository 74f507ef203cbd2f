"""A pair's copy grown by token rows (engine/memory/token_rows.py;
kvd/node/replication_rounds.py ``collect_rows``; kvd/node/replica_store.py
``_apply_rows``): a copy built round by round, each decode step's new
token as one row, holds exactly the sender's KV of every computed token,
across block boundaries and a move of the copy from the device tier to the
host tier; a round that does not start where the copy ends changes nothing
and is answered with what is held; a round past the budget is refused."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.memory.token_rows import gather_rows, row_runs
from engine.request import SamplingParams
from engine.stream import STAGING
from kvd import protocol, trust
from kvd.node.replica_store import ReplicaStore
from kvd.node.replication_rounds import collect

from .tiny_driver import running_driver

BS = 16
KEY = trust.holder_key(b"coordinator secret", "n2", "inc-1")


def test_row_runs_merge_consecutive_blocks_and_split_at_a_jump():
    # the module docstring's example: blocks [7, 8, 3], tokens [20, 40)
    assert row_runs([7, 8, 3], BS, 20, 40) == [(0, 132, 12), (12, 48, 8)]
    assert row_runs([4, 5, 6], BS, 3, 40) == [(0, 67, 37)]                 # one run across three blocks
    assert row_runs([4], BS, 5, 5) == []
    with pytest.raises(ValueError):
        row_runs([4, 5], BS, 10, 33)                                         # past the blocks


def rows_of(pool, tier: str, block_ids: list[int], n: int) -> torch.Tensor:
    layout = pool.kv_layout()
    num_layers, _, _, kvh, hd = layout.block_shape
    out = torch.empty((num_layers, 2, n, kvh, hd), dtype=layout.dtype)
    gather_rows(pool, tier, block_ids, 0, n, out)
    return out


async def one_round(engine, store, sent, tickets) -> protocol.ReplicaAck | None:
    """The sender's round, through the wire's encoding, applied by the holder."""
    msg, buf, _, _ = collect(engine, sent, set(), {}, tickets, exact=True)
    if msg is None:
        return None
    try:
        header, frames = protocol.encode(protocol.ReplicaData(id="rep", source="n1", **msg))
        ack = await store.on_data(protocol.decode(header, [bytes(f) for f in frames]))
    finally:
        STAGING.release(buf)
    sent.update({rid: n for rid, n in ack.held.items() if rid in msg["request_ids"]})
    return ack


async def test_a_copy_grown_by_rows_holds_the_senders_kv_of_every_computed_token():
    engine = LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=BS, kv_blocks=64,
                                                host_kv_blocks=0, max_model_len=512, num_threads=1))
    engine.add_request("a", list(range(1, 101)), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    engine.step()                                                            # the prefill: 100 tokens
    async with running_driver(block_size=BS, kv_blocks=16, host_kv_blocks=64) as driver:
        store = ReplicaStore(driver, budget_blocks=32, timeout=10)
        store.key, store.partner = KEY, "n1"
        pool = driver.engine.pool
        sent, tickets = {}, {"a": trust.replica_ticket(KEY, "n1", "a")}
        ack = await one_round(engine, store, sent, tickets)
        assert ack.held == {"a": 100} and store.counts["received_rows"] == 100
        rep = store.replicas[("n1", "a")]
        assert rep.region.tier == "device" and rep.region.blocks == 7
        # the holder's device tier is then full: the copy's next block moves it to the host tier whole
        hog = await driver.call(lambda eng: eng.pool.alloc_mem(eng.pool.free_blocks("device"), reclaim=False))
        for _ in range(20):                                                  # one row a round, past token 112
            engine.step()
            ack = await one_round(engine, store, sent, tickets)
            assert ack.refused == {}
        rep = store.replicas[("n1", "a")]
        src = next(r for r in engine.scheduler.running if r.request_id == "a")
        assert len(rep.tokens) == src.num_computed == 120 and rep.tokens == src.all_ids[:120]
        assert rep.region.tier == "host" and rep.region.blocks == 8
        assert torch.equal(rows_of(pool, "host", rep.region.block_ids, 120),
                           rows_of(engine.pool, "device", src.block_ids, 120))
        assert store.counts["received_rows"] == 120

        # a round that does not start where the copy ends: answered with what is held, nothing written
        frame = torch.zeros_like(rows_of(pool, "host", rep.region.block_ids, 1))
        gap = protocol.ReplicaData(id="gap", source="n1", block_size=BS, request_ids=("a",), starts=(125,),
                                   counts=(1,), token_ids=(9,), tensors=(frame,), tickets=tickets, rows=True)
        header, frames = protocol.encode(gap)
        ack = await store.on_data(protocol.decode(header, [bytes(f) for f in frames]))
        assert ack.held == {"a": 120} and len(store.replicas[("n1", "a")].tokens) == 120

        # past the budget: the round that needs a ninth block is refused, the copy unchanged
        store.budget = 8
        for _ in range(10):                                                  # token 128 needs a ninth block
            engine.step()
            ack = await one_round(engine, store, sent, tickets)
            if ack.refused:
                break
        assert "replica budget" in ack.refused["a"]
        assert len(store.replicas[("n1", "a")].tokens) == 128 and store.replicas[("n1", "a")].region.blocks == 8
        await driver.call(lambda eng: eng.pool.free_mem(hog))
