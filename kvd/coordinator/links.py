"""The coordinator's links to its nodes, and the owned tasks that send on them.

``NodeLink`` is one node's connection and the task reading it: each message
that decodes is dispatched; one that does not is counted (``bad_messages``)
and, when it names a request, turned into an ``Error`` with code
``REFUSED`` so that its request ends now, not at a deadline. ``NodeLinks``
holds every node's link by name and owns the fire-and-forget sends (aborts,
KV returns, prefill legs): each is a task that ``close`` awaits, briefly.

Imports no torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kvd import protocol
from kvd.ratelog import RateLimitedLog
from transports import Connection, TransportClosed, TransportError

log = logging.getLogger("kvd.coordinator.client")

# Error.code of a request whose node sent a message about it that failed to decode here: its
# legs are aborted (the node still runs it) and the request ends with this error.
REFUSED = "refused_message"

Dispatch = Callable[[str, protocol.Message], None]


class NodeLink:
    """The coordinator's connection to one node, and the task reading it."""

    def __init__(self, node: str, conn: Connection, dispatch: Dispatch,
                 bad_messages: collections.Counter, warn: RateLimitedLog | None = None) -> None:
        self.node = node
        self.conn = conn
        self._dispatch = dispatch
        self._bad = bad_messages
        self._warn = warn or RateLimitedLog(log)   # bad messages: counted each, logged rate-limited
        self.reader = asyncio.create_task(self._read(), name=f"link {node}")

    async def _read(self) -> None:
        while True:
            try:
                incoming = await self.conn.recv()
            except TransportError:
                return
            msg = protocol.decode(incoming.header, incoming.frames)
            if isinstance(msg, protocol.ProtocolError):
                self._bad[msg.reason] += 1
                self._warn.warning((self.node, msg.reason), "bad message from node %s: %s",
                                   self.node, msg.reason)
                if msg.request_id is not None:          # its request ends now, not at a deadline
                    self._dispatch(self.node, protocol.Error(
                        code=REFUSED, request_id=msg.request_id,
                        message=f"node {self.node} sent a {msg.type or 'message'} this coordinator refused "
                                f"({msg.reason}: {msg.detail})"))
                continue
            self._dispatch(self.node, msg)

    async def send(self, msg: protocol.Message) -> None:
        await self.conn.send(*protocol.encode(msg))

    async def call(self, header: bytes) -> protocol.Message | protocol.ProtocolError:
        """Send an encoded message as a request; its decoded reply. Raises
        TransportError (RequestTimeout past the link's request timeout)."""
        reply = await self.conn.request(header)
        return protocol.decode(reply.header, reply.frames)

    async def close(self) -> None:
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        await self.conn.close()


class NodeLinks:
    """Every linked node's ``NodeLink`` (``by_node``), the messages their
    readers could not decode (``bad_messages``), and the owned send tasks."""

    def __init__(self, dispatch: Dispatch) -> None:
        self.by_node: dict[str, NodeLink] = {}
        self.bad_messages: collections.Counter[str] = collections.Counter()
        self.warn = RateLimitedLog(log)        # one line per (node, reason) per interval
        self._dispatch = dispatch
        self._tasks: set[asyncio.Task] = set()

    def get(self, node: str) -> NodeLink | None:
        return self.by_node.get(node)

    async def attach(self, node: str, conn: Connection) -> None:
        """Start using ``conn`` for ``node`` (replacing, and closing, an older link)."""
        await self.drop(node)
        self.by_node[node] = NodeLink(node, conn, self._dispatch, self.bad_messages, self.warn)

    async def drop(self, node: str) -> None:
        """Close and forget ``node``'s link, if any."""
        link = self.by_node.pop(node, None)
        if link is not None:
            await link.close()

    def send(self, node: str, msg: protocol.Message) -> None:
        """Send ``msg`` to ``node`` in an owned task, if it is linked; a
        failure or a send past 2 s is ignored (the message was advisory)."""
        link = self.by_node.get(node)
        if link is not None:
            self.spawn(send_quietly(link, msg))

    def send_abort(self, node: str, request_id: str, reason: str = "client closed") -> None:
        self.send(node, protocol.Abort(request_id=request_id, reason=reason))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """An owned task (awaited, at most briefly, by ``close``)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Close every link; wait up to 2 s for the owned tasks."""
        for link in list(self.by_node.values()):
            await link.close()
        self.by_node.clear()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)


async def send_quietly(link: NodeLink, msg: protocol.Message) -> None:
    with contextlib.suppress(TransportError, TransportClosed, TimeoutError):
        async with asyncio.timeout(2.0):
            await link.send(msg)
