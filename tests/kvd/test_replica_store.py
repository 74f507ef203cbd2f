"""ReplicaStore on a real engine: a prefill node's prompt replica written for
its decode node is the writer's until that node adopts it; only the named
owner can adopt; the adopted replica is extended by the owner's rounds and
given back whole on recovery."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from kvd import protocol
from kvd.node.engine_driver import EngineDriver
from kvd.node.replication import ReplicaStore

BS = 16


@pytest.fixture
async def store():
    engine = LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=BS, kv_blocks=64,
                                                host_kv_blocks=64, max_model_len=512, num_threads=1))
    driver = EngineDriver(engine)
    await driver.start()
    yield ReplicaStore(driver, budget_blocks=32, timeout=10)
    await driver.stop()


def kv_of(store: ReplicaStore, blocks: int, fill: float) -> torch.Tensor:
    layout = store.driver.engine.pool.kv_layout()
    return torch.full((layout.num_layers, 2, blocks, *layout.block_shape[2:]), fill, dtype=layout.dtype)


def write(store, source: str, rid: str, start: int, blocks: int, owner: str = "") -> protocol.ReplicaData:
    return protocol.ReplicaData(source=source, owner=owner, block_size=BS, request_ids=(rid,), starts=(start,),
                                counts=(blocks,), token_ids=tuple(range(start + 1, start + 1 + blocks * BS)),
                                tensors=(kv_of(store, blocks, 1.0 + start),))


async def test_only_the_named_owner_adopts_a_prompt_replica_and_then_extends_it(store):
    ack = await store.on_data(write(store, "p1", "r", 0, 2, owner="d1"))
    assert ack.held == {"r": 2 * BS} and not ack.refused
    assert store.report() == {"p1": {"r": 2 * BS}}          # the writer's until adopted

    # another node cannot claim it, whatever it names
    ack = await store.on_data(protocol.ReplicaData(source="d2", block_size=BS, adopt={"r": "p1"}))
    assert ack.held == {} and store.report() == {"p1": {"r": 2 * BS}}
    # a claim naming a writer that sent nothing gets no answer for it (the owner retries)
    ack = await store.on_data(protocol.ReplicaData(source="d1", block_size=BS, adopt={"r": "p9"}))
    assert ack.held == {}

    ack = await store.on_data(protocol.ReplicaData(source="d1", block_size=BS, adopt={"r": "p1"}))
    assert ack.held == {"r": 2 * BS} and store.report() == {"d1": {"r": 2 * BS}}
    # claiming again is harmless: the answer is what the owner holds
    ack = await store.on_data(protocol.ReplicaData(source="d1", block_size=BS, adopt={"r": "p1"}))
    assert ack.held == {"r": 2 * BS}
    # the writer can no longer touch it: its resend opens a replica of its own, not the owner's
    await store.on_data(protocol.ReplicaData(source="p1", block_size=BS, frees=("r",)))
    assert store.report() == {"d1": {"r": 2 * BS}}

    ack = await store.on_data(write(store, "d1", "r", 2 * BS, 1))
    assert ack.held == {"r": 3 * BS} and store.blocks == 3
    rep = store.take("d1", "r")
    assert rep is not None and rep.tokens == list(range(1, 1 + 3 * BS))
    await store.release(rep)
    assert store.blocks == 0 and store.stats()["adopted"] == 1


async def test_an_unadopted_prompt_replica_counts_against_the_budget_and_is_dropped_by_request(store):
    await store.on_data(write(store, "p1", "a", 0, 30, owner="d1"))
    ack = await store.on_data(write(store, "d2", "b", 0, 3))
    assert "replica budget" in ack.refused["b"]
    assert await store.drop(["a"]) == 1
    assert store.blocks == 0
