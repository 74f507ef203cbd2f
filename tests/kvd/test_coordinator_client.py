"""RemoteEngineClient's contracts, without processes: a node that leaves on
purpose loses only what it gave up; a dead node loses everything; a request a
node refuses, does not answer, or could not even decode ends at once."""

from __future__ import annotations

import asyncio

import pytest

from engine.request import SamplingParams
from kvd import protocol
from kvd.coordinator.client import RemoteEngineClient
from kvd.coordinator.membership import Membership
from kvd.coordinator.router import LeastLoadRouter
from kvd.engine_client import EngineDead
from transports import InprocRegistry, TransportOptions, connect, listen


async def node_and_client(options: TransportOptions | None = None):
    """A registered node 'n1' whose listener we hold, and a client linked to it."""
    registry = InprocRegistry()
    listener = await listen("inproc://n1", registry=registry)
    membership = Membership(deadline=5.0)
    info, _ = membership.register(protocol.Hello(
        id="h", node="n1", address="inproc://n1", incarnation="i1", model_name="m",
        max_model_len=512, block_size=16, blocks_per_tier={"host": 64}))
    client = RemoteEngineClient("m", None, membership, LeastLoadRouter())
    await client.attach(info, await connect("inproc://n1", registry=registry, options=options))
    return listener, membership, info, client


async def collect(client: RemoteEngineClient, rid: str, params: SamplingParams | None = None) -> list:
    """Every output of ``rid``, ending with the EngineDead it raised, if any."""
    outputs: list = []
    try:
        async for out in client.generate(rid, [1, 2, 3], params or SamplingParams(max_tokens=2, temperature=0)):
            outputs.append(out)
    except EngineDead as exc:
        outputs.append(exc)
    return outputs


async def start(client: RemoteEngineClient, listener, rid: str, answer: protocol.Message | None = None):
    """Begin streaming ``rid``, the node answering ``Accepted`` (or ``answer``);
    returns (collector task, the node's peer id)."""
    task = asyncio.create_task(collect(client, rid))
    incoming = await asyncio.wait_for(listener.recv(), 5)
    msg = protocol.decode(incoming.header, incoming.frames)
    assert isinstance(msg, protocol.GenerateRequest) and msg.request_id == rid
    assert incoming.request_id, "a GenerateRequest must be a request: its answer ends a refused one"
    await listener.reply(incoming, *protocol.encode(answer or protocol.Accepted(id=msg.id, request_id=rid)))
    return task, incoming.peer


async def join(client: RemoteEngineClient, membership: Membership, registry: InprocRegistry,
               listeners: dict, name: str, incarnation: str = "i", role: str = "mixed") -> None:
    """Register node ``name`` (a new process when ``incarnation`` is new), link
    the client to it and keep its listener in ``listeners``."""
    listeners[name] = await listen(f"inproc://{name}", registry=registry)
    info, _ = membership.register(protocol.Hello(
        id="h", node=name, address=f"inproc://{name}", incarnation=incarnation, model_name="m", role=role,
        max_model_len=512, block_size=16, blocks_per_tier={"host": 64}))
    await client.attach(info, await connect(f"inproc://{name}", registry=registry))


async def streaming_on_n1(client: RemoteEngineClient, listeners: dict, max_tokens: int):
    """Start request "r"; n1 accepts it and delivers token 7. Returns (task,
    outputs) once the client has that token."""
    outputs: list = []

    async def run():
        async for out in client.generate("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0)):
            outputs.append(out)
    task = asyncio.create_task(run())
    first = await asyncio.wait_for(listeners["n1"].recv(), 5)          # least load, ties by name
    await listeners["n1"].reply(first, *protocol.encode(protocol.Accepted(id="a", request_id="r")))
    await listeners["n1"].send(first.peer, *protocol.encode(protocol.TokenChunk(
        request_id="r", start_index=0, token_ids=(7,), text_ends=(0,))))
    while len(outputs) < 1:
        await asyncio.sleep(0.01)
    return task, outputs


def last_chunk(rid: str) -> protocol.TokenChunk:
    return protocol.TokenChunk(request_id=rid, start_index=0, token_ids=(7, 8), text_ends=(0, 0),
                               finish_reason="length",
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


async def test_a_refused_request_ends_at_once_and_leaves_nothing_in_flight():
    listener, membership, info, client = await node_and_client()
    refused, _ = await start(client, listener, "r", protocol.Error(
        id="r", code="duplicate", request_id="r", message="request id already in flight"))
    outputs = await asyncio.wait_for(refused, 5)
    assert [(o.finish_reason, o.error) for o in outputs] == [("error", "request id already in flight")]
    assert client.streams_on("n1") == [] and info.in_flight == set()
    await listener.close()


async def test_a_draining_refusal_is_retried_once_then_ends():
    listener, membership, info, client = await node_and_client()
    draining = protocol.Error(id="d", code="draining", request_id="d", message="node n1 is draining")
    task, _ = await start(client, listener, "d", draining)
    # the only other candidate is the same node, excluded: no node is left
    outputs = await asyncio.wait_for(task, 5)
    assert isinstance(outputs[-1], EngineDead) and "no node" in str(outputs[-1])
    assert client.streams_on("n1") == []
    await listener.close()


async def test_a_request_the_node_never_answers_ends_after_the_request_timeout():
    listener, membership, info, client = await node_and_client(TransportOptions(request_timeout=0.5))
    task = asyncio.create_task(collect(client, "silent"))
    first = await asyncio.wait_for(listener.recv(), 5)         # received, never answered
    outputs = await asyncio.wait_for(task, 5)
    assert isinstance(outputs[-1], EngineDead) and "silent" in str(outputs[-1])
    assert client.streams_on("n1") == [] and info.in_flight == set()
    # it may have taken the request and lost only its answer: it is told to abort
    nxt = await asyncio.wait_for(listener.recv(), 5)
    msg = protocol.decode(nxt.header, nxt.frames)
    assert isinstance(msg, protocol.Abort) and msg.request_id == "silent"
    assert first.request_id
    await listener.close()


async def test_a_request_over_the_wire_limit_is_refused_before_it_is_sent():
    listener, membership, info, client = await node_and_client()
    client.limits = protocol.ProtocolLimits(max_header_bytes=4096)
    outputs = await collect(client, "big", SamplingParams(max_tokens=2, stop=("x" * 1024,) * 4))
    assert len(outputs) == 1 and outputs[0].finish_reason == "error"
    assert "4096-byte limit" in outputs[0].error
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(listener.recv(), 0.2)            # nothing reached the node
    assert client.streams_on("n1") == [] and info.in_flight == set()
    await listener.close()


async def test_a_dead_nodes_request_resumes_elsewhere_after_its_delivered_tokens():
    """recovery = reprefill: the request goes to the other node with the
    tokens the client has; its stream goes on from there, no gap, no repeat."""
    from kvd.coordinator.recovery import RecoveryPolicy

    registry = InprocRegistry()
    membership = Membership(deadline=5.0)
    client = RemoteEngineClient("m", None, membership, LeastLoadRouter(), recovery=RecoveryPolicy("reprefill"))
    listeners: dict = {}
    for name in ("n1", "n2"):
        await join(client, membership, registry, listeners, name)
    outputs: list = []

    async def run():
        async for out in client.generate("r", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0)):
            outputs.append(out)
    task = asyncio.create_task(run())
    first = await asyncio.wait_for(listeners["n1"].recv(), 5)   # least load, ties by name: n1
    await listeners["n1"].reply(first, *protocol.encode(protocol.Accepted(id="a", request_id="r")))
    await listeners["n1"].send(first.peer, *protocol.encode(protocol.TokenChunk(
        request_id="r", start_index=0, token_ids=(7, 8), text="ab", text_ends=(1, 2))))
    while len(outputs) < 1:
        await asyncio.sleep(0.01)
    dead = membership.remove("n1")
    assert await client.fail_node(dead, "no heartbeat") == 0          # recovering, not lost
    incoming = await asyncio.wait_for(listeners["n2"].recv(), 5)
    resumed = protocol.decode(incoming.header, incoming.frames)
    assert resumed.output_token_ids == (7, 8) and resumed.replica_from == ""
    await listeners["n2"].reply(incoming, *protocol.encode(protocol.Accepted(id="b", request_id="r")))
    await listeners["n2"].send(incoming.peer, *protocol.encode(protocol.TokenChunk(   # one repeated token
        request_id="r", start_index=1, token_ids=(8, 9, 10, 11), text="bcde", text_ends=(1, 2, 3, 4),
        finish_reason="length")))
    await asyncio.wait_for(task, 5)
    assert [t for o in outputs for t in o.new_token_ids] == [7, 8, 9, 10, 11]
    assert "".join(o.text for o in outputs) == "abcde"           # the repeated token's text once, the rest kept
    assert client.recovery.outcomes[("reprefill", "resumed")] == 1
    for lst in listeners.values():
        await lst.close()


async def test_a_recovery_target_declared_dead_after_accepting_is_not_a_resume():
    """The target of a recovery is declared dead while its Accepted is on the
    way: the recovery owns the stream, so it counts the target as failed and
    moves the request on to the next node (no second recovery task, no
    stream left pointing at a dead node)."""
    from kvd.coordinator.recovery import RecoveryPolicy

    registry = InprocRegistry()
    membership = Membership(deadline=5.0)
    client = RemoteEngineClient("m", None, membership, LeastLoadRouter(),
                                recovery=RecoveryPolicy("reprefill", max_recoveries=3))
    listeners: dict = {}
    for name in ("n1", "n2", "n3"):
        await join(client, membership, registry, listeners, name)
    task, outputs = await streaming_on_n1(client, listeners, 4)
    assert await client.fail_node(membership.remove("n1"), "no heartbeat") == 0
    second = await asyncio.wait_for(listeners["n2"].recv(), 5)            # least load, ties by name
    assert client.lose_requests("n2", ["r"], "no heartbeat") == 0         # n2 dies before its answer
    await listeners["n2"].reply(second, *protocol.encode(protocol.Accepted(id="b", request_id="r")))
    third = await asyncio.wait_for(listeners["n3"].recv(), 5)
    resumed = protocol.decode(third.header, third.frames)
    assert resumed.output_token_ids == (7,)
    await listeners["n3"].reply(third, *protocol.encode(protocol.Accepted(id="c", request_id="r")))
    await listeners["n3"].send(third.peer, *protocol.encode(protocol.TokenChunk(
        request_id="r", start_index=1, token_ids=(8, 9, 10), text_ends=(0, 0, 0), finish_reason="length")))
    await asyncio.wait_for(task, 5)
    assert [t for o in outputs for t in o.new_token_ids] == [7, 8, 9, 10]
    assert client.recovery.outcomes[("reprefill", "resumed")] == 1
    assert client.requests() == {}
    for lst in listeners.values():
        await lst.close()


async def test_a_restarted_node_is_a_new_instance_and_a_recovery_target_again():
    """Nodes that failed a request are excluded by (name, incarnation): n1
    dies, the request moves to n2; n1 comes back as a new process; n2 dies
    and the request moves to the new n1 (excluding names would leave no
    target in a two-node cluster and fail it)."""
    from kvd.coordinator.recovery import RecoveryPolicy

    registry = InprocRegistry()
    membership = Membership(deadline=5.0)
    client = RemoteEngineClient("m", None, membership, LeastLoadRouter(),
                                recovery=RecoveryPolicy("reprefill", max_recoveries=3))
    listeners: dict = {}
    for name in ("n1", "n2"):
        await join(client, membership, registry, listeners, name, "i1")
    task, outputs = await streaming_on_n1(client, listeners, 3)
    assert await client.fail_node(membership.remove("n1"), "no heartbeat") == 0
    second = await asyncio.wait_for(listeners["n2"].recv(), 5)
    await listeners["n2"].reply(second, *protocol.encode(protocol.Accepted(id="b", request_id="r")))
    while client.recovery.outcomes[("reprefill", "resumed")] < 1:     # resumed on n2
        await asyncio.sleep(0.01)
    await listeners["n1"].close()
    await join(client, membership, registry, listeners, "n1", "i2")   # restarted: a new process
    assert await client.fail_node(membership.remove("n2"), "no heartbeat") == 0
    third = await asyncio.wait_for(listeners["n1"].recv(), 5)
    assert protocol.decode(third.header, third.frames).output_token_ids == (7,)
    await listeners["n1"].reply(third, *protocol.encode(protocol.Accepted(id="c", request_id="r")))
    await listeners["n1"].send(third.peer, *protocol.encode(protocol.TokenChunk(
        request_id="r", start_index=1, token_ids=(8, 9), text_ends=(0, 0), finish_reason="length")))
    await asyncio.wait_for(task, 5)
    assert [t for o in outputs for t in o.new_token_ids] == [7, 8, 9]
    assert client.recovery.outcomes[("reprefill", "resumed")] == 2
    for lst in listeners.values():
        await lst.close()


async def test_a_prefill_leg_is_its_nodes_load_from_the_pick_until_the_decode_node_prefills_itself():
    """The prefill node carries the request in ``in_flight`` while the decode
    node decides (the router's bookkeeping follows it there); a decode node
    that computes the prompt itself (no grant) or refuses takes it off."""
    registry, membership, listeners = InprocRegistry(), Membership(deadline=5.0), {}
    client = RemoteEngineClient("m", None, membership, LeastLoadRouter())
    for name, role in (("d1", "decode"), ("p1", "prefill")):
        await join(client, membership, registry, listeners, name, role=role)
    p1 = membership.nodes["p1"]
    for rid, answer in (("local", protocol.Accepted(id="a", request_id="local")),
                        ("refused", protocol.Error(id="a", code="invalid_request", request_id="refused",
                                                   message="no"))):
        task = asyncio.create_task(collect(client, rid))
        incoming = await asyncio.wait_for(listeners["d1"].recv(), 5)
        msg = protocol.decode(incoming.header, incoming.frames)
        assert msg.prefill_node == "p1" and rid in p1.in_flight
        await listeners["d1"].reply(incoming, *protocol.encode(answer))
        if rid == "local":
            while rid in p1.in_flight:
                await asyncio.sleep(0.01)
            await listeners["d1"].send(incoming.peer, *protocol.encode(last_chunk(rid)))
        await asyncio.wait_for(task, 5)
        assert rid not in p1.in_flight
    for listener in listeners.values():
        await listener.close()


async def test_chunks_that_queue_while_the_consumer_is_busy_arrive_as_one_output_in_order():
    """The consumer falls behind the node: the chunks that queued meanwhile
    (one repeating a token, one past a gap, one filling it) are delivered as
    one output, tokens in order and once each; an Error queued behind them
    still ends the stream after them."""
    listener, membership, info, client = await node_and_client()
    outputs: list = []
    gate = asyncio.Event()

    async def run():
        async for out in client.generate("r", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0)):
            outputs.append(out)
            await gate.wait()                  # a slow consumer: the stream's queue fills meanwhile
    task = asyncio.create_task(run())
    first = await asyncio.wait_for(listener.recv(), 5)
    await listener.reply(first, *protocol.encode(protocol.Accepted(id="a", request_id="r")))

    def chunk(start, tokens, text, finish=None):
        return protocol.encode(protocol.TokenChunk(request_id="r", start_index=start, token_ids=tokens, text=text,
                                                   text_ends=tuple(range(1, len(tokens) + 1)), finish_reason=finish,
                                                   usage={"prompt_tokens": 3, "completion_tokens": start + len(tokens),
                                                          "cached_tokens": 0}))
    await listener.send(first.peer, *chunk(0, (7,), "a"))
    while not outputs:
        await asyncio.sleep(0.01)
    for start, tokens, text in ((0, (7,), "a"), (3, (10,), "d"), (1, (8, 9), "bc")):
        await listener.send(first.peer, *chunk(start, tokens, text))
    await listener.send(first.peer, *chunk(4, (11,), "e", finish="length"))
    while client._streams["r"].queue.qsize() < 4:
        await asyncio.sleep(0.01)
    gate.set()
    await asyncio.wait_for(task, 5)
    assert len(outputs) == 2
    merged = outputs[1]
    assert merged.new_token_ids == [8, 9, 10, 11] and merged.text == "bcde"
    assert merged.finished and merged.finish_reason == "length" and merged.num_output_tokens == 5
    assert client.streams_on("n1") == []

    # an Error behind queued chunks: they are delivered, then the stream ends with it
    outputs.clear()
    gate.clear()
    task = asyncio.create_task(run())
    first = await asyncio.wait_for(listener.recv(), 5)
    await listener.reply(first, *protocol.encode(protocol.Accepted(id="b", request_id="r")))
    await listener.send(first.peer, *chunk(0, (7,), "a"))
    while not outputs:
        await asyncio.sleep(0.01)
    await listener.send(first.peer, *chunk(1, (8,), "b"))
    await listener.send(first.peer, *chunk(2, (9,), "c"))
    await listener.send(first.peer, *protocol.encode(protocol.Error(code="engine_error", request_id="r",
                                                                   message="boom")))
    while client._streams["r"].queue.qsize() < 3:
        await asyncio.sleep(0.01)
    gate.set()
    await asyncio.wait_for(task, 5)
    assert [o.new_token_ids for o in outputs] == [[7], [8, 9], []]
    assert outputs[-1].finish_reason == "error" and outputs[-1].error == "boom"
    assert outputs[-1].error_code == "engine_error"          # the server's fault: HTTP 500, not 400
    await listener.close()


async def test_a_chunk_this_coordinator_refuses_ends_its_request_at_once_and_aborts_it():
    """A node's TokenChunk that fails to decode here (its text_ends do not fit its text) is
    counted, its request ends with an error at once (not at a deadline), and the node is
    told to abort it. A refused message naming a request another node serves ends nothing."""
    import orjson

    registry = InprocRegistry()
    membership = Membership(deadline=5.0)
    client = RemoteEngineClient("m", None, membership, LeastLoadRouter())
    listeners: dict = {}
    for name in ("n1", "n2"):
        await join(client, membership, registry, listeners, name)
    outputs: dict = {"r": [], "q": []}

    async def run(rid: str, prompt: list[int]):
        async for out in client.generate(rid, prompt, SamplingParams(max_tokens=2, temperature=0)):
            outputs[rid].append(out)
    task = asyncio.create_task(run("r", [1, 2, 3]))
    first = await asyncio.wait_for(listeners["n1"].recv(), 5)           # least load, ties by name
    await listeners["n1"].reply(first, *protocol.encode(protocol.Accepted(id="a", request_id="r")))
    other = asyncio.create_task(run("q", [4, 5, 6]))
    second = await asyncio.wait_for(listeners["n2"].recv(), 5)          # n1 has one in flight
    await listeners["n2"].reply(second, *protocol.encode(protocol.Accepted(id="b", request_id="q")))

    def chunk_about(rid: str) -> bytes:
        return orjson.dumps({"type": "TokenChunk", "v": protocol.PROTOCOL_VERSION, "request_id": rid,
                             "start_index": 0, "token_ids": [7], "text": "a", "text_ends": [5]})
    await listeners["n2"].send(second.peer, chunk_about("r"), [])      # n2 does not serve "r"
    await asyncio.sleep(0.2)
    assert not task.done() and client.bad_messages["invalid_field"] == 1
    await listeners["n1"].send(first.peer, chunk_about("r"), [])
    await asyncio.wait_for(task, 5)
    assert len(outputs["r"]) == 1 and outputs["r"][0].finish_reason == "error"
    assert "refused" in outputs["r"][0].error and "invalid_field" in outputs["r"][0].error
    assert client.bad_messages["invalid_field"] == 2
    abort = await asyncio.wait_for(listeners["n1"].recv(), 5)
    msg = protocol.decode(abort.header, abort.frames)
    assert isinstance(msg, protocol.Abort) and msg.request_id == "r"
    await listeners["n2"].send(second.peer, *protocol.encode(last_chunk("q")))
    await asyncio.wait_for(other, 5)
    assert [t for o in outputs["q"] for t in o.new_token_ids] == [7, 8]
    assert client.requests() == {}
    for lst in listeners.values():
        await lst.close()
