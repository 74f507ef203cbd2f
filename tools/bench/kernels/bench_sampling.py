"""Sampling over SmolLM2-sized logits rows (vocabulary 49,152), alternated in one process:

- greedy: ``engine.sampling.greedy`` against ``torch.argmax``;
- random rows of each kind (temperature, top-k, top-p, seeded): ``engine.sampling.sample``
  with the C++ sampler (kernels/sampler.py, every row in one call) against the same rows
  drawn one by one in torch as ``sample`` did before it (``previous_row``: torch.topk,
  a full torch.sort for top-p, an inverse-CDF draw); ``--fallback`` adds the torch
  fallback of a host without a kernel build (``engine.sampling.draw_row``).

Rows come from two sources: ``randn`` (N(0, 3) logits: a flat distribution, many tokens
within a few nats of the top) and ``model`` (SmolLM2's own next-token logits at every
position of a prose prompt, the bundled GGUF: peaked, as served).

    .venv/bin/python -m tools.bench.kernels.bench_sampling [--rows 1,8,32,64] [--threads 2] [--fallback]

Prints a markdown table per kind and appends JSON to results/bench_sampling.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine.request import SamplingParams
from engine.sampling import draw_row, draw_seed, greedy, make_generator, sample
from kernels.sampler import RowSampler
from tools.bench.engine.bench_engine import append_result, machine

VOCAB = 49152
PROSE = ("The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his father "
         "had taught him. Outside, the storm pressed against the glass, and far below the waves broke "
         "white on the rocks. He trimmed the wick, polished the great lens, and watched the beam sweep "
         "across the water toward the ships that would never know his name. In the morning he wrote "
         "in the log: wind from the west, visibility poor, one vessel passed safely to the north. ") * 2
KINDS = {
    "T 0.8": SamplingParams(temperature=0.8),
    "T 0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T 1, top-p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "T 0.8, top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "T 0.8, top-k 50, top-p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
}


def previous_row(logits: torch.Tensor, p: SamplingParams, g: torch.Generator | None) -> int:
    """One random row as engine.sampling drew it before the C++ sampler (the baseline)."""
    x = logits / p.temperature
    if 0 < p.top_k < x.shape[0]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        sorted_x = sorted_x.masked_fill(probs.cumsum(-1) - probs > p.top_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    cdf = (x - x.max()).exp_().cumsum(0, dtype=torch.float64)
    u = torch.rand((), dtype=torch.float64, generator=g) * float(cdf[-1])
    return min(int(torch.searchsorted(cdf, u, right=True)), x.shape[0] - 1)


def model_logits(rows: int) -> torch.Tensor:
    """SmolLM2's next-token logits at the first ``rows`` positions of PROSE: [rows, V]. The
    model runs alone, over a KV buffer of its own (no engine, no MemPool)."""
    from engine.engine import EngineConfig, build_model
    from engine.model.registry import resolve_model
    from kernels.attention import AttentionBatch, PrefillSeq
    source = resolve_model("smollm2")
    model = build_model(EngineConfig(model="smollm2"), source.load_weights(quantized=True))
    ids = source.load_tokenizer().encode(PROSE)[:rows]
    if len(ids) < rows:
        raise SystemExit(f"the prose prompt has {len(ids)} tokens, fewer than --rows' {rows}")
    n, bs, c = len(ids), 16, model.config
    blocks = -(-n // bs)
    scratch = torch.zeros(c.num_layers, 2, blocks, bs, c.num_kv_heads, c.head_dim, dtype=model.dtype)
    table = torch.arange(blocks, dtype=torch.int64)
    pos = torch.arange(n)
    batch = AttentionBatch(slots=table[pos // bs] * bs + pos % bs, is_prefill=True,
                           prefill=[PrefillSeq(0, n, n, table)])
    with torch.inference_mode():
        return model.compute_logits(model.forward(torch.tensor(ids), pos, batch, scratch)).float().contiguous()


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fallback", action="store_true", help="time engine.sampling.draw_row too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(r) for r in args.rows.split(",")]
    cpu = machine()["cpu"]
    kernel = RowSampler.create()
    if kernel is None:
        raise SystemExit("no sampling kernel on this host (see the log)")
    rows_out = []
    print("| CPU | threads | rows | torch.argmax µs | greedy µs | speed-up |")
    print("|---|---|---|---|---|---|")
    for b in sizes:
        x = torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(b))
        assert greedy(x) == x.argmax(dim=-1).tolist()
        calls = max(20, 2000 // b)
        ref, new = [], []
        for _ in range(args.rounds):                  # alternated
            ref.append(per_call_us(lambda: x.argmax(dim=-1).tolist(), calls))
            new.append(per_call_us(lambda: greedy(x), calls))
        r, n = statistics.median(ref), statistics.median(new)
        rows_out.append({"rows": b, "torch_argmax_us": r, "greedy_us": n})
        print(f"| {cpu} | {args.threads} | {b} | {r:.1f} | {n:.1f} | {r / n:.1f}× |")

    sources = {"randn": torch.randn(max(sizes), VOCAB, generator=torch.Generator().manual_seed(0)) * 3,
               "model": model_logits(max(sizes))}
    print(f"\n| CPU | threads | logits | kind | rows | before µs/row | C++ sampler µs/row | speed-up |"
          + (" torch fallback µs/row |" if args.fallback else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.fallback else ""))
    random_out = []
    for source, logits in sources.items():
        for kind, base in KINDS.items():
            for b in sizes:
                x = logits[:b]
                params = [SamplingParams(temperature=base.temperature, top_k=base.top_k, top_p=base.top_p, seed=i)
                          for i in range(b)]
                gens = [make_generator(q) for q in params]

                def before() -> list[int]:
                    out = []
                    for row, (q, g) in enumerate(zip(params, gens)):
                        g.manual_seed(draw_seed(q.seed, 0))
                        out.append(previous_row(x[row], q, g))
                    return out

                def fallback() -> list[int]:
                    out = []
                    for row, (q, g) in enumerate(zip(params, gens)):
                        g.manual_seed(draw_seed(q.seed, 0))
                        out.append(draw_row(x[row], q, float(torch.rand((), dtype=torch.float64, generator=g))))
                    return out

                assert sample(x, params, gens, [0] * b, kernel=kernel) == sample(x, params, gens, [0] * b)
                calls = max(3, 100 // b)
                ref, new, fb = [], [], []
                for _ in range(args.rounds):              # alternated
                    ref.append(per_call_us(before, calls) / b)
                    new.append(per_call_us(lambda: sample(x, params, gens, [0] * b, kernel=kernel), calls) / b)
                    if args.fallback:
                        fb.append(per_call_us(fallback, calls) / b)
                r, n = statistics.median(ref), statistics.median(new)
                rec = {"logits": source, "kind": kind, "rows": b, "before_us_per_row": r, "kernel_us_per_row": n,
                       "rounds_before": ref, "rounds_kernel": new}
                line = f"| {cpu} | {args.threads} | {source} | {kind} | {b} | {r:.0f} | {n:.1f} | {r / n:.0f}× |"
                if args.fallback:
                    rec["fallback_us_per_row"] = statistics.median(fb)
                    line += f" {rec['fallback_us_per_row']:.0f} |"
                random_out.append(rec)
                print(line, flush=True)
    append_result(Path("results/bench_sampling.json"), {"machine": machine(), "threads": args.threads,
                                                        "kernel": kernel.variant, "results": rows_out,
                                                        "random": random_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
