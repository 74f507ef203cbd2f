"""Sampling over SmolLM2-sized logits rows (vocabulary 49,152), alternated in one process:

- greedy: ``engine.sampling.greedy`` against ``torch.argmax``;
- random (temperature 0.8, seeded): ``engine.sampling.sample`` (one inverse-CDF ``draw``
  a row) against the same rows through ``torch.multinomial`` (softmax, then one sample),
  what ``sample`` ran before.

    .venv/bin/python -m tools.bench_sampling [--rows 1,8,32,64] [--threads 2]

Prints a markdown table per kind and appends JSON to results/bench_sampling.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine.request import SamplingParams
from engine.sampling import draw_seed, greedy, sample
from tools.bench_engine import append_result, machine

VOCAB = 49152


def per_call_us(fn, x: torch.Tensor, calls: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn(x)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows_out = []
    print("| CPU | threads | rows | torch.argmax µs | greedy µs | speed-up |")
    print("|---|---|---|---|---|---|")
    cpu = machine()["cpu"]
    for b in (int(r) for r in args.rows.split(",")):
        x = torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(b))
        assert greedy(x) == x.argmax(dim=-1).tolist()
        calls = max(20, 2000 // b)
        ref, new = [], []
        for _ in range(args.rounds):                  # alternated
            ref.append(per_call_us(lambda t: t.argmax(dim=-1).tolist(), x, calls))
            new.append(per_call_us(greedy, x, calls))
        r, n = statistics.median(ref), statistics.median(new)
        rows_out.append({"rows": b, "torch_argmax_us": r, "greedy_us": n})
        print(f"| {cpu} | {args.threads} | {b} | {r:.1f} | {n:.1f} | {r / n:.1f}× |")
    print("\n| CPU | threads | rows | torch.multinomial µs | sample (inverse CDF) µs | speed-up |")
    print("|---|---|---|---|---|---|")
    random_out = []
    for b in (int(r) for r in args.rows.split(",")):
        x = torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(b))
        params = [SamplingParams(temperature=0.8, seed=i) for i in range(b)]
        gens = [torch.Generator() for _ in range(b)]

        def multinomial(t: torch.Tensor) -> list[int]:
            out = []
            for row, (p, g) in enumerate(zip(params, gens)):
                g.manual_seed(draw_seed(p.seed, 0))
                out.append(int(torch.multinomial((t[row] / p.temperature).softmax(-1), 1, generator=g).item()))
            return out

        calls = max(5, 200 // b)
        ref, new = [], []
        for _ in range(args.rounds):                  # alternated
            ref.append(per_call_us(multinomial, x, calls))
            new.append(per_call_us(lambda t: sample(t, params, gens, [0] * b), x, calls))
        r, n = statistics.median(ref), statistics.median(new)
        random_out.append({"rows": b, "multinomial_us": r, "sample_us": n})
        print(f"| {cpu} | {args.threads} | {b} | {r:.0f} | {n:.0f} | {r / n:.1f}× |")
    append_result(Path("results/bench_sampling.json"), {"machine": machine(), "threads": args.threads,
                                                        "results": rows_out, "random": random_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
