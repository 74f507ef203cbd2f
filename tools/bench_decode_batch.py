"""Decode step time against batch size: the plan executor (native GGUF weights,
kernels/plan_decode.py) on SmolLM2, one ``PlanDecoder.decode`` call per step.

Each batch size runs ``--steps`` steps after a warm-up, every sequence at
position ``--context`` (its keys random, block tables distinct); the figure is
the fastest step (the host is shared: interference only slows a step down)
and the median. ``--repos`` compares checkouts side by side (e.g. this tree
and a ``git worktree`` of an older commit): each is run in a subprocess of
its own, alternated ``--rounds`` times.

    .venv/bin/python tools/bench_decode_batch.py [--threads 1] [--context 256]
        [--batches 1,2,3,4,6,8,12,16,32] [--repos .,/tmp/old] [--rounds 2]

Prints a table (ms per step; per sequence in brackets) and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(threads: int, context: int, batches: list[int], steps: int) -> dict[int, dict]:
    """Runs in the checkout under test (its engine and kernels on sys.path)."""
    import torch

    from engine.model.llama import LlamaModel
    from engine.model.registry import resolve_model
    from kernels.plan_decode import PlanDecoder
    from kernels.quant_linear import QuantKernel

    torch.set_num_threads(threads)
    w = resolve_model("smollm2").load_weights(quantized=True)
    model = LlamaModel(w.config, w.tensors, quant_kernel=QuantKernel.create())
    c, bs = model.config, 16
    per = context // bs + 2
    kv = torch.randn(c.num_layers, 2, max(batches) * per + 1, bs, c.num_kv_heads, c.head_dim)
    dec = PlanDecoder.create(model, kv, bs)
    if dec is None:
        raise SystemExit("bench_decode_batch: the plan executor does not run here (see the log)")
    out = {}
    for b in batches:
        ids = torch.randint(0, c.vocab_size, (b,), generator=torch.Generator().manual_seed(b))
        pos = torch.full((b,), context, dtype=torch.int64)
        tables = torch.arange(b * per, dtype=torch.int64).reshape(b, per)
        for _ in range(3):
            dec.decode(ids, pos, tables, kv)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            dec.decode(ids, pos, tables, kv)
            times.append((time.perf_counter() - t) * 1e3)
        out[b] = {"min_ms": min(times), "median_ms": statistics.median(times)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,2,3,4,6,8,12,16,32")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repos", default=".", help="comma-separated checkouts to compare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_decode_batch.json"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        sys.path.insert(0, os.getcwd())
        print(json.dumps(measure(args.threads, args.context, batches, args.steps)))
        return
    sys.path.insert(0, str(REPO))
    from tools._twoproc import write_results
    from tools.loadgen.report import cpu_model

    repos = [str(Path(r).resolve()) for r in args.repos.split(",")]
    rows = []
    for rnd in range(args.rounds):
        for repo in (repos if rnd % 2 == 0 else repos[::-1]):
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--threads",
                                   str(args.threads), "--context", str(args.context), "--batches", args.batches,
                                   "--steps", str(args.steps)], cwd=repo, capture_output=True, text=True,
                                  timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"bench_decode_batch: {repo}: {proc.stderr.strip()[-500:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"repo": repo, "round": rnd, "steps": {int(k): v for k, v in result.items()}})
    cpu = cpu_model()
    print(f"\n{cpu}, {args.threads} thread(s), context {args.context}: fastest step over {args.rounds} rounds, "
          f"ms (per sequence)\n")
    print("| batch | " + " | ".join(repos) + " |")
    print("|---" * (len(repos) + 1) + "|")
    for b in batches:
        cells = []
        for repo in repos:
            best = min(r["steps"][b]["min_ms"] for r in rows if r["repo"] == repo)
            cells.append(f"{best:.1f} ({best / b:.1f})")
        print(f"| {b} | " + " | ".join(cells) + " |")
    write_results(args.out, rows, cpu=cpu, args=vars(args))


if __name__ == "__main__":
    main()
