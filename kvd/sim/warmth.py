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
  this node's own prefill would (``prefill_cools``: the cache is shared);
- idle time: a node whose engine waited ``g`` seconds for work loses
  ``idle_cools * min(1, g / idle_full_s)`` of its warmth (whatever else
  the machine runs meanwhile fills the cache: other processes, other
  tenants of a virtual machine's host while its CPU halts).

Warmth ``w`` is the cached share, in [0, 1]; each decode step on the node
brings ``1 / warm_steps`` of the weights back (a cache's insertion policy does
not keep all of one pass: it takes several). Reading the evicted weights from
memory takes ``decode_cold_s * (1 - w)`` beyond a one-row step's warm time,
``w`` read after the step's own prefill part (the engine runs that part
first). A batched step whose warm time exceeds the one-row step's by
``hidden`` seconds does that reading under its arithmetic, and pays only what
is left: ``max(0, decode_cold_s * (1 - w) - hidden)`` on top of
StepCosts.decode_seconds (a step takes the longer of its compute and its
memory traffic).
Nothing else changes ``w``. Pure Python; ``kvd profile`` measures the
numbers (tools/sim/profile_cache.py); a profile without the two idle fields
keeps an idle node's warmth.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from kvd.sim.costs import from_object


@dataclass(frozen=True)
class CacheCosts:
    """A profile's ``cache`` object: ``decode_cold_s`` seconds >= 0,
    ``warm_steps`` >= 1, ``prefill_cools``, ``neighbour_cools`` and
    ``idle_cools`` in [0, 1], ``idle_full_s`` seconds > 0 (optional: no idle
    cooling)."""

    decode_cold_s: float
    warm_steps: float
    prefill_cools: float
    neighbour_cools: float
    idle_cools: float = 0.0
    idle_full_s: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"cache.{f.name} must be a finite number, got {v!r}")
        if not 0 <= self.decode_cold_s < 60:
            raise ValueError(f"cache.decode_cold_s must be seconds in [0, 60), got {self.decode_cold_s!r}")
        if not 1 <= self.warm_steps <= 10_000:
            raise ValueError(f"cache.warm_steps must be in [1, 10000], got {self.warm_steps!r}")
        for name in ("prefill_cools", "neighbour_cools", "idle_cools"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"cache.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not 0 < self.idle_full_s <= 3600:
            raise ValueError(f"cache.idle_full_s must be seconds in (0, 3600], got {self.idle_full_s!r}")

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

    def step_extra(self, prefill: bool, decode: bool, hidden: float = 0.0) -> float:
        """Apply one step (a prefill part, a decode part, or both) and return the
        seconds its decode part spends beyond a warm one, of which ``hidden``
        seconds >= 0 overlap its compute (module docstring)."""
        c = self.costs
        if c is None:
            return 0.0
        if prefill:
            self.w *= 1.0 - c.prefill_cools
        if not decode:
            return 0.0
        extra = max(0.0, c.decode_cold_s * (1.0 - self.w) - hidden)
        self.w = min(1.0, self.w + 1.0 / c.warm_steps)
        return extra

    def idle(self, seconds: float) -> None:
        """The node's engine waited ``seconds`` for work before its next step."""
        c = self.costs
        if c is None or seconds <= 0:
            return
        self.w *= 1.0 - c.idle_cools * min(1.0, seconds / c.idle_full_s)

    def neighbour_step(self, prefill: bool = False, decode: bool = True) -> None:
        """Another node on the same host ran a step (a prefill part, a decode part, or both)."""
        c = self.costs
        if c is None:
            return
        if prefill:
            self.w *= 1.0 - c.prefill_cools
        if decode:
            self.w *= 1.0 - c.neighbour_cools
