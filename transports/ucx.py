"""UCX transport (`ucx://host:port`) over the `ucxx` package, an optional extra.

`pip install 'kvd[ucx]'` (ucxx-cu12) brings UCX; on a CPU machine it runs over
TCP, on a cluster over RDMA/NVLink. ucxx is imported lazily, on first use, so
the rest of kvd never pays for (or needs) it.

A UCX endpoint is a point-to-point link, so ROUTER semantics are built here:
the listener gives each accepted endpoint a peer id and one reader task, and
`send(peer, ...)` picks that endpoint. One message is one `send_multi` of
`[envelope, header, frame...]`; ucxx receives each buffer into a fresh,
writable numpy array (no further copy). Sends on one endpoint are serialized
by a lock so two messages never interleave.

Authentication (with keys; kvd's daemons require them unless run insecure):
each new endpoint runs the handshake of `transports.ucx_auth` before the
listener reads a single message from it; a peer that fails it is dropped
(`stats.refused`) and every message of one that passes carries its key's
name (`Incoming.identity`). ucxx listens on every interface (it takes no
bind address): the host in the URL is what peers are told.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from . import ucx_auth
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
    TransportError,
    TransportOptions,
    TransportStats,
    as_buffer,
    encode_header,
    pack_envelope,
    unpack_envelope,
)
from .keys import CurveClient, CurveServer


def _import_ucxx(progress_mode: str) -> Any:
    """ucxx, set up for this process on first use with ``progress_mode``
    (unless UCXPY_PROGRESS_MODE is set: ucxx reads it, and it wins).

    Why "blocking" is the default: ucxx's own default, "thread", runs a
    progress thread that polls. On a node whose cores run the engine, or
    on a small host, that thread takes a core from everything else, and plain UCX
    bytes move several times slower than in blocking mode (docs/benchmarks.md,
    design measurements; tools/bench/transfer/bench_kv_transfer.py).
    """
    try:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx  # noqa: PLC0415 -- optional extra, imported on first use
    except ImportError as e:
        raise ImportError(
            "the ucx:// transport needs the optional 'ucxx' package: "
            "pip install 'kvd[ucx]' (or ucxx-cu12)") from e
    with _INIT_LOCK:
        if not _INITIALIZED:
            try:
                ucxx.init(progress_mode=None if "UCXPY_PROGRESS_MODE" in os.environ else progress_mode)
            except RuntimeError:
                pass            # set up already (by ucxx itself or by an embedding program)
            _INITIALIZED.append(progress_mode)
    return ucxx


_INIT_LOCK = threading.Lock()
_INITIALIZED: list[str] = []


def _host_port(url: str) -> tuple[str, int]:
    scheme, sep, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "ucx" or not sep or not host or not port.isdigit():
        raise ValueError(f"not a ucx url (ucx://host:port): {url!r}")
    return host, int(port)


async def _recv_message(ep: Any) -> tuple[int, int, bytes, list[Any]] | None:
    """One message from `ep`: (kind, request_id, header, frames), None if malformed."""
    parts = await ep.recv_multi()
    env = unpack_envelope(memoryview(parts[0]).cast("B")) if len(parts) >= 2 else None
    if env is None:
        return None
    return env[0], env[1], bytes(parts[1]), [memoryview(p).cast("B") for p in parts[2:]]


async def _send_message(ep: Any, lock: asyncio.Lock, kind: int, request_id: int,
                        header: bytes, frames: list[memoryview]) -> None:
    async with lock:
        await ep.send_multi([pack_envelope(kind, request_id), header, *frames])


class _Link:
    """One accepted endpoint on the listener side."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.lock = asyncio.Lock()
        self.finished = asyncio.Event()  # its reader (the accept callback) returned


class UcxListener(Listener):
    def __init__(self, host: str, port: int, options: TransportOptions,
                 keys: CurveServer | None = None) -> None:
        self.options = options
        self.stats = TransportStats()
        self._keys = keys
        self.authenticated = keys is not None
        self._ucxx = _import_ucxx(options.ucx_progress_mode)
        self._inbox: asyncio.Queue[Incoming | None] = asyncio.Queue(options.queue_depth)
        self._links: dict[PeerId, _Link] = {}
        self._peer_ids = itertools.count(1)
        self._closed = False
        self._listener = self._ucxx.create_listener(self._on_endpoint, port=port or None)
        self.url = f"ucx://{host}:{self._listener.port}"

    async def _on_endpoint(self, ep: Any) -> None:
        # ucxx keeps the endpoint alive while this callback runs, so the
        # callback *is* the per-peer reader; it ends when the peer goes.
        identity = None
        if self._keys is not None:
            try:
                async with asyncio.timeout(self.options.send_timeout):
                    identity = await ucx_auth.accept(ep, self._keys)
            except Exception:  # noqa: BLE001 -- failed, timed out or broken: this peer is refused
                self.stats.refused += 1
                ep.abort()
                return
        peer = next(self._peer_ids).to_bytes(8, "little")
        link = _Link(ep)
        self._links[peer] = link
        try:
            while not self._closed:
                try:
                    message = await _recv_message(ep)
                except Exception:  # noqa: BLE001 -- any UCX error ends this peer only
                    return
                if message is None:
                    self.stats.malformed += 1
                    continue
                kind, request_id, header, frames = message
                if kind == KIND_REPLY:
                    self.stats.malformed += 1
                    continue
                await self._inbox.put(Incoming(peer, header, frames, request_id, identity))
        finally:
            self._links.pop(peer, None)
            link.finished.set()

    async def recv(self) -> Incoming:
        if self._closed:
            raise TransportClosed(self.url)
        message = await self._inbox.get()
        if message is None:
            self._inbox.put_nowait(None)
            raise TransportClosed(self.url)
        self.stats.received += 1
        return message

    async def send(self, peer: PeerId, header: bytes | Mapping[str, Any],
                   frames: Sequence[Frame] = (), *, request_id: int = 0) -> None:
        if self._closed:
            raise TransportClosed(self.url)
        link = self._links.get(peer)
        if link is None or link.ep.closed:
            raise PeerGone(f"peer {peer.hex()} is not connected to {self.url}")
        kind = KIND_REPLY if request_id else 0
        try:
            async with asyncio.timeout(self.options.send_timeout):
                await _send_message(link.ep, link.lock, kind, request_id, encode_header(header),
                                    [as_buffer(f) for f in frames])
        except TimeoutError:
            raise RequestTimeout(f"send to peer {peer.hex()} blocked") from None
        except self._ucxx.exceptions.UCXError as e:
            raise PeerGone(str(e)) from e
        self.stats.sent += 1

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        links = list(self._links.values())
        for link in links:
            link.ep.abort()
        # Let the per-peer readers see their aborted endpoints and return
        # before the UCX listener goes (ucxx warns about live handlers).
        waits = [asyncio.ensure_future(link.finished.wait()) for link in links]
        if waits:
            done, pending = await asyncio.wait(waits, timeout=1.0)
            for w in pending:
                w.cancel()
        self._listener.close()
        self._links.clear()
        while not self._inbox.empty():
            self._inbox.get_nowait()
        self._inbox.put_nowait(None)


class UcxConnection(Connection):
    def __init__(self, url: str, ep: Any, ucxx: Any, options: TransportOptions) -> None:
        super().__init__(url, options)
        self._ep = ep
        self._ucxx = ucxx
        self._lock = asyncio.Lock()
        self._reader = asyncio.create_task(self._read_loop(), name=f"ucx-read {url}")

    async def _send_raw(self, kind: int, request_id: int, header: bytes,
                        frames: list[memoryview]) -> None:
        try:
            await _send_message(self._ep, self._lock, kind, request_id, header, frames)
        except self._ucxx.exceptions.UCXError as e:
            raise PeerGone(str(e)) from e

    async def _read_loop(self) -> None:
        error: TransportError = PeerGone(f"{self.url} disconnected")
        try:
            while True:
                message = await _recv_message(self._ep)
                if message is None:
                    self.stats.malformed += 1
                    continue
                self._deliver(*message)
        except asyncio.CancelledError:
            error = TransportClosed(self.url)
            raise
        except Exception:  # noqa: BLE001 -- the link is gone; waiters learn why below
            pass
        finally:
            # UCX links do not reconnect: a lost peer ends this connection.
            self._shutdown(error)

    async def close(self) -> None:
        if self._closed:
            return
        self._shutdown(TransportClosed(self.url))
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._ep.abort()


async def listen(url: str, *, options: TransportOptions, keys: CurveServer | None = None) -> UcxListener:
    """Listen at ``url``; with ``keys``, every peer must pass the handshake first."""
    host, port = _host_port(url)
    if keys is not None:
        ucx_auth.link_key(keys.secret_key, keys.public_key)   # fail now on a bad key or no X25519
    return UcxListener(host, port, options, keys)


async def connect(url: str, *, options: TransportOptions, keys: CurveClient | None = None) -> UcxConnection:
    """Connect to ``url``; with ``keys``, authenticate both ends before returning
    (AuthenticationFailed: the listener refused our key or did not prove its own)."""
    host, port = _host_port(url)
    ucxx = _import_ucxx(options.ucx_progress_mode)
    try:
        async with asyncio.timeout(options.send_timeout):
            ep = await ucxx.create_endpoint(host, port)
    except TimeoutError:
        raise RequestTimeout(f"connecting to {url} timed out") from None
    except ucxx.exceptions.UCXError as e:
        raise PeerGone(f"cannot connect to {url}: {e}") from e
    if keys is not None:
        try:
            async with asyncio.timeout(options.send_timeout):
                await ucx_auth.authenticate(ep, keys)
        except AuthenticationFailed as e:
            ep.abort()
            raise AuthenticationFailed(f"ucx handshake with {url} failed: {e}") from None
        except (TimeoutError, ucxx.exceptions.UCXError) as e:
            ep.abort()
            raise AuthenticationFailed(f"ucx handshake with {url} failed ({type(e).__name__}: "
                                       f"is our key authorized there?)") from None
    return UcxConnection(url, ep, ucxx, options)
