"""The thread count of each one-call decode step, chosen from the step times the engine sees.

A decode step's team is as fast as its slowest thread at every barrier. On a host
where another process at the same priority shares one of the team's CPUs, the
thread on that CPU runs a fraction of the time, and a step on the whole team can
be several times slower than the same step on the threads that still have a CPU
to themselves (work claiming takes over what a held-up thread has not started,
but every barrier still waits for it to arrive). Which team size is fastest
therefore changes with the host's load, and only measuring tells.

``TeamSizer`` keeps, per batch-size class, a moving average of the seconds per
step of each candidate size, uses the fastest (the first candidate, the whole
team, unless another is ``MARGIN`` faster: a near tie is noise), and now and then runs one step on
another candidate to see whether the host changed (an exploring step costs at
most the difference between two sizes, once every ``explore_every`` steps). A
candidate never measured is measured first. The outputs do not depend on the
size: the decode executors compute every output's bits the same on any thread
count (kernels/plan_decode.py).

Pure and synchronous: the runner calls ``pick`` before a step and ``record``
after it, on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

EXPLORE_EVERY = 64           # steps of a class between two exploring steps
SMOOTHING = 0.3              # weight of a new step time in a candidate's moving average
CLASS_ROWS = (1, 4, 16)      # batch-size classes: rows <= 1, <= 4, <= 16, more
MARGIN = 0.1                 # another size replaces the default only when this much faster


class TeamSizer:
    """Per batch-size class, the fastest of ``sizes`` (threads per step) by measured
    step time. ``sizes`` must be positive; the first is the default while nothing is
    measured."""

    def __init__(self, sizes: Sequence[int], explore_every: int = EXPLORE_EVERY) -> None:
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"team sizes must be positive, got {list(sizes)}")
        if explore_every < 2:
            raise ValueError("explore_every must be >= 2")
        self.sizes = tuple(dict.fromkeys(sizes))
        self.explore_every = explore_every
        self._seconds: dict[tuple[int, int], float] = {}      # (class, size) -> moving average
        self._steps: dict[int, int] = {}                     # class -> steps seen
        self._explored: dict[int, int] = {}                  # class -> exploring steps taken

    @staticmethod
    def batch_class(rows: int) -> int:
        """The class of a step of ``rows`` rows: an index into CLASS_ROWS, or its length."""
        for i, limit in enumerate(CLASS_ROWS):
            if rows <= limit:
                return i
        return len(CLASS_ROWS)

    def best(self, rows: int) -> int:
        """The size a step of ``rows`` rows runs on when it does not explore."""
        c = self.batch_class(rows)
        measured = [s for s in self.sizes if (c, s) in self._seconds]
        if not measured:
            return self.sizes[0]
        fastest = min(measured, key=lambda s: self._seconds[(c, s)])
        default = self._seconds.get((c, self.sizes[0]))
        if default is not None and self._seconds[(c, fastest)] > (1 - MARGIN) * default:
            return self.sizes[0]            # near-equal: noise must not move steps off the default
        return fastest

    def pick(self, rows: int) -> int:
        """The size for the next step of ``rows`` rows: a candidate never measured in its
        class first, then the fastest, with every ``explore_every``-th step on another."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        c = self.batch_class(rows)
        for s in self.sizes:
            if (c, s) not in self._seconds:
                return s
        n = self._steps.get(c, 0)
        best = self.best(rows)
        if n % self.explore_every != self.explore_every - 1:
            return best
        others = [s for s in self.sizes if s != best]
        k = self._explored.get(c, 0)
        self._explored[c] = k + 1
        return others[k % len(others)]

    def record(self, rows: int, size: int, seconds: float) -> None:
        """A step of ``rows`` rows took ``seconds`` on ``size`` threads."""
        if size not in self.sizes or seconds < 0:
            return
        c = self.batch_class(rows)
        self._steps[c] = self._steps.get(c, 0) + 1
        old = self._seconds.get((c, size))
        self._seconds[(c, size)] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def seconds(self) -> dict[str, dict[int, float]]:
        """The moving averages, per class (``"<= 4 rows"``, ``"> 16 rows"``), per size."""
        out: dict[str, dict[int, float]] = {}
        for (c, s), v in sorted(self._seconds.items()):
            name = f"<= {CLASS_ROWS[c]} rows" if c < len(CLASS_ROWS) else f"> {CLASS_ROWS[-1]} rows"
            out.setdefault(name, {})[s] = v
        return out
