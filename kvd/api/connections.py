"""Connection limits of the HTTP server: no client can hold it open.

``RefusedConnection`` (answer once, then close) also turns away admin-socket
connections beyond that socket's cap (kvd/api/admin.py).

Three bounds, all ``[server]`` options (docs/operations.md, "Limits"):

- ``header_timeout``: a connection must deliver a complete request head
  (request line and headers) within this many seconds of opening, and of each
  response it got; else it is closed. aiohttp has this timer under the name
  ``keepalive_timeout`` (armed at connect and after every response, it closes
  a connection whose handler still waits for a head), with a default of an
  hour: ``runner_options`` sets it. So one timer closes a client trickling an
  unfinished head (slowloris) and an idle keep-alive connection alike.
- ``body_timeout``: the front door's own (``http.read_body``, 408).
- ``max_connections``: ``CappedSite`` accepts a connection beyond the cap
  only to answer it 503 (OpenAI-shaped JSON, ``Connection: close``) and close
  it; the connections already served are untouched. ``fit_open_files``
  raises the process's open-files limit so that the cap, not EMFILE, is what
  a flood meets first.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
from typing import Any

import orjson
from aiohttp import web

log = logging.getLogger("kvd.http")

FD_RESERVE = 256          # files the process needs besides HTTP connections (zmq, admin, logs)
REFUSED_LINGER_S = 0.5    # a refused connection's request is read and dropped this long, then closed


def runner_options(header_timeout: float) -> dict[str, Any]:
    """``web.AppRunner`` keywords for the head timeout (see the module doc)."""
    return {"keepalive_timeout": header_timeout}


def fit_open_files(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE toward ``max_connections + FD_RESERVE``, as
    far as the hard limit allows. Returns the connection cap that fits:
    ``max_connections``, or less (with a warning) when the hard limit is lower."""
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, soft - FD_RESERVE)
        log.warning("max_connections %d lowered to %d: the process may open %d files "
                    "(raise LimitNOFILE / ulimit -n)", max_connections, cap, soft)
        return cap
    return max_connections


def _refusal(max_connections: int) -> bytes:
    body = orjson.dumps({"error": {
        "message": f"too many connections (limit {max_connections}); retry later",
        "type": "service_unavailable", "param": None, "code": "too_many_connections"}})
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n" % len(body)) + body


class RefusedConnection(asyncio.Protocol):
    """A connection over a cap: sent ``answer`` (an HTTP 503, an admin error
    line) at once; what it sends is read and dropped for REFUSED_LINGER_S
    (closing with unread data would reset the connection, and the client
    might never see the answer), then it is closed."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.answer)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False                          # the client is done too: close now

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


class BindError(OSError):
    """The HTTP port cannot be bound (taken, or not an address of this host)."""


def reserve_port(host: str, port: int) -> list[socket.socket]:
    """Sockets bound, not yet listening, to every address ``host`` resolves to
    (all interfaces for ``""``), at ``port``; port 0 takes one free port for
    all of them. From here on no port the kernel picks (a node's data port
    bound to port 0, an outgoing connection's source port) is this one, and a
    client that connects before ``CappedSite.start`` is refused at once, not
    queued.
    BindError (closing what it bound) when the port is taken or the host
    does not resolve. Like asyncio's ``create_server``: SO_REUSEADDR, IPv6
    sockets IPv6-only, and an address family this host lacks (IPv6 turned
    off) skipped."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise BindError(exc.errno, f"cannot resolve HTTP host {host!r}: {exc.strerror}") from None
    addresses = list(dict.fromkeys((family, sockaddr) for family, _, _, _, sockaddr in infos))
    socks: list[socket.socket] = []
    try:
        for family, sockaddr in addresses:
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue                       # a family this host lacks (IPv6 off), as asyncio skips it
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:
                sockaddr = (sockaddr[0], socks[0].getsockname()[1], *sockaddr[2:])
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise BindError(exc.errno, f"cannot bind HTTP port {sockaddr[1]} on {sockaddr[0]}: "
                                         f"{exc.strerror}") from None
            sock.setblocking(False)
        if not socks:
            raise BindError(errno.EAFNOSUPPORT, f"cannot bind HTTP port {port} on {host!r}: none of its "
                                                "address families works here")
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


class CappedSite(web.BaseSite):
    """A TCP site serving at most ``max_connections`` connections at once, on
    sockets from ``reserve_port`` (``start`` makes them listen).

    Like ``web.TCPSite``, but its protocol factory counts the runner's open
    connections first: at the cap, a new one gets ``RefusedConnection``
    instead of a request handler. ``refused`` counts them (for /metrics)."""

    def __init__(self, runner: web.BaseRunner, sockets: list[socket.socket], *, max_connections: int,
                 backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        if not sockets:
            raise ValueError("CappedSite needs at least one socket")
        self.sockets = sockets
        self.max_connections = max_connections
        self.refused = 0
        self._answer = _refusal(max_connections)
        self._servers: list[asyncio.AbstractServer] = []

    @property
    def name(self) -> str:
        return f"http://{self.sockets[0].getsockname()[0]}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (the same on every socket)."""
        return self.sockets[0].getsockname()[1]

    @property
    def open_connections(self) -> int:
        return len(self._runner.server.connections)

    async def start(self) -> None:
        await super().start()                 # registers the site with its runner
        server = self._runner.server

        def accept() -> asyncio.BaseProtocol:
            if len(server.connections) >= self.max_connections:
                self.refused += 1
                return RefusedConnection(self._answer)
            return server()
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            self._servers.append(await loop.create_server(accept, sock=sock, backlog=self._backlog))
        self._server = self._servers[0]

    async def stop(self) -> None:
        for server in self._servers[1:]:
            server.close()
        await super().stop()                  # closes the first and unregisters the site
