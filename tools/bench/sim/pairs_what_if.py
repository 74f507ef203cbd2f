"""``bench_pairs``' trace in the simulator: a pair against 1P1D and two mixed
nodes on a profile, beside a measured ``bench_pairs`` run, and on the same
profile with batching made free (what a memory-bound accelerator's decode
does: a step of B requests takes what a step of one takes).

Each configuration is ``bench_pairs``' own (its config files; mixed nodes
chunk prompts at 256 tokens; nodes of 2048 device and host blocks, one
thread each, colocated on one host of two cores, as ``bench_recovery``
pins them), fed the same trace (``bench_pairs.trace``, the same seeds per
round and rate), and summarised by ``bench_pairs.summary``: mean JCT, p99
TBT, p99 TTFT over every request of every round, and the pair's mean JCT
against the better of the other two (AcceLLM's measure): on this machine's
costs, and on a machine's where batching costs nothing.

    .venv/bin/python -m tools.bench.sim.pairs_what_if --profile results/sim/profile.json \\
        [--high 0.7 1.0] [--rounds 1] [--duration 120] [--period 30] [--long-share 0.5] \\
        [--measured results/bench_pairs.json]

Prints a table per rate and writes results/sim/pairs_what_if.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tools.bench.cluster.bench_pairs import CONFIGS, config_file, summary, trace  # noqa: E402

KV_BLOCKS = 2048         # bench_recovery.cluster's nodes at bench_pairs' sizes


def free_batching(profile):
    """``profile`` with a decode step's cost independent of its batch (the one-row
    step's time at every batch size; context still costs what it costs)."""
    c = profile.costs
    one = c.decode_batch_seconds(1)
    costs = replace(c, decode_batch_s=((1, one), (4096, one)), decode_seq_s=0.0)
    return replace(profile, costs=costs)


def simulate_round(name: str, profile, profile_path: str, requests, tmp: str) -> tuple[list[dict], int]:
    """``requests`` (bench_pairs.trace) on configuration ``name`` with ``profile``'s
    costs (``profile_path``: its file, whose shape checks apply): bench_pairs'
    rows (a row's wait: its TTFT less its prompt's prefill alone), and the handoffs."""
    from kvd.sim.cluster import SimCluster
    from kvd.sim.events import EventQueue
    from tools.sim.run import load_shape

    flags, node_flags = config_file(name, tmp)
    cfg = Path(flags[1])
    cfg.write_text(f"[engine]\nnum_threads = 1\nkv_blocks = {KV_BLOCKS}\nhost_kv_blocks = {KV_BLOCKS}\n"
                   + cfg.read_text())
    shape = load_shape(str(cfg), profile_path, 2, 1 if name == "1p1d" else 0, None, True)
    engine = shape.engine
    if node_flags:
        engine = replace(engine, prefill_chunk_tokens=int(node_flags[1]))
    events = EventQueue()
    sim = SimCluster(engine, shape.cluster, list(shape.roles), profile, events, colocated=True,
                     host_cores=shape.host_cores)
    done: dict[int, object] = {}
    for i, (at, ids, max_tokens) in enumerate(requests):
        events.at(at, lambda i=i, ids=ids, m=max_tokens: sim.submit(f"r{i}", ids, m,
                                                                     lambda s, i=i: done.setdefault(i, s)))
    events.run()
    rows = []
    for i, (at, ids, max_tokens) in enumerate(requests):
        s = done.get(i)
        times = s.arrivals if s is not None and not s.error else []
        rows.append({"prompt": len(ids), "max_tokens": max_tokens, "tokens": len(times),
                     "error": (s.error or None) if s is not None else "lost", "at_s": at,
                     "ttft_s": times[0] - s.sent_at if times else None,
                     "wait_s": times[0] - s.sent_at - profile.costs.prefill_seconds([(len(ids), 0)]) if times else None,
                     "jct_s": times[-1] - s.sent_at if times else None,
                     "tbt_s": [b - a for a, b in zip(times, times[1:])]})
    return rows, sim.pairs.describe()["handoffs"] if sim.pairs else 0


def main() -> None:
    from kvd.sim.profile_file import load_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--period", type=float, default=30.0)
    ap.add_argument("--high", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--low", type=float, default=None)
    ap.add_argument("--long-share", type=float, default=0.5)
    ap.add_argument("--measured", default=None, help="a bench_pairs JSON to print beside (its summaries)")
    ap.add_argument("--out", default=str(ROOT / "results/sim/pairs_what_if.json"))
    args = ap.parse_args()
    profile = load_profile(args.profile, check_cpu=False)
    profiles = {"profile": profile, "free batching": free_batching(profile)}
    measured = {}
    if args.measured:
        for r in json.loads(Path(args.measured).read_text())["rows"]:
            if r.get("summary"):
                measured[(r["high"], r["config"])] = r
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for high in args.high:
            print(f"\nhigh {high:g} req/s: mean JCT / p99 TBT / p99 TTFT")
            print("| costs | " + " | ".join(CONFIGS) + " | pair against the better other (JCT) |")
            print("|---|" + "---|" * (len(CONFIGS) + 1))
            table = {}
            if any((high, n) in measured for n in CONFIGS):
                table["measured"] = {n: measured.get((high, n)) for n in CONFIGS}
            for label, prof in profiles.items():
                table[label] = {}
                for name in CONFIGS:
                    rows, moved = [], 0
                    for rnd in range(args.rounds):
                        got, n = simulate_round(name, prof, args.profile, trace(random.Random(100 + rnd), args, high),
                                                tmp)
                        rows, moved = rows + got, moved + n
                    table[label][name] = summary(rows, moved)
            for label, sums in table.items():
                def cell(s):
                    return (f"{s['mean_jct_s']:.2f} s / {s['p99_tbt_s'] * 1e3:.0f} ms / {s['p99_ttft_s']:.2f} s"
                            if s and s.get("ok") else "n/a")
                others = [sums[n]["mean_jct_s"] for n in CONFIGS if n != "pair" and sums.get(n) and sums[n]["ok"]]
                ratio = min(others) / sums["pair"]["mean_jct_s"] if others and sums.get("pair") else None
                print(f"| {label} | " + " | ".join(cell(sums.get(n)) for n in CONFIGS)
                      + (f" | {ratio:.2f}x |" if ratio else " | n/a |"))
                out.append({"high": high, "costs": label, "ratio": ratio,
                            **{n: sums.get(n) for n in CONFIGS}})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"profile": args.profile, "rounds": args.rounds, "rows": out}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
