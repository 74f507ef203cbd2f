"""A node's lost requests (their output could not be delivered) travel in its
heartbeats, over a real in-process link, until a beat naming them is
accepted; a refused beat keeps them; a Goodbye names those still untold."""

from __future__ import annotations

import asyncio

from kvd import protocol
from transports import InprocRegistry, listen

from .test_heartbeat import node_n1


async def test_lost_requests_are_named_until_an_accepted_beat_and_then_no_more():
    registry = InprocRegistry()
    listener = await listen("inproc://coordinator", registry=registry)
    beats: list[tuple[str, ...]] = []
    refuse = asyncio.Event()
    goodbyes: list[tuple[str, ...]] = []

    async def coordinator():
        while True:
            incoming = await listener.recv()
            msg = protocol.decode(incoming.header, incoming.frames)
            accepted = True
            if isinstance(msg, protocol.Heartbeat):
                beats.append(msg.lost)
                accepted = not (msg.lost and refuse.is_set())
            elif isinstance(msg, protocol.Goodbye):
                goodbyes.append(msg.unfinished)
            await listener.reply(incoming, *protocol.encode(protocol.Welcome(
                id=msg.id, node="n1", accepted=accepted, reason="" if accepted else "seq out of step",
                heartbeat_interval=0.02)))
    serving = asyncio.create_task(coordinator())
    hb = node_n1(registry)
    beating = asyncio.create_task(hb.run())
    try:
        await asyncio.wait_for(hb.joined.wait(), 5)
        refuse.set()
        hb.report_lost("a")
        hb.report_lost("b")
        while beats.count(("a", "b")) < 2:           # refused: named again, after registering again
            await asyncio.sleep(0.01)
        refuse.clear()
        while hb.lost:
            await asyncio.sleep(0.01)
        told = len(beats)
        while len(beats) < told + 3:
            await asyncio.sleep(0.01)
        assert all(lost == () for lost in beats[told:])      # accepted: never named again
        hb.paused = True
        hb.report_lost("c")                                  # untold when it leaves
        await hb.goodbye("shutdown", ("d",))
        assert goodbyes == [("d", "c")]
    finally:
        beating.cancel()
        serving.cancel()
        await asyncio.gather(beating, serving, return_exceptions=True)
        await listener.close()
