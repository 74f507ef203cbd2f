"""The simulator past one machine: a cluster of ``--nodes`` (1,000 by default)
mixed nodes with prompt-tree routing, swept over request rates around its
capacity, on a profile.

For each rate it simulates ``--seconds`` of Poisson traffic (random prompts
of ``--input-len`` tokens sharing ``--prefixes`` prefixes of half that
length, ``--output-len`` tokens out), and reports the wall time the
simulation took, events per wall second, the router's wall time per routing
decision (the coordinator's real PromptTreeRouter and global prompt trees,
at that many nodes), the CPU time it got (on a shared host, less than the
wall time), the output throughput, p50/p99 TTFT, and whether the
cluster kept up: every request completed and the queue did not grow over
the window (the median TTFT of the last quarter of the requests, by send
time, within 2x that of the first quarter; a short window hides a queue
that grows slowly, so the first quarter is the baseline, not a lower
rate's run). The lowest rate that does not keep up is where it saturates. The prompts are token ids made here (the
dataset code's tokenizer would dominate at this scale); the arrival process
is kvd-loadgen's (``start_offsets``).

    .venv/bin/python -m tools.bench.sim.bench_scale --profile results/sim/profile-smollm2.json \\
        [--nodes 1000] [--seconds 20] [--rates 0.5,1,1.5] (per node)

Writes results/sim/bench_scale.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tools.sim.run import load_shape, simulate  # noqa: E402
from tools.sim.workload import WorkloadOptions  # noqa: E402
from tools.loadgen.datasets import Conversation, Turn  # noqa: E402
from tools.loadgen.metrics import compute_metrics  # noqa: E402


def workload(n: int, input_len: int, output_len: int, prefixes: int, seed: int):
    rng = random.Random(seed)
    ids = list(range(100, 30000))             # shared int objects: an hour's prompts are millions of ids
    heads = [[rng.choice(ids) for _ in range(input_len // 2)] for _ in range(prefixes)]
    prompts = {}
    convs = []
    for i in range(n):
        key = f"p{i}"
        prompts[key] = heads[i % prefixes] + [rng.choice(ids) for _ in range(input_len - input_len // 2)]
        convs.append(Conversation((Turn(key, input_len, output_len),)))
    return convs, (lambda text: prompts[text])


def quarter_ttfts(records) -> tuple[float, float]:
    """Median TTFT (s) of the first and of the last quarter of the requests, by send time."""
    done = sorted((r for r in records if r.ttft is not None), key=lambda r: r.start)
    q = max(1, len(done) // 4)
    return statistics.median(r.ttft for r in done[:q]), statistics.median(r.ttft for r in done[-q:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rates", default="0.5,1,1.5", help="requests per second per node")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "results/sim/bench_scale.json"))
    args = ap.parse_args()
    shape = load_shape(None, args.profile, args.nodes, 0, "prompt-tree")
    rows = []
    for per_node in (float(r) for r in args.rates.split(",")):
        rate = per_node * args.nodes
        n = max(1, int(rate * args.seconds))
        convs, encode = workload(n, args.input_len, args.output_len, args.prefixes, seed=0)
        t0, cpu0 = time.perf_counter(), time.process_time()
        records, duration, cluster = simulate(shape, convs, WorkloadOptions(request_rate=rate, seed=0), encode)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        m = compute_metrics(records, duration, [50, 99])
        d = cluster.describe()
        first, last = quarter_ttfts(records)
        kept_up = m["completed"] == n and last <= 2 * first
        row = {"nodes": args.nodes, "rate_per_node": per_node, "requests": n, "simulated_s": round(duration, 1),
               "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "events_per_s": round(cluster.events.processed / wall),
               "route_us_per_decision": d["route_us_per_decision"], "steps": d["steps"],
               "output_throughput": round(m["output_throughput"], 1),
               "median_ttft_ms": round(m["median_ttft_ms"], 1), "p99_ttft_ms": round(m["p99_ttft_ms"], 1),
               "ttft_first_quarter_ms": round(1e3 * first, 1), "ttft_last_quarter_ms": round(1e3 * last, 1),
               "kept_up": kept_up}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from tools.loadgen.report import machine_info
    out.write_text(json.dumps({"machine": machine_info(), "profile": args.profile, "rows": rows}, indent=1))
    print("| nodes | req/s per node | requests | simulated s | wall s | CPU s | route µs/decision | "
          "p50 TTFT ms | p99 TTFT ms | TTFT first / last quarter ms | kept up |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r['rate_per_node']:g} | {r['requests']} | {r['simulated_s']} | {r['wall_s']} | "
              f"{r['cpu_s']} | {r['route_us_per_decision']} | {r['median_ttft_ms']} | {r['p99_ttft_ms']} | "
              f"{r['ttft_first_quarter_ms']} / {r['ttft_last_quarter_ms']} | {'yes' if r['kept_up'] else 'no'} |")
    kept = [r["rate_per_node"] for r in rows if r["kept_up"]]
    lost = [r["rate_per_node"] for r in rows if not r["kept_up"]]
    if lost and kept and min(lost) > max(kept):
        print(f"{args.nodes} nodes saturate between {max(kept):g} and {min(lost):g} req/s per node "
              f"({max(kept) * args.nodes:g}-{min(lost) * args.nodes:g} req/s)")
    elif lost:
        print(f"{args.nodes} nodes did not keep up at {', '.join(f'{r:g}' for r in lost)} req/s per node")
    else:
        print(f"{args.nodes} nodes kept up at every rate swept (up to {max(kept):g} req/s per node)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
