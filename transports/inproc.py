"""In-process transport: asyncio queues, for the embedded server and tests.

Addresses are `inproc://name`, resolved in an explicit `InprocRegistry` that
the caller owns and passes to both sides (no module-global namespace, so two
embedded clusters in one process never see each other).

Frames are handed over by reference, never copied: a sender must not mutate a
buffer after sending it (the same rule as zmq's copy=False).

Identity: only code in this process can reach an inproc listener, so a
connection names itself (`connect(..., identity=NAME)`) and every message it
sends carries that name as `Incoming.identity`; the listener counts as
authenticated (a connection that names nobody sends with identity None).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from .base import (
    KIND_REPLY,
    Connection,
    Frame,
    Incoming,
    Listener,
    PeerGone,
    PeerId,
    TransportClosed,
    TransportOptions,
    TransportStats,
    as_buffer,
    encode_header,
)


class InprocRegistry:
    """The namespace of `inproc://` listeners. Not thread-safe: one event loop."""

    def __init__(self) -> None:
        self._listeners: dict[str, InprocListener] = {}

    def lookup(self, name: str) -> "InprocListener | None":
        return self._listeners.get(name)

    def _bind(self, name: str, listener: "InprocListener") -> None:
        if name in self._listeners:
            raise OSError(f"inproc://{name} is already bound")
        self._listeners[name] = listener

    def _unbind(self, name: str, listener: "InprocListener") -> None:
        if self._listeners.get(name) is listener:
            del self._listeners[name]


class InprocListener(Listener):
    authenticated = True      # reachable from this process only; callers name themselves

    def __init__(self, name: str, registry: InprocRegistry, options: TransportOptions) -> None:
        self.url = f"inproc://{name}"
        self.options = options
        self.stats = TransportStats()
        self._name = name
        self._registry = registry
        # Bounded: a flooding peer waits in send, as with a zmq HWM.
        self._inbox: asyncio.Queue[Incoming | None] = asyncio.Queue(options.queue_depth)
        self._peers: dict[PeerId, InprocConnection] = {}
        self._peer_ids = itertools.count(1)
        self._closed = False
        registry._bind(name, self)

    def _attach(self, conn: "InprocConnection") -> PeerId:
        if self._closed:
            raise PeerGone(f"{self.url} is closed")
        peer = next(self._peer_ids).to_bytes(8, "little")
        self._peers[peer] = conn
        return peer

    def _detach(self, peer: PeerId) -> None:
        self._peers.pop(peer, None)

    async def _accept(self, message: Incoming) -> None:
        if self._closed:
            raise PeerGone(f"{self.url} is closed")
        await self._inbox.put(message)

    async def recv(self) -> Incoming:
        if self._closed:
            raise TransportClosed(self.url)
        message = await self._inbox.get()
        if message is None:  # close() woke us
            self._inbox.put_nowait(None)
            raise TransportClosed(self.url)
        self.stats.received += 1
        return message

    async def send(self, peer: PeerId, header: bytes | Mapping[str, Any],
                   frames: Sequence[Frame] = (), *, request_id: int = 0) -> None:
        if self._closed:
            raise TransportClosed(self.url)
        conn = self._peers.get(peer)
        if conn is None or conn.closed:
            raise PeerGone(f"peer {peer.hex()} is not connected to {self.url}")
        kind = KIND_REPLY if request_id else 0
        conn._deliver(kind, request_id, encode_header(header), [as_buffer(f) for f in frames])
        self.stats.sent += 1

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._registry._unbind(self._name, self)
        for conn in list(self._peers.values()):
            conn._shutdown(PeerGone(f"{self.url} closed"))
        self._peers.clear()
        while not self._inbox.empty():  # drop undelivered, then wake recv()
            self._inbox.get_nowait()
        self._inbox.put_nowait(None)


class InprocConnection(Connection):
    def __init__(self, listener: InprocListener, options: TransportOptions,
                 identity: str | None = None) -> None:
        super().__init__(listener.url, options)
        self._listener = listener
        self._identity = identity
        self._peer = listener._attach(self)

    async def _send_raw(self, kind: int, request_id: int, header: bytes,
                        frames: list[memoryview]) -> None:
        await self._listener._accept(Incoming(self._peer, header, frames, request_id, self._identity))

    async def close(self) -> None:
        if self._closed:
            return
        self._listener._detach(self._peer)
        self._shutdown(TransportClosed(self.url))


async def listen(name: str, *, registry: InprocRegistry, options: TransportOptions) -> InprocListener:
    return InprocListener(name, registry, options)


async def connect(name: str, *, registry: InprocRegistry, options: TransportOptions,
                  identity: str | None = None) -> InprocConnection:
    listener = registry.lookup(name)
    if listener is None:
        raise PeerGone(f"nothing listens on inproc://{name}")
    return InprocConnection(listener, options, identity)


__all__ = ["InprocRegistry", "InprocListener", "InprocConnection", "listen", "connect"]
