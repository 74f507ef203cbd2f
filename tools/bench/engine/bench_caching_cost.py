"""Fit MemServe's context-caching cost model (§5.3) on this machine.

    python -m tools.bench.engine.bench_caching_cost [--model smollm2] [--lengths 128,256,512,768,1024]
                                       [--ratios 0,0.25,0.5,0.75,0.9] [--reps 2] [--threads N]
                                       [--kv-cache-dtype auto|float16]

On the real engine (``--model``, default dtype, whole-prompt prefill steps),
rounds best-of ``--reps`` (the host may be shared: another job only ever
slows a round down):

1. **prefill**: for every prompt length ``P`` and cached ratio ``r``, a
   prompt whose first ``c = r*P`` tokens (whole blocks) sit in the prefix
   cache on the device tier; the time of the step that prefills the other
   ``n = P - c`` tokens and samples the first token. Fitted, relative least
   squares with non-negative coefficients, to
   ``t(n, c) = fixed + a*n + b*n*(c + n/2)`` (engine/memory/caching_cost.py);
2. **swap-in**: a cached prefix of ``h`` blocks moved to the host tier
   (``MemPool.swap_out``), then the ``MemPool.swap_in`` that admission makes
   timed alone; ``s`` is the slope over ``h``;
3. **check**: prefills whose cached prefix sits in the host tier (admission
   swaps it in), against ``t(n, c) + s*h``.

Prints the fit, every point's residual, what the model decides for each
length and host-resident ratio, and the ``etc/kvd.toml`` lines; appends the
whole run to ``results/bench_caching_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.memory.caching_cost import CachingCostModel
from tools.bench.engine.bench_engine import append_result, machine, random_prompts
from tools.bench.engine.bench_weights import prefill_seconds
from tools.loadgen.report import cpu_model

RESULTS = Path("results/bench_caching_cost.json")


def make_engine(model: str, max_len: int, kv_cache_dtype: str = "auto") -> LLMEngine:
    """Whole prompts in one step (chunked prefill off: a step is exactly one
    t(n, c)), host hits swapped in unconditionally (what step 3 times)."""
    blocks = 4 * (max_len // 16 + 2)
    return LLMEngine.from_config(EngineConfig(
        model=model, kv_blocks=blocks, host_kv_blocks=blocks, prefill_chunk_tokens=0,
        max_num_batched_tokens=max(4096, max_len), host_hit_policy="swap", kv_cache_dtype=kv_cache_dtype))


def cache_prefix(eng: LLMEngine, tokens: list[int]) -> None:
    """Leave exactly ``tokens`` (whole blocks) in the device tier's prefix cache, nothing else."""
    eng.pool.flush()
    if tokens:
        prefill_seconds(eng, tokens)                   # retires with its full blocks cached
    assert eng.pool.cached_tokens(tokens) == len(tokens)


def timed_prefill(eng: LLMEngine, prompt: list[int], cached: int, host: bool) -> float:
    cache_prefix(eng, prompt[:cached])
    if host and cached:
        moved = eng.pool.swap_out(cached // eng.config.block_size)
        assert moved == cached // eng.config.block_size and eng.pool.stats()["device"]["cached"] == 0
    return prefill_seconds(eng, prompt)


def swap_in_seconds(eng: LLMEngine, prefix: list[int], blocks: int) -> float:
    """Time of the ``MemPool.swap_in`` of the last ``blocks`` blocks of the cached
    ``prefix``, moved to the host tier first (``swap_out`` takes LRU leaves)."""
    assert eng.pool.swap_out(blocks) == blocks
    lock = eng.pool.lock_prefix(prefix)
    host = [r for r in lock.blocks if r.tier == "host"]
    assert len(host) == blocks and len(lock.blocks) * eng.config.block_size == len(prefix)
    t = time.perf_counter()
    ids = eng.pool.swap_in(host)
    el = time.perf_counter() - t
    assert ids is not None
    eng.pool.unlock(lock)
    return el


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative column and refit
    (three columns: a few passes at most)."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if coef.min() >= 0:
            return coef
        active.remove(int(np.argmin(coef)))


def fit_prefill(points: list[dict]) -> tuple[float, float, float]:
    """(a, b, fixed) minimising the relative residuals over ``points``."""
    n = np.array([p["new"] for p in points], float)
    c = np.array([p["cached"] for p in points], float)
    t = np.array([p["seconds"] for p in points], float)
    x = np.stack([n, n * (c + n / 2), np.ones_like(n)], axis=1) / t[:, None]
    a, b, fixed = nonneg_lstsq(x, np.ones_like(t))
    return float(a), float(b), float(fixed)


def fit_swap(points: list[dict]) -> float:
    """s: the slope of swap-in seconds over blocks (an intercept absorbs the call's overhead)."""
    h = np.array([p["blocks"] for p in points], float)
    t = np.array([p["seconds"] for p in points], float)
    slope, _ = nonneg_lstsq(np.stack([h, np.ones_like(h)], axis=1), t)
    return float(slope)


def run(model: str, lengths: list[int], ratios: list[float], reps: int, kv_cache_dtype: str = "auto") -> dict:
    load_before = os.getloadavg()
    eng = make_engine(model, max(lengths), kv_cache_dtype)
    bs = eng.config.block_size
    prompts = {p: random_prompts(eng.tokenizer, 1, [p], seed=p)[0] for p in lengths}
    warm = random_prompts(eng.tokenizer, 1, [min(lengths)], seed=1)[0]
    for c in (0, len(warm) // 2 // bs * bs):          # warm-up: first shapes, cold and with a hit
        timed_prefill(eng, warm, c, host=False)
    grid = sorted({(p, min(int(r * p) // bs * bs, (p - 1) // bs * bs)) for p in lengths for r in ratios})
    points = []
    for p, c in grid:
        secs = [timed_prefill(eng, prompts[p], c, host=False) for _ in range(reps)]
        points.append({"prompt": p, "cached": c, "new": p - c, "seconds": min(secs), "rounds_s": secs})
        print(f"prefill P={p} cached={c}: {min(secs) * 1e3:.1f} ms", flush=True)
    a, b, fixed = fit_prefill(points)
    longest = prompts[max(lengths)]
    prefix = longest[:(len(longest) - 1) // bs * bs]
    cache_prefix(eng, prefix)
    swaps = []
    for h in sorted({h for h in (1, 4, 16, 32) if h < len(prefix) // bs} | {len(prefix) // bs}):
        secs = [swap_in_seconds(eng, prefix, h) for _ in range(max(reps, 5))]
        swaps.append({"blocks": h, "seconds": min(secs), "rounds_s": secs})
    s = fit_swap(swaps)
    fitted = CachingCostModel(token_s=a, attention_s=b, fixed_s=fixed, swap_block_s=s)
    for pt in points:
        pt["predicted_s"] = fitted.prefill_seconds(pt["new"], pt["cached"])
    checks = []
    for p, c in grid:
        if c == 0 or c < p // 2:
            continue
        secs = [timed_prefill(eng, prompts[p], c, host=True) for _ in range(reps)]
        checks.append({"prompt": p, "cached": c, "host_blocks": c // bs, "seconds": min(secs),
                       "rounds_s": secs,
                       "predicted_s": fitted.prefill_seconds(p - c, c) + s * (c // bs)})
    eng.check_integrity()
    return {"bench": "caching_cost", "model": model, "dtype": str(eng.model.dtype), "block_size": bs,
            "reps": reps, "prefill": points, "swap_in": swaps, "host_hit_prefill": checks,
            "fit": {"token_s": a, "attention_s": b, "fixed_s": fixed, "swap_block_s": s},
            "load_avg_before": load_before, "load_avg_after": os.getloadavg()}


def decisions(fitted: CachingCostModel, lengths: list[int], ratios: list[float], bs: int) -> list[str]:
    """Per length and host-resident ratio (the whole hit on host): swap time, the
    recompute it saves, and the model's choice."""
    rows = ["| prompt | cached on host | swap in | recompute instead | decision |", "|---|---|---|---|---|"]
    for p in lengths:
        for r in ratios:
            h = min(int(r * p) // bs, (p - 1) // bs)
            if h == 0:
                continue
            on_host = [True] * h
            swap = fitted.cost_of_keeping(on_host, h, p, bs) - fitted.prefill_seconds(p - h * bs, h * bs)
            saved = fitted.prefill_seconds(p, 0) - fitted.prefill_seconds(p - h * bs, h * bs)
            keep = fitted.reuse_blocks(on_host, p, bs)
            rows.append(f"| {p} | {h * bs} ({h} blocks) | {swap * 1e3:.2f} ms | {saved * 1e3:.1f} ms | "
                        f"{'swap in' if keep == h else 'recompute'} |")
    return rows


def report(r: dict) -> list[str]:
    f, bs = r["fit"], r["block_size"]
    lines = [f"CPU: {r['machine']['cpu']}, {r['machine']['torch_threads']} threads, {r['model']} {r['dtype']}",
             f"fit: t(n, c) = {f['fixed_s'] * 1e3:.2f} ms + n * ({f['token_s'] * 1e3:.4f} ms "
             f"+ {f['attention_s'] * 1e6:.4f} us * (c + n/2));  swap-in {f['swap_block_s'] * 1e3:.4f} ms/block",
             "", "| prompt | cached | new | measured | fitted | residual |", "|---|---|---|---|---|---|"]
    for p in r["prefill"]:
        lines.append(f"| {p['prompt']} | {p['cached']} | {p['new']} | {p['seconds'] * 1e3:.1f} ms | "
                     f"{p['predicted_s'] * 1e3:.1f} ms | {(p['seconds'] / p['predicted_s'] - 1) * 100:+.1f}% |")
    lines += ["", "| swap-in blocks | seconds |", "|---|---|"]
    lines += [f"| {s['blocks']} | {s['seconds'] * 1e3:.3f} ms |" for s in r["swap_in"]]
    lines += ["", "| prompt | cached on host (swapped in) | measured | t(n, c) + s*h | residual |",
              "|---|---|---|---|---|"]
    for p in r["host_hit_prefill"]:
        lines.append(f"| {p['prompt']} | {p['cached']} | {p['seconds'] * 1e3:.1f} ms | "
                     f"{p['predicted_s'] * 1e3:.1f} ms | {(p['seconds'] / p['predicted_s'] - 1) * 100:+.1f}% |")
    fitted = CachingCostModel(**f)
    lines += [""] + decisions(fitted, r["lengths"], [0.1, 0.25, 0.5, 0.9], bs)
    ratio = f["swap_block_s"] / (bs * f["token_s"]) if f["token_s"] else float("inf")
    lines += ["", f"swap-in of one block / recompute of the cheapest block (position 0, bs*a): {ratio:.4f}"
              + (" -> swapping in always wins" if ratio < 1 else ""),
              "", "etc/kvd.toml [engine]:",
              f"cost_token_s = {f['token_s']:.4g}", f"cost_attention_s = {f['attention_s']:.4g}",
              f"cost_fixed_s = {f['fixed_s']:.4g}", f"cost_swap_block_s = {f['swap_block_s']:.4g}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", default="128,256,512,768,1024")
    ap.add_argument("--ratios", default="0,0.25,0.5,0.75,0.9")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype (a block's swap-in "
                    "moves its bytes: float16 halves them)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    print(f"CPU: {cpu_model()}", json.dumps(info), flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    r = run(args.model, lengths, [float(x) for x in args.ratios.split(",")], args.reps, args.kv_cache_dtype)
    r.update(machine=info, lengths=lengths, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    for line in report(r):
        print(line)
    append_result(RESULTS, r)


if __name__ == "__main__":
    main()
