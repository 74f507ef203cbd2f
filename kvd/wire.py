"""The kvd wire format: typed messages as a JSON header plus raw tensor frames.

A message on the wire (vLLM v1 serial_utils style — nothing is ever pickled)::

    header (orjson) = {"type": "KVData", "v": 2, "id": "t-17", "deadline": 1.7e9,
                       ...the message's own fields...,
                       "frames": [{"dtype": "bfloat16", "shape": [2, 16, 64]}, ...]}
    frames          = [raw bytes of tensor 0, raw bytes of tensor 1, ...]

Each message type is a frozen dataclass registered by its class name. Fields
are checked against their annotations (and each class's `_check` for ranges)
when a message is built, so a message that exists is valid; `decode` builds
messages the same way and turns *every* problem — bad JSON, unknown type,
wrong version, oversized header or frames, a frame whose size disagrees with
its (dtype, shape) — into a `ProtocolError` value with a `reason` code for
metrics. `decode` never raises: a daemon loop counts the error and goes on.

The message classes themselves are kvd/protocol.py's (which re-exports
this module: callers name both ``protocol.X``).

This module imports no torch: tensors travel as `RawTensor` (dtype name,
shape, buffer) and become torch views, without a copy, in `RawTensor.to_torch`.
"""

from __future__ import annotations

import collections
import logging
import math
import time
import types
import typing
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import orjson

from engine.request import SamplingParams, TokenLogprobs
from kvd.ratelog import LOG_EVERY_S, RateLimitedLog
from transports.base import Connection, Incoming, Listener, TransportClosed, TransportError, as_buffer

log = logging.getLogger(__name__)
# RawTensor.to_torch views read-only zmq frames on purpose (see its docstring).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

# Raised whenever a message changes in a way the other side of an older build cannot read
# (2: TokenChunk.text_ends; 3: Heartbeat.incarnation and lost, replica tickets and keys,
# GenerateRequest.kv_to_incarnation; 4: the legs of a request are their own messages,
# GenerateRequest | DecodeLeg | PrefillLeg | ResumeRequest; 5: TokenChunk.logprobs and
# prompt_logprobs; 6: Hello.fingerprint): a node of another build is then refused at its
# Hello (`bad_version`), not message by message.
PROTOCOL_VERSION = 6

# Allow-list of tensor dtypes (name -> bytes per element). Names are torch's.
DTYPES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}

# Reason codes a ProtocolError may carry (the label set of a metrics counter).
REASONS = frozenset({
    "header_too_large", "bad_json", "not_object", "bad_version", "unknown_type",
    "missing_field", "unknown_field", "invalid_field", "too_many_frames",
    "frame_mismatch", "bad_frame", "bad_dtype", "bad_shape", "frame_too_large",
    "size_mismatch", "unexpected_frames", "internal",
})
_RESERVED = ("type", "v", "frames")


@dataclass(frozen=True, slots=True)
class ProtocolLimits:
    """What `decode` accepts. A 1 MiB header holds a ~128k-token prompt as JSON
    (a 64 KiB cap would stop prompts near 10k tokens); KV travels in frames."""

    max_header_bytes: int = 1 << 20
    max_frames: int = 256
    max_frame_bytes: int = 1 << 30
    max_total_frame_bytes: int = 4 << 30
    max_ndim: int = 8

    def __post_init__(self) -> None:
        if min(self.max_header_bytes, self.max_frames, self.max_frame_bytes,
               self.max_total_frame_bytes, self.max_ndim) <= 0:
            raise ValueError("protocol limits must be > 0")


DEFAULT_LIMITS = ProtocolLimits()


@dataclass(frozen=True, slots=True)
class ProtocolError:
    """A rejected message, as a value. `type`/`id`/`request_id` are filled when
    readable (the request a refused message was about ends with an error)."""

    reason: str
    detail: str
    type: str | None = None
    id: str | None = None
    request_id: str | None = None


def dtype_name(dtype: Any) -> str:
    """A torch dtype's name on the wire: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


_WIRE_NAMES: dict[Any, str] = {}     # torch dtype -> its name on the wire: the allowed ones met so far


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A tensor as it travels: dtype name, shape, and its raw bytes (C order)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]

    @classmethod
    def from_torch(cls, tensor: Any) -> "RawTensor":
        """View a CPU tensor's bytes (copies only if it is not contiguous)."""
        name = _WIRE_NAMES.get(tensor.dtype)
        if name is None:
            name = dtype_name(tensor.dtype)
            if name not in DTYPES:
                raise ValueError(f"dtype {name} is not allowed on the wire")
            _WIRE_NAMES[tensor.dtype] = name
        return cls(name, tuple(tensor.shape), as_buffer(tensor))

    def to_torch(self) -> Any:
        """A torch tensor sharing memory with the received frame (no copy).

        Frames from zmq are read-only: do not write to the result; `.clone()`
        it to own a writable copy.
        """
        import torch  # noqa: PLC0415 -- the coordinator never calls this

        dtype = getattr(torch, self.dtype)
        count = math.prod(self.shape)
        if count == 0:
            return torch.empty(self.shape, dtype=dtype)
        # frombuffer warns on read-only buffers: filtered once, at import
        # (a catch_warnings block per frame doubled the cost of this view)
        return torch.frombuffer(self.data, dtype=dtype, count=count).view(self.shape)


# ─── field checking by annotation ────────────────────────────────────────────

Checker = Callable[[Any], Any]


def _fail(what: str, value: Any) -> typing.NoReturn:
    raise ValueError(f"expected {what}, got {type(value).__name__}")


def _check_int(v: Any) -> int:
    return v if type(v) is int else _fail("int", v)  # bool is not an int here


def _check_float(v: Any) -> float:
    if type(v) is float or type(v) is int:
        if math.isfinite(v):
            return float(v)
    return _fail("finite number", v)


def _check_str(v: Any) -> str:
    return v if type(v) is str else _fail("str", v)


def _check_bool(v: Any) -> bool:
    return v if type(v) is bool else _fail("bool", v)


def _json_value(v: Any) -> Any:
    return v  # orjson produced it, or the caller built it; orjson.dumps re-checks on encode


def _check_sampling(v: Any) -> SamplingParams:
    # the engine's own validation, so the wire refuses what the engine would
    # (InvalidParam is a ValueError: decode answers it as invalid_field)
    return v if isinstance(v, SamplingParams) else SamplingParams.from_dict(v)


_SCALARS: dict[Any, Checker] = {int: _check_int, float: _check_float, str: _check_str,
                                bool: _check_bool, Any: _json_value, SamplingParams: _check_sampling,
                                TokenLogprobs: TokenLogprobs.from_json}


_INT_ONLY = frozenset((int,))


def _checker(tp: Any) -> Checker:
    """Compile an annotation into a function that validates (and freezes) a value."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        check = _checker(inner[0]) if len(inner) == 1 else _json_value
        return lambda v: None if v is None else check(v)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        elem = _checker(args[0])
        if elem is _check_int:  # hot path: token id lists
            def check_ints(v: Any) -> tuple[int, ...]:
                # the types as a set, built in C: a bool (or anything else) shows up in it
                if isinstance(v, (list, tuple)) and set(map(type, v)) <= _INT_ONLY:
                    return tuple(v)
                return _fail("list of int", v)
            return check_ints
        def check_tuple(v: Any) -> tuple[Any, ...]:
            return tuple(elem(x) for x in v) if isinstance(v, (list, tuple)) else _fail("list", v)
        return check_tuple
    if origin is dict:
        value = _checker(args[1])
        def check_dict(v: Any) -> dict[str, Any]:
            if not isinstance(v, dict):
                _fail("object", v)
            return {_check_str(k): value(x) for k, x in v.items()}
        return check_dict
    raise TypeError(f"unsupported field annotation {tp!r}")


# ─── messages ────────────────────────────────────────────────────────────────

MESSAGE_TYPES: dict[str, type["Message"]] = {}  # filled once, at import, by @message


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of all wire messages: `id` correlates request and reply; `deadline`
    (unix seconds) tells the receiver when the sender stops caring."""

    TYPE: ClassVar[str] = ""
    FRAMES_FIELD: ClassVar[str | None] = None  # the field carrying tensor frames
    _CHECKERS: ClassVar[dict[str, Checker]] = {}
    _REQUIRED: ClassVar[frozenset[str]] = frozenset()
    _FIELDS: ClassVar[tuple[str, ...]] = ()          # every field, declaration order
    _KNOWN: ClassVar[frozenset[str]] = frozenset()   # header keys: the fields but the frames

    id: str = ""
    deadline: float | None = None

    def __post_init__(self) -> None:
        for name, check in self._CHECKERS.items():
            value = getattr(self, name)
            checked = check(value)
            if checked is not value:        # most checkers hand back what they were given
                object.__setattr__(self, name, checked)
        if self.FRAMES_FIELD is not None:
            tensors = tuple(t if isinstance(t, RawTensor) else RawTensor.from_torch(t)
                            for t in getattr(self, self.FRAMES_FIELD))
            object.__setattr__(self, self.FRAMES_FIELD, tensors)
        self._check()

    def _check(self) -> None:
        """Range and cross-field checks; raise ValueError. Override per type."""

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.time() if now is None else now) > self.deadline


def message(cls: type[Message]) -> type[Message]:
    """Register a message class by name and compile its field checkers."""
    hints = typing.get_type_hints(cls)
    cls.TYPE = cls.__name__
    cls._CHECKERS = {f.name: _checker(hints[f.name]) for f in fields(cls)
                     if f.name != cls.FRAMES_FIELD}
    cls._REQUIRED = frozenset(f.name for f in fields(cls)
                              if f.default is MISSING and f.default_factory is MISSING)
    cls._FIELDS = tuple(f.name for f in fields(cls))
    cls._KNOWN = frozenset(cls._FIELDS) - {cls.FRAMES_FIELD}
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls


@message
@dataclass(frozen=True, kw_only=True)
class Error(Message):
    """A failed request. `code` is a ProtocolError reason or a handler's code."""

    code: str
    message: str = ""
    request_id: str | None = None


class MessageTooLarge(ValueError):
    """A message over the wire's limits: its peer's `decode` would refuse it
    (and could not tell whom it was about), so `encode` refuses it first and
    the sender ends what it was about with an error (`CODE_TOO_LARGE`)."""


CODE_TOO_LARGE = "message_too_large"      # the Error code of a request whose message was too large


def encode(msg: Message, limits: ProtocolLimits = DEFAULT_LIMITS) -> tuple[bytes, list[memoryview]]:
    """(header bytes, frames) for `msg`; frames are views, not copies. Raises
    MessageTooLarge for a message `decode` with `limits` would refuse for its size."""
    body: dict[str, Any] = {"type": msg.TYPE, "v": PROTOCOL_VERSION}
    frames: list[memoryview] = []
    for name in msg._FIELDS:
        value = getattr(msg, name)
        if name == msg.FRAMES_FIELD:
            body["frames"] = [{"dtype": t.dtype, "shape": t.shape} for t in value]
            frames = [t.data for t in value]
        elif isinstance(value, SamplingParams):
            body[name] = value.to_dict()        # its JSON form (logit_bias an object), not orjson's dataclass
        elif value is not None or name in msg._REQUIRED:
            body[name] = value
    header = orjson.dumps(body)
    total = sum(f.nbytes for f in frames)
    if len(header) > limits.max_header_bytes:
        raise MessageTooLarge(f"{msg.TYPE}: its header takes {len(header)} bytes, over the wire's "
                              f"{limits.max_header_bytes}-byte limit")
    if (len(frames) > limits.max_frames or total > limits.max_total_frame_bytes
            or any(f.nbytes > limits.max_frame_bytes for f in frames)):
        raise MessageTooLarge(f"{msg.TYPE}: {len(frames)} frames of {total} bytes, over the wire's limits "
                              f"({limits.max_frames} frames, {limits.max_frame_bytes} bytes each, "
                              f"{limits.max_total_frame_bytes} in all)")
    return header, frames


def encode_reply(reply: Message, limits: ProtocolLimits = DEFAULT_LIMITS) -> tuple[bytes, list[memoryview]]:
    """`encode(reply)`, or, for a reply too large to send, an Error (`CODE_TOO_LARGE`)
    that answers the same request instead."""
    try:
        return encode(reply, limits)
    except MessageTooLarge as exc:
        log.warning("reply %s not sent: %s", reply.TYPE, exc)
        return encode(Error(id=reply.id, code=CODE_TOO_LARGE, message=str(exc),
                            request_id=getattr(reply, "request_id", None)), limits)


def decode(header: bytes, frames: list[Any], limits: ProtocolLimits = DEFAULT_LIMITS
           ) -> Message | ProtocolError:
    """Parse and validate one message. Never raises; see ProtocolError.reason."""
    try:
        return _decode(header, frames, limits)
    except Exception as e:  # noqa: BLE001 -- a decode bug must not kill a daemon loop
        log.exception("protocol decode failed unexpectedly")
        return ProtocolError("internal", f"{type(e).__name__}: {e}")


def _decode(header: Any, frames: list[Any], limits: ProtocolLimits) -> Message | ProtocolError:
    if not isinstance(header, (bytes, bytearray, memoryview)):
        return ProtocolError("not_object", "header must be bytes")
    if len(header) > limits.max_header_bytes:
        return ProtocolError("header_too_large", f"{len(header)} > {limits.max_header_bytes} bytes")
    try:
        body = orjson.loads(header)
    except orjson.JSONDecodeError as e:
        return ProtocolError("bad_json", str(e))
    if not isinstance(body, dict):
        return ProtocolError("not_object", "header must be a JSON object")
    name, msg_id, rid = body.get("type"), body.get("id"), body.get("request_id")
    err = lambda reason, detail: ProtocolError(  # noqa: E731
        reason, detail, name if isinstance(name, str) else None,
        msg_id if isinstance(msg_id, str) else None, rid if isinstance(rid, str) and rid else None)
    if body.get("v") != PROTOCOL_VERSION or type(body.get("v")) is not int:
        return err("bad_version", f"protocol version {body.get('v')!r}, want {PROTOCOL_VERSION}: "
                                  "a peer of another kvd build (upgrade a cluster whole)")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        return err("unknown_type", f"unknown message type {name!r}")
    if not isinstance(frames, (list, tuple)):
        return err("bad_frame", "frames must be a list")
    descriptors = body.get("frames", [])
    if len(frames) > limits.max_frames:
        return err("too_many_frames", f"{len(frames)} > {limits.max_frames}")
    if cls.FRAMES_FIELD is None and (frames or descriptors):
        return err("unexpected_frames", f"{name} carries no frames")
    if not isinstance(descriptors, list) or len(descriptors) != len(frames):
        return err("frame_mismatch", "frame descriptors do not match the frames")
    tensors = []
    total = 0
    for i, (desc, frame) in enumerate(zip(descriptors, frames)):
        tensor = _frame(i, desc, frame, limits, err)
        if isinstance(tensor, ProtocolError):
            return tensor
        total += tensor.data.nbytes         # its descriptor's size (_frame checked them equal)
        if total > limits.max_total_frame_bytes:
            return err("frame_too_large", f"frames total over {limits.max_total_frame_bytes} bytes")
        tensors.append(tensor)
    kwargs = {k: v for k, v in body.items() if k not in _RESERVED}
    if unknown := kwargs.keys() - cls._KNOWN:
        return err("unknown_field", f"unknown fields {sorted(unknown)}")
    if missing := cls._REQUIRED - kwargs.keys():
        return err("missing_field", f"missing fields {sorted(missing)}")
    if cls.FRAMES_FIELD is not None:
        kwargs[cls.FRAMES_FIELD] = tuple(tensors)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        return err("invalid_field", str(e))


_DESCRIPTORS: dict[tuple[str, tuple[int, ...]], int] = {}   # valid (dtype, shape) -> bytes
_DESCRIPTORS_MAX = 4096       # a peer sending ever new shapes cannot grow it past this


def _descriptor(desc: Any, limits: ProtocolLimits) -> tuple[str, tuple[int, ...], int] | str:
    """(dtype, shape, nbytes) of a valid frame descriptor, else the rejection
    reason. The frames of one message mostly share a descriptor (a KV
    transfer's pieces): a valid one is remembered, later ones are a lookup."""
    if type(desc) is not dict or len(desc) != 2:
        return "frame_mismatch"
    dtype, shape = desc.get("dtype"), desc.get("shape")
    if type(shape) is not list:
        return "bad_shape" if "shape" in desc and "dtype" in desc else "frame_mismatch"
    if not set(map(type, shape)) <= _INT_ONLY or len(shape) > limits.max_ndim:
        # (only ints: True == 1 and 1.0 == 1, and they hash alike in the lookup below)
        return "bad_shape" if "dtype" in desc else "frame_mismatch"
    key = (dtype, tuple(shape))
    try:
        nbytes = _DESCRIPTORS.get(key)
    except TypeError:             # an unhashable dtype or dimension: invalid either way
        nbytes = None
    if nbytes is not None:
        return dtype, key[1], nbytes
    if "dtype" not in desc:
        return "frame_mismatch"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return "bad_dtype"
    if min(shape, default=0) < 0:
        return "bad_shape"
    nbytes = math.prod(shape) * DTYPES[dtype]
    if len(_DESCRIPTORS) >= _DESCRIPTORS_MAX:
        _DESCRIPTORS.clear()
    _DESCRIPTORS[key] = nbytes
    return dtype, key[1], nbytes


_DESCRIPTOR_ERRORS = {"frame_mismatch": "descriptor must be {dtype, shape}",
                      "bad_dtype": "dtype not allowed", "bad_shape": "bad shape"}


def _frame(i: int, desc: Any, frame: Any, limits: ProtocolLimits,
           err: Callable[[str, str], ProtocolError]) -> RawTensor | ProtocolError:
    checked = _descriptor(desc, limits)
    if type(checked) is str:
        return err(checked, f"frame {i}: {_DESCRIPTOR_ERRORS[checked]}: {desc!r:.200}")
    dtype, shape, nbytes = checked
    try:
        data = frame if type(frame) is memoryview else memoryview(frame)
        data = data if (data.format == "B" and data.ndim == 1) else data.cast("B")
    except (TypeError, ValueError) as e:
        return err("bad_frame", f"frame {i}: not a contiguous buffer ({e})")
    if nbytes > limits.max_frame_bytes or data.nbytes > limits.max_frame_bytes:
        return err("frame_too_large", f"frame {i}: over {limits.max_frame_bytes} bytes")
    if data.nbytes != nbytes:
        return err("size_mismatch", f"frame {i}: {data.nbytes} bytes for {dtype}{list(shape)}")
    return RawTensor(dtype, shape, data)


# ─── over a transport ────────────────────────────────────────────────────────


async def call(conn: Connection, msg: Message, *, timeout: float | None = None,
               limits: ProtocolLimits = DEFAULT_LIMITS) -> Message | ProtocolError:
    """Send `msg` as a request and decode the reply.

    The wait ends at `timeout`, else at `msg.deadline`, else at the
    connection's request_timeout. Transport failures raise TransportError
    (RequestTimeout included); a reply that does not decode is a ProtocolError.
    """
    if timeout is None and msg.deadline is not None:
        timeout = max(0.0, msg.deadline - time.time())
    header, frames = encode(msg)
    reply = await conn.request(header, frames, timeout=timeout)
    return decode(reply.header, reply.frames, limits)


Handler = Callable[[Message, Incoming], Awaitable[Message | None]]


Gate = Callable[[Message, Incoming], "str | None"]


async def serve(listener: Listener, handle: Handler, *, limits: ProtocolLimits = DEFAULT_LIMITS,
                rejected: collections.Counter[str] | None = None, gate: Gate | None = None,
                log_every: float = LOG_EVERY_S) -> None:
    """Decode and dispatch messages until the listener closes.

    Bad messages are counted in `rejected[reason]`, logged (peer and reason
    only, at most one line per reason per `log_every` seconds: a flood is
    counted, not written out), answered with an Error when the sender awaits
    a reply, and skipped; expired requests get Error("deadline_exceeded").
    `gate(msg, incoming)`, if given, returns why the sender may not send
    this message (kvd/trust.py) or None: a refused message gets
    Error("forbidden"), is counted as `rejected["forbidden"]` and never
    reaches `handle`. `handle` runs inline — it should hand long work to an
    owned task — and its returned message, if any, is the reply. A peer that
    left before its reply is logged, not fatal.
    """
    rejected = collections.Counter() if rejected is None else rejected
    warn = RateLimitedLog(log, log_every)
    while True:
        try:
            incoming = await listener.recv()
        except TransportClosed:
            return
        msg = decode(incoming.header, incoming.frames, limits)
        if isinstance(msg, ProtocolError):
            rejected[msg.reason] += 1
            warn.warning(msg.reason, "rejected %s from peer %s (%s): %s", msg.type or "message",
                         incoming.peer.hex(), incoming.identity or "unauthenticated", msg.reason)
            reply: Message | None = Error(id=msg.id or "", code=msg.reason, message=msg.detail)
        elif msg.expired():
            rejected["deadline_exceeded"] += 1
            reply = Error(id=msg.id, code="deadline_exceeded", message="deadline passed on arrival")
        elif gate is not None and (why := gate(msg, incoming)) is not None:
            rejected["forbidden"] += 1
            warn.warning("forbidden", "refused %s from peer %s (%s): %s", msg.TYPE, incoming.peer.hex(),
                         incoming.identity or "unauthenticated", why)
            reply = Error(id=msg.id, code="forbidden", message=why,
                          request_id=getattr(msg, "request_id", None))
        else:
            reply = await handle(msg, incoming)
        if reply is not None and incoming.request_id:
            try:
                await listener.reply(incoming, *encode_reply(reply))
            except TransportError as e:
                log.info("reply to peer %s not delivered: %s", incoming.peer.hex(), e)
