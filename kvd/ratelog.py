"""Rate-limited log lines: a flood of one kind of event writes one line per interval.

A peer that sends a thousand bad messages a second must not write a
thousand WARNING lines a second (the disk, journald's rate limit, and the
one line an operator needs, drowned): the events are *counted* where they
happen (metrics, ``kvctl status``), and logged here at most once per key per
``interval`` seconds; the next line that gets through says how many of its
kind were left out since the previous one. Lines suppressed at the end of a
burst are not logged, only counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

LOG_EVERY_S = 10.0      # the default interval: one line per kind of event per 10 s
MAX_KEYS = 1024         # kinds remembered; beyond, the oldest is forgotten (a fresh line)


class RateLimitedLog:
    """One line per ``key`` per ``interval`` seconds through ``logger``.

    Not thread-safe: one event loop logs through it. The state is per
    instance (no globals): each loop or link that logs owns one."""

    def __init__(self, logger: logging.Logger, interval: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval >= 0:
            raise ValueError("interval must be >= 0")
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._state: dict[object, list] = {}     # key -> [time of its last line, suppressed since]

    def log(self, level: int, key: object, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless a line of ``key`` went out less than
        ``interval`` ago (then count it). Returns whether it was logged."""
        now = self.clock()
        state = self._state.get(key)
        if state is not None and now - state[0] < self.interval:
            state[1] += 1
            return False
        suppressed = state[1] if state is not None else 0
        if state is None and len(self._state) >= MAX_KEYS:
            del self._state[next(iter(self._state))]
        self._state[key] = [now, 0]
        if suppressed:
            msg += " (%d more like it in the last %.0fs, not logged)"
            args = (*args, suppressed, now - state[0])
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: object, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)
