"""Borrowed KV on the serving path (docs/benchmarks.md; docs/cluster.md, "Requests on
borrowed blocks"): capacity and decode-step time with a context split across two daemons.

A real coordinator and two node processes (n1 on core 0, n2 on core 1,
``bench_recovery.cluster``). For each context length L (``--lengths``), each round runs,
in alternating order:

- **split**: both nodes hold about L/2 tokens (``--kv-blocks``), lend and borrow: the one
  the coordinator picks keeps the sequence's first chunks and borrows the rest from the
  other, whose attention over them it computes every layer;
- **one**: the same two nodes with blocks for the whole sequence, borrowing off;
- **base** (with ``--baseline DIR``): the split, served by the daemons of another
  checkout of kvd (``git archive COMMIT | tar -x -C DIR``): a change against the code
  before it, side by side in one run.

One greedy streamed completion of L prompt tokens and ``--max-tokens`` tokens each. Reported:
TPOT (the decode steps after the first token) split over one (base over one too), and
whether the split text is the one-node text (the capacity check: the sequence is about 2x
what one node holds).

    .venv/bin/python -m tools.bench.cluster.bench_borrow [--model smollm2] [--lengths 1024 4096 8192]
        [--baseline DIR]

Prints a table and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tools._twoproc import write_results  # noqa: E402
from tools.bench.cluster import bench_recovery  # noqa: E402
from tools.bench.cluster.bench_recovery import cluster, stream  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402

BS, CHUNK = 16, 128


def split_flags(length: int, max_tokens: int) -> list[str]:
    """Each node holds about half the sequence (whole 128-token chunks) and may lend and
    borrow all of its blocks."""
    half = -(-(length // 2 + max_tokens) // CHUNK) * CHUNK // BS
    return ["--kv-blocks", str(half), "--host-kv-blocks", "0", "--lend-kv-blocks", str(half),
            "--borrow-kv-blocks", str(2 * half)]


@contextlib.contextmanager
def daemons_of(repo: Path | None):
    """bench_recovery's daemons run from ``repo`` (another checkout) meanwhile."""
    if repo is None:
        yield
        return
    saved, bench_recovery.REPO = bench_recovery.REPO, repo
    try:
        yield
    finally:
        bench_recovery.REPO = saved


def one_round(args: argparse.Namespace, tmp: str, length: int, rnd: int, ids: list[int]) -> dict:
    out: dict = {"length": length, "round": rnd}
    modes = ["split", "one", *(["base"] if args.baseline else [])]
    modes = modes[rnd % len(modes):] + modes[:rnd % len(modes)]     # rotate which runs first
    for mode in modes:
        # float32 both ways: attention over borrowed blocks runs on the float32 paged kernel
        flags = ["--dtype", "float32", *(split_flags(length, args.max_tokens) if mode != "one" else [])]
        with (daemons_of(Path(args.baseline).resolve() if mode == "base" else None),
              cluster(f"borrow-{length}-{rnd}-{mode}", args, tmp, [], tuple(flags)) as (base, _)):
            stream(base, ids[:32], 2)                                  # warm-up
            times, text, error = stream(base, ids, args.max_tokens)
        if error or len(times) < 3:
            raise SystemExit(f"bench_borrow: {mode} at {length} tokens failed: "
                             f"{error or f'{len(times)} tokens (is {length} + --max-tokens past the context?)'}")
        gaps = [b - a for a, b in zip(times[1:], times[2:])]
        out[mode] = {"tpot_s": statistics.mean(gaps), "median_itl_s": statistics.median(gaps),
                     "tokens": len(times), "text": text}
    out["same_text"] = all(out[m]["text"] == out["one"]["text"] for m in modes)
    out["tpot_ratio"] = out["split"]["tpot_s"] / out["one"]["tpot_s"]
    if "base" in out:
        out["base_tpot_ratio"] = out["base"]["tpot_s"] / out["one"]["tpot_s"]
    for mode in modes:
        del out[mode]["text"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--deadline", type=float, default=3.0, help="heartbeat deadline (s)")
    p.add_argument("--out", default="", help="JSON path (default results/bench_borrow.json)")
    p.add_argument("--baseline", default="", help="a checkout of kvd whose daemons also serve the split (base)")
    args = p.parse_args(argv)
    if any(n < 2 * CHUNK for n in args.lengths) or args.max_tokens < 3 or args.rounds < 1:
        p.error("lengths must be >= 256, --max-tokens >= 3, --rounds >= 1")
    if args.baseline and not (Path(args.baseline) / "kvd" / "cli.py").is_file():
        p.error(f"--baseline {args.baseline} is not a checkout of kvd (no kvd/cli.py)")
    rng = random.Random(7)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in args.lengths:
            ids = [rng.randrange(1, 40000) for _ in range(length)]
            for rnd in range(args.rounds):
                row = one_round(args, tmp, length, rnd, ids)
                rows.append(row)
                base = f", base {row['base']['tpot_s'] * 1e3:7.2f} ms ({row['base_tpot_ratio']:.3f})" if "base" in row else ""
                print(f"L={length:6d} round {rnd}: TPOT split {row['split']['tpot_s'] * 1e3:7.2f} ms, "
                      f"one {row['one']['tpot_s'] * 1e3:7.2f} ms, ratio {row['tpot_ratio']:.3f}{base}, "
                      f"same text {row['same_text']}", flush=True)
    summary = {str(n): {key + "_median": statistics.median(r[key] for r in rows if r["length"] == n)
                        for key in ("tpot_ratio", "base_tpot_ratio") if key in rows[0]}
               | {"same_text": all(r["same_text"] for r in rows if r["length"] == n)} for n in args.lengths}
    print(summary)
    write_results(args.out or str(REPO / "results" / "bench_borrow.json"), rows, summary=summary, args=vars(args),
                  host=machine_info())
    return 0 if all(s["same_text"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
