"""Simulated time: a clock and a queue of events.

``EventQueue.at(t, fn, *args)`` runs ``fn(*args)`` when the clock reaches
``t``; events at the same time run in the order they were scheduled (a
sequence number breaks ties), so a run is deterministic. ``now`` only moves
forward: scheduling into the past is a bug (ValueError). ``clock`` is a
zero-argument callable of the current time, for code that reads a clock
(the coordinator's routers take it in place of ``time.monotonic``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable


class EventQueue:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()
        self.processed = 0

    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` at time ``t`` (>= now)."""
        if not t >= self.now:                    # NaN too
            raise ValueError(f"event at {t} is before now ({self.now})")
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` ``delay`` (>= 0) seconds from now."""
        self.at(self.now + delay, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float = math.inf, max_events: int | None = None) -> int:
        """Process events in time order until none is left, the next lies past
        ``until`` (the clock then stops at ``until``) or ``max_events`` ran.
        Returns the number processed."""
        n = 0
        heap = self._heap
        while heap and heap[0][0] <= until and (max_events is None or n < max_events):
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)
            n += 1
        if not heap and until != math.inf and until > self.now:
            self.now = until
        elif heap and heap[0][0] > until and until > self.now:
            self.now = until
        self.processed += n
        return n
