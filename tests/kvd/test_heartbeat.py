"""The node's Heartbeater against a coordinator on a real (in-process) transport link:
after its Goodbye a node neither beats nor registers again, although the coordinator
removes it on receipt and answers the Goodbye only later (its trailing chunks' grace)."""

from __future__ import annotations

import asyncio

from kvd import protocol
from kvd.node.heartbeat import Heartbeater
from transports import InprocRegistry, connect, listen

GOODBYE_ANSWER_DELAY_S = 0.3        # the coordinator's grace for a leaving node's last chunks, shortened


async def coordinator(listener, seen: list[str], gone: asyncio.Event) -> None:
    """Welcomes a Hello and the beats of a known node; refuses beats after a Goodbye
    ("unknown node", as kvd's coordinator does), and answers the Goodbye late."""
    while True:
        incoming = await listener.recv()
        msg = protocol.decode(incoming.header, incoming.frames)
        seen.append(msg.TYPE)
        if isinstance(msg, protocol.Hello):
            gone.clear()
            reply = protocol.Welcome(id=msg.id, node=msg.node, accepted=True, heartbeat_interval=0.02)
        elif isinstance(msg, protocol.Heartbeat):
            reply = protocol.Welcome(id=msg.id, node=msg.node, accepted=not gone.is_set(),
                                     reason="unknown node" if gone.is_set() else "", heartbeat_interval=0.02)
        else:
            assert isinstance(msg, protocol.Goodbye)
            gone.set()
            await asyncio.sleep(GOODBYE_ANSWER_DELAY_S)
            reply = protocol.Welcome(id=msg.id, node=msg.node, accepted=False, reason="goodbye")
        await listener.reply(incoming, *protocol.encode(reply))


def node_n1(registry: InprocRegistry) -> Heartbeater:
    """Node n1's Heartbeater towards inproc://coordinator, beating every 20 ms."""

    async def beat(seq: int) -> protocol.Heartbeat:
        return protocol.Heartbeat(node="n1", seq=seq, load=0.0, running=0, waiting=0, free_blocks={"host": 8})

    return Heartbeater("n1", lambda: connect("inproc://coordinator", registry=registry),
                       lambda: protocol.Hello(node="n1", address="inproc://n1", blocks_per_tier={"host": 8},
                                              block_size=16),
                       beat, interval=0.02, timeout=2.0)


async def test_no_beat_or_registration_after_goodbye():
    registry = InprocRegistry()
    listener = await listen("inproc://coordinator", registry=registry)
    seen: list[str] = []
    gone = asyncio.Event()
    serving = asyncio.create_task(coordinator(listener, seen, gone))

    hb = node_n1(registry)
    beating = asyncio.create_task(hb.run())
    try:
        await asyncio.wait_for(hb.joined.wait(), 5)
        while seen.count(protocol.Heartbeat.TYPE) < 3:             # beating
            await asyncio.sleep(0.01)
        await hb.goodbye("shutdown")
        at_goodbye = len(seen)
        await asyncio.sleep(10 * 0.02)                              # ten intervals more
        assert seen.count(protocol.Hello.TYPE) == 1, seen          # never registered again
        assert len(seen) == at_goodbye, seen[at_goodbye:]         # and said nothing after its Goodbye
        assert hb.registrations == 1
    finally:
        beating.cancel()
        serving.cancel()
        await asyncio.gather(beating, serving, return_exceptions=True)
        await listener.close()


async def test_a_coordinator_of_another_build_never_registers_the_node(caplog):
    """A Welcome of another protocol version (a coordinator of another kvd build) is not
    taken for one: the node stays unregistered, retries, and says why."""
    registry = InprocRegistry()
    listener = await listen("inproc://coordinator", registry=registry)
    hellos = 0

    async def other_build() -> None:
        nonlocal hellos
        while True:
            incoming = await listener.recv()
            msg = protocol.decode(incoming.header, incoming.frames)
            assert isinstance(msg, protocol.Hello)
            hellos += 1
            header, frames = protocol.encode(protocol.Welcome(id=msg.id, node=msg.node, accepted=True))
            other = header.replace(b'"v":%d' % protocol.PROTOCOL_VERSION, b'"v":%d' % (protocol.PROTOCOL_VERSION + 1))
            await listener.reply(incoming, other, *frames)

    serving = asyncio.create_task(other_build())

    hb = node_n1(registry)
    beating = asyncio.create_task(hb.run())
    try:
        with caplog.at_level("WARNING", logger="kvd.node.heartbeat"):
            while hellos < 3:                                      # it keeps trying ...
                await asyncio.sleep(0.01)
        assert not hb.joined.is_set() and hb.registrations == 0   # ... and never counts itself in
        assert "reply to registration refused: bad_version: protocol version" in caplog.text
        assert "another kvd build" in caplog.text
        assert caplog.text.count("registration refused") == 1     # one line per 10 s, not per try
    finally:
        beating.cancel()
        serving.cancel()
        await asyncio.gather(beating, serving, return_exceptions=True)
        await listener.close()
