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

The trace (one per round and rate, the same for every configuration):
Poisson arrivals whose rate alternates between a high rate and ``--low``
requests/s (default: a fifth of the high one) every ``--period`` seconds,
for ``--duration`` seconds; each request is, with probability
``--long-share``, a 1-2K-token prompt with a short answer (16-32 tokens),
else a short chat (32-128 tokens) with a long answer (128-384 tokens);
random token ids (no prefix-cache hits), greedy, the bundled SmolLM2 by
default. Per configuration and high rate: mean JCT (end-to-end latency),
p99 TBT (inter-token gaps) and p99 TTFT over every request of every round,
with what explains them: mean TTFT, the mean wait before a prompt's
prefill (its TTFT less the prefill of a prompt that long on the idle
cluster, measured at the start of each cluster), median TBT, the share of
gaps over 250 ms (a decode that waited behind a prefill) and the pair's
handoffs.

The rates are a sweep (``--high R [R ...]``). The knee is where one
node's prefill stops keeping up with the high rate: ``high * long_share *
1536 * c`` reaches 1, ``c`` the idle cluster's prefill seconds per token
that each cluster line prints (1.3 ms on a quiet core with SmolLM2: about
1 request/s at a long share of 0.5; 4-6 ms on a loaded shared host: about
0.3). Below it a pair's prompts run on one node while the other decodes,
and its decodes never wait behind a prompt; past it both nodes of the
pair prefill at once (no node is left to take the decodes, which then
wait as a mixed node's do) and 1P1D queues prompts on its one prefill
node.

    .venv/bin/python -m tools.bench.cluster.bench_pairs [--rounds 3] [--duration 120] [--period 30] [--high 0.4 1.0]
    .venv/bin/python -m tools.bench.cluster.bench_pairs --rounds 1 --duration 20 --period 5   # a short run

Prints a table per high rate and writes JSON to results/ (every request's
row: arrival, TTFT, JCT, its gaps; and the summaries). The host it runs on
is named; a shared host's numbers are its load's as much as kvd's.
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

from kvd.ctl import request as admin_request  # noqa: E402
from tools._twoproc import write_results  # noqa: E402
from tools.bench.cluster.bench_recovery import cluster, stream  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402

CONFIGS = ("pair", "1p1d", "mixed")
STALL_S = 0.25            # an inter-token gap this long: the stream waited behind a prefill
CALIBRATE_TOKENS = 1024   # the idle cluster's prefill of a prompt this long scales the waits


def trace(rng: random.Random, args: argparse.Namespace, high: float) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, max tokens) of one round at ``high`` requests/s (module docstring)."""
    out, t = [], 0.0
    low = args.low if args.low is not None else high / 5
    while True:
        rate = high if int(t // args.period) % 2 == 0 else low
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


def run(base: str, requests: list[tuple[float, list[int], int]], prefill_s: float) -> list[dict]:
    """Send ``requests`` at their arrival times, each streamed on a thread;
    one row each. ``prefill_s``: the idle cluster's prefill per prompt
    token (a row's ``wait_s`` is its TTFT less its prompt's share)."""
    rows: list[dict] = [{} for _ in requests]
    t0 = time.perf_counter()

    def one(i: int, ids: list[int], max_tokens: int, sent: float) -> None:
        times, _, error = stream(base, ids, max_tokens)
        gaps = [round(b - a, 5) for a, b in zip(times, times[1:])]
        rows[i] = {"prompt": len(ids), "max_tokens": max_tokens, "tokens": len(times), "error": error,
                   "at_s": round(sent - t0, 4), "ttft_s": times[0] - sent if times else None,
                   "wait_s": times[0] - sent - prefill_s * len(ids) if times else None,
                   "jct_s": times[-1] - sent if times else None, "tbt_s": gaps}
    threads = []
    for i, (at, ids, max_tokens) in enumerate(requests):
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        th = threading.Thread(target=one, args=(i, ids, max_tokens, time.perf_counter()), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(900)
    return rows


def calibrate(base: str, rng: random.Random) -> float:
    """Seconds of prefill per prompt token on the idle cluster (the best
    of two ``CALIBRATE_TOKENS``-token prompts, one token each)."""
    best = float("inf")
    for _ in range(2):
        ids = [rng.randrange(1, 40000) for _ in range(CALIBRATE_TOKENS)]
        sent = time.perf_counter()
        times, _, _ = stream(base, ids, 1)
        best = min(best, (times[0] - sent) if times else best)
    return best / CALIBRATE_TOKENS


def handoffs(sock: str) -> int:
    """Handoffs the coordinator made so far (``kvctl nodes``)."""
    return sum(n.get("handoffs", 0) for n in admin_request(sock, {"cmd": "nodes"})["nodes"])


def summary(rows: list[dict], moved: int = 0) -> dict:
    ok = [r for r in rows if r and r["error"] is None and r["tokens"]]
    gaps = sorted(g for r in ok for g in r["tbt_s"])
    ttfts = sorted(r["ttft_s"] for r in ok)
    p99 = lambda xs: xs[int(0.99 * (len(xs) - 1))] if xs else None  # noqa: E731
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {"requests": len(rows), "ok": len(ok), "mean_jct_s": mean([r["jct_s"] for r in ok]),
            "p99_tbt_s": p99(gaps), "p99_ttft_s": p99(ttfts), "mean_ttft_s": mean(ttfts),
            "mean_wait_s": mean([r["wait_s"] for r in ok]), "p50_tbt_s": gaps[len(gaps) // 2] if gaps else None,
            "stall_share": sum(g > STALL_S for g in gaps) / len(gaps) if gaps else None, "handoffs": moved}


def line(s: dict) -> str:
    """One summary in words (the round lines and the table's explanation)."""
    if not s["ok"]:
        return f"0/{s['requests']} ok"
    return (f"{s['ok']}/{s['requests']} ok, mean JCT {s['mean_jct_s']:.2f} s, p99 TBT {s['p99_tbt_s'] * 1e3:.0f} ms, "
            f"p99 TTFT {s['p99_ttft_s']:.2f} s, mean TTFT {s['mean_ttft_s']:.2f} s, mean wait "
            f"{s['mean_wait_s']:.2f} s, p50 TBT {s['p50_tbt_s'] * 1e3:.0f} ms, gaps > {STALL_S * 1e3:.0f} ms "
            f"{s['stall_share']:.1%}, handoffs {s['handoffs']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals a round")
    ap.add_argument("--period", type=float, default=30.0, help="seconds between two rate changes")
    ap.add_argument("--high", type=float, nargs="+", default=[1.0],
                    help="requests/s in the high periods; several: a sweep, each rate its own table")
    ap.add_argument("--low", type=float, default=None, help="requests/s in the low periods (default: high / 5)")
    ap.add_argument("--long-share", type=float, default=0.5, help="share of 1-2K-token prompts")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--deadline", type=float, default=30.0)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_pairs.json"))
    args = ap.parse_args()
    for name in ("duration", "period"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name} must be > 0")
    if not all(h > 0 for h in args.high) or (args.low is not None and not args.low > 0):
        ap.error("--high and --low must be > 0")
    if not 0 <= args.long_share <= 1:
        ap.error("--long-share must be in [0, 1]")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    args.lengths, args.max_tokens = [2048], 384          # bench_recovery.cluster sizes the nodes by them
    configs = tuple(c for c in CONFIGS if c in args.configs)
    results: dict[tuple[float, str], list[dict]] = {(h, c): [] for h in args.high for c in configs}
    moved: dict[tuple[float, str], int] = dict.fromkeys(results, 0)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        for rnd in range(args.rounds):
            for high in args.high:
                requests = trace(random.Random(100 + rnd), args, high)
                order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
                for name in order:
                    flags, node_flags = config_file(name, tmp)
                    with cluster(f"{name}-{rnd}-{high}", args, tmp, flags, node_flags) as (base, sock):
                        stream(base, [7, 8, 9], 2)                          # warm-up
                        prefill_s = calibrate(base, random.Random(7))
                        before = handoffs(sock)
                        rows = run(base, requests, prefill_s)
                        n = handoffs(sock) - before
                    results[(high, name)] += [dict(r, round=rnd, high=high) if r else r for r in rows]
                    moved[(high, name)] += n
                    print(f"round {rnd} high {high:g}/s {name}: {line(summary(rows, n))}, idle prefill "
                          f"{prefill_s * 1e3:.2f} ms/token, load {os.getloadavg()[0]:.1f}", flush=True)
    summaries = {key: summary(rows, moved[key]) for key, rows in results.items()}
    for high in args.high:
        print(f"\nhigh {high:g} req/s, low {args.low if args.low is not None else high / 5:g} req/s"
              "\n| configuration | requests ok | mean JCT | p99 TBT | p99 TTFT |\n|---|---|---|---|---|")
        for name in configs:
            s = summaries[(high, name)]
            if s["ok"]:
                print(f"| {name} | {s['ok']}/{s['requests']} | {s['mean_jct_s']:.2f} s | {s['p99_tbt_s'] * 1e3:.0f} ms | "
                      f"{s['p99_ttft_s']:.2f} s |")
        for name in configs:
            print(f"{name}: {line(summaries[(high, name)])}")
    print(f"CPU: {machine_info().get('cpu_model', '?')}, model {args.model}, one core per node")
    write_results(args.out, [{"config": n, "high": h, "summary": True, **s} for (h, n), s in summaries.items()]
                  + [{"config": n, **r} for (_, n), rows in results.items() for r in rows])


if __name__ == "__main__":
    main()
