"""``kvd profile``'s cache measurements: the numbers of kvd/sim/warmth.py.

On one running request (a decode step reads every weight once):

- warm: the median of the last steps of each ramp after a flush (below);
- ``decode_cold_s``: the median step right after the last-level cache was
  flushed (a buffer twice its size read and written, one byte a line),
  less the warm step;
- ``warm_steps``: after one flush, the steps until a step is warm again,
  fitted to the warmth model's linear return (least squares over a grid);
- ``prefill_cools``: the steps after one prefill call of another prompt on
  the same engine, fitted with ``warm_steps`` known;
- ``neighbour_cools``: a second engine of the same config (its own copy of
  the weights, as a second node on the host holds) steps in turn with this
  one; the steady step of this one, against the model's equilibrium;
- ``idle_cools`` and ``idle_full_s``: the steps right after the engine
  waited ``IDLE_GAPS`` seconds, each gap's coldness fitted as the prefill's
  is, then the linear-to-full model through them (``fit_idle``).

Each fit is clamped to its field's range (CacheCosts validates it).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from kvd.sim.warmth import CacheCosts

LLC_FALLBACK = 64 << 20
CACHE_ROUNDS = 6            # rounds of each measurement (two progress ticks a round)
IDLE_GAPS = (0.005, 0.015, 0.04, 0.3)   # seconds the engine waits before a measured step
IDLE_STEPS = 3              # steps timed after each gap (its coldness is fitted on them)


def llc_bytes() -> int:
    """The largest CPU cache's size (sysfs), or 64 MiB when sysfs does not say."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or LLC_FALLBACK


class Flusher:
    """Evicts the last-level cache: reads and writes a buffer twice its size."""

    def __init__(self, llc: int) -> None:
        self.buf = np.zeros(2 * llc, dtype=np.uint8)

    def flush(self) -> None:
        self.buf[::64] += 1


def _linear_return(warm: float, cold: float, k: float, start_cold: float, n: int, done: int = 0) -> list[float]:
    """The model's step times from coldness ``start_cold`` over ``n`` decode steps,
    ``done`` decode steps after the coldness began."""
    return [warm + cold * max(0.0, start_cold - (j + done) / k) for j in range(n)]


def _sq(pred: list[float], ys: list[float]) -> float:
    return sum((p - y) ** 2 for p, y in zip(pred, ys))


def measure_cache(engine, make_engine, ids, *, steps: int = 16, rounds: int = CACHE_ROUNDS,
                  progress=None) -> CacheCosts:
    """Measure ``engine`` (an LLMEngine with nothing running); ``make_engine()``
    builds the neighbour, ``ids(n)`` makes an n-token prompt. A round's ramps
    are ``2 * steps`` decode steps long; the warm step is the median of each
    flush ramp's last ``steps // 2`` (the same request at the same context:
    a decode step grows with its context, so a warm step taken elsewhere
    would read as a ramp that never ends)."""
    from engine.request import SamplingParams

    flusher = Flusher(llc_bytes())
    ramp_len, tail = 2 * steps, max(1, steps // 2)
    per_round = 4 * ramp_len + steps // 2 + len(IDLE_GAPS) * (IDLE_STEPS + ramp_len)
    long = SamplingParams(max_tokens=per_round + 2 * steps, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def timed(eng, n: int, before=None) -> list[float]:
        out = []
        for _ in range(n):
            if before is not None:
                before()
            t0 = time.perf_counter()
            eng.step()
            out.append(time.perf_counter() - t0)
        return out

    warm_s, cold_s, ramps, after_prefill = [], [], [], []
    after_idle: dict[float, list[list[float]]] = {g: [] for g in IDLE_GAPS}
    for r in range(rounds):                                 # a new request a round: short contexts
        engine.add_request(f"cache-a{r}", ids(32), long)
        engine.step()                                       # its prefill
        timed(engine, ramp_len)                             # back to steady
        cold_s.append(statistics.median(timed(engine, steps // 2, flusher.flush)))
        timed(engine, ramp_len)
        flusher.flush()
        ramp = timed(engine, ramp_len)
        ramps.append(ramp[:-tail])
        warm_s.append(statistics.median(ramp[-tail:]))
        engine.add_request(f"cache-p{r}", ids(64), one)     # one prefill call (beside a's decode)
        engine.step()
        after_prefill.append(timed(engine, ramp_len - tail))
        timed(engine, tail)
        for gap in IDLE_GAPS:                               # the engine waits for work, then steps
            time.sleep(gap)
            after_idle[gap].append(timed(engine, IDLE_STEPS))
            timed(engine, ramp_len)
        engine.abort_request(f"cache-a{r}")
        if progress is not None:
            progress.tick("cache")
    warm, cold = statistics.median(warm_s), max(0.0, statistics.median(cold_s) - statistics.median(warm_s))
    k = fit_warm_steps(warm, cold, [statistics.median(col) for col in zip(*ramps)])
    # the prefill call's step also decoded a (its cold part is not in the list): one step done
    c_p = fit_cooling(warm, cold, k, [statistics.median(col) for col in zip(*after_prefill)], done=1)
    idle = {g: fit_cooling(warm, cold, k, [statistics.median(col) for col in zip(*rows)])
            for g, rows in after_idle.items()}
    idle_cools, idle_full = fit_idle(idle)

    neighbour = make_engine()
    mine = []
    for r in range(rounds):
        engine.add_request(f"cache-n{r}", ids(32), long)
        neighbour.add_request(f"cache-b{r}", ids(32), long)
        engine.step()
        neighbour.step()
        for i in range(3 * steps):               # in turn; the first third reaches the equilibrium
            t0 = time.perf_counter()
            engine.step()
            if i >= steps:
                mine.append(time.perf_counter() - t0)
            neighbour.step()
        engine.abort_request(f"cache-n{r}")
        neighbour.abort_request(f"cache-b{r}")
        if progress is not None:
            progress.tick("cache")
    e = neighbour_cooling(warm, cold, k, statistics.median(mine))
    return CacheCosts(decode_cold_s=cold, warm_steps=k, prefill_cools=c_p, neighbour_cools=e,
                      idle_cools=idle_cools, idle_full_s=idle_full)


def fit_idle(coldness: dict[float, float]) -> tuple[float, float]:
    """``(idle_cools, idle_full_s)`` from the coldness measured after each idle
    gap: ``idle_cools`` is the longest gap's, ``idle_full_s`` the one (a grid
    of the gaps and their midpoints) whose ``idle_cools * min(1, g / full)``
    best fits the shorter gaps'."""
    gaps = sorted(coldness)
    top = coldness[gaps[-1]]
    if top <= 0:
        return 0.0, 1.0
    grid = sorted({*gaps, *((a + b) / 2 for a, b in zip(gaps, gaps[1:]))})
    full = min(grid, key=lambda f: sum((top * min(1.0, g / f) - coldness[g]) ** 2 for g in gaps))
    return top, full


def fit_warm_steps(warm: float, cold: float, ramp: list[float]) -> float:
    """``warm_steps`` whose linear return from cold best fits ``ramp`` (the step
    times after a flush), on a grid of quarter steps up to 4x the ramp's length."""
    if cold <= 0:
        return 1.0
    grid = [1 + i / 4 for i in range(16 * len(ramp))]
    return min(grid, key=lambda k: _sq(_linear_return(warm, cold, k, 1.0, len(ramp)), ramp))


def fit_cooling(warm: float, cold: float, k: float, times: list[float], done: int = 0) -> float:
    """The coldness (a share of the weights, grid of 1/50) that best explains
    ``times``, the decode steps that followed it (``done`` steps already ran)."""
    if cold <= 0:
        return 0.0
    grid = [i / 50 for i in range(51)]
    return min(grid, key=lambda c: _sq(_linear_return(warm, cold, k, c, len(times), done), times))


def neighbour_cooling(warm: float, cold: float, k: float, steady: float) -> float:
    """``neighbour_cools`` from the steady step of a node stepping in turn with a
    neighbour: warmth ``w`` before each of its steps holds when
    ``min(1, w + 1/k) * (1 - e) = w``."""
    if cold <= 0:
        return 0.0
    w = min(1.0, max(0.0, 1.0 - (steady - warm) / cold))
    return min(1.0, max(0.0, 1.0 - w / min(1.0, w + 1.0 / k)))
