"""Requests as the engine sees them: sampling parameters, state, outputs.

``SamplingParams`` validates itself; a bad value raises ``InvalidParam`` naming
the offending parameter, which the HTTP layer turns into an OpenAI-shaped 400.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field


class InvalidParam(ValueError):
    """A request parameter is out of range; ``param`` names it (OpenAI's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParam(param, message)

        check(type(self.max_tokens) is int and self.max_tokens >= 1, "max_tokens",
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(_finite(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature",
              f"temperature must be in [0, 2], got {self.temperature!r}")
        check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
              f"top_p must be in (0, 1], got {self.top_p!r}")
        check(type(self.top_k) is int and self.top_k >= -1, "top_k",
              f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        check(self.seed is None or (type(self.seed) is int and 0 <= self.seed < 2**63), "seed",
              f"seed must be a non-negative integer below 2**63, got {self.seed!r}")
        check(len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop), "stop",
              "stop must be up to 16 non-empty strings")
        check(all(type(t) is int and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "stop_token_ids must be non-negative integers")
        check(type(self.min_tokens) is int and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              "min_tokens must be an integer in [0, max_tokens]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # not admitted yet (or preempted by recompute)
    RUNNING = "running"        # holds device blocks for all computed tokens
    SWAPPED = "swapped"        # preempted: private KV parked on the host tier
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


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
    prefix: object | None = None        # MemPool PrefixHit, released exactly once
    num_computed: int = 0
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

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
