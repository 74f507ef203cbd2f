"""How much of a node's weights its CPU's last-level cache holds, step by step.

A decode step reads every weight of the model once. With the weights in the
last-level cache it takes the profile's decode time; with them evicted it
takes ``decode_cold_s`` more (they come from memory). What evicts them:

- the node's own prefill (its activations and the prefill kernels' working
  set): ``prefill_cools`` of the warmth is lost at each prefill call;
- another node on the same host (``kvd serve --nodes N`` on one machine, or
  a simulation with ``--colocated``): each decode part it runs reads its own
  copy of the weights through the shared cache, and ``neighbour_cools`` of
  this node's warmth is lost; each prefill part it runs evicts as much as
  this node's own prefill would (``prefill_cools``: the cache is shared).

Warmth ``w`` is the cached share, in [0, 1]; each decode step on the node
brings ``1 / warm_steps`` of the weights back (a cache's insertion policy does
not keep all of one pass: it takes several). A decode step costs
``decode_cold_s * (1 - w)`` on top of StepCosts.decode_seconds, ``w`` read
after the step's own prefill part (the engine runs that part first).
Nothing else changes ``w``: an idle node keeps what it had (a quiet host).
Pure Python; ``kvd profile`` measures the four numbers (tools/sim/profile_cache.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from kvd.sim.costs import from_object


@dataclass(frozen=True)
class CacheCosts:
    """A profile's ``cache`` object: ``decode_cold_s`` seconds >= 0,
    ``warm_steps`` >= 1, ``prefill_cools`` and ``neighbour_cools`` in [0, 1]."""

    decode_cold_s: float
    warm_steps: float
    prefill_cools: float
    neighbour_cools: float

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"cache.{f.name} must be a finite number, got {v!r}")
        if not 0 <= self.decode_cold_s < 60:
            raise ValueError(f"cache.decode_cold_s must be seconds in [0, 60), got {self.decode_cold_s!r}")
        if not 1 <= self.warm_steps <= 10_000:
            raise ValueError(f"cache.warm_steps must be in [1, 10000], got {self.warm_steps!r}")
        for name in ("prefill_cools", "neighbour_cools"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"cache.{name} must be in [0, 1], got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: object) -> "CacheCosts":
        """From a profile's ``cache`` object; raises ValueError naming a missing or bad field."""
        return from_object(cls, d, "cache")

    def as_dict(self) -> dict:
        return asdict(self)


class Warmth:
    """One node's warmth (starts warm: a served node has run its warm-up)."""

    def __init__(self, costs: CacheCosts | None) -> None:
        self.costs = costs
        self.w = 1.0

    def step_extra(self, prefill: bool, decode: bool) -> float:
        """Apply one step (a prefill part, a decode part, or both) and return the
        seconds its decode part spends beyond a warm one."""
        c = self.costs
        if c is None:
            return 0.0
        if prefill:
            self.w *= 1.0 - c.prefill_cools
        if not decode:
            return 0.0
        extra = c.decode_cold_s * (1.0 - self.w)
        self.w = min(1.0, self.w + 1.0 / c.warm_steps)
        return extra

    def neighbour_step(self, prefill: bool = False, decode: bool = True) -> None:
        """Another node on the same host ran a step (a prefill part, a decode part, or both)."""
        c = self.costs
        if c is None:
            return
        if prefill:
            self.w *= 1.0 - c.prefill_cools
        if decode:
            self.w *= 1.0 - c.neighbour_cools
