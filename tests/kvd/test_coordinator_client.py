"""RemoteEngineClient's membership contracts, without processes: a node that
leaves on purpose loses only what it gave up; a dead node loses everything."""

from __future__ import annotations

import asyncio

from engine.request import SamplingParams
from kvd import protocol
from kvd.coordinator.client import RemoteEngineClient
from kvd.coordinator.membership import Membership
from kvd.coordinator.router import LeastLoadRouter
from kvd.engine_client import EngineDead
from transports import InprocRegistry, connect, listen


async def node_and_client():
    """A registered node 'n1' whose listener we hold, and a client linked to it."""
    registry = InprocRegistry()
    listener = await listen("inproc://n1", registry=registry)
    membership = Membership(deadline=5.0)
    info, _ = membership.register(protocol.Hello(
        id="h", node="n1", address="inproc://n1", incarnation="i1", model_name="m",
        max_model_len=512, block_size=16, blocks_per_tier={"cpu": 64}))
    client = RemoteEngineClient("m", None, membership, LeastLoadRouter())
    await client.attach(info, await connect("inproc://n1", registry=registry))
    return listener, membership, info, client


async def start(client: RemoteEngineClient, listener, rid: str):
    """Begin streaming ``rid``; returns (collector task, the node's peer id)."""
    outputs: list = []

    async def collect():
        try:
            async for out in client.generate(rid, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0)):
                outputs.append(out)
        except EngineDead as exc:
            outputs.append(exc)
        return outputs
    task = asyncio.create_task(collect())
    incoming = await asyncio.wait_for(listener.recv(), 5)
    assert protocol.decode(incoming.header, incoming.frames).request_id == rid
    return task, incoming.peer


def last_chunk(rid: str) -> protocol.TokenChunk:
    return protocol.TokenChunk(request_id=rid, start_index=0, token_ids=(7, 8), finish_reason="length",
                               usage={"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0})


async def test_goodbye_ends_only_the_unfinished_and_waits_for_trailing_chunks():
    listener, membership, info, client = await node_and_client()
    done, peer = await start(client, listener, "done")
    given_up, _ = await start(client, listener, "given-up")
    membership.remove("n1")

    async def trailing_chunk():            # the finished request's last chunk trails the Goodbye
        await asyncio.sleep(0.2)
        await listener.send(peer, *protocol.encode(last_chunk("done")))
    sender = asyncio.create_task(trailing_chunk())
    lost = await client.node_left(info, ("given-up",), "left: shutdown", grace=2.0)
    await sender
    assert lost == 1
    finished = await asyncio.wait_for(done, 5)
    assert [o.finish_reason for o in finished] == ["length"] and finished[0].new_token_ids == [7, 8]
    failed = await asyncio.wait_for(given_up, 5)
    assert isinstance(failed[-1], EngineDead) and "given-up" in str(failed[-1])
    assert "n1" not in client.links
    await listener.close()


async def test_goodbye_grace_is_bounded_and_a_silent_stream_fails_after_it():
    listener, membership, info, client = await node_and_client()
    silent, _ = await start(client, listener, "silent")
    membership.remove("n1")
    t0 = asyncio.get_running_loop().time()
    lost = await client.node_left(info, (), "left: shutdown", grace=0.3)
    assert lost == 1 and 0.25 < asyncio.get_running_loop().time() - t0 < 2.0
    assert isinstance((await asyncio.wait_for(silent, 5))[-1], EngineDead)
    await listener.close()


async def test_a_dead_node_fails_every_stream_at_once():
    listener, membership, info, client = await node_and_client()
    a, _ = await start(client, listener, "a")
    b, _ = await start(client, listener, "b")
    assert await client.fail_node(info, "no heartbeat") == 2
    for task in (a, b):
        assert isinstance((await asyncio.wait_for(task, 5))[-1], EngineDead)
    await listener.close()
