"""A zmq listener pushing to a peer that stops reading (a stalled process):
sends wait for room, up to send_timeout, in order -- they do not fail at once
because another peer of the same ROUTER has room."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import zmq
import zmq.asyncio

import transports
from transports import RequestTimeout, TransportOptions
from transports.base import KIND_MSG, pack_envelope, unpack_envelope
from transports.zmq import zmq_endpoint

SMALL = TransportOptions(send_timeout=3.0, request_timeout=3.0, queue_depth=4)
FRAME = b"x" * 4096           # fills the peer's queue and the socket buffers in a few hundred sends


class SilentPeer:
    """A real DEALER that says hello once and then reads only when told to."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVHWM, 4)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(zmq_endpoint(url))

    async def hello(self) -> None:
        await self.sock.send_multipart([pack_envelope(KIND_MSG, 0), b'{"hello": 1}'])

    async def read(self, n: int) -> list[int]:
        """The ``seq`` of the next ``n`` messages."""
        out = []
        for _ in range(n):
            parts = await asyncio.wait_for(self.sock.recv_multipart(), 10)
            assert unpack_envelope(parts[0]) == (KIND_MSG, 0)
            out.append(orjson.loads(parts[1])["seq"])
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.destroy(0)


async def fill(listener, peer: bytes, start: int = 0) -> tuple[int, asyncio.Future]:
    """Send until one waits 0.3 s (the peer is full): (how many went out, the waiting send)."""
    seq = start
    while True:
        try:
            await asyncio.wait_for(asyncio.shield(send := asyncio.ensure_future(
                listener.send(peer, {"seq": seq}, [FRAME]))), 0.3)
        except TimeoutError:
            return seq, send
        seq += 1


@pytest.mark.parametrize("kind", ["zmq+tcp", "zmq+ipc"])
async def test_a_full_peer_makes_sends_wait_in_order_not_fail(kind, make_url):
    listener = await transports.listen(make_url(kind), options=SMALL)
    slow, other = SilentPeer(listener.url), await transports.connect(listener.url, options=SMALL)
    try:
        await slow.hello()
        peer = (await listener.recv()).peer
        await other.send({"hello": 2})          # a second peer with room: the ROUTER is "writable"
        await listener.recv()
        sent, blocked = await fill(listener, peer)
        # more sends queue behind the blocked one; none fails while the peer is merely slow
        later = [asyncio.ensure_future(listener.send(peer, {"seq": sent + 1 + i}, [FRAME])) for i in range(5)]
        await asyncio.sleep(0.5)
        assert not blocked.done() and not any(f.done() for f in later)
        got = await slow.read(sent + 6)          # the peer reads again: everything arrives, in order
        await asyncio.gather(blocked, *later)
        assert got == list(range(sent + 6))
        assert listener.stats.sent == sent + 6
    finally:
        slow.close()
        await other.close()
        await listener.close()


async def test_a_peer_that_never_reads_times_out_the_send(make_url):
    listener = await transports.listen(make_url("zmq+tcp"), options=SMALL)
    slow, other = SilentPeer(listener.url), await transports.connect(listener.url, options=SMALL)
    try:
        await slow.hello()
        peer = (await listener.recv()).peer
        await other.send({"hello": 2})
        await listener.recv()
        _, blocked = await fill(listener, peer)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(RequestTimeout):
            await blocked
        assert loop.time() - t0 < SMALL.send_timeout + 1
        # the other peer is served meanwhile and after
        await listener.send((await _peer_of(listener, other)), {"seq": -1})
        assert orjson.loads((await asyncio.wait_for(other.recv(), 5)).header) == {"seq": -1}
    finally:
        slow.close()
        await other.close()
        await listener.close()


async def _peer_of(listener, conn) -> bytes:
    await conn.send({"who": 1})
    return (await listener.recv()).peer
