"""Requests as the engine sees them: sampling parameters, state, outputs.

``SamplingParams`` validates itself; a bad value raises ``InvalidParam`` naming
the offending parameter, which the HTTP layer turns into an OpenAI-shaped 400.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field, fields

from engine.structured.spec import StructuredOutput, StructuredOutputError


class InvalidParam(ValueError):
    """A request parameter is refused; ``param`` names it and ``code`` says
    why, as OpenAI's error does: ``invalid_type`` (a value of the wrong type)
    or ``invalid_value`` (out of range)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# Bounds on the stop conditions. A request carries them to a node in one wire
# header (kvd.protocol.ProtocolLimits) and every decode step matches them
# against the text. OpenAI allows 4 stop sequences; their length is ours to
# bound (a stop string longer than this would have to be generated whole to
# ever match).
MAX_STOP = 4
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing logits
# by a smaller one is not sampling any more, and below ~1e-45 the C++
# sampler's float temperature is 0 (0/0 for the maximum's own weight).
GREEDY_TEMPERATURE = 1e-5
# top_k's bound: an int32 (what vLLM's sampler tensors hold); a k at or above
# the vocabulary keeps every token.
MAX_TOP_K = 2**31 - 1
# logit_bias, as OpenAI bounds it: at most this many tokens, each biased by a
# number in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS].
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0
MAX_TOKEN_ID = 2**31 - 1                # before the vocabulary is known (check_vocab)
MAX_REPETITION_PENALTY = 2.0
MAX_LOGPROBS = 20       # top logprobs per token a request may ask (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. A temperature below
    ``GREEDY_TEMPERATURE`` (0 among them) is greedy.

    The one definition of the sampling parameters, end to end: the HTTP schema
    (kvd/api/schema.py) builds one with ``from_dict``, the wire carries it
    (``kvd.protocol.GenerateRequest.sampling``, a JSON object of these fields)
    and decodes it with ``from_dict`` again, and the engine samples with it. A
    value refused here is refused at every edge, with this message.
    Construction validates types and ranges and raises ``InvalidParam``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # logit adjustments (engine/sampling.py applies them, in vLLM's order)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias), ids ascending; JSON: {"id": bias}
    repetition_penalty: float = 1.0                  # 1: off
    min_p: float = 0.0                               # 0: off
    # log probabilities (engine/logprobs.py): None: none computed; k in [0, MAX_LOGPROBS]:
    # each token's own logprob and the k most likely at its position
    logprobs: int | None = None                      # every output token
    prompt_logprobs: int | None = None               # every prompt token but the first
    # structured output (engine/structured/): the grammar every output token must keep to; JSON:
    # {"kind", "value"} (StructuredOutput.to_dict), None: unconstrained
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        def check(param: str, typed: bool, in_range: bool, message: str) -> None:
            # typed: the value has the right type (else code invalid_type)
            if not typed:
                raise InvalidParam(param, message, code="invalid_type")
            if not in_range:
                raise InvalidParam(param, message)

        def integer(x: object) -> bool:
            return type(x) is int                  # bool is not an integer here

        check("max_tokens", integer(self.max_tokens), integer(self.max_tokens) and self.max_tokens >= 1,
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check("temperature", _number(self.temperature), _finite(self.temperature) and 0.0 <= self.temperature <= 2.0,
              f"temperature must be a number in [0, 2], got {self.temperature!r}")
        check("top_p", _number(self.top_p), _finite(self.top_p) and 0.0 < self.top_p <= 1.0,
              f"top_p must be a number in (0, 1], got {self.top_p!r}")
        check("top_k", integer(self.top_k), integer(self.top_k) and -1 <= self.top_k <= MAX_TOP_K,
              f"top_k must be -1, 0 (disabled) or an integer in [1, {MAX_TOP_K}] (at or above the "
              f"vocabulary size: every token), got {self.top_k!r}")
        check("seed", self.seed is None or integer(self.seed),
              self.seed is None or (integer(self.seed) and 0 <= self.seed < 2**63),
              f"seed must be a non-negative integer below 2**63, got {self.seed!r}")
        stop_typed = isinstance(self.stop, tuple) and all(isinstance(s, str) for s in self.stop)
        check("stop", stop_typed, stop_typed and len(self.stop) <= MAX_STOP
              and all(0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
              f"stop must be up to {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters each")
        ids_typed = isinstance(self.stop_token_ids, tuple) and all(map(integer, self.stop_token_ids))
        check("stop_token_ids", ids_typed, ids_typed and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
              and all(t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be up to {MAX_STOP_TOKEN_IDS} non-negative integers")
        check("ignore_eos", type(self.ignore_eos) is bool, True,
              f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        check("min_tokens", integer(self.min_tokens),
              integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
              f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        check("repetition_penalty", _number(self.repetition_penalty),
              _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
              f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1: off), "
              f"got {self.repetition_penalty!r}")
        check("min_p", _number(self.min_p), _finite(self.min_p) and 0.0 <= self.min_p <= 1.0,
              f"min_p must be a number in [0, 1] (0: off), got {self.min_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            check(name, k is None or integer(k), k is None or (integer(k) and 0 <= k <= MAX_LOGPROBS),
                  f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        check("structured", self.structured is None or isinstance(self.structured, StructuredOutput), True,
              f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        """``logit_bias``: a tuple of (token id, bias) pairs, ids unique in [0, MAX_TOKEN_ID],
        biases numbers in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]; stored sorted by id (so that equal
        maps make equal params)."""
        pairs = self.logit_bias
        shape = (f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] "
                 f"(a JSON object such as {{\"50256\": -100}})")
        if not (isinstance(pairs, tuple) and all(isinstance(e, tuple) and len(e) == 2 and type(e[0]) is int
                                                 and _number(e[1]) for e in pairs)):
            raise InvalidParam("logit_bias", shape, code="invalid_type")
        if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidParam("logit_bias", f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                               f"got {len(pairs)}")
        for token, bias in pairs:
            if not 0 <= token <= MAX_TOKEN_ID:
                raise InvalidParam("logit_bias", f"logit_bias: {token} is not a token id")
            if not (_finite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidParam("logit_bias", f"{shape}; got {bias!r} for token {token}")
        ordered = tuple(sorted((t, float(b)) for t, b in pairs))
        if len({t for t, _ in ordered}) != len(ordered):
            raise InvalidParam("logit_bias", "logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", ordered)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidParam if a token id this request names is outside a
        vocabulary of ``vocab_size`` (only the model knows it: the engine's
        check_request and the HTTP front door call this). Changes nothing."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise InvalidParam("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), got {token}")

    @classmethod
    def from_dict(cls, values: object) -> "SamplingParams":
        """Build from a JSON object (an HTTP body's fields, a wire header's).

        Absent keys take their defaults; a list stands for a tuple and an
        integer for a float where a float is due (JSON cannot tell them apart).
        Raises ``InvalidParam`` on an unknown key or a bad value; never
        anything else."""
        if not isinstance(values, dict):
            raise InvalidParam("sampling", f"sampling parameters must be an object, got {type(values).__name__}",
                               code="invalid_type")
        unknown = values.keys() - _FIELDS
        if unknown:
            name = sorted(map(str, unknown))[0]
            raise InvalidParam(name, f"unknown sampling parameter {name!r}")
        kwargs = dict(values)
        for name in ("stop", "stop_token_ids"):
            if isinstance(kwargs.get(name), list):
                kwargs[name] = tuple(kwargs[name])
        for name in ("temperature", "top_p", "repetition_penalty", "min_p"):
            if type(kwargs.get(name)) is int:
                kwargs[name] = float(kwargs[name])
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = _logit_bias_pairs(kwargs["logit_bias"])
        if isinstance(kwargs.get("structured"), dict):     # the wire's JSON form
            try:
                kwargs["structured"] = StructuredOutput.from_dict(kwargs["structured"])
            except StructuredOutputError as exc:
                raise InvalidParam(exc.param, str(exc), exc.code) from None
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The JSON object ``from_dict`` reads back to an equal SamplingParams."""
        out = {name: list(v) if isinstance(v, tuple) else v
               for name in _FIELD_ORDER for v in (getattr(self, name),)}
        out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        out["structured"] = self.structured.to_dict() if self.structured is not None else None
        return out

    @property
    def greedy(self) -> bool:
        """Pick each row's most likely token: the temperature is below GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """A logit_bias or a repetition penalty changes this request's logits (every
        row, greedy or not; min_p only filters a random row's draw)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0


_FIELD_ORDER = tuple(f.name for f in fields(SamplingParams))
_FIELDS = frozenset(_FIELD_ORDER)


def _logit_bias_pairs(value: object) -> object:
    """OpenAI's ``logit_bias`` JSON object (token ids as decimal strings, or ints
    from a Python caller) as SamplingParams holds it: (id, bias) pairs. A value
    of another shape is handed on as it is, for the constructor to refuse."""
    if not isinstance(value, dict):
        return value
    pairs = []
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            key = int(key)
        elif type(key) is not int:
            raise InvalidParam("logit_bias", f"logit_bias keys must be token ids, got {str(key)[:40]!r}")
        pairs.append((key, float(bias) if type(bias) is int else bias))
    return tuple(pairs)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return _number(x) and math.isfinite(x)


LOGPROB_FLOOR = -9999.0      # a logprob below it (-inf among them) is reported as it: JSON has no -inf


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log probabilities (engine/logprobs.py computes them): the logprob of ``token_id`` (the sampled or
    prompt token there) and the ``top`` most likely tokens as (id, logprob),
    most likely first, as many as the request asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_json(cls, value: object) -> "TokenLogprobs":
        """Validate the JSON object orjson writes for one (``kvd.protocol.TokenChunk``
        carries them): raises ValueError for anything else."""
        if isinstance(value, TokenLogprobs):
            return value
        if not (isinstance(value, dict) and value.keys() == {"token_id", "logprob", "top"}):
            raise ValueError("a token's logprobs must be an object of token_id, logprob and top")
        token, logprob, top = value["token_id"], value["logprob"], value["top"]
        if not (type(token) is int and token >= 0 and _logprob(logprob)):
            raise ValueError("a token's logprobs need a token id >= 0 and a logprob in [floor, 0]")
        if not (isinstance(top, list) and len(top) <= MAX_LOGPROBS
                and all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int and e[0] >= 0
                        and _logprob(e[1]) for e in top)):
            raise ValueError(f"top logprobs must be at most {MAX_LOGPROBS} [token id, logprob] pairs")
        return cls(token, float(logprob), tuple((t, float(lp)) for t, lp in top))


def _logprob(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and LOGPROB_FLOOR <= x <= 0.0


# RequestOutput.error_code (also kvd.protocol.Error.code on the wire)
INVALID_REQUEST = "invalid_request"     # refused before it ran: bad parameters, too long, no room
ENGINE_ERROR = "engine_error"           # failed inside a step: the server's fault, not the client's


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # not admitted yet (or preempted by recompute)
    RUNNING = "running"        # holds device blocks for all computed tokens
    SWAPPED = "swapped"        # preempted: private KV parked on the host tier
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"            # this request failed inside a step (RequestOutput.error says why)


@dataclass
class Request:
    """One generation. Mutated only by the engine thread.

    KV bookkeeping: ``block_ids`` are device blocks covering token positions
    ``[0, num_computed)`` (plus blocks allocated for the step in flight). The
    first ``len(prefix.blocks)`` of them belong to the prefix cache and are
    locked through ``prefix``; the rest are private to this request.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)   # while SWAPPED
    prefix: object | None = None        # MemPool PrefixLock (match), released exactly once
    kv_out: object | None = None        # engine.stream.KVSink: prefill here, stream the KV, hand off
    num_computed: int = 0
    prefilling: bool = False            # admitted; its last prefill chunk (which samples) not run yet
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    grammar: object | None = None       # engine.structured.GrammarState: params.structured's matcher, at output_ids
    # params.prompt_logprobs: prompt token i's TokenLogprobs at [i - 1], filled as prefill chunks compute them
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and a prefill has not computed them all yet (the
        scheduler then computes its whole prompt: a cached prefix yields no logits)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prefix_blocks(self) -> int:
        return len(self.prefix.blocks) if self.prefix is not None else 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a delta, not a total)."""

    request_id: str
    new_token_ids: list[int]
    text: str                           # newly stable text
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # whose fault ``error`` is: INVALID_REQUEST (the request was refused: the client's, HTTP
    # 400) or a server-side code such as ENGINE_ERROR (it failed while running: HTTP 500)
    error_code: str | None = None
    handed_off: bool = False            # finished here after its prefill: another instance decodes it
    # len(text) once each of new_token_ids is in: token i's text is text[ends[i-1]:ends[i]]
    # (what a receiver that already holds the first tokens keeps of the text)
    text_ends: list[int] = dataclasses.field(default_factory=list)
    # one per new token (params.logprobs set), else None; prompt_logprobs (params.prompt_logprobs
    # set) on the request's first output: prompt tokens 1.. (engine/logprobs.py)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """One delta for this output and the request's ``later`` one: both
        deltas' tokens and text, the later one's state and counts."""
        n = len(self.text)
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return dataclasses.replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                                   text=self.text + later.text,
                                   text_ends=self.text_ends + [n + e for e in later.text_ends],
                                   logprobs=logprobs, prompt_logprobs=(self.prompt_logprobs if self.prompt_logprobs is not None
                                                                    else later.prompt_logprobs))
