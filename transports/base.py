"""The transport interface: messages between a Listener (server) and Connections.

Every transport moves the same thing: a *message* = one header (JSON bytes,
opaque to the transport) plus zero or more raw frames. The wire protocol
(`kvd.protocol`) gives the header its meaning; a transport only delivers it.

Shape (ZeroMQ ROUTER/DEALER semantics on every transport)::

    Connection (DEALER) ──send/request──▶ Listener (ROUTER)
       │  ▲                                  │ recv() -> Incoming(peer=...)
       │  └──────── reply / send(peer) ──────┘
       └─ recv(): messages the listener pushed with send(peer, ...)

A request carries a correlation id chosen by the connection; the listener's
`reply(incoming, ...)` sends it back and the connection resolves the waiting
future. Every request ends in exactly one of: a reply, a `TransportError`
(peer gone, closed, refused), or `RequestTimeout`. Nothing waits forever:
sends and requests have deadlines from `TransportOptions`.

On the wire (zmq, ucx) each message is framed as::

    [envelope(10 B), header, frame0, frame1, ...]
    envelope = struct "<BBQ": magic 0xKD, kind (MSG|REQUEST|REPLY), correlation id

A peer that sends a malformed envelope is counted in `stats.malformed` and
dropped; the listener keeps serving.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import itertools
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

# Frame: anything with the buffer protocol, or a CPU torch tensor (sent as its
# raw bytes; see `as_buffer`). Receivers always get memoryview-like buffers.
Frame = Any
PeerId = bytes

ENVELOPE = struct.Struct("<BBQ")
ENVELOPE_MAGIC = 0xD7
KIND_MSG, KIND_REQUEST, KIND_REPLY = 0, 1, 2
_KINDS = (KIND_MSG, KIND_REQUEST, KIND_REPLY)


UCX_PROGRESS_MODES = ("blocking", "thread", "polling", "thread-polling")


class TransportError(Exception):
    """Base of everything a transport raises for a failed exchange."""


class TransportClosed(TransportError):
    """This endpoint was closed (locally) while the operation was pending."""


class PeerGone(TransportError):
    """The remote peer is unknown, disconnected or refused the connection."""


class AuthenticationFailed(PeerGone):
    """The CURVE handshake failed (wrong or missing key)."""


class RequestTimeout(TransportError, TimeoutError):
    """A request or send did not complete before its deadline."""


@dataclass(frozen=True, slots=True)
class TransportOptions:
    """Knobs shared by all transports; defaults are documented in etc/kvd.toml.

    send_timeout: seconds a send may wait for queue space / a connected peer.
    request_timeout: default seconds `Connection.request` waits for a reply.
    max_frame_bytes: largest frame a listener accepts (zmq: MAXMSGSIZE; a
        peer sending more is disconnected by libzmq).
    queue_depth: messages buffered per peer before send waits (zmq HWM,
        inproc queue size).
    ucx_progress_mode: how ucxx drives UCX ("blocking": the event loop
        wakes on the worker's fd; "thread": a progress thread polls, which
        takes a core; also "polling", "thread-polling"). UCX is set up once
        per process, so the first ucx listener or connection decides; the
        environment variable UCXPY_PROGRESS_MODE, if set, wins.
    """

    send_timeout: float = 30.0
    request_timeout: float = 30.0
    max_frame_bytes: int = 1 << 30
    queue_depth: int = 1000
    ucx_progress_mode: str = "blocking"

    def __post_init__(self) -> None:
        if not self.send_timeout > 0 or not self.request_timeout > 0:
            raise ValueError("timeouts must be > 0")
        if self.max_frame_bytes <= 0 or self.queue_depth <= 0:
            raise ValueError("max_frame_bytes and queue_depth must be > 0")
        if self.ucx_progress_mode not in UCX_PROGRESS_MODES:
            raise ValueError(f"ucx_progress_mode must be one of {UCX_PROGRESS_MODES}, "
                             f"got {self.ucx_progress_mode!r}")


@dataclass(slots=True)
class TransportStats:
    """Counters a daemon exports as metrics. Mutated by the transport only."""

    received: int = 0
    sent: int = 0
    malformed: int = 0      # envelope/framing errors from peers (dropped)
    refused: int = 0        # peers that failed authentication (listener; nothing delivered)
    late_replies: int = 0   # replies whose request had already timed out


@dataclass(frozen=True, slots=True)
class Incoming:
    """One received message.

    peer: opaque id of the sender's link (listener side; b"" on a connection).
    header: the JSON header bytes, undecoded.
    frames: the raw frames, as buffers the caller may keep (no copy made).
    request_id: non-zero when the sender awaits `Listener.reply`.
    identity: who sent it, as the listener authenticated it: the name its
        key set gives the sender's key (zmq CURVE, the ucx handshake; see
        transports/keys.py), or the name an in-process caller connected as
        (inproc). None: the link is not authenticated (no keys configured).
    """

    peer: PeerId
    header: bytes
    frames: list[Any]
    request_id: int = 0
    identity: str | None = None

    def header_dict(self) -> Any:
        return orjson.loads(self.header)


def encode_header(header: bytes | Mapping[str, Any]) -> bytes:
    if isinstance(header, (bytes, bytearray, memoryview)):
        return bytes(header)
    return orjson.dumps(header)


@functools.cache
def _numpy_dtypes(torch: Any) -> frozenset:
    """The torch dtypes numpy views as they are (bfloat16 and the float8s it has not)."""
    return frozenset((torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                      torch.int8, torch.uint8, torch.bool))


def as_buffer(frame: Frame) -> memoryview:
    """A flat byte view of `frame` without copying where possible.

    torch tensors: detached; a non-contiguous tensor is copied to a contiguous
    one (the only copy); tensors off the CPU are refused (move them first —
    a hidden device sync would hide in the hot path).
    """
    if isinstance(frame, memoryview):
        return frame if (frame.format == "B" and frame.ndim == 1) else frame.cast("B")
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(frame, torch.Tensor):
        if not frame.is_cpu:
            raise ValueError(f"tensor frames must be on the CPU, got {frame.device}")
        t = frame.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype in _numpy_dtypes(torch):        # numpy's own view: a third of the ops below (a hot path)
            return memoryview(t.numpy().reshape(-1)).cast("B")
        # uint8 reinterpretation works for every dtype (bf16 has no numpy twin).
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    view = memoryview(frame)
    return view if (view.format == "B" and view.ndim == 1) else view.cast("B")


def pack_envelope(kind: int, request_id: int) -> bytes:
    return ENVELOPE.pack(ENVELOPE_MAGIC, kind, request_id)


def unpack_envelope(raw: Any) -> tuple[int, int] | None:
    """(kind, request_id), or None when `raw` is not a valid envelope."""
    try:
        magic, kind, request_id = ENVELOPE.unpack(raw)
    except (struct.error, TypeError):
        return None
    if magic != ENVELOPE_MAGIC or kind not in _KINDS:
        return None
    if kind != KIND_MSG and request_id == 0:
        return None
    return kind, request_id


class Listener(abc.ABC):
    """Server side: accepts messages from many peers, replies to one peer.

    `recv` raises TransportClosed once the listener is closed. `send` raises
    PeerGone for an unknown or disconnected peer, RequestTimeout when the
    peer's queue stays full past `send_timeout`.
    """

    url: str  # the bound address (port 0 resolved)
    stats: TransportStats
    # True when every Incoming carries the sender's authenticated identity
    # (keys configured on zmq/ucx); inproc and keyless listeners: False.
    authenticated: bool = False

    @abc.abstractmethod
    async def recv(self) -> Incoming: ...

    @abc.abstractmethod
    async def send(self, peer: PeerId, header: bytes | Mapping[str, Any],
                   frames: Sequence[Frame] = (), *, request_id: int = 0) -> None:
        """Push a message to `peer` (request_id non-zero: a reply)."""

    async def reply(self, incoming: Incoming, header: bytes | Mapping[str, Any],
                    frames: Sequence[Frame] = ()) -> None:
        """Answer `incoming` (a request); a one-way message is answered one-way."""
        await self.send(incoming.peer, header, frames, request_id=incoming.request_id)

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting; pending `recv` calls raise TransportClosed. Idempotent."""

    async def __aenter__(self) -> "Listener":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Connection(abc.ABC):
    """Client side: one logical link to a listener.

    Subclasses implement `_send_raw` and `close`, and feed received messages
    to `_deliver`; the request/reply bookkeeping lives here, once.

    Messages the listener pushes (not replies) wait in an unbounded inbox
    until `recv` takes them: a client that expects pushes must keep reading.
    """

    url: str
    stats: TransportStats
    options: TransportOptions

    def __init__(self, url: str, options: TransportOptions) -> None:
        self.url = url
        self.options = options
        self.stats = TransportStats()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Incoming]] = {}
        self._inbox: asyncio.Queue[Incoming | TransportError] = asyncio.Queue()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @abc.abstractmethod
    async def _send_raw(self, kind: int, request_id: int, header: bytes,
                        frames: list[memoryview]) -> None:
        """Hand one message to the wire (may wait for space or a peer)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the link; pending requests fail with TransportClosed. Idempotent."""

    async def send(self, header: bytes | Mapping[str, Any], frames: Sequence[Frame] = ()) -> None:
        """One-way message. Raises RequestTimeout past `send_timeout`."""
        await self._send(KIND_MSG, 0, header, frames, self.options.send_timeout)

    async def request(self, header: bytes | Mapping[str, Any], frames: Sequence[Frame] = (),
                      *, timeout: float | None = None) -> Incoming:
        """Send and wait for the matching reply, at most `timeout` seconds.

        Ends in the reply, RequestTimeout, or a TransportError (PeerGone when
        the link drops, TransportClosed when this side closes).
        """
        timeout = self.options.request_timeout if timeout is None else timeout
        if self._closed:
            raise TransportClosed(self.url)
        request_id = next(self._ids)
        reply: asyncio.Future[Incoming] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = reply
        # The send runs as a child task so that a link failure reported while
        # it still waits for a peer (disconnect, failed CURVE handshake) ends
        # the request at once instead of at its deadline.
        sending = asyncio.create_task(self._send(KIND_REQUEST, request_id, header, frames, None))
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait((sending, reply), return_when=asyncio.FIRST_COMPLETED)
                if sending.done() and not reply.done():
                    sending.result()  # a failed send ends the request with its error
                return await reply
        except TimeoutError:
            raise RequestTimeout(f"no reply from {self.url} within {timeout:.3g}s") from None
        finally:
            self._pending.pop(request_id, None)
            if not sending.done():
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
            elif not sending.cancelled():
                sending.exception()  # retrieved: the outcome is already decided
            if reply.done() and not reply.cancelled():
                reply.exception()

    async def recv(self) -> Incoming:
        """Next message pushed by the listener (not a reply). Raises TransportClosed."""
        if self._closed and self._inbox.empty():
            raise TransportClosed(self.url)
        item = await self._inbox.get()
        if isinstance(item, TransportError):
            self._inbox.put_nowait(item)  # stays terminal for later callers
            raise item
        return item

    async def _send(self, kind: int, request_id: int, header: bytes | Mapping[str, Any],
                    frames: Sequence[Frame], timeout: float | None) -> None:
        if self._closed:
            raise TransportClosed(self.url)
        raw = encode_header(header)
        bufs = [as_buffer(f) for f in frames]
        try:
            async with asyncio.timeout(timeout):
                await self._send_raw(kind, request_id, raw, bufs)
        except TimeoutError:
            if timeout is None:
                raise  # the caller's deadline, not ours
            raise RequestTimeout(f"send to {self.url} blocked for {timeout:.3g}s") from None
        self.stats.sent += 1

    def _deliver(self, kind: int, request_id: int, header: bytes, frames: list[Any]) -> None:
        """Route one received message: a reply to its future, else to the inbox."""
        self.stats.received += 1
        message = Incoming(b"", header, frames, request_id if kind == KIND_REQUEST else 0)
        if kind == KIND_REPLY:
            future = self._pending.get(request_id)
            if future is None or future.done():
                self.stats.late_replies += 1
            else:
                future.set_result(message)
            return
        self._inbox.put_nowait(message)

    def _fail_pending(self, error: TransportError) -> None:
        """Fail every waiting request with `error` (link lost or closed)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    def _shutdown(self, error: TransportError) -> None:
        """Mark closed, fail waiters, and wake `recv` callers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fail_pending(error)
        self._inbox.put_nowait(error)

    async def __aenter__(self) -> "Connection":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
