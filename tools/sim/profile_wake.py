"""``kvd profile``'s wake measurement: the table of kvd/sim/wake.py.

A prefill of ``WAKE_TOKENS`` fresh tokens (one engine step, nothing cached)
is timed right after the engine waited each of ``WAKE_GAPS`` seconds, and
back to back (a step right after a step); a gap's extra is the median of its
rounds less the median back-to-back one. Rounds take the gaps in an order
rotated each round, so a drift of the host's speed reaches every gap. About
``rounds * (sum(WAKE_GAPS) + ...)`` seconds: 25 s at the defaults.
"""

from __future__ import annotations

import statistics
import time

from kvd.sim.wake import WakeCosts, fit_wake

WAKE_GAPS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)   # seconds the engine waits before a timed step
WAKE_TOKENS = 16                               # the timed prefill's new tokens: a cost per wake, not per token
WAKE_ROUNDS = 3


def measure_wake(engine, ids, *, rounds: int = WAKE_ROUNDS, gaps=WAKE_GAPS, progress=None) -> WakeCosts:
    """Measure ``engine`` (an LLMEngine with nothing running; ``ids(n)`` makes an
    n-token prompt). Leaves nothing running and the prefix cache flushed."""
    from engine.request import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    counter = iter(range(1 << 30))

    def prefill() -> float:
        engine.add_request(f"wake-{next(counter)}", ids(WAKE_TOKENS), one)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        engine.pool.flush()
        return dt

    after: dict[float, list[float]] = {g: [] for g in gaps}
    back_to_back: list[float] = []
    for r in range(rounds):
        order = list(gaps[r % len(gaps):]) + list(gaps[:r % len(gaps)])
        for gap in order:
            prefill()
            back_to_back.append(prefill())          # a step right after a step
            time.sleep(gap)
            after[gap].append(prefill())
        if progress is not None:
            progress.tick("wake")
    base = statistics.median(back_to_back)
    return fit_wake(list(gaps), [statistics.median(after[g]) - base for g in gaps])
