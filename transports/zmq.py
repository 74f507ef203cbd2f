"""ZeroMQ transport: ROUTER listener, DEALER connections, pyzmq asyncio.

Addresses: `zmq+tcp://host:port` (port 0 picks a free one; `Listener.url`
holds the bound port) and `zmq+ipc:///path`.

Large frames travel zero-copy: we send with `copy=False` (pyzmq still copies
frames under its 64 KiB copy threshold, where copying is cheaper than the
bookkeeping) and receive with `copy=False`, so a received frame is a
read-only memoryview over libzmq's own message buffer.

CURVE (optional; kvd's daemons require it unless run insecure, see
kvd/links.py): the listener holds a secret key and a key set naming the
allowed client public keys (transports/keys.py), checked by a ZAP handler
(`zmq.auth.asyncio.AsyncioAuthenticator`) on the listener's own context; a
client holds its keypair and the server's public key. A peer whose key is
wrong or unknown never completes the handshake, so nothing it sends reaches
`Listener.recv`; every message that does carries the name of its sender's
key (`Incoming.identity`, from the connection's ZAP User-Id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from .base import (
    KIND_REPLY,
    AuthenticationFailed,
    Connection,
    Frame,
    Incoming,
    Listener,
    PeerGone,
    PeerId,
    RequestTimeout,
    TransportClosed,
    TransportOptions,
    TransportStats,
    as_buffer,
    encode_header,
    pack_envelope,
    unpack_envelope,
)
from .keys import (  # noqa: F401 -- re-exported: the key API lived here first
    CurveClient,
    CurveServer,
    as_key_set,
    generate_keypair,
    load_keypair,
    load_public_keys,
)

# ─── CURVE ───────────────────────────────────────────────────────────────────


class _NamingAuthenticator(AsyncioAuthenticator):
    """The ZAP handler of one listener: accepts exactly the client keys its
    key set names, and hands libzmq that name as the connection's User-Id,
    which every message from the client then carries (`Frame.get`)."""

    def __init__(self, ctx: zmq.asyncio.Context, curve: CurveServer, stats: TransportStats) -> None:
        super().__init__(ctx)
        self._keys = as_key_set(curve.allowed_clients)
        self._stats = stats

    def callback(self, domain: str, key: bytes) -> bool:
        if self._keys.name_of(key) is not None:
            return True
        self._stats.refused += 1
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._keys.name_of(z85.encode(client_public_key)) or ""


# ─── addresses ───────────────────────────────────────────────────────────────


def zmq_endpoint(url: str) -> str:
    """`zmq+tcp://h:p` -> `tcp://h:p`; `zmq+ipc:///p` -> `ipc:///p`."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("zmq+tcp", "zmq+ipc"):
        raise ValueError(f"not a zmq url: {url!r}")
    if scheme == "zmq+tcp" and rest.endswith(":0"):
        rest = rest[:-2] + ":*"  # libzmq's spelling of "any free port"
    return f"{scheme[4:]}://{rest}"


def _frame_buffers(parts: list[zmq.Frame]) -> list[memoryview]:
    return [p.buffer for p in parts]


def _apply_options(sock: zmq.Socket, options: TransportOptions) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, options.queue_depth)
    sock.setsockopt(zmq.RCVHWM, options.queue_depth)


# ─── listener ────────────────────────────────────────────────────────────────


BLOCKED_RETRY_MIN_S = 0.001    # a full peer is retried after this, doubling ...
BLOCKED_RETRY_MAX_S = 0.02     # ... up to this: how late a send may notice the peer's room


class _BlockedPeer:
    """The sends waiting for one peer's room: the first retries, the rest wait their turn."""

    __slots__ = ("turn", "waiters")

    def __init__(self) -> None:
        self.turn = asyncio.Lock()        # FIFO: sends leave in the order they began waiting
        self.waiters = 0


class ZmqListener(Listener):
    """A bound ROUTER socket. Owns its context (and ZAP authenticator, if any)."""

    def __init__(self, url: str, options: TransportOptions, curve: CurveServer | None) -> None:
        self.options = options
        self.stats = TransportStats()
        self._blocked: dict[PeerId, _BlockedPeer] = {}   # peers whose queue is full, while sends wait
        self._ctx = zmq.asyncio.Context()
        self._auth: AsyncioAuthenticator | None = None
        self._closed = False
        sock = self._ctx.socket(zmq.ROUTER)
        _apply_options(sock, options)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> EHOSTUNREACH, not silent drop
        sock.setsockopt(zmq.MAXMSGSIZE, options.max_frame_bytes)
        if curve is not None:
            # The ZAP handler must run before bind so no handshake slips past it.
            self._auth = _NamingAuthenticator(self._ctx, curve, self.stats)
            self._auth.start()
            self._auth.configure_curve_callback("*", self._auth)
            self.authenticated = True
            sock.curve_server = True
            sock.curve_publickey = curve.public_key
            sock.curve_secretkey = curve.secret_key
        try:
            sock.bind(zmq_endpoint(url))
        except zmq.ZMQError:
            sock.close(0)
            self._teardown_context()
            raise
        self._sock = sock
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.url = "zmq+" + bound

    async def recv(self) -> Incoming:
        while True:
            if self._closed:
                raise TransportClosed(self.url)
            try:
                parts = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                raise TransportClosed(self.url) if self._closed else PeerGone(str(e)) from e
            except asyncio.CancelledError:
                # pyzmq cancels a pending recv when close() closes the socket;
                # only a cancellation of *our* task is passed on as one.
                task = asyncio.current_task()
                if self._closed and task is not None and not task.cancelling():
                    raise TransportClosed(self.url) from None
                raise
            # parts: [peer identity, envelope, header, frame...]
            env = unpack_envelope(parts[1].buffer) if len(parts) >= 3 else None
            if env is None or env[0] == KIND_REPLY:
                self.stats.malformed += 1
                continue
            self.stats.received += 1
            # CURVE: the name our ZAP handler gave the client's key, on every message
            identity = parts[1].get("User-Id") if self.authenticated else None
            return Incoming(parts[0].bytes, parts[2].bytes, _frame_buffers(parts[3:]), env[1], identity)

    async def send(self, peer: PeerId, header: bytes | Mapping[str, Any],
                   frames: Sequence[Frame] = (), *, request_id: int = 0) -> None:
        """Push one message to ``peer``. A peer that reads slower than we send
        (its queue at the high-water mark: a stalled process) makes this wait,
        up to ``send_timeout`` (RequestTimeout), never fail at once; messages
        to one peer leave in the order their sends began."""
        if self._closed:
            raise TransportClosed(self.url)
        kind = KIND_REPLY if request_id else 0
        parts = [peer, pack_envelope(kind, request_id), encode_header(header),
                 *(as_buffer(f) for f in frames)]
        try:
            async with asyncio.timeout(self.options.send_timeout):
                await self._send_in_turn(peer, parts)
        except TimeoutError:
            raise RequestTimeout(f"send to peer {peer.hex()} blocked for "
                                 f"{self.options.send_timeout:.3g}s (it does not read)") from None
        except zmq.ZMQError as e:
            if self._closed:
                raise TransportClosed(self.url) from None
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerGone(f"peer {peer.hex()} is not connected to {self.url}") from None
            raise PeerGone(str(e)) from e
        self.stats.sent += 1

    async def _send_in_turn(self, peer: PeerId, parts: list) -> None:
        """Hand ``parts`` to libzmq, waiting while ``peer``'s queue is full.

        A ROUTER cannot wait for one peer's room: with ROUTER_MANDATORY a full
        peer answers EAGAIN, and the socket's POLLOUT means "some peer has
        room" (pyzmq's awaitable send fails with EAGAIN as soon as any other
        peer can take a message). So a sender that meets a full peer retries
        with a backoff (at most BLOCKED_RETRY_MAX_S late), and while one does,
        the other sends to that peer queue behind it (a FIFO lock): one task
        polls per blocked peer, and the order of the sends is kept."""
        blocked = self._blocked.get(peer)
        if blocked is None:
            try:
                await self._sock.send_multipart(parts, flags=zmq.DONTWAIT, copy=False)
                return
            except zmq.Again:
                blocked = self._blocked[peer] = _BlockedPeer()
        blocked.waiters += 1
        try:
            async with blocked.turn:
                delay = BLOCKED_RETRY_MIN_S
                while True:
                    try:
                        await self._sock.send_multipart(parts, flags=zmq.DONTWAIT, copy=False)
                        return
                    except zmq.Again:
                        await asyncio.sleep(delay)
                        delay = min(2 * delay, BLOCKED_RETRY_MAX_S)
        finally:
            blocked.waiters -= 1
            if not blocked.waiters and self._blocked.get(peer) is blocked:
                del self._blocked[peer]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        self._teardown_context()

    def _teardown_context(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)


# ─── connection ──────────────────────────────────────────────────────────────

_AUTH_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
}


class ZmqConnection(Connection):
    """A DEALER socket plus two owned tasks: the reader and the link monitor.

    The monitor turns libzmq's connection events into request outcomes: a
    disconnect fails every pending request with PeerGone at once (the request
    may be lost) instead of leaving it to its timeout; a failed CURVE
    handshake fails them with AuthenticationFailed. libzmq keeps reconnecting
    in the background, so a restarted listener is picked up again.
    """

    def __init__(self, url: str, options: TransportOptions, curve: CurveClient | None) -> None:
        super().__init__(url, options)
        self.last_error: Exception | None = None
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        _apply_options(sock, options)
        # IMMEDIATE: queue only to completed connections, so a send to a
        # listener that is not there waits (and times out) instead of
        # disappearing into a buffer.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if curve is not None:
            sock.curve_publickey = curve.public_key
            sock.curve_secretkey = curve.secret_key
            sock.curve_serverkey = curve.server_key
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        sock.connect(zmq_endpoint(url))
        self._sock = sock
        self._tasks = [asyncio.create_task(self._read_loop(), name=f"zmq-read {url}"),
                       asyncio.create_task(self._monitor_loop(), name=f"zmq-monitor {url}")]

    async def _send_raw(self, kind: int, request_id: int, header: bytes,
                        frames: list[memoryview]) -> None:
        try:
            await self._sock.send_multipart([pack_envelope(kind, request_id), header, *frames],
                                            copy=False)
        except zmq.ZMQError as e:
            raise TransportClosed(self.url) if self._closed else PeerGone(str(e)) from e

    async def _read_loop(self) -> None:
        while True:
            try:
                parts = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                return  # socket closed under us: close() handles the rest
            env = unpack_envelope(parts[0].buffer) if len(parts) >= 2 else None
            if env is None:
                self.stats.malformed += 1
                continue
            self._deliver(env[0], env[1], parts[1].bytes, _frame_buffers(parts[2:]))

    async def _monitor_loop(self) -> None:
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())
            except zmq.ZMQError:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.last_error = None
            elif kind in _AUTH_FAILURES:
                self.last_error = AuthenticationFailed(f"CURVE handshake with {self.url} failed")
                self._fail_pending(self.last_error)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._fail_pending(PeerGone(f"{self.url} disconnected"))

    async def close(self) -> None:
        if self._closed:
            return
        self._shutdown(TransportClosed(self.url))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.destroy(linger=0)


async def listen(url: str, *, options: TransportOptions, curve: CurveServer | None = None) -> ZmqListener:
    return ZmqListener(url, options, curve)


async def connect(url: str, *, options: TransportOptions, curve: CurveClient | None = None) -> ZmqConnection:
    return ZmqConnection(url, options, curve)


__all__ = ["CurveServer", "CurveClient", "generate_keypair", "load_keypair", "load_public_keys",
           "ZmqListener", "ZmqConnection", "listen", "connect"]
