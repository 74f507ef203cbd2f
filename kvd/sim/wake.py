"""What a node's first step after a wait for work costs beyond its own work.

A CPU whose thread waited for work does not come back at full speed: its
core halted (a virtual machine's vCPU is descheduled and its host runs other
tenants meanwhile; a bare-metal core drops to a deep C-state and a lower
clock), and the caches, the branch predictors and the clock come back over
the first milliseconds of the next step. It is a cost per wake, not per
token; it grows with the wait and levels off after a few seconds, and its
size follows the host's other work (docs/planning.md, "Waking up").

``WakeCosts`` is the profile's ``wake`` table: ``[[gap_s, extra_s], ...]``,
gaps rising and > 0, extras >= 0; the extra of a gap is linear between the
table's points, from 0 at a gap of 0, and the last point's extra past it.
The simulator adds it to the first step a node runs after its engine waited
(kvd/sim/node.py); the decode part's cold cache is apart (kvd/sim/warmth.py).
``kvd profile`` measures the table (tools/sim/profile_wake.py); a profile
without one has no wake cost. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WakeCosts:
    """A validated wake table (module docstring)."""

    table: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        ok = isinstance(self.table, (list, tuple)) and len(self.table) <= 64 and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(
                not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in p)
            and 0 < p[0] <= 3600 and 0 <= p[1] < 60 for p in self.table)
        if not ok:
            raise ValueError("wake must be a list of at most 64 [gap seconds in (0, 3600], extra seconds in "
                             f"[0, 60)] pairs, got {self.table!r}")
        if any(a[0] >= b[0] for a, b in zip(self.table, self.table[1:])):
            raise ValueError(f"wake's gaps must rise, got {[p[0] for p in self.table]}")
        object.__setattr__(self, "table", tuple((float(g), float(e)) for g, e in self.table))

    @classmethod
    def from_object(cls, d: object) -> "WakeCosts":
        """From a profile's ``wake`` value; raises ValueError saying what is wrong."""
        if not isinstance(d, (list, tuple)):
            raise ValueError(f"wake must be a list of [gap, extra] pairs, got {d!r}")
        return cls(tuple(d))

    def as_list(self) -> list[list[float]]:
        return [[g, e] for g, e in self.table]

    def extra(self, gap: float) -> float:
        """Seconds the first step after a wait of ``gap`` seconds takes beyond its work."""
        if gap <= 0 or not self.table:
            return 0.0
        g0, e0 = 0.0, 0.0
        for g1, e1 in self.table:
            if gap <= g1:
                return e0 + (e1 - e0) * (gap - g0) / (g1 - g0)
            g0, e0 = g1, e1
        return e0


def fit_wake(gaps: list[float], extras: list[float]) -> WakeCosts:
    """The table from measured ``extras`` (seconds beyond a back-to-back step) at
    rising ``gaps``: each clamped to [0, 60) and made non-decreasing (a longer wait
    never costs less; a dip is the measurement's noise)."""
    table, top = [], 0.0
    for g, e in zip(gaps, extras):
        top = max(top, min(max(e, 0.0), 59.0))
        table.append((float(g), top))
    return WakeCosts(tuple(table))
