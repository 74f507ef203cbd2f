"""A pair against 1P1D and against two mixed nodes, on the same two cores and
the same trace (docs/benchmarks.md; docs/cluster.md, "Pairs and roles";
AcceLLM §5).

Three clusters, each a real coordinator and two node processes (n1 on core
0, n2 on core 1, ``bench_recovery.cluster``), one at a time, in an order
rotated every round:

- ``pair``:   n1-n2 a pair (``[cluster].pairs``, the pair scheduler on):
              either node takes prompts, the other the decodes;
- ``1p1d``:   n1 prefill, n2 decode, with the prefill-queue bound
              (``[cluster].prefill_queue_factor``, its default);
- ``mixed``:  two mixed nodes with chunked prefill (``--prefill-chunk-tokens``).

The trace (one per round, the same for every configuration): Poisson
arrivals whose rate alternates between ``--high`` and ``--low`` requests/s
every ``--period`` seconds, for ``--duration`` seconds; each request is,
with probability ``--long-share``, a 1-2K-token prompt with a short answer
(16-32 tokens), else a short chat (32-128 tokens) with a long answer
(128-384 tokens); random token ids (no prefix-cache hits), greedy, the
bundled SmolLM2 by default. Per configuration: mean JCT (end-to-end
latency), p99 TBT (inter-token gaps) and p99 TTFT, over every request of
every round.

    .venv/bin/python -m tools.bench.cluster.bench_pairs [--rounds 3] [--duration 120] [--period 30]
    .venv/bin/python -m tools.bench.cluster.bench_pairs --rounds 1 --duration 20 --period 5   # a short run

Prints a table and writes JSON to results/ (the configurations' requests
and summaries). The host it runs on is named; a shared host's numbers are
its load's as much as kvd's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tools._twoproc import write_results  # noqa: E402
from tools.bench.cluster.bench_recovery import cluster, stream  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402

CONFIGS = ("pair", "1p1d", "mixed")


def trace(rng: random.Random, args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, max tokens) of one round (module docstring)."""
    out, t = [], 0.0
    while True:
        rate = args.high if int(t // args.period) % 2 == 0 else args.low
        t += rng.expovariate(rate)
        if t >= args.duration:
            return out
        if rng.random() < args.long_share:
            n, answer = rng.randint(1024, 2048), rng.randint(16, 32)
        else:
            n, answer = rng.randint(32, 128), rng.randint(128, 384)
        out.append((t, [rng.randrange(1, 40000) for _ in range(n)], answer))


def config_file(name: str, tmp: str) -> tuple[list[str], tuple[str, ...]]:
    """The daemons' flags (a config file) and the nodes' engine flags of ``name``."""
    path = os.path.join(tmp, f"{name}.toml")
    body = {"pair": "[cluster]\npairs = true\n[nodes.n1]\n[nodes.n2]\n",
            "1p1d": '[nodes.n1]\nrole = "prefill"\n[nodes.n2]\nrole = "decode"\n',
            "mixed": "[nodes.n1]\n[nodes.n2]\n"}[name]
    Path(path).write_text(body)
    return ["-c", path], (("--prefill-chunk-tokens", "256") if name == "mixed" else ())


def run(base: str, requests: list[tuple[float, list[int], int]]) -> list[dict]:
    """Send ``requests`` at their arrival times, each streamed on a thread; one row each."""
    rows: list[dict] = [{} for _ in requests]

    def one(i: int, ids: list[int], max_tokens: int, sent: float) -> None:
        times, _, error = stream(base, ids, max_tokens)
        gaps = [b - a for a, b in zip(times, times[1:])]
        rows[i] = {"prompt": len(ids), "max_tokens": max_tokens, "tokens": len(times), "error": error,
                   "ttft_s": times[0] - sent if times else None, "jct_s": times[-1] - sent if times else None,
                   "tbt_s": gaps}
    threads, t0 = [], time.perf_counter()
    for i, (at, ids, max_tokens) in enumerate(requests):
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        th = threading.Thread(target=one, args=(i, ids, max_tokens, time.perf_counter()), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(900)
    return rows


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if r and r["error"] is None and r["tokens"]]
    gaps = sorted(g for r in ok for g in r["tbt_s"])
    ttfts = sorted(r["ttft_s"] for r in ok)
    p99 = lambda xs: xs[int(0.99 * (len(xs) - 1))] if xs else None  # noqa: E731
    return {"requests": len(rows), "ok": len(ok), "mean_jct_s": statistics.fmean(r["jct_s"] for r in ok) if ok else None,
            "p99_tbt_s": p99(gaps), "p99_ttft_s": p99(ttfts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals a round")
    ap.add_argument("--period", type=float, default=30.0, help="seconds between two rate changes")
    ap.add_argument("--high", type=float, default=1.0, help="requests/s in the high periods")
    ap.add_argument("--low", type=float, default=0.2, help="requests/s in the low periods")
    ap.add_argument("--long-share", type=float, default=0.5, help="share of 1-2K-token prompts")
    ap.add_argument("--deadline", type=float, default=30.0)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_pairs.json"))
    args = ap.parse_args()
    for name in ("duration", "period", "high", "low"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name} must be > 0")
    if not 0 <= args.long_share <= 1:
        ap.error("--long-share must be in [0, 1]")
    args.lengths, args.max_tokens = [2048], 384          # bench_recovery.cluster sizes the nodes by them
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        for rnd in range(args.rounds):
            requests = trace(random.Random(100 + rnd), args)
            order = CONFIGS[rnd % 3:] + CONFIGS[:rnd % 3]
            for name in order:
                flags, node_flags = config_file(name, tmp)
                with cluster(f"{name}-{rnd}", args, tmp, flags, node_flags) as (base, _):
                    stream(base, [7, 8, 9], 2)                          # warm-up
                    rows = run(base, requests)
                results[name] += rows
                s = summary(rows)
                print(f"round {rnd} {name}: {s['ok']}/{s['requests']} ok, mean JCT {s['mean_jct_s']:.2f} s, "
                      f"p99 TBT {s['p99_tbt_s'] * 1e3:.0f} ms, p99 TTFT {s['p99_ttft_s']:.2f} s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    summaries = {name: summary(rows) for name, rows in results.items()}
    print("\n| configuration | requests ok | mean JCT | p99 TBT | p99 TTFT |\n|---|---|---|---|---|")
    for name, s in summaries.items():
        print(f"| {name} | {s['ok']}/{s['requests']} | {s['mean_jct_s']:.2f} s | {s['p99_tbt_s'] * 1e3:.0f} ms | "
              f"{s['p99_ttft_s']:.2f} s |")
    print(f"CPU: {machine_info().get('cpu_model', '?')}, model {args.model}, one core per node")
    write_results(args.out, [{"config": n, "summary": True, **s} for n, s in summaries.items()]
                  + [{"config": n, **r} for n, rows in results.items() for r in rows])


if __name__ == "__main__":
    main()
