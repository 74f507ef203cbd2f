"""ReplicaStore on a real engine: a prefill node's prompt replica written for
its decode node is the writer's until that node adopts it; only the named
owner can adopt; the adopted replica is extended by the owner's rounds and
given back whole on recovery. Every write needs the coordinator's ticket
for (this holder, owner, request); a replica is private (no lookup matches
it) until a recovery commits the part that agrees with the request's
tokens. The decode side: a claim the holder cannot answer falls back to
sending the prompt from the decode node."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from kvd import protocol, trust
from kvd.node.engine_driver import EngineDriver
from kvd.node.replica_store import ReplicaStore

from .tiny_driver import running_driver

BS = 16
KEY = trust.holder_key(b"coordinator secret", "r1", "inc-1")     # the holder's, from its Welcome


@pytest.fixture
async def store():
    async with running_driver(block_size=BS, kv_blocks=64, host_kv_blocks=64) as driver:
        store = ReplicaStore(driver, budget_blocks=32, timeout=10)
        store.key = KEY
        yield store


def kv_of(store: ReplicaStore, blocks: int, fill: float) -> torch.Tensor:
    layout = store.driver.engine.pool.kv_layout()
    return torch.full((layout.num_layers, 2, blocks, *layout.block_shape[2:]), fill, dtype=layout.dtype)


def write(store, source: str, rid: str, start: int, blocks: int, owner: str = "",
          ticket: str | None = None) -> protocol.ReplicaData:
    """A write of ``blocks`` blocks from ``start``, with the coordinator's ticket (or ``ticket``)."""
    ticket = trust.replica_ticket(KEY, owner or source, rid) if ticket is None else ticket
    return protocol.ReplicaData(source=source, owner=owner, block_size=BS, request_ids=(rid,), starts=(start,),
                                counts=(blocks,), token_ids=tuple(range(start + 1, start + 1 + blocks * BS)),
                                tensors=(kv_of(store, blocks, 1.0 + start),), tickets={rid: ticket} if ticket else {})


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
    assert store.driver.engine.pool.stats()["host"]["request_owned"] == 0


async def test_a_replica_without_the_coordinators_ticket_is_refused_and_changes_nothing(store):
    pool = store.driver.engine.pool
    before = pool.stats()
    bad = {"none": "", "forged": "00" * trust.TICKET_BYTES,
           "another owner's": trust.replica_ticket(KEY, "n2", "r"),          # r runs on n2, not n1
           "another holder's": trust.replica_ticket(trust.holder_key(b"coordinator secret", "r9", "i"), "n1", "r")}
    for what, ticket in bad.items():
        ack = await store.on_data(write(store, "n1", "r", 0, 2, ticket=ticket))
        assert "ticket" in ack.refused.get("r", ""), (what, ack)
        assert not ack.held
    # a prefill node's write for its decode node needs the decode node's ticket, not its own
    ack = await store.on_data(write(store, "p1", "r", 0, 2, owner="d1", ticket=trust.replica_ticket(KEY, "p1", "r")))
    assert "ticket" in ack.refused["r"]
    # one entry without a ticket refuses the whole message (one frame for all)
    both = protocol.ReplicaData(source="n1", block_size=BS, request_ids=("a", "b"), starts=(0, 0), counts=(1, 1),
                                token_ids=tuple(range(1, 1 + 2 * BS)), tensors=(kv_of(store, 2, 1.0),),
                                tickets={"a": trust.replica_ticket(KEY, "n1", "a")})
    ack = await store.on_data(both)
    assert set(ack.refused) == {"a", "b"} and not ack.held
    assert store.report() == {} and pool.stats() == before
    assert store.stats()["no_ticket"] == len(bad) + 2
    store.key = None                                   # not registered yet: nothing is taken
    ack = await store.on_data(write(store, "n1", "r", 0, 1, ticket=trust.replica_ticket(KEY, "n1", "r")))
    assert "replica key" in ack.refused["r"]


async def test_a_replica_is_private_until_its_recovery_commits_what_agrees_with_the_request(store):
    """The held KV is in no index: a request for the same tokens does not
    hit it, a flush keeps it. A recovery commits only the whole blocks that
    agree with the request's tokens as the coordinator knows them."""
    pool = store.driver.engine.pool
    ack = await store.on_data(write(store, "n1", "r", 0, 3))
    assert ack.held == {"r": 3 * BS}
    tokens = list(range(1, 1 + 3 * BS))
    assert pool.cached_tokens(tokens) == 0
    await store.driver.call(lambda engine: engine.pool.flush())
    assert store.blocks == 3
    rep = store.take("n1", "r")
    known = tokens[:BS + 5] + [99999] + tokens[BS + 6:] + [7]       # differs in block 1
    assert rep.usable(known) == BS + 5
    await store.commit(rep, known)
    assert pool.cached_tokens(tokens) == BS and rep.lock is not None and rep.region is None
    await store.release(rep)
    assert pool.stats()["host"]["request_owned"] == 0 and pool.stats()["host"]["cached"] == 1


async def test_an_unadopted_prompt_replica_counts_against_the_budget_and_is_dropped_by_request(store):
    await store.on_data(write(store, "p1", "a", 0, 30, owner="d1"))
    ack = await store.on_data(write(store, "d2", "b", 0, 3))
    assert "replica budget" in ack.refused["b"]
    assert await store.drop(["a"]) == 1
    assert store.blocks == 0


async def holder_serving(store: ReplicaStore, registry, url: str):
    """A listener at ``url`` that answers ReplicaData with ``store``."""
    from transports import listen

    listener = await listen(url, registry=registry)

    async def serve() -> None:
        while True:
            incoming = await listener.recv()
            msg = protocol.decode(incoming.header, incoming.frames)
            await listener.reply(incoming, *protocol.encode(await store.on_data(msg)))
    return listener, asyncio.create_task(serve())


async def test_a_claim_the_holder_cannot_answer_falls_back_to_sending_the_prompt(store, monkeypatch):
    """The decode side: a prompt replica that never reached the holder (or
    sits on a node that is not the peer) is sent from here after the wait,
    and the holder then has the decode node's own replica."""
    from engine.request import SamplingParams
    from kvd.node import replication
    from transports import InprocRegistry, connect

    monkeypatch.setattr(replication, "ADOPT_WAIT_S", 0.3)
    registry = InprocRegistry()
    listener, serving = await holder_serving(store, registry, "inproc://r1")
    # the requests must still run when the fallback sends their replicas: torch's decode
    # steps (milliseconds each for the tiny model, where the plan executor's take tenths of
    # one) and 2,000 tokens keep them running for many seconds; the test ends them once
    # the replicas are in
    decode = EngineDriver(LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=BS,
                                                             kv_blocks=320, host_kv_blocks=0, max_model_len=2048,
                                                             num_threads=1, decode_kernel="torch")))
    await decode.start()
    conn = await connect("inproc://r1", registry=registry)
    rep = replication.Replicator("d1", decode, lambda name, addr: _const(conn), _noop, interval=0.02, timeout=5)
    rep.set_peer("r1", "inproc://r1", {rid: trust.replica_ticket(KEY, "d1", rid) for rid in "ab"})
    rep.expect_prompt("a", writer="p1", holder="r1")        # p1's replica never comes
    rep.expect_prompt("b", writer="p1", holder="r9")        # sent to another node than the peer
    running = asyncio.create_task(rep.run())
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    streams = [asyncio.create_task(_drain(decode.generate(rid, list(range(1, 41)), params))) for rid in "ab"]
    try:
        for _ in range(500):
            held = store.report().get("d1", {})
            if held.get("a", 0) >= 2 * BS and held.get("b", 0) >= 2 * BS:
                break
            await asyncio.sleep(0.02)
        assert held.get("a", 0) >= 2 * BS and held.get("b", 0) >= 2 * BS, store.report()
        assert rep.counts["adopt_fallbacks"] == 2 and rep.counts["adopted"] == 0
        assert not rep.adopting
    finally:
        for t in (running, serving, *streams):
            t.cancel()
        await asyncio.gather(running, serving, *streams, return_exceptions=True)
        await conn.close()
        await listener.close()
        await decode.stop()


async def _const(value):
    return value


async def _noop(*_):
    return None


async def _drain(outputs) -> None:
    async for _ in outputs:
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_blocks_of_a_staged_prompt_are_copied_without_an_openmp_team(dtype):
    """send_prompt_replica copies the full blocks on an executor thread: the same values
    as torch's slice, and no OpenMP workers left on that thread (they would throttle the
    engine thread's team)."""
    from kvd.node.replication import first_blocks

    kv = torch.randn(30, 2, 8, BS, 3, 64).to(dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    box: dict = {"before": len(os.listdir("/proc/self/task"))}

    def copy():
        box["out"] = first_blocks(kv, 5)
        box["during"] = len(os.listdir("/proc/self/task"))
    try:
        t = threading.Thread(target=copy)
        t.start()
        t.join(60)
    finally:
        torch.set_num_threads(saved)
    assert box["out"].is_contiguous() and box["out"].dtype == dtype
    assert torch.equal(box["out"], kv[:, :, :5])
    assert box["during"] == box["before"] + 1           # the copying thread alone, no workers


async def test_a_prompt_replica_send_reports_sent_empty_refused_and_failed(store):
    """The prefill side's outcomes against a real holder: a prompt with no
    full block sends nothing; one past the holder's budget is refused with
    its reason; a holder that never answers is ``failed`` at the deadline."""
    from kvd.node.replication import send_prompt_replica
    from transports import InprocRegistry, connect, listen

    registry = InprocRegistry()
    listener, serving = await holder_serving(store, registry, "inproc://r1")
    silent = await listen("inproc://r2", registry=registry)
    conn, mute = await connect("inproc://r1", registry=registry), await connect("inproc://r2", registry=registry)
    kv = kv_of(store, 3, 2.0)

    def send(c, rid: str, n_tokens: int, timeout: float = 5):
        return send_prompt_replica(c, source="p1", owner="d1", request_id=rid, prompt=list(range(1, n_tokens + 1)),
                                   kv=kv, block_size=BS, timeout=timeout, ticket=trust.replica_ticket(KEY, "d1", rid))
    try:
        assert await send(conn, "short", BS - 1) == ("empty", "")
        assert await send(conn, "a", 2 * BS + 5) == ("sent", "")        # 2 full blocks of the 3 staged
        assert store.report() == {"p1": {"a": 2 * BS}}
        await store.on_data(write(store, "p1", "big", 0, 30, owner="d1"))
        outcome, why = await send(conn, "b", 3 * BS)
        assert outcome == "refused" and "replica budget" in why
        outcome, _ = await send(mute, "c", 3 * BS, timeout=0.3)
        assert outcome == "failed"
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        for c in (conn, mute):
            await c.close()
        await listener.close()
        await silent.close()
