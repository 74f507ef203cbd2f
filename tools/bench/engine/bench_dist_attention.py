"""Decode-step time with a sequence's KV split over two memories (DistAttention,
engine/dist_attention.py) against the same context in one.

For each ``--contexts`` length, one SmolLM2 sequence (native GGUF weights, or
``--weights random``: the same shapes and block formats) decodes its next token
through ``ModelRunner.execute`` three ways, steps alternated one by one:

- ``executor``: every block local, the one-call plan executor (the engine's decode);
- ``torch``: every block local, the torch model with the paged attention kernel
  (the path a split sequence takes, unsplit);
- ``split``: the first half of the context's 128-key chunks local, the rest in a
  second MemPool whose micro-attention runs on a thread of its own
  (``InProcessLender``, ``--lender-threads`` OpenMP threads) while the debtor
  computes its half: every layer sends the query, computes locally, merges.

The keys are random (a step's time does not depend on them). The figure is the
fastest step (interference only slows a step) and the median; ratios are
split / torch and split / executor. The split's lender shares this host's
cores with the debtor: on a real pair of nodes it has its own.

    .venv/bin/python -m tools.bench.engine.bench_dist_attention [--contexts 1024,4096,8000]
        [--threads 2] [--lender-threads 1] [--steps 20] [--weights bundled|random]

Prints a table and writes JSON to results/bench_dist_attention.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BS = 16


def measure(contexts: list[int], threads: int, lender_threads: int, steps: int, weights: str) -> list[dict]:
    import torch

    from engine.dist_attention import InProcessLender, LentKV, RemoteKV, RemotePart
    from engine.memory.kv_cache import KVCache
    from engine.memory.mempool import MemPool
    from engine.memory.region import Purpose
    from engine.model.decode_kernels import plan_decoder
    from engine.request import Request, SamplingParams
    from engine.runner import ModelRunner
    from kernels.dist_attention import KEY_CHUNK, chunks_of
    from tools.bench.engine.bench_engine import smollm2_served

    torch.set_num_threads(threads)
    model = smollm2_served(weights)
    c = model.config
    windows = [c.layer_window(i) for i in range(model.num_local_layers)]
    rows = []
    for ctx in contexts:
        blocks = -(-ctx // BS)
        local = KVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=BS,
                        device_blocks=blocks + 1)
        kv = local.tier("device")
        g = torch.Generator().manual_seed(ctx)
        for layer in kv:                                 # a layer at a time: no second copy of the cache
            layer.copy_(torch.randn(layer.shape, generator=g))
        executor = ModelRunner(model, kv, BS, fused=plan_decoder(model, kv, BS))
        plain = ModelRunner(model, kv, BS)
        split_at = chunks_of(ctx) // 2                   # chunks [0, split_at) local
        lender = MemPool(device_blocks=blocks, host_blocks=0, block_size=BS,
                         storage=KVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                         block_size=BS, device_blocks=blocks))
        first = split_at * KEY_CHUNK // BS
        region = lender.reserve_region((), num_blocks=blocks - first, purpose=Purpose.LENT)
        for layer in range(c.num_layers):                # the lent keys as the debtor had them
            for i, kc in enumerate(lender.layer_caches(layer)):
                kc[torch.tensor(region.block_ids)] = kv[layer, i, first:blocks]
        pool = concurrent.futures.ThreadPoolExecutor(1)
        lent = LentKV(lender, region.block_ids, split_at, model.attention_kernel, model.scale, windows,
                      threads=lender_threads)
        plain_split = ModelRunner(model, kv, BS)
        plain_split.remote_kv = RemoteKV()
        req = Request("r", torch.randint(0, c.vocab_size, (ctx,)).tolist(), SamplingParams(max_tokens=1 << 20,
                                                                                           temperature=0.0))
        req.block_ids, req.num_computed = list(range(blocks)), ctx - 1
        plain_split.remote_kv.add("r", [RemotePart(split_at, None, InProcessLender(lent, pool))])
        ways = {"executor": executor, "torch": plain, "split": plain_split}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(2):
            for runner in ways.values():
                runner.execute([req], False, [None], [])
        for _ in range(steps):
            for name, runner in ways.items():
                t = time.perf_counter()
                runner.execute([req], False, [None], [])
                times[name].append((time.perf_counter() - t) * 1e3)
        pool.shutdown()
        row = {"context": ctx, "local_keys": split_at * KEY_CHUNK, "lent_keys": ctx - split_at * KEY_CHUNK}
        for name, ts in times.items():
            row[name] = {"min_ms": min(ts), "median_ms": statistics.median(ts)}
        rows.append(row)
        print(f"context {ctx}: " + ", ".join(f"{k} {row[k]['min_ms']:.2f} ms" for k in ways), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,8000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lender-threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--weights", choices=("bundled", "random"), default="bundled")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_dist_attention.json"))
    args = ap.parse_args()
    try:
        contexts = [int(x) for x in args.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts: comma-separated integers, got {args.contexts!r}")
    if any(not 256 <= n <= 8192 for n in contexts) or args.threads < 1 or args.lender_threads < 1 or args.steps < 1:
        ap.error("contexts in 256..8192 (SmolLM2's positions), threads and steps >= 1")
    sys.path.insert(0, str(REPO))
    from tools._twoproc import write_results
    from tools.loadgen.report import cpu_model

    rows = measure(contexts, args.threads, args.lender_threads, args.steps, args.weights)
    cpu = cpu_model()
    print(f"\n{cpu}, {args.threads} thread(s) + lender {args.lender_threads}, {args.weights} weights: "
          "fastest decode step of a single sequence, ms (median)\n")
    print("| context | executor | torch | split (half lent) | split / torch | split / executor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        e, t, s = (r[k]["min_ms"] for k in ("executor", "torch", "split"))
        print(f"| {r['context']} | {e:.2f} ({r['executor']['median_ms']:.2f}) | {t:.2f} ({r['torch']['median_ms']:.2f})"
              f" | {s:.2f} ({r['split']['median_ms']:.2f}) | {s / t:.2f}x | {s / e:.2f}x |")
    write_results(args.out, rows, cpu=cpu, args=vars(args))


if __name__ == "__main__":
    main()
