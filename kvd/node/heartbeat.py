"""A node's link to the coordinator: registration (Hello/Welcome) and heartbeats.

Contract: ``run()`` loops until cancelled and never raises for a coordinator
that is down, slow or restarted:

- not registered: send Hello (a request with a deadline); on Welcome(accepted)
  start beating;
- registered: send a Heartbeat request every ``interval``; a reply
  ``Welcome(accepted=False)`` means the coordinator does not know us (it
  restarted, or declared us dead): register again at once;
- a transport failure or timeout: reconnect (UCX links do not reconnect by
  themselves) and register again.

``paused`` (fault injection, admin ``fail stop``) stops the beats without
stopping anything else, so the coordinator's failure detector fires.

``report_lost(request_id)``: the node gave a request up because its output
could not reach the coordinator (the data link's send timed out: the
coordinator stalled longer than ``send_timeout``). Every beat names such
requests (``Heartbeat.lost``, at most ``MAX_LOST_PER_BEAT``) until a beat
that named them is accepted, so the coordinator ends or recovers them
however many beats a stall costs; a Goodbye names them as unfinished.

``joined`` is set at the first accepted registration (the node daemon's
READY=1) and stays set. ``timeout`` bounds a Hello (the coordinator connects
back to us before it answers), ``beat_timeout`` a Heartbeat: the node passes
the coordinator's heartbeat deadline, since an answer later than that is
worthless, and a beat lost with a crashed coordinator must not delay the
registration with its successor for longer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Awaitable, Callable

from kvd import protocol
from kvd.ratelog import RateLimitedLog
from transports import Connection, TransportError

# The coordinator answers a Goodbye once our last chunks reached it (it waits
# up to 1.5 s for them), so this is longer than that wait.
GOODBYE_TIMEOUT_S = 3.0
MAX_LOST_PER_BEAT = 512        # lost request ids one beat names (the rest: the next beats)

log = logging.getLogger("kvd.heartbeat")


class Heartbeater:
    def __init__(self, name: str, connect: Callable[[], Awaitable[Connection]],
                 hello: Callable[[], protocol.Hello],
                 beat: Callable[[int], Awaitable[protocol.Heartbeat]],
                 interval: float, timeout: float, beat_timeout: float | None = None,
                 on_reply: Callable[[protocol.Welcome], None] | None = None) -> None:
        self.name = name
        self._connect = connect
        self._hello = hello
        self._beat = beat
        self.interval = interval
        self.timeout = timeout
        self.beat_timeout = min(timeout, beat_timeout or timeout)
        self._on_reply = on_reply          # each accepted Welcome (registration and beats): its assignments
        self.registered = False
        self.registrations = 0
        self.paused = False
        self.leaving = False               # said Goodbye: no beat or registration from now on
        self.seq = 0
        self.lost: dict[str, None] = {}   # request ids given up and not yet answered for, oldest first
        self.conn: Connection | None = None
        self.joined = asyncio.Event()
        self._kick = asyncio.Event()
        self._warn = RateLimitedLog(log)   # a refused registration is retried every interval

    def kick(self) -> None:
        """Beat now (state changed: draining, undrained)."""
        self._kick.set()

    def report_lost(self, request_id: str) -> None:
        """``request_id`` was given up without its last message reaching the
        coordinator: name it in the next beats (module docstring), and beat now."""
        self.lost[request_id] = None
        self._kick.set()

    async def run(self) -> None:
        try:
            while True:
                if not (self.paused or self.leaving):
                    await self._once()
                self._kick.clear()
                try:
                    async with asyncio.timeout(self.interval):
                        await self._kick.wait()
                except TimeoutError:
                    pass
        finally:
            if self.conn is not None:
                await self.conn.close()

    async def _once(self) -> None:
        try:
            if self.conn is None or self.conn.closed:
                self.registered = False
                self.conn = await asyncio.wait_for(self._connect(), self.timeout)
            if not self.registered:
                reply = await protocol.call(self.conn, self._hello(), timeout=self.timeout)
                if isinstance(reply, protocol.Welcome) and reply.accepted:
                    self.registered = True
                    self.registrations += 1
                    self.seq = 0            # beats count from 1 in each registration (membership.py)
                    self.joined.set()
                    if reply.heartbeat_interval > 0:
                        self.interval = reply.heartbeat_interval
                    if self._on_reply is not None:
                        self._on_reply(reply)
                    log.info("registered with the coordinator (%d)", self.registrations)
                elif isinstance(reply, protocol.ProtocolError):     # e.g. a coordinator of another build
                    self._warn.warning("registration", "coordinator's reply to registration refused: %s: %s",
                                       reply.reason, reply.detail)
                else:
                    self._warn.warning("registration", "coordinator refused registration: %s",
                                       getattr(reply, "reason", None) or getattr(reply, "message", reply))
                return
            self.seq += 1
            beat = await self._beat(self.seq)
            told = tuple(itertools.islice(self.lost, MAX_LOST_PER_BEAT))
            if told:
                beat = dataclasses.replace(beat, lost=told)
            reply = await protocol.call(self.conn, beat, timeout=self.beat_timeout)
            if isinstance(reply, protocol.Welcome) and reply.accepted:    # the coordinator has them
                for rid in told:
                    self.lost.pop(rid, None)
            if self.leaving:                # a beat that crossed our Goodbye: the coordinator forgot us
                return
            if isinstance(reply, protocol.Welcome) and not reply.accepted:
                log.warning("coordinator does not know this node (%s); registering again", reply.reason)
                self.registered = False
                self._kick.set()
            elif isinstance(reply, protocol.Welcome) and self._on_reply is not None:
                self._on_reply(reply)
        except (TransportError, TimeoutError) as exc:
            if self.registered:
                log.warning("heartbeat to the coordinator failed: %s", exc)
            self.registered = False
            if self.conn is not None and self.conn.url.startswith("ucx"):
                await self.conn.close()  # a lost UCX link never comes back: reconnect
                self.conn = None

    async def goodbye(self, reason: str, unfinished: tuple[str, ...] = ()) -> None:
        """Tell the coordinator we leave on purpose (best effort, bounded);
        ``unfinished``: the request ids we give up. From now on this node neither
        beats nor registers again: the coordinator removes it on receipt, and a
        beat it refuses then must not make the leaving node routable again."""
        self.leaving = True
        if self.conn is None or self.conn.closed or not self.registered:
            return
        unfinished = tuple(dict.fromkeys((*unfinished, *self.lost)))
        try:
            await protocol.call(self.conn, protocol.Goodbye(node=self.name, reason=reason, unfinished=unfinished),
                                timeout=GOODBYE_TIMEOUT_S)
        except (TransportError, TimeoutError):
            pass
