"""The links a node opens to other nodes' listeners (a prefill leg's KV and
prompt replica, the replication stream): one per peer process.

``PeerLinks`` keeps one link per node name, made for one address and
incarnation of that node. A caller that names the node at another address,
or as another incarnation (when both are known), is given a new link at once
and the old one is closed: a restarted node (a new process, usually on a new
port) is reached from its first request on, never through the link to its
dead predecessor. An incarnation of "" (a caller that does not know it)
matches the link's. A link its caller saw fail is dropped (``drop``), and
the next ``get`` connects again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from transports import Connection

log = logging.getLogger("kvd.node.peers")


@dataclass(slots=True)
class _Link:
    address: str
    incarnation: str              # "" until a caller names it
    conn: Connection


class PeerLinks:
    def __init__(self, connect: Callable[[str, str], Awaitable[Connection]]) -> None:
        self._connect = connect                         # (node name, address) -> a new authenticated link
        self._links: dict[str, _Link] = {}
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.replaced = 0                               # links given up for a peer's new address or process

    async def get(self, node: str, address: str, incarnation: str = "") -> Connection:
        """The link to ``node`` at ``address`` (as process ``incarnation``,
        "" = unknown): the kept one, or a new one that replaces a link to
        another address or process of that name. Raises what connecting raises."""
        async with self._locks[node]:
            link = self._links.get(node)
            if link is not None and not self._same(link, address, incarnation):
                log.info("peer %s is now at %s%s: its link to %s is replaced", node, address,
                         f" (process {incarnation})" if incarnation else "", link.address)
                self.replaced += 1
                del self._links[node]
                await _close(link.conn)
                link = None
            if link is None:
                link = self._links[node] = _Link(address, incarnation, await self._connect(node, address))
            elif incarnation and not link.incarnation:
                link.incarnation = incarnation
            return link.conn

    @staticmethod
    def _same(link: _Link, address: str, incarnation: str) -> bool:
        return (link.address == address and not link.conn.closed
                and not (incarnation and link.incarnation and link.incarnation != incarnation))

    async def drop(self, node: str) -> None:
        """Forget the link to ``node`` (a caller saw it fail) and close it."""
        link = self._links.pop(node, None)
        if link is not None:
            await _close(link.conn)

    async def close(self) -> None:
        """Close every link (the daemon's cleanup)."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            await _close(link.conn)

    def __len__(self) -> int:
        return len(self._links)


async def _close(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        await conn.close()
