"""Rejected wire messages are counted one by one and logged rate-limited (issue 9, item 8)."""

from __future__ import annotations

import asyncio
import collections
import logging

import orjson
import pytest
import zmq
import zmq.asyncio

import transports
from kvd import protocol
from kvd.coordinator.links import NodeLink
from kvd.ratelog import RateLimitedLog
from transports.base import KIND_MSG, KIND_REQUEST, pack_envelope

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_key_per_interval_and_the_next_says_how_many_were_left_out(caplog):
    clock = FakeClock()
    warn = RateLimitedLog(logging.getLogger("t.ratelog"), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t.ratelog"):
        logged = [warn.warning("bad_json", "rejected %s", i) for i in range(1000)]
        logged += [warn.warning("bad_version", "rejected v")]        # another kind: its own line
        clock.now += 9.9
        logged += [warn.warning("bad_json", "rejected late")]        # still inside the interval
        clock.now += 0.2
        logged += [warn.warning("bad_json", "rejected %s", "after")]
    assert sum(logged) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "rejected 0" and lines[1] == "rejected v"
    assert lines[2].startswith("rejected after (1000 more like it in the last 10s")


async def test_a_flood_of_bad_messages_is_counted_each_and_logged_per_reason(caplog):
    """900 malformed messages of three kinds over a real zmq socket: every one
    counted by reason and answered, three WARNING lines in all."""
    listener = await transports.listen("zmq+tcp://127.0.0.1:0")
    rejected: collections.Counter[str] = collections.Counter()
    handled: list[protocol.Message] = []

    async def handle(msg, incoming):
        handled.append(msg)
        return None

    serving = asyncio.create_task(protocol.serve(listener, handle, rejected=rejected))
    good, _ = protocol.encode(protocol.Abort(request_id="r"))
    body = orjson.loads(good)
    bad = [b"{not json", orjson.dumps({**body, "v": 99}), orjson.dumps({**body, "type": "Nope"})]
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(listener.url.replace("zmq+tcp://", "tcp://"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvd.wire"):
            for i in range(900):
                await sock.send_multipart([pack_envelope(KIND_REQUEST, i + 1), bad[i % 3]])
            await sock.send_multipart([pack_envelope(KIND_MSG, 0), good])
            async with asyncio.timeout(20):
                while not handled:
                    await asyncio.sleep(0.01)
                replies = [await sock.recv_multipart() for _ in range(900)]   # each one answered
        assert rejected == {"bad_json": 300, "bad_version": 300, "unknown_type": 300}
        assert all(protocol.decode(r[1], r[2:]).code in rejected for r in replies)
        assert isinstance(handled[0], protocol.Abort)         # the good one still got through
        warnings = [r for r in caplog.records if r.name == "kvd.wire" and r.levelno == logging.WARNING]
        assert len(warnings) == 3, [r.getMessage() for r in warnings]
    finally:
        sock.close(0)
        ctx.term()
        serving.cancel()
        await listener.close()


async def test_the_coordinator_logs_a_nodes_bad_messages_rate_limited(caplog):
    """NodeLink: what a node pushes that does not decode is counted each time,
    logged once per (node, reason) per interval."""
    registry = transports.InprocRegistry()
    listener = await transports.listen("inproc://n1", registry=registry)
    conn = await transports.connect("inproc://n1", registry=registry, identity="coordinator")
    bad: collections.Counter[str] = collections.Counter()
    got: list = []
    link = NodeLink("n1", conn, lambda node, msg: got.append(msg), bad)
    try:
        await conn.send(b'{"hello": 1}')
        peer = (await listener.recv()).peer
        with caplog.at_level(logging.WARNING, logger="kvd.coordinator.client"):
            for _ in range(300):
                await listener.send(peer, b"{garbage")
            await listener.send(peer, protocol.encode(protocol.Abort(request_id="x"))[0])
            async with asyncio.timeout(10):
                while not got:
                    await asyncio.sleep(0.01)
        assert bad == {"bad_json": 300}
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "n1" in warnings[0].getMessage()
    finally:
        await link.close()
        await listener.close()
