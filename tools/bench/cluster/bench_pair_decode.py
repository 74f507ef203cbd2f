"""What a pair's redundant copy costs its decode steps (docs/benchmarks.md;
docs/cluster.md, "Pairs and roles").

The same ``--concurrency`` greedy streams (short prompts, long answers, all
sent at once) on three clusters of two pinned nodes (``bench_pairs``'s
configurations, the pair with its scheduler off so that nothing moves):

- ``pair``:  each node decodes about half the streams and copies each
             step's new KV to its partner (and writes its partner's);
- ``mixed``: the same split over two nodes, no copies: the pair's
             difference from it is the copy's cost per step;
- ``1p1d``:  the decode node runs every stream (a batch twice as large).

Per configuration and round: the median over streams of each stream's
median inter-token gap (ITL), its p99 gap, TPOT, and the node processes'
CPU time per token generated (which a shared host's load stretches far
less than the gaps); rounds alternate the order.

    .venv/bin/python -m tools.bench.cluster.bench_pair_decode [--rounds 3] [--concurrency 8] [--max-tokens 192]

Prints a table and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tools._twoproc import write_results  # noqa: E402
from tools.bench.cluster.bench_pairs import config_file  # noqa: E402
from tools.bench.cluster.bench_recovery import cluster, stream  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402

CONFIGS = ("pair", "mixed", "1p1d")


def node_cpu_s(tag: str) -> float:
    """CPU seconds the node processes of cluster ``tag`` used so far (their
    command lines name its keys folder; /proc, Linux)."""
    total = 0.0
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"node" in cmd and any(a.endswith(f"keys-{tag}".encode()) for a in cmd):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            continue
    return total


def one(base: str, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """Every prompt streamed at once; the streams' gaps, summarised, and the
    nodes' CPU time per token (what a shared host's load does not stretch)."""
    cpu = node_cpu_s(tag)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        res = list(pool.map(lambda p: stream(base, p, max_tokens), prompts))
    cpu = node_cpu_s(tag) - cpu
    itl = [[b - a for a, b in zip(t, t[1:])] for t, _, _ in res if len(t) > 2]
    gaps = sorted(g for s in itl for g in s)
    return {"streams": len(itl), "errors": sum(e is not None for _, _, e in res),
            "itl_median_s": statistics.median(statistics.median(s) for s in itl),
            "itl_p99_s": gaps[int(0.99 * (len(gaps) - 1))],
            "tpot_s": statistics.median((t[-1] - t[0]) / (len(t) - 1) for t, _, _ in res if len(t) > 2),
            "cpu_ms_per_token": cpu * 1e3 / max(1, sum(len(t) for t, _, _ in res))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--deadline", type=float, default=30.0)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_pair_decode.json"))
    args = ap.parse_args()
    if args.rounds < 1 or args.concurrency < 1 or args.prompt_len < 1 or args.max_tokens < 3:
        ap.error("--rounds, --concurrency and --prompt-len must be >= 1, --max-tokens >= 3")
    args.lengths = [args.prompt_len]                 # bench_recovery.cluster sizes the nodes by them
    configs = tuple(c for c in CONFIGS if c in args.configs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        for rnd in range(args.rounds):
            rng = random.Random(rnd)
            prompts = [[rng.randrange(1, 40000) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
            for name in configs[rnd % len(configs):] + configs[:rnd % len(configs)]:
                flags, node_flags = config_file(name, tmp)
                if name == "pair":                   # nothing moves: only the copies differ from mixed
                    Path(flags[1]).write_text(Path(flags[1]).read_text().replace(
                        "pairs = true\n", "pairs = true\npair_scheduler = false\n"))
                with cluster(f"{name}-{rnd}", args, tmp, flags, node_flags) as (base, _):
                    stream(base, [7, 8, 9], 4)       # warm-up
                    row = dict(one(base, prompts, args.max_tokens, f"{name}-{rnd}"), config=name, round=rnd,
                               loadavg=os.getloadavg()[0])
                rows.append(row)
                print(f"round {rnd} {name}: median ITL {row['itl_median_s'] * 1e3:.1f} ms, p99 gap "
                      f"{row['itl_p99_s'] * 1e3:.1f} ms, TPOT {row['tpot_s'] * 1e3:.1f} ms, node CPU "
                      f"{row['cpu_ms_per_token']:.2f} ms/token ({row['streams']} "
                      f"streams, {row['errors']} errors, load {row['loadavg']:.1f})", flush=True)
    print(f"\n{args.concurrency} streams, {args.prompt_len}-token prompts, {args.max_tokens} tokens each\n"
          "| configuration | median ITL | p99 gap | TPOT | ITL over mixed | node CPU per token |\n"
          "|---|---|---|---|---|---|")
    med = {c: statistics.median(r["itl_median_s"] for r in rows if r["config"] == c) for c in configs}
    for c in configs:
        p99 = statistics.median(r["itl_p99_s"] for r in rows if r["config"] == c)
        tpot = statistics.median(r["tpot_s"] for r in rows if r["config"] == c)
        ratio = f"{med[c] / med['mixed']:.3f}x" if "mixed" in med else "-"
        cpu = statistics.median(r["cpu_ms_per_token"] for r in rows if r["config"] == c)
        print(f"| {c} | {med[c] * 1e3:.1f} ms | {p99 * 1e3:.1f} ms | {tpot * 1e3:.1f} ms | {ratio} | {cpu:.2f} ms |")
    print(f"CPU: {machine_info().get('cpu_model', '?')}, model {args.model}, one core per node, shared host")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
