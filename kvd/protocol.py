"""The kvd wire messages: one typed class per message, valid once built.

Each message type is a frozen dataclass registered by its class name
(``@message``); its fields are checked against their annotations and its
``_check`` when it is built, by ``encode``'s peer ``decode`` as by a
sender. The format (JSON header plus raw tensor frames), the field
checkers, ``encode``/``decode``, ``call`` and ``serve`` are kvd/wire.py's,
re-exported here: callers use ``protocol.X`` for both.
Who sends which: docs/cluster.md, "Wire and tasks".
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from engine.memory.mempool import TIERS as MEMPOOL_TIERS
from engine.request import FinishReason, SamplingParams, TokenLogprobs
from kvd.cluster_config import ROLES as CONFIG_ROLES
from kvd.transfer_state import COMMIT_STATUSES
from kvd.wire import (  # noqa: F401 -- re-exported: the format and the messages are one vocabulary
    CODE_TOO_LARGE,
    DEFAULT_LIMITS,
    DTYPES,
    Error,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    REASONS,
    Gate,
    Handler,
    Message,
    MessageTooLarge,
    ProtocolError,
    ProtocolLimits,
    RawTensor,
    call,
    decode,
    dtype_name,
    encode,
    encode_reply,
    message,
    serve,
)


TIERS = MEMPOOL_TIERS  # the engine's memory tiers ("device", "host"), fastest first: one set of names
FINISH_REASONS = tuple(r.value for r in FinishReason)   # engine/request.py
ROLES = CONFIG_ROLES                      # what a node computes: whole requests, prompts, or decodes


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
    fingerprint: str = ""              # the node's build fingerprint (engine/fingerprint.py)
    pair: str = ""                     # the node it is paired with ("" = none; docs/cluster.md)

    def _check(self) -> None:
        _require(bool(self.node) and bool(self.address), "node and address must be set")
        _require(self.pair != self.node, "a node cannot be paired with itself")
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
    free_blocks: dict[str, int]        # per tier: free plus unlocked cached blocks (what an allocation may take)
    draining: bool = False             # finishing its requests; route nothing new here
    cached_blocks: int = 0             # blocks held by the prefix cache (all tiers)
    cache_events: int = 0              # MemPool stored/removed events shipped (CacheEvents) since the last beat
    replicas: dict[str, dict[str, int]] = field(default_factory=dict)  # sender -> {request id -> tokens held here}: DejaVu's (x, j, t)
    stats: dict[str, Any] = field(default_factory=dict)  # engine snapshot (metrics)
    lost: tuple[str, ...] = ()         # requests it gave up, their output undeliverable (until a beat is answered)
    lend_cap: int = 0                  # [engine].lend_kv_blocks: most device blocks it lends at once
    lent: dict[str, int] = field(default_factory=dict)      # debtor -> device blocks lent to it (rmanager.py)
    borrowed: dict[str, int] = field(default_factory=dict)  # creditor -> device blocks borrowed from it

    def _check(self) -> None:
        _require(all(self.lost), "lost request ids must be set")
        _require(self.cached_blocks >= 0 and self.cache_events >= 0, "counts must be >= 0")
        _require(self.lend_cap >= 0 and all(n >= 0 for n in (*self.lent.values(), *self.borrowed.values())),
                 "lent and borrowed blocks must be >= 0")
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


# Bytes of one prompt token's TokenLogprobs in a TokenChunk's JSON header, at most: its object
# with a 6-digit id and a 20-character logprob, and each of its top (id, logprob) pairs.
PROMPT_LOGPROB_BYTES = 64
TOP_LOGPROB_BYTES = 30


def prompt_logprobs_fit(num_prompt_tokens: int, top: int) -> bool:
    """Whether the prompt logprobs of a ``num_prompt_tokens``-token prompt with
    ``top`` top logprobs each fit the one TokenChunk that carries them (three
    quarters of the header limit: the rest is the chunk's other fields)."""
    size = (num_prompt_tokens - 1) * (PROMPT_LOGPROB_BYTES + TOP_LOGPROB_BYTES * top)
    return size <= DEFAULT_LIMITS.max_header_bytes * 3 // 4


@message
@dataclass(frozen=True, kw_only=True)
class TokenChunk(Message):
    """Node -> coordinator: tokens [start_index, start_index + len(token_ids)).

    ``text_ends[i]`` is ``len(text)`` once token i is in (one per token,
    non-decreasing, the last ``len(text)``; no tokens, no text): a coordinator
    that already holds the first k tokens (a recomputed or resumed leg repeats
    them) keeps ``text[text_ends[k - 1]:]``.

    ``logprobs`` (the request asks, ``SamplingParams.logprobs``): one per
    token, computed by the node that sampled it; ``prompt_logprobs``
    (``SamplingParams.prompt_logprobs``): prompt tokens 1.., on the chunk of
    token 0, from the node that computed the prompt."""

    request_id: str
    start_index: int
    token_ids: tuple[int, ...]
    text: str = ""
    text_ends: tuple[int, ...] = ()
    finish_reason: str | None = None
    stop_reason: Any = None              # the stop string or token id that ended it
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, cached_tokens
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    def _check(self) -> None:
        _require(self.start_index >= 0, "start_index must be >= 0")
        _require(self.finish_reason in (None, *FINISH_REASONS), f"finish_reason in {FINISH_REASONS}")
        ends = self.text_ends
        _require(len(ends) == len(self.token_ids), "text_ends must give one end per token")
        _require(all(0 <= a <= b for a, b in zip((0, *ends), ends)), "text_ends must be non-decreasing and >= 0")
        _require((ends[-1] if ends else 0) == len(self.text), "text_ends must end at len(text)")
        _require(self.logprobs is None or [e.token_id for e in self.logprobs] == list(self.token_ids),
                 "logprobs must give one entry per token, for that token")
        _require(self.prompt_logprobs is None or self.start_index == 0, "prompt_logprobs come with token 0")

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
    hd]. With ``rows`` (a pair's copy, current to the step) the entries are
    token rows instead: entry ``i`` writes tokens ``[starts[i], starts[i] +
    counts[i])`` (any token: where the holder's copy ends), the next
    ``counts[i]`` of ``token_ids``, whose KV are the next ``counts[i]`` rows
    of the one frame [L, 2, sum(counts), kvh, hd] (a step sends its new
    tokens, not their blocks). ``frees``: replicas to drop (their requests ended here). The holder
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
    rows: bool = False               # a pair's copy: token rows (starts any token, counts tokens)

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
        if self.rows:   # entry i: tokens [starts[i], starts[i] + counts[i]), their KV rows of the one frame
            _require(all(s >= 0 for s in self.starts) and all(c > 0 for c in self.counts),
                     "rows: starts must be >= 0, counts > 0")
            _require(len(self.token_ids) == sum(self.counts) and all(t >= 0 for t in self.token_ids),
                     "rows: one token id >= 0 per row")
            _require(len(self.tensors) == (1 if n else 0), "one KV frame when there are entries")
            _require(not n or (len(self.tensors[0].shape) == 5 and self.tensors[0].shape[1] == 2
                               and self.tensors[0].shape[2] == sum(self.counts)),
                     "the rows frame must be [L, 2, sum(counts), kvh, hd]")
            return
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
    after the holder restarted), the requests it refused (``refused``:
    request id -> why, e.g. over ``replica_kv_blocks``), and whether its
    engine has a prompt waiting or being computed (``prompting``: a pair
    partner that takes no handoff now, engine/prefill_alone.py)."""

    held: dict[str, int] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    prompting: bool = False

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


# ─── borrowed KV memory (Infinite-LLM §4.4; kvd/node/lending.py) ─────────────

@message
@dataclass(frozen=True, kw_only=True)
class CreditorQuery(Message):
    """Node -> coordinator: ``node`` needs ``blocks`` KV blocks it does not
    have; which nodes may lend them (``exclude``: nodes that just said no)."""

    node: str
    blocks: int
    exclude: tuple[str, ...] = ()

    def _check(self) -> None:
        _require(bool(self.node), "node must be set")
        _require(self.blocks > 0, "blocks must be > 0")


@message
@dataclass(frozen=True, kw_only=True)
class Creditors(Message):
    """Coordinator -> node: up to three creditor candidates, best first
    (kvd/coordinator/ledger.py), each with its transport URL."""

    candidates: tuple[str, ...] = ()
    addresses: tuple[str, ...] = ()

    def _check(self) -> None:
        _require(len(self.candidates) == len(self.addresses) <= 3, "one address per candidate, at most 3")


@message
@dataclass(frozen=True, kw_only=True)
class BorrowRequest(Message):
    """Debtor -> creditor: lend ``blocks`` device KV blocks to ``debtor``
    (the sender's own key). Answered at once by a BorrowReply."""

    debtor: str
    blocks: int

    def _check(self) -> None:
        _require(bool(self.debtor), "debtor must be set")
        _require(self.blocks > 0, "blocks must be > 0")


@message
@dataclass(frozen=True, kw_only=True)
class BorrowReply(Message):
    """Creditor -> debtor: the loan (its id, blocks, lease seconds, and where the
    creditor's remote-attention channel listens, kvd/node/attention_channel.py), or
    ``ok=False`` with the reason (cap, free blocks, lending off)."""

    ok: bool
    loan_id: str = ""
    blocks: int = 0
    lease_s: float = 0.0
    reason: str = ""
    channel: str = ""           # the creditor's remote-attention channel, tcp://host:port ("" none)

    def _check(self) -> None:
        _require(self.ok == bool(self.loan_id), "a granted loan has an id, a refusal none")
        _require(not self.channel or self.channel.startswith("tcp://"), "a channel is at tcp://host:port")
        _require(not self.ok or (self.blocks > 0 and self.lease_s > 0), "a loan has blocks and a lease")


@message
@dataclass(frozen=True, kw_only=True)
class ReturnLoan(Message):
    """Debtor -> creditor: ``loan_id`` is given back; its blocks are freed."""

    debtor: str
    loan_id: str

    def _check(self) -> None:
        _require(bool(self.debtor) and bool(self.loan_id), "debtor and loan_id must be set")


@message
@dataclass(frozen=True, kw_only=True)
class LeaseRenew(Message):
    """Debtor -> creditor, every heartbeat interval: the loans ``debtor``
    still holds there. A loan not renewed for its lease is freed. Its own
    message, not a coordinator heartbeat: only the debtor itself proves
    that it lives and still knows the loan (a restarted debtor names none,
    so its predecessor's loans lapse), whatever the coordinator knows."""

    debtor: str
    loan_ids: tuple[str, ...]

    def _check(self) -> None:
        _require(bool(self.debtor) and all(self.loan_ids), "debtor and loan ids must be set")


@message
@dataclass(frozen=True, kw_only=True)
class LoanWrite(Message):
    """Debtor -> creditor: KV of layers [layer_start, layer_end) for the
    loan's blocks [start, start + n), ONE frame [layers, 2, n, bs, kvh, hd]."""

    FRAMES_FIELD: ClassVar[str | None] = "tensors"

    debtor: str
    loan_id: str
    start: int = 0
    layer_start: int = 0
    layer_end: int = 0
    tensors: tuple[Any, ...] = ()

    def _check(self) -> None:
        _require(bool(self.debtor) and bool(self.loan_id), "debtor and loan_id must be set")
        _require(0 <= self.start and 0 <= self.layer_start < self.layer_end, "need start >= 0, layer_start < layer_end")
        _require(len(self.tensors) == 1 and len(self.tensors[0].shape) == 6
                 and self.tensors[0].shape[0] == self.layer_end - self.layer_start
                 and self.tensors[0].shape[1] == 2, "one frame [layers, 2, n, bs, kvh, hd]")


@message
@dataclass(frozen=True, kw_only=True)
class LoanAck(Message):
    """Creditor -> debtor: a ReturnLoan, LeaseRenew or LoanWrite done
    (``renewed``: loans renewed, ``gone``: those it no longer has), or
    refused with the reason."""

    ok: bool
    loan_id: str = ""
    renewed: int = 0
    gone: tuple[str, ...] = ()         # LeaseRenew: the named loans this creditor no longer has
    reason: str = ""

    def _check(self) -> None:
        _require(self.renewed >= 0, "renewed must be >= 0")


@message
@dataclass(frozen=True, kw_only=True)
class RemoteAttend(Message):
    """Debtor -> creditor, per layer of a step (DistAttention, kvd/node/remote_attention.py):
    the K/V of positions [first, first + p) of request ``request_id`` go into loan
    ``loan_id`` (the sequence's chunks from ``lo`` on), then the micro-attention of its
    last n rows over the loan's chunks, ``ctx`` keys. Frames: q fp32 [n, H, hd], k and v
    [p, kvh, hd] (p may be 0). Answered by RemotePartials."""

    FRAMES_FIELD: ClassVar[str | None] = "tensors"

    debtor: str
    loan_id: str
    request_id: str
    lo: int
    layer: int
    ctx: int
    first: int = 0
    tensors: tuple[Any, ...] = ()

    def _check(self) -> None:
        _require(bool(self.debtor) and bool(self.loan_id), "debtor and loan_id must be set")
        _require(self.lo >= 1 and self.layer >= 0 and self.first >= 0, "need lo >= 1, layer >= 0, first >= 0")
        _require(len(self.tensors) == 3 and len(self.tensors[0].shape) == 3
                 and all(len(t.shape) == 3 for t in self.tensors[1:])
                 and self.tensors[1].shape == self.tensors[2].shape, "frames q [n, H, hd], k and v [p, kvh, hd]")
        _require(self.tensors[0].dtype == "float32", "q must be float32")
        _require(0 < self.tensors[0].shape[0] <= self.ctx, "0 < query rows <= ctx")
        _require(self.first + self.tensors[1].shape[0] <= self.ctx, "K/V positions past ctx")


@message
@dataclass(frozen=True, kw_only=True)
class RemotePartials(Message):
    """Creditor -> debtor: a RemoteAttend's per-chunk partials, frames m, l [n, C, H] and
    o [n, C, H, hd] fp32 (kernels/dist_attention.py), or ``ok=False`` with the reason."""

    FRAMES_FIELD: ClassVar[str | None] = "tensors"

    ok: bool
    reason: str = ""
    tensors: tuple[Any, ...] = ()

    def _check(self) -> None:
        _require(not self.ok or (len(self.tensors) == 3 and all(t.dtype == "float32" for t in self.tensors)),
                 "an answer carries m, l, o in float32")


@message
@dataclass(frozen=True, kw_only=True)
class RingOpen(Message):
    """Debtor -> creditor, on the creditor's remote-attention channel only: open a
    shared-memory ring for ``debtor``'s RemoteAttend (kvd/node/attention_ring.py), the
    debtor holding loan ``loan_id`` there and running on the host whose boot id is
    ``host``. Answered by RingOffer."""

    debtor: str
    loan_id: str
    host: str

    def _check(self) -> None:
        _require(bool(self.debtor) and bool(self.loan_id) and bool(self.host), "debtor, loan_id and host must be set")


@message
@dataclass(frozen=True, kw_only=True)
class RingOffer(Message):
    """Creditor -> debtor: the ring's segment ``name`` (under /dev/shm, mode 0600), its
    ``nonce`` (hex, written in the segment) and geometry, or ``ok=False`` with the reason."""

    ok: bool
    name: str = ""
    nonce: str = ""
    slots: int = 0
    slot_bytes: int = 0
    reason: str = ""

    def _check(self) -> None:
        _require(not self.ok or (bool(self.name) and bool(self.nonce) and self.slots > 0 and self.slot_bytes > 0),
                 "an offered ring has a name, a nonce, slots and their size")


@message
@dataclass(frozen=True, kw_only=True)
class RecallKV(Message):
    """Debtor -> creditor: send the KV of blocks [start, start + blocks) of loan ``loan_id``,
    which the debtor brings home before it returns the loan (DGFM's recall,
    kvd/node/recall.py). Answered by LoanKV."""

    debtor: str
    loan_id: str
    start: int = 0
    blocks: int

    def _check(self) -> None:
        _require(bool(self.debtor) and bool(self.loan_id), "debtor and loan_id must be set")
        _require(self.start >= 0 and self.blocks > 0, "need start >= 0, blocks > 0")


@message
@dataclass(frozen=True, kw_only=True)
class LoanKV(Message):
    """Creditor -> debtor: a RecallKV's blocks, ONE frame [L, 2, n, bs, kvh, hd], or
    ``ok=False`` with the reason."""

    FRAMES_FIELD: ClassVar[str | None] = "tensors"

    ok: bool
    reason: str = ""
    tensors: tuple[Any, ...] = ()

    def _check(self) -> None:
        _require(len(self.tensors) == (1 if self.ok else 0), "an answer carries one frame, a refusal none")
        _require(not self.ok or (len(self.tensors[0].shape) == 6 and self.tensors[0].shape[1] == 2),
                 "the frame must be [L, 2, n, bs, kvh, hd]")


LENDING_MESSAGES = (BorrowRequest, ReturnLoan, LeaseRenew, LoanWrite, RemoteAttend, RecallKV)   # debtor -> creditor


# ─── encode / decode ─────────────────────────────────────────────────────────
