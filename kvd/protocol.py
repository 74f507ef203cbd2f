"""The kvd wire protocol: typed messages as a JSON header plus raw tensor frames.

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

from engine.memory.mempool import TIERS as MEMPOOL_TIERS
from engine.request import FinishReason, SamplingParams
from kvd.cluster_config import ROLES as CONFIG_ROLES
from kvd.ratelog import LOG_EVERY_S, RateLimitedLog
from transports.base import Connection, Incoming, Listener, TransportClosed, TransportError, as_buffer

log = logging.getLogger(__name__)
# RawTensor.to_torch views read-only zmq frames on purpose (see its docstring).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

# Raised whenever a message changes in a way the other side of an older build cannot read
# (2: TokenChunk.text_ends; 3: Heartbeat.incarnation and lost, replica tickets and keys,
# GenerateRequest.kv_to_incarnation; 4: the legs of a request are their own messages,
# GenerateRequest | DecodeLeg | PrefillLeg | ResumeRequest): a node of another build is
# then refused at its Hello (`bad_version`), not message by message.
PROTOCOL_VERSION = 4

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
        name = dtype_name(tensor.dtype)
        if name not in DTYPES:
            raise ValueError(f"dtype {name} is not allowed on the wire")
        return cls(name, tuple(tensor.shape), as_buffer(tensor))

    def to_torch(self) -> Any:
        """A torch tensor sharing memory with the received frame (no copy).

        Frames from zmq are read-only: do not write to the result; `.clone()`
        it to own a writable copy.
        """
        import torch  # noqa: PLC0415 -- the coordinator never calls this

        dtype = getattr(torch, self.dtype)
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=dtype)
        # frombuffer warns on read-only buffers: filtered once, at import
        # (a catch_warnings block per frame doubled the cost of this view)
        return torch.frombuffer(self.data, dtype=dtype, count=math.prod(self.shape)).view(self.shape)


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
                                bool: _check_bool, Any: _json_value, SamplingParams: _check_sampling}


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
            object.__setattr__(self, name, check(getattr(self, name)))
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


TIERS = MEMPOOL_TIERS  # the engine's memory tiers ("device", "host"), fastest first: one set of names
FINISH_REASONS = tuple(r.value for r in FinishReason)   # engine/request.py
ROLES = CONFIG_ROLES                      # what a node computes: whole requests, prompts, or decodes
COMMIT_STATUSES = ("done", "finished", "failed")
def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _hex(s: str) -> bool:
    return len(s) % 2 == 0 and all(c in "0123456789abcdef" for c in s)


def _tiers_ok(blocks: dict[str, int]) -> bool:
    return all(t in TIERS and n >= 0 for t, n in blocks.items())


@message
@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Node -> coordinator registration."""

    node: str
    address: str                       # transport URL the node listens on
    role: str = "mixed"                # ROLES: mixed (default), prefill or decode
    blocks_per_tier: dict[str, int]    # KV blocks per tier (TIERS: "device", "host")
    block_size: int                    # tokens per KV block
    model_name: str = ""               # the served model (all nodes of a cluster agree)
    max_model_len: int = 0             # context length; 0: unknown
    incarnation: str = ""              # changes on every node process start

    def _check(self) -> None:
        _require(bool(self.node) and bool(self.address), "node and address must be set")
        _require(self.max_model_len >= 0, "max_model_len must be >= 0")
        _require(self.role in ROLES, f"role must be one of {ROLES}")
        _require(_tiers_ok(self.blocks_per_tier), f"tiers must be in {TIERS}, counts >= 0")
        _require(self.block_size > 0, "block_size must be > 0")


@message
@dataclass(frozen=True, kw_only=True)
class Welcome(Message):
    """Coordinator -> node: accepted (or not), and how to behave."""

    node: str
    accepted: bool
    reason: str = ""
    heartbeat_interval: float = 1.0
    replica_peer: str = ""             # the node to stream this node's KV to ("" = none: replicate nothing)
    replica_address: str = ""          # its transport URL
    drop_replicas: tuple[str, ...] = ()   # replicas held here whose requests are not in flight: free them
    replica_key: str = ""              # registration only: this node's key for the tickets of replicas it holds (hex)
    replica_tickets: dict[str, str] = field(default_factory=dict)  # request id -> ticket at replica_peer (kvd/trust.py)

    def _check(self) -> None:
        _require(self.heartbeat_interval > 0, "heartbeat_interval must be > 0")
        _require(bool(self.replica_peer) == bool(self.replica_address),
                 "replica_peer and replica_address are set together")
        _require(not self.replica_tickets or bool(self.replica_peer), "replica_tickets need a replica_peer")
        _require(_hex(self.replica_key), "replica_key must be hex")


@message
@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """Node -> coordinator, every interval; a missed deadline declares the node dead.
    ``incarnation`` is the registered process's (Hello); ``seq`` counts the
    beats since that process registered, from 1 (kvd/coordinator/membership.py)."""

    node: str
    incarnation: str = ""
    seq: int
    load: float                        # 0..1, fraction of decode capacity in use
    running: int
    waiting: int
    free_blocks: dict[str, int]
    draining: bool = False             # finishing its requests; route nothing new here
    cached_blocks: int = 0             # blocks held by the prefix cache (all tiers)
    cache_events: int = 0              # MemPool stored/removed events shipped (CacheEvents) since the last beat
    replicas: dict[str, dict[str, int]] = field(default_factory=dict)  # sender -> {request id -> tokens held here}: DejaVu's (x, j, t)
    stats: dict[str, Any] = field(default_factory=dict)  # engine snapshot (metrics)
    lost: tuple[str, ...] = ()         # requests it gave up, their output undeliverable (until a beat is answered)

    def _check(self) -> None:
        _require(all(self.lost), "lost request ids must be set")
        _require(self.cached_blocks >= 0 and self.cache_events >= 0, "counts must be >= 0")
        _require(all(n >= 0 for held in self.replicas.values() for n in held.values()),
                 "replicated tokens must be >= 0")
        _require(self.seq >= 0 and self.running >= 0 and self.waiting >= 0, "counts must be >= 0")
        _require(self.load >= 0, "load must be >= 0")
        _require(_tiers_ok(self.free_blocks), f"tiers must be in {TIERS}, counts >= 0")


@message
@dataclass(frozen=True, kw_only=True)
class CacheEvents(Message):
    """Node -> coordinator: the node's MemPool cache events, numbered, for the
    global prompt tree (kvd/coordinator/cache_sync.py). Answered by CacheAck.

    ``snapshot`` False: events ``[seq, seq + n)``, applied only when ``seq``
    is the next one the coordinator expects. ``snapshot`` True: the node's
    whole cache (stored ops only, parents first); the next events are
    numbered from ``seq``. Two int64 frames (kvd/cache_events.py)::

        ops    [n, 3]   (kind: 1 stored | 0 removed, parent hash, block hash)
        tokens [m, block_size]  the tokens of the m stored ops, in order
    """

    FRAMES_FIELD: ClassVar[str | None] = "tensors"

    node: str
    seq: int
    block_size: int
    snapshot: bool = False
    tensors: tuple[Any, ...] = ()

    def _check(self) -> None:
        _require(self.seq >= 0 and self.block_size > 0, "seq must be >= 0, block_size > 0")
        _require(len(self.tensors) == 2 and all(t.dtype == "int64" for t in self.tensors),
                 "needs two int64 frames: ops and tokens")
        ops, toks = self.tensors
        _require(len(ops.shape) == 2 and ops.shape[1] == 3, "ops must be [n, 3]")
        _require(len(toks.shape) == 2 and toks.shape[1] == self.block_size,
                 "tokens must be [m, block_size]")
        kinds = ops.data.cast("q")[0::3]
        _require(set(kinds) <= {0, 1}, "op kinds must be 0 (removed) or 1 (stored)")
        _require(sum(kinds) == toks.shape[0], "one token row per stored op")
        _require(not self.snapshot or all(kinds), "a snapshot holds stored ops only")
        _require(min(toks.data.cast("q"), default=0) >= 0, "token ids must be >= 0")


@message
@dataclass(frozen=True, kw_only=True)
class CacheAck(Message):
    """Coordinator -> node, the reply to CacheEvents: applied (``next_seq`` is
    the next event number it expects) or ``resync``: send a snapshot."""

    node: str
    next_seq: int = 0
    resync: bool = False
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class LegRequest(Message):
    """Coordinator -> node: run one leg of a request. Not a message itself:
    the base of the four that are, one per kind of leg (docs/cluster.md,
    "Wire and tasks"), each with only its own fields::

        GenerateRequest  the whole request on this node
        DecodeLeg        the decode half; the prompt may be computed on ``prefill_node``
        PrefillLeg       the prompt half, its KV streamed into the decode node's grant
        ResumeRequest    a recovered request, resumed after the tokens the client has

    ``sampling`` is the engine's own ``SamplingParams``: on the wire a JSON
    object of its fields (absent ones take their defaults), decoded by
    ``SamplingParams.from_dict``, so a value the engine would refuse is an
    ``invalid_field`` here, with the engine's message.

    ``replica_to``/``replica_address``/``replica_ticket`` (with replication):
    where this request's replica is written and the coordinator's ticket
    for it (kvd/trust.py). On a leg that runs the request's decode: that
    node's ring peer, for its own replication rounds; on a prefill leg: the
    decode node's peer, and the ticket of the decode node's request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    replica_to: str = ""
    replica_address: str = ""
    replica_ticket: str = ""

    def _check(self) -> None:
        _require(bool(self.request_id), "request_id must be set")
        _require(len(self.prompt_token_ids) > 0, "prompt must not be empty")
        _require(all(t >= 0 for t in self.prompt_token_ids), "token ids must be >= 0")
        _require(not self.replica_to or bool(self.replica_address and self.replica_ticket),
                 "replica_to needs replica_address and replica_ticket")

    @classmethod
    def of(cls, leg: LegRequest, **values: Any) -> LegRequest:
        """A ``cls`` for the request ``leg`` is for: its id, deadline, request,
        prompt, sampling and replica fields, with ``values`` set over them."""
        return cls(**({f.name: getattr(leg, f.name) for f in fields(LegRequest)} | values))


@message
@dataclass(frozen=True, kw_only=True)
class GenerateRequest(LegRequest):
    """Coordinator -> node: generate for this prompt, the whole request here."""


@message
@dataclass(frozen=True, kw_only=True)
class DecodeLeg(LegRequest):
    """Coordinator -> decode node, the first of a disaggregated request's two
    legs (docs/cluster.md, "Disaggregated prefill"): ``prefill_node`` may
    compute the prompt. The node's ``Accepted`` carries the grant (``kv_*``)
    when it chose to have it computed there, none when it prefills itself."""

    prefill_node: str

    def _check(self) -> None:
        LegRequest._check(self)
        _require(bool(self.prefill_node), "prefill_node must be set")


@message
@dataclass(frozen=True, kw_only=True)
class PrefillLeg(LegRequest):
    """Coordinator -> prefill node, the second leg: compute the prompt,
    stream the KV of blocks ``[kv_have_blocks, ...)`` into the decode node's
    grant (``kv_transfer_id``, ``kv_block_ids``, ``kv_have_blocks``,
    ``kv_num_layers``, ``kv_dtype``) layer by layer, send the first token
    to the coordinator (TokenChunk 0) and to the decode node (``KVCommit``),
    and be done. ``kv_to_node``/``kv_to_address``/``kv_to_incarnation``: the
    decode node process (it keys the prefill node's link to it).

    With ``replica_to``/``replica_address`` (``[cluster].replicas = 1``, a
    grant from block 0) it also sends the prompt's full blocks to the decode
    node's replica peer as a ``ReplicaData`` owned by the decode node, which
    adopts it (kvd/node/replication.py), so the decode node never sends the
    prompt."""

    kv_to_node: str
    kv_to_address: str
    kv_to_incarnation: str = ""
    kv_transfer_id: str
    kv_block_ids: tuple[int, ...]
    kv_have_blocks: int = 0
    kv_num_layers: int
    kv_dtype: str

    def _check(self) -> None:
        LegRequest._check(self)
        _require(bool(self.kv_to_node), "kv_to_node must be set")
        _check_grant(self.kv_transfer_id, self.kv_block_ids, self.kv_have_blocks, self.kv_num_layers,
                     self.kv_dtype, len(self.prompt_token_ids))
        _require(bool(self.kv_to_address), "kv_to_address must be set with kv_to_node")
        _require(not self.replica_to or (self.kv_have_blocks == 0 and self.replica_to != self.kv_to_node),
                 "a prefill leg's replica_to needs a grant from block 0, to another node than the decode node")


@message
@dataclass(frozen=True, kw_only=True)
class ResumeRequest(LegRequest):
    """Coordinator -> node: a request recovered from a dead node (docs/cluster.md,
    "Failure semantics"), with the tokens the client already has
    (``output_token_ids``): the node resumes after them, its first chunk at
    ``start_index = len(output_token_ids)``. ``replica_from`` names the dead
    node whose replica of this request the node holds (its KV up to the
    replicated position is used, the rest recomputed); "" re-runs prompt and
    tokens from the prefix cache."""

    output_token_ids: tuple[int, ...]
    replica_from: str = ""

    def _check(self) -> None:
        LegRequest._check(self)
        _require(len(self.output_token_ids) > 0, "a resumed request has output_token_ids")
        _require(all(t >= 0 for t in self.output_token_ids), "token ids must be >= 0")


def _check_grant(transfer_id: str, block_ids: tuple[int, ...], have_blocks: int, num_layers: int,
                 dtype: str, prompt_len: int | None = None) -> None:
    """A decode node's grant for a prompt of ``prompt_len`` tokens (None:
    not known here): blocks [have_blocks, ceil(prompt_len / bs)) (block size
    unknown here: checked by the prefill node)."""
    _require(bool(transfer_id), "kv_transfer_id must be set")
    _require(have_blocks >= 0 and all(b >= 0 for b in block_ids), "block ids and counts must be >= 0")
    _require(len(set(block_ids)) == len(block_ids), "block ids must be distinct")
    _require(num_layers > 0 and dtype in DTYPES, f"kv_num_layers > 0 and kv_dtype in {sorted(DTYPES)}")
    _require(prompt_len is None or have_blocks + len(block_ids) <= prompt_len, "more blocks than prompt tokens")


@message
@dataclass(frozen=True, kw_only=True)
class Accepted(Message):
    """Node -> coordinator, the reply to a ``LegRequest``: the node took the
    leg and its TokenChunks follow. A refusal is an Error reply instead
    (draining, duplicate, or a message the node could not decode), so every
    leg is answered or times out: none waits forever.

    A decode node asked with a ``DecodeLeg`` answers its grant for the
    ``PrefillLeg`` here (``kv_transfer_id`` set: blocks reserved), or no
    grant: it computes the prompt itself."""

    request_id: str
    kv_transfer_id: str = ""
    kv_block_ids: tuple[int, ...] = ()
    kv_have_blocks: int = 0
    kv_num_layers: int = 0
    kv_dtype: str = ""
    resumed_tokens: int = 0            # a recovered request: tokens whose KV came from the replica

    def _check(self) -> None:
        _require(self.resumed_tokens >= 0, "resumed_tokens must be >= 0")
        if self.kv_transfer_id:
            _check_grant(self.kv_transfer_id, self.kv_block_ids, self.kv_have_blocks, self.kv_num_layers,
                         self.kv_dtype)


@message
@dataclass(frozen=True, kw_only=True)
class TokenChunk(Message):
    """Node -> coordinator: tokens [start_index, start_index + len(token_ids)).

    ``text_ends[i]`` is ``len(text)`` once token i is in (one per token,
    non-decreasing, the last ``len(text)``; no tokens, no text): a coordinator
    that already holds the first k tokens (a recomputed or resumed leg repeats
    them) keeps ``text[text_ends[k - 1]:]``."""

    request_id: str
    start_index: int
    token_ids: tuple[int, ...]
    text: str = ""
    text_ends: tuple[int, ...] = ()
    finish_reason: str | None = None
    stop_reason: Any = None              # the stop string or token id that ended it
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, cached_tokens

    def _check(self) -> None:
        _require(self.start_index >= 0, "start_index must be >= 0")
        _require(self.finish_reason in (None, *FINISH_REASONS), f"finish_reason in {FINISH_REASONS}")
        ends = self.text_ends
        _require(len(ends) == len(self.token_ids), "text_ends must give one end per token")
        _require(all(0 <= a <= b for a, b in zip((0, *ends), ends)), "text_ends must be non-decreasing and >= 0")
        _require((ends[-1] if ends else 0) == len(self.text), "text_ends must end at len(text)")

    @property
    def indices(self) -> range:
        return range(self.start_index, self.start_index + len(self.token_ids))


@message
@dataclass(frozen=True, kw_only=True)
class Goodbye(Message):
    """Node -> coordinator: leaving on purpose (drained); not a failure.

    ``unfinished`` names the requests the node gives up (its drain timed out);
    every other request it served has sent its last chunk, which travels on the
    data link and may reach the coordinator after this message does."""

    node: str
    reason: str = ""
    unfinished: tuple[str, ...] = ()


@message
@dataclass(frozen=True, kw_only=True)
class Abort(Message):
    """Coordinator -> node: stop a request and free its blocks. ``leg =
    "prefill"`` to a decode node: stop waiting for the remote prefill (its
    prefill node will not run it) and compute the prompt here, or fail it,
    as ``[cluster].kv_load_failure`` says."""

    request_id: str
    reason: str = ""
    leg: str = ""

    def _check(self) -> None:
        _require(self.leg in ("", "prefill"), "leg must be '' or 'prefill'")


@message
@dataclass(frozen=True, kw_only=True)
class Error(Message):
    """A failed request. `code` is a ProtocolError reason or a handler's code."""

    code: str
    message: str = ""
    request_id: str | None = None


@message
@dataclass(frozen=True, kw_only=True)
class KVTransferRequest(Message):
    """MemServe transfer, step 1 (allocation): sender asks the receiver for blocks.

    Steps: KVTransferRequest -> KVAllocReply (block ids) -> KVData... (the
    last with last=True) -> KVAck (inserted into the receiver's index).
    """

    transfer_id: str
    request_id: str | None = None
    src_node: str
    dst_node: str
    token_ids: tuple[int, ...]         # the tokens whose KV moves (the radix key)
    num_blocks: int
    num_layers: int
    dtype: str

    def _check(self) -> None:
        _require(self.num_blocks > 0 and self.num_layers > 0, "num_blocks, num_layers must be > 0")
        _require(self.dtype in DTYPES, f"dtype must be in {sorted(DTYPES)}")


@message
@dataclass(frozen=True, kw_only=True)
class KVAllocReply(Message):
    transfer_id: str
    ok: bool
    block_ids: tuple[int, ...] = ()    # receiver blocks for the sender's blocks [have_blocks:]
    have_blocks: int = 0               # leading blocks the receiver already caches (not sent)
    reason: str = ""


@message
@dataclass(frozen=True, kw_only=True)
class KVData(Message):
    """MemServe step 2 (transmission): KV of layers [layer_start, layer_end) for
    `block_ids`, in one of two frame layouts:

    - packed (`pieces` empty): ONE frame [layer_end-layer_start, 2, n, bs, kvh, hd];
    - pieces: the sender's blocks sent straight from its pool, no gather: one
      frame [pieces[r], bs, kvh, hd] per (layer, K|V, run r of consecutive
      sender blocks), in that order; `sum(pieces)` = n.

    A KVData always belongs to an allocation the receiver granted (step 1):
    there is no form that allocates on arrival (kvd/node/transfer.py).
    """

    FRAMES_FIELD: ClassVar[str | None] = "tensors"

    transfer_id: str
    seq: int = 0
    layer_start: int = 0
    layer_end: int = 0
    block_ids: tuple[int, ...] = ()
    last: bool = False
    pieces: tuple[int, ...] = ()       # blocks per run, pieces layout (see above)
    tensors: tuple[Any, ...] = ()      # RawTensor, or torch tensors (viewed, not copied)

    def _check(self) -> None:
        _require(0 <= self.layer_start <= self.layer_end, "need 0 <= layer_start <= layer_end")
        _require(self.seq >= 0, "seq must be >= 0")
        _require(all(n > 0 for n in self.pieces), "pieces must be > 0")
        _require(not self.pieces or not self.tensors
                 or len(self.tensors) == (self.layer_end - self.layer_start) * 2 * len(self.pieces),
                 "pieces layout needs one frame per (layer, K|V, piece)")

    def as_torch(self) -> tuple[Any, ...]:
        return tuple(t.to_torch() for t in self.tensors)


@message
@dataclass(frozen=True, kw_only=True)
class KVAck(Message):
    """MemServe step 3 (insertion): the receiver indexed the KV (or failed)."""

    transfer_id: str
    ok: bool
    inserted_tokens: int = 0           # set on the ack that completes the transfer
    have_blocks: int = 0               # leading blocks the receiver already had (not imported)
    reason: str = ""


@message
@dataclass(frozen=True, kw_only=True)
class KVCommit(Message):
    """Prefill node -> decode node, the end of a disaggregated prefill (a
    request; the reply is a KVAck): ``done``: every layer was sent and
    acknowledged, ``first_token`` is the request's token 0 and the decode
    node runs the request from its imported KV; ``finished``: token 0 ended
    the request (the coordinator has it): release the grant; ``failed``:
    no KV will come (``reason``): the decode node computes the prompt itself
    or fails the request (``[cluster].kv_load_failure``). ``replica_to``:
    the node the prefill node is sending the prompt's replica to, on the
    decode node's behalf (it adopts it there; PrefillLeg)."""

    transfer_id: str
    request_id: str
    status: str
    first_token: int = -1
    cached_tokens: int = 0             # prompt tokens the prefill node served from its cache
    reason: str = ""
    replica_to: str = ""

    def _check(self) -> None:
        _require(self.status in COMMIT_STATUSES, f"status must be one of {COMMIT_STATUSES}")
        _require(self.status != "done" or self.first_token >= 0, "a done commit carries first_token")
        _require(self.cached_tokens >= 0, "cached_tokens must be >= 0")


@message
@dataclass(frozen=True, kw_only=True)
class ReplicaData(Message):
    """Node -> its replica peer (a request; the reply is a ReplicaAck): one
    replication round (kvd/node/replication.py). Entry ``i`` extends the
    replica of request ``request_ids[i]`` from token ``starts[i]`` (a whole
    number of blocks; 0 opens it) by ``counts[i]`` full blocks: their tokens
    are the next ``counts[i] * block_size`` of ``token_ids`` and their KV the
    next ``counts[i]`` blocks of the one frame [L, 2, sum(counts), bs, kvh,
    hd]. ``frees``: replicas to drop (their requests ended here). The holder
    keys every replica by the sender's authenticated name, so a node can
    touch its own replicas only. ``tickets``: request id -> the
    coordinator's ticket for that replica at this holder, owned by ``owner``
    or else ``source`` (kvd/trust.py); an entry without a valid one is
    refused."""

    FRAMES_FIELD: ClassVar[str | None] = "tensors"

    source: str
    block_size: int
    request_ids: tuple[str, ...] = ()
    starts: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    frees: tuple[str, ...] = ()
    owner: str = ""
    adopt: dict[str, str] = field(default_factory=dict)
    tickets: dict[str, str] = field(default_factory=dict)
    tensors: tuple[Any, ...] = ()

    def _check(self) -> None:
        n = len(self.request_ids)
        _require(set(self.tickets) <= set(self.request_ids), "tickets are for the message's request ids")
        _require(bool(self.source) and self.block_size > 0, "source and block_size must be set")
        _require(self.owner != self.source, "owner is another node than source (or empty)")
        _require(all(k and v and v != self.source for k, v in self.adopt.items()),
                 "adopt maps request ids to the nodes that wrote them")
        _require(not (self.owner and self.adopt), "a message either writes for an owner or adopts")
        _require(len(self.starts) == n and len(self.counts) == n, "one start and one count per request id")
        _require(len(set(self.request_ids)) == n and all(self.request_ids), "request ids must be distinct, non-empty")
        _require(all(s >= 0 and s % self.block_size == 0 for s in self.starts), "starts must be whole blocks")
        _require(all(c > 0 for c in self.counts), "counts must be > 0")
        _require(len(self.token_ids) == sum(self.counts) * self.block_size, "token_ids must fill the blocks")
        _require(all(t >= 0 for t in self.token_ids), "token ids must be >= 0")
        _require(len(self.tensors) == (1 if n else 0), "one KV frame when there are entries")
        if n:
            shape = self.tensors[0].shape
            _require(len(shape) == 6 and shape[1] == 2 and shape[2] == sum(self.counts)
                     and shape[3] == self.block_size, "the KV frame must be [L, 2, sum(counts), bs, kvh, hd]")


@message
@dataclass(frozen=True, kw_only=True)
class ReplicaAck(Message):
    """Replica holder -> sender: the tokens it now holds of each request of
    the ReplicaData (a replica the sender must restart from there, e.g. 0
    after the holder restarted), and the requests it refused (``refused``:
    request id -> why, e.g. over ``replica_kv_blocks``)."""

    held: dict[str, int] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def _check(self) -> None:
        _require(all(n >= 0 for n in self.held.values()), "held tokens must be >= 0")


@message
@dataclass(frozen=True, kw_only=True)
class AdminCommand(Message):
    command: str
    args: dict[str, Any] = field(default_factory=dict)


@message
@dataclass(frozen=True, kw_only=True)
class AdminReply(Message):
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# ─── encode / decode ─────────────────────────────────────────────────────────


def encode(msg: Message) -> tuple[bytes, list[memoryview]]:
    """(header bytes, frames) for `msg`; frames are views, not copies."""
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
    return orjson.dumps(body), frames


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
        total += tensor.nbytes
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
                await listener.reply(incoming, *encode(reply))
            except TransportError as e:
                log.info("reply to peer %s not delivered: %s", incoming.peer.hex(), e)
