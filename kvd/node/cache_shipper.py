"""Pushes this node's MemPool cache events to the coordinator's global prompt tree.

Contract (the coordinator's side is kvd/coordinator/cache_sync.py):

- Every ``interval`` seconds, while registered, the stored/removed events
  the engine produced since the last round are drained on the engine thread
  (``MemPool.take_events``) and sent as ONE ``CacheEvents`` request numbered
  from ``seq``; the ``CacheAck`` says which number comes next. Nothing is sent
  when there was no event.
- A snapshot (``MemPool.cache_snapshot``, taken on the engine thread with
  the event buffer drained in the same call, so nothing falls between them)
  replaces the coordinator's view of this node. It is sent after every
  registration (first start, a coordinator restart, a node declared dead and
  back), when the coordinator asks (``resync``: a gap, or it lost track),
  after an ``Error`` reply, when the event buffer overflowed
  (``MemPool.events_dropped`` grew), and when a send failed or timed out
  (it may or may not have been applied).
- One message in flight at a time, so the coordinator sees them in order.

Pushed rather than carried in heartbeats: the coordinator learns about a
prefix within ``interval`` (50 ms by default) instead of a heartbeat interval
(500 ms); docs/benchmarks.md has the cost of both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvd import protocol
from engine.memory.radix import CacheEvent
from kvd.cache_events import pack
from kvd.node.heartbeat import Heartbeater
from transports import TransportError

log = logging.getLogger("kvd.node.cache")


def _drain(snapshot: bool):
    """The engine-thread half: (events or a snapshot, events dropped so far)."""
    def run(engine) -> tuple[list, int]:
        pool = engine.pool
        events = pool.take_events()
        if snapshot:
            events = pool.cache_snapshot()       # supersedes the drained events
        return events, pool.events_dropped()
    return run


class CacheOutbox:
    """The synchronous half of shipping (no I/O): which message goes next and
    what its answer means. Pure bookkeeping, so the protocol is unit-tested
    against real MemPools and the real coordinator side
    (tests/kvd/test_prompt_tree_sync.py)."""

    def __init__(self, name: str, block_size: int) -> None:
        self.name = name
        self.block_size = block_size
        self.seq = 0                     # number of the next event to send
        self.need_snapshot = True
        self.sent_events = 0
        self.snapshots = 0
        self.since_beat = 0
        self._registration: object = None
        self._dropped = 0

    def registered(self, registration: object) -> None:
        """The node's current registration (any value that changes when it
        registers again): a new one needs a snapshot."""
        if registration != self._registration:
            self._registration = registration
            self.need_snapshot = True

    def message(self, events: list[CacheEvent], dropped: int, snapshot: bool,
                deadline: float | None = None) -> protocol.CacheEvents | None:
        """The message for what ``_drain(snapshot)`` returned, or None: nothing
        to send, or the event buffer overflowed (then ``need_snapshot`` is set
        and the caller drains again, for a snapshot)."""
        overflowed = dropped != self._dropped
        self._dropped = dropped
        if overflowed and not snapshot:
            self.need_snapshot = True
            return None
        if not events and not snapshot:
            return None
        return pack(self.name, self.seq, self.block_size, events, snapshot=snapshot,
                    msg_id=f"cache-{self.name}-{self.seq}", deadline=deadline)

    def on_reply(self, msg: protocol.CacheEvents, reply: object) -> bool:
        """Take the coordinator's answer to ``msg``; True when it was applied."""
        if isinstance(reply, protocol.CacheAck) and not reply.resync:
            self.seq = reply.next_seq
            self.need_snapshot = False
            if msg.snapshot:
                self.snapshots += 1
            else:
                n = msg.tensors[0].shape[0]
                self.sent_events += n
                self.since_beat += n
            return True
        self.need_snapshot = True
        return False

    def on_failure(self) -> None:
        """The message (or its answer) was lost: it may or may not have been applied."""
        self.need_snapshot = True


class CacheShipper:
    """The asynchronous half: drains on the engine thread, sends, waits (see the module docstring)."""

    def __init__(self, name: str, driver: Any, heartbeat: Heartbeater, block_size: int,
                 interval: float, timeout: float) -> None:
        self.driver = driver
        self.heartbeat = heartbeat
        self.interval = interval
        self.timeout = timeout
        self.outbox = CacheOutbox(name, block_size)
        self.messages = 0

    async def run(self) -> None:
        """Ship every ``interval`` until cancelled; never raises for a coordinator that is away."""
        while True:
            await asyncio.sleep(self.interval)
            await self.ship_once()

    def events_since_beat(self) -> int:
        """Events shipped since the last call (the heartbeat's ``cache_events``)."""
        n, self.outbox.since_beat = self.outbox.since_beat, 0
        return n

    async def ship_once(self) -> None:
        """One round: drain, send, read the answer."""
        hb, box = self.heartbeat, self.outbox
        if not hb.registered or hb.paused or hb.conn is None:
            return
        box.registered(hb.registrations)
        for _ in range(2):               # a second time only for the snapshot after an overflow
            snapshot = box.need_snapshot
            try:
                events, dropped = await self.driver.call(_drain(snapshot), timeout=self.timeout)
            except Exception:            # noqa: BLE001 -- the engine was busy: its events may be lost
                box.on_failure()
                return
            msg = box.message(events, dropped, snapshot, deadline=time.time() + self.timeout)
            if msg is not None or not box.need_snapshot:
                break
        if msg is None:
            return
        try:
            reply = await protocol.call(hb.conn, msg, timeout=self.timeout)
        except (TransportError, TimeoutError) as exc:
            log.info("cache events not delivered (%s); a snapshot follows", exc)
            box.on_failure()
            return
        self.messages += 1
        if not box.on_reply(msg, reply):
            log.info("coordinator asks for a cache snapshot: %s",
                     getattr(reply, "reason", None) or getattr(reply, "message", reply))

    def stats(self) -> dict:
        box = self.outbox
        return {"seq": box.seq, "sent_events": box.sent_events, "snapshots": box.snapshots,
                "messages": self.messages, "need_snapshot": box.need_snapshot}
