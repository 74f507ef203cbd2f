"""Serving metrics from request records: pure functions, no I/O, no clock.

Definitions follow vLLM's ``bench serve`` so the two tools' numbers compare:

- TTFT  time to the first non-empty chunk (client.py explains the timing).
- TPOT  per request, ``(E2EL - TTFT) / (output_tokens - 1)``; requests with at
        most one output token have no TPOT (and count as TPOT 0 for goodput).
- ITL   every gap between consecutive non-empty chunks, pooled over requests.
- E2EL  time to ``data: [DONE]``.
- goodput  successful requests meeting every given SLO, per second.

Only successful requests enter latencies and token totals; failures are
counted and their messages grouped.  Each latency gets mean, median, std and
the requested percentiles (numpy's linear interpolation, as vLLM), in ms; a
latency with no samples reports ``None`` rather than a made-up 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from tools.loadgen.client import RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2el")
LATENCY_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(frozen=True)
class Slo:
    """Goodput service-level objectives in ms; ``None`` means no limit."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"goodput {name[:-3]} must be >= 0 ms, got {value}")

    @classmethod
    def parse(cls, items: Iterable[str]) -> "Slo":
        """``["ttft:500", "tpot:50"]`` -> Slo.  Raises ValueError with a one-line reason."""
        limits: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"bad --goodput item {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
            try:
                limits[name + "_ms"] = float(value)
            except ValueError:
                raise ValueError(f"bad --goodput item {item!r}: {value!r} is not a number") from None
        return cls(**limits)

    def as_dict(self) -> dict[str, float]:
        return {k[:-3]: v for k, v in vars(self).items() if v is not None}

    def met_by(self, ttft_s: float, tpot_s: float, e2el_s: float) -> bool:
        return ((self.ttft_ms is None or ttft_s * 1e3 <= self.ttft_ms)
                and (self.tpot_ms is None or tpot_s * 1e3 <= self.tpot_ms)
                and (self.e2el_ms is None or e2el_s * 1e3 <= self.e2el_ms))


def percentile_label(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (vLLM's key spelling: ``p99_ttft_ms``)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def request_tpot(rec: RequestRecord) -> float | None:
    """Seconds per output token after the first; None with <= 1 token."""
    if rec.ttft is None or rec.output_tokens <= 1:
        return None
    return (rec.e2el - rec.ttft) / (rec.output_tokens - 1)


def summarize(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean/median/std/percentiles of ``values_s`` (seconds) as ``*_{name}_ms`` keys."""
    out: dict[str, float | None] = {}
    if len(values_s) == 0:
        out[f"mean_{name}_ms"] = out[f"median_{name}_ms"] = out[f"std_{name}_ms"] = None
        for p in percentiles:
            out[f"p{percentile_label(p)}_{name}_ms"] = None
        return out
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out[f"mean_{name}_ms"] = float(ms.mean())
    out[f"median_{name}_ms"] = float(np.median(ms))
    out[f"std_{name}_ms"] = float(ms.std())
    for p in percentiles:
        out[f"p{percentile_label(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failure messages with how often each occurred, most frequent first."""
    counts = Counter(r.error or "unknown error" for r in records if not r.success)
    return dict(counts.most_common())


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    percentiles: Sequence[float] = (99,), slo: Slo | None = None) -> dict:
    """Every metric of a run as one flat dict (the JSON result's ``metrics``).

    ``duration_s`` is the wall time of the whole run; throughputs divide by it.
    Input tokens are the server's ``usage.prompt_tokens`` when it reported
    them (they include any chat template), else the dataset's count.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    ttfts, tpots, itls, e2els = [], [], [], []
    good = 0
    total_in = total_out = 0
    for r in ok:
        total_in += r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
        total_out += r.output_tokens
        ttft = r.ttft if r.ttft is not None else r.e2el
        tpot = request_tpot(r)
        ttfts.append(ttft)
        e2els.append(r.e2el)
        itls.extend(r.itl)
        if tpot is not None:
            tpots.append(tpot)
        if slo is not None and slo.met_by(ttft, tpot or 0.0, r.e2el):
            good += 1

    metrics: dict = {
        "duration": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "empty": sum(1 for r in ok if r.chunks == 0),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if slo is not None else None,
        # the share of all requests (failed ones too) that met every SLO: DistServe's attainment
        "slo_attainment": good / len(records) if slo is not None and records else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(summarize(name, values, percentiles))
    return metrics


def token_arrivals(rec: RequestRecord) -> list[tuple[float, float]]:
    """``(time since run start, tokens)`` for each non-empty chunk of ``rec``.

    With usage reported, the request's output tokens are spread evenly over
    its chunks (a chunk may carry several tokens, or a token no text).
    """
    if not rec.success or rec.ttft is None or rec.chunks == 0:
        return []
    per_chunk = rec.output_tokens / rec.chunks
    t = rec.start + rec.ttft
    out = [(t, per_chunk)]
    for gap in rec.itl:
        t += gap
        out.append((t, per_chunk))
    return out


def throughput_series(records: Sequence[RequestRecord], bin_s: float = 1.0
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per ``bin_s`` bin: bin starts, output tokens/s, completed requests/s."""
    if bin_s <= 0:
        raise ValueError("bin_s must be positive")
    ends = [r.start + r.e2el for r in records if r.success]
    arrivals = [a for r in records for a in token_arrivals(r)]
    horizon = max(ends + [t for t, _ in arrivals] + [0.0])
    nbins = int(horizon // bin_s) + 1
    tokens = np.zeros(nbins)
    done = np.zeros(nbins)
    for t, n in arrivals:
        tokens[int(t // bin_s)] += n
    for t in ends:
        done[int(t // bin_s)] += 1
    return np.arange(nbins) * bin_s, tokens / bin_s, done / bin_s
