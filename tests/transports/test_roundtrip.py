"""Every transport: messages, large frames, request/reply, deadlines, dead peers."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import transports
from transports import PeerGone, RequestTimeout, TransportClosed, TransportError, TransportOptions

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


async def echo_once(listener):
    """Answer one request with its own header and frames."""
    incoming = await listener.recv()
    await listener.reply(incoming, incoming.header, incoming.frames)
    return incoming


async def test_header_and_frames_round_trip_including_64_mib(kind, endpoints):
    listener, conn = await endpoints(kind)
    big = np.random.default_rng(0).integers(0, 255, 64 * MiB, dtype=np.uint8)
    tensor = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    server = asyncio.create_task(echo_once(listener))
    reply = await conn.request({"type": "test", "n": 3}, [b"small", b"", big, tensor], timeout=30)
    incoming = await server
    assert incoming.request_id != 0 and incoming.header_dict() == {"type": "test", "n": 3}
    assert reply.header_dict() == {"type": "test", "n": 3}
    assert [len(memoryview(f)) for f in reply.frames] == [5, 0, 64 * MiB, 4000]
    assert bytes(reply.frames[0]) == b"small"
    assert np.array_equal(np.frombuffer(reply.frames[2], dtype=np.uint8), big)
    back = torch.frombuffer(bytearray(reply.frames[3]), dtype=torch.float32).reshape(10, 100)
    assert torch.equal(back, tensor)


async def test_one_way_both_directions_and_push_to_a_peer(kind, endpoints):
    listener, conn = await endpoints(kind)
    await conn.send({"hello": 1}, [b"x" * 100_000])
    incoming = await asyncio.wait_for(listener.recv(), 5)
    assert incoming.request_id == 0 and incoming.header_dict() == {"hello": 1}
    await listener.send(incoming.peer, b'{"push":2}', [b"y"])
    pushed = await asyncio.wait_for(conn.recv(), 5)
    assert pushed.header_dict() == {"push": 2} and bytes(pushed.frames[0]) == b"y"
    assert conn.stats.sent == 1 and listener.stats.received == 1


async def test_concurrent_requests_are_matched_by_correlation_id(kind, endpoints):
    listener, conn = await endpoints(kind)

    async def serve():
        # Answer in reverse arrival order: correlation, not order, must match them.
        batch = [await listener.recv() for _ in range(20)]
        for incoming in reversed(batch):
            await listener.reply(incoming, {"echo": incoming.header_dict()["i"]})

    server = asyncio.create_task(serve())
    replies = await asyncio.gather(*(conn.request({"i": i}, timeout=10) for i in range(20)))
    await server
    assert [r.header_dict()["echo"] for r in replies] == list(range(20))


async def test_request_to_a_silent_peer_times_out(kind, endpoints):
    listener, conn = await endpoints(kind)
    start = time.monotonic()
    with pytest.raises(RequestTimeout):
        await conn.request({"q": 1}, timeout=0.3)
    assert time.monotonic() - start < 2
    assert (await asyncio.wait_for(listener.recv(), 5)).header_dict() == {"q": 1}


async def test_late_reply_after_timeout_is_counted_not_delivered(kind, endpoints):
    listener, conn = await endpoints(kind)
    with pytest.raises(RequestTimeout):
        await conn.request({"q": 1}, timeout=0.2)
    incoming = await asyncio.wait_for(listener.recv(), 5)
    await listener.reply(incoming, {"late": True})
    await conn.send({"sync": 1})  # let the reply arrive before checking
    for _ in range(100):
        if conn.stats.late_replies:
            break
        await asyncio.sleep(0.02)
    assert conn.stats.late_replies == 1


async def test_dead_listener_fails_pending_and_new_requests(kind, endpoints):
    listener, conn = await endpoints(kind)
    # the link is up (ucx and zmq connect lazily)
    server = asyncio.create_task(echo_once(listener))
    await conn.request({"warm": 1}, timeout=10)
    await server
    pending = asyncio.create_task(conn.request({"q": 1}, timeout=5))
    await asyncio.wait_for(listener.recv(), 5)
    start = time.monotonic()
    await listener.close()
    with pytest.raises((PeerGone, RequestTimeout)):
        await pending
    assert time.monotonic() - start < 5
    with pytest.raises(TransportError):
        await conn.request({"q": 2}, timeout=0.5)


async def test_listener_send_to_departed_peer_raises_peer_gone(kind, endpoints):
    listener, conn = await endpoints(kind)
    await conn.send({"hi": 1})
    peer = (await asyncio.wait_for(listener.recv(), 5)).peer
    await conn.close()
    with pytest.raises(PeerGone):
        for _ in range(100):  # zmq and ucx learn of the disconnect asynchronously
            await listener.send(peer, {"anyone": "?"})
            await asyncio.sleep(0.05)
    with pytest.raises(PeerGone):
        await listener.send(b"no-such-peer", {"x": 1})


async def test_close_wakes_waiters_and_is_idempotent(kind, endpoints):
    listener, conn = await endpoints(kind)
    waiting_listener = asyncio.create_task(listener.recv())
    waiting_conn = asyncio.create_task(conn.recv())
    await asyncio.sleep(0.05)
    await conn.close()
    await listener.close()
    for task in (waiting_listener, waiting_conn):
        with pytest.raises(TransportClosed):
            await asyncio.wait_for(task, 5)
    await conn.close()
    await listener.close()
    with pytest.raises(TransportClosed):
        await conn.send({"x": 1})


@pytest.mark.parametrize("kind", ["inproc", "zmq+tcp", "zmq+ipc"])
async def test_connect_to_nothing_fails_or_times_out(kind, make_url, registry):
    options = TransportOptions(send_timeout=0.3, request_timeout=0.3)
    url = make_url(kind).replace(":0", ":1")  # port 1: nobody listens
    try:
        conn = await transports.connect(url, options=options, registry=registry)
    except PeerGone:
        return  # inproc knows at once
    try:
        with pytest.raises(RequestTimeout):
            await conn.send({"x": 1})
        with pytest.raises(RequestTimeout):
            await conn.request({"x": 1})
    finally:
        await conn.close()


async def test_inproc_frames_are_passed_by_reference(endpoints):
    listener, conn = await endpoints("inproc")
    data = bytearray(b"abc")
    await conn.send({}, [data])
    incoming = await listener.recv()
    data[0] = ord("z")  # documented rule: do not mutate after send; shows no copy was made
    assert bytes(incoming.frames[0]) == b"zbc"


async def test_inproc_registries_are_separate_namespaces():
    a, b = transports.InprocRegistry(), transports.InprocRegistry()
    listener = await transports.listen("inproc://n", registry=a)
    with pytest.raises(PeerGone):
        await transports.connect("inproc://n", registry=b)
    with pytest.raises(OSError):
        await transports.listen("inproc://n", registry=a)
    await listener.close()
    again = await transports.listen("inproc://n", registry=a)  # name freed on close
    await again.close()
