"""RemoteEngineClient's per-node load (``LoadBook``) and the ends of requests a
node gave up, without processes (the test is the nodes, over real in-process
links): every node's ``in_flight`` is back to zero once nothing is in flight,
whichever nodes a request visited; a node that reports a request lost (its
output could not be delivered) has it recovered or ended at once; a node that
streams a request not in flight there is told to stop."""

from __future__ import annotations

import asyncio

import pytest

from engine.request import SamplingParams
from kvd import protocol
from kvd.coordinator.client import RemoteEngineClient
from kvd.coordinator.membership import Membership
from kvd.coordinator.recovery import RecoveryPolicy
from kvd.coordinator.router import LeastLoadRouter
from kvd.engine_client import EngineDead
from transports import InprocRegistry

from .test_coordinator_client import collect, join, last_chunk, streaming_on_n1


async def cluster(names, policy: str = "fail", roles: dict[str, str] | None = None):
    registry, membership, listeners = InprocRegistry(), Membership(deadline=5.0), {}
    client = RemoteEngineClient("m", None, membership, LeastLoadRouter(), recovery=RecoveryPolicy(policy))
    for name in names:
        await join(client, membership, registry, listeners, name, role=(roles or {}).get(name, "mixed"))
    return client, membership, listeners


def loads(membership: Membership) -> dict[str, set[str]]:
    return {name: set(n.in_flight) for name, n in membership.nodes.items()}


async def close(listeners: dict) -> None:
    for listener in listeners.values():
        await listener.close()


async def recv(listener) -> tuple[protocol.Message, object]:
    incoming = await asyncio.wait_for(listener.recv(), 5)
    return protocol.decode(incoming.header, incoming.frames), incoming


async def finish_on_n2(listeners: dict, incoming, task: asyncio.Task, outputs: list) -> None:
    """n2 accepts request "r", recovered to it as ``incoming``, and ends it
    with tokens 8 and 9; asserts the request then ended with 7, 8, 9."""
    await listeners["n2"].reply(incoming, *protocol.encode(protocol.Accepted(id="b", request_id="r")))
    await listeners["n2"].send(incoming.peer, *protocol.encode(protocol.TokenChunk(
        request_id="r", start_index=1, token_ids=(8, 9), text_ends=(0, 0), finish_reason="length")))
    await asyncio.wait_for(task, 5)
    assert [t for o in outputs for t in o.new_token_ids] == [7, 8, 9]


async def test_a_request_recovered_to_another_node_is_uncounted_there_when_it_ends():
    client, membership, listeners = await cluster(("n1", "n2", "n3"), "reprefill")
    task, outputs = await streaming_on_n1(client, listeners, 3)
    assert loads(membership) == {"n1": {"r"}, "n2": set(), "n3": set()}
    assert await client.fail_node(membership.remove("n1"), "no heartbeat") == 0
    msg, incoming = await recv(listeners["n2"])
    assert msg.output_token_ids == (7,)
    await finish_on_n2(listeners, incoming, task, outputs)
    assert loads(membership) == {"n2": set(), "n3": set()}
    assert len(client.load) == 0 and client.requests() == {}
    await close(listeners)


async def test_a_request_its_node_lost_ends_at_once_with_an_error_and_is_uncounted():
    client, membership, listeners = await cluster(("n1",), "fail")
    task, peer = await _accepted(client, listeners["n1"], "r")
    assert client.lost_by_node("n1", ["r", "unknown-request"]) == 1
    outputs = await asyncio.wait_for(task, 5)
    assert isinstance(outputs[-1], EngineDead) and "could not reach the coordinator" in str(outputs[-1])
    assert loads(membership) == {"n1": set()} and client.requests() == {}
    assert client.lost_by_node("n1", ["r"]) == 0            # repeated in a later beat: nothing left to end
    await close(listeners)


async def test_a_request_its_live_node_lost_resumes_elsewhere_and_leaves_no_count_on_it():
    client, membership, listeners = await cluster(("n1", "n2"), "reprefill")
    task, outputs = await streaming_on_n1(client, listeners, 3)
    assert client.lost_by_node("n1", ["r"]) == 0             # recovering, not ended
    msg, incoming = await recv(listeners["n2"])
    assert msg.output_token_ids == (7,)
    assert loads(membership) == {"n1": set(), "n2": {"r"}}   # n1 lives on, without the request
    await finish_on_n2(listeners, incoming, task, outputs)
    assert loads(membership) == {"n1": set(), "n2": set()}
    await close(listeners)


async def test_a_prefill_leg_lost_before_its_first_token_ends_the_request_and_aborts_the_decode_leg():
    client, membership, listeners = await cluster(("d1", "p1"), roles={"d1": "decode", "p1": "prefill"})
    task = asyncio.create_task(collect(client, "r"))
    msg, incoming = await recv(listeners["d1"])
    assert msg.prefill_node == "p1"
    await listeners["d1"].reply(incoming, *protocol.encode(protocol.Accepted(
        id="a", request_id="r", kv_transfer_id="t", kv_block_ids=(1,), kv_num_layers=2, kv_dtype="float32")))
    leg, _ = await recv(listeners["p1"])
    assert leg.kv_to_node == "d1" and leg.kv_to_incarnation == membership.nodes["d1"].incarnation
    assert client.lost_by_node("p1", ["r"]) == 1
    outputs = await asyncio.wait_for(task, 5)
    assert isinstance(outputs[-1], EngineDead) and "first token" in str(outputs[-1])
    aborts = {name: (await recv(listeners[name]))[0] for name in ("d1", "p1")}
    assert all(isinstance(m, protocol.Abort) and m.request_id == "r" for m in aborts.values())
    assert loads(membership) == {"d1": set(), "p1": set()}
    await close(listeners)


async def test_a_node_streaming_a_request_not_in_flight_there_is_told_to_stop_once():
    client, membership, listeners = await cluster(("n1",))
    task, peer = await _accepted(client, listeners["n1"], "r")
    await listeners["n1"].send(peer, *protocol.encode(last_chunk("r")))
    await asyncio.wait_for(task, 5)
    for start in (5, 6, 7):                   # the node runs a request this coordinator does not have
        await listeners["n1"].send(peer, *protocol.encode(protocol.TokenChunk(
            request_id="orphan", start_index=start, token_ids=(1,), text_ends=(0,))))
    await listeners["n1"].send(peer, *protocol.encode(last_chunk("r")))   # a late final chunk: no Abort
    msg, _ = await recv(listeners["n1"])
    assert isinstance(msg, protocol.Abort) and msg.request_id == "orphan"
    with pytest.raises(TimeoutError):                        # one Abort, not one per chunk
        await asyncio.wait_for(listeners["n1"].recv(), 0.3)
    assert client.orphans_aborted == 1
    await close(listeners)


async def _accepted(client, listener, rid: str):
    """``rid`` streaming, accepted by the node: (its collector task, the node's peer id)."""
    task = asyncio.create_task(collect(client, rid, SamplingParams(max_tokens=2, temperature=0)))
    msg, incoming = await recv(listener)
    await listener.reply(incoming, *protocol.encode(protocol.Accepted(id=msg.id, request_id=rid)))
    while rid not in client.requests():
        await asyncio.sleep(0.01)
    return task, incoming.peer
