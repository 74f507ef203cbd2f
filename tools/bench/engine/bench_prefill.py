"""Prefill over native GGUF weights: the old and new paths side by side in one run.

    python -m tools.bench.engine.bench_prefill [--lengths 512,1024] [--rounds 3] [--threads N] [--random-weights]
                                  [--variants host|all]

For the bundled SmolLM2 (Q4_1 layers), rounds alternated between the
configurations, best of the rounds (the host may be shared: another job only
ever slows a round down) and every round in the JSON:

- **engine prefill** of one prompt (no cached prefix), seconds, five ways:
  native weights with the paged attention kernel and the row ops kernel
  (the default), native with torch's ops for RMSNorm, SwiGLU and RoPE
  (``row_ops = None``), native with torch's SDPA (``attention_kernel =
  None``), and ``weights = "dequantize"`` (fp32, MKL) with each attention;
- **matmuls**: a layer's four projections at M = the prompt length, native
  (kernels/quant_linear.py: 16-bit activations; the host's build, or with
  ``--variants all`` every serving build this CPU runs, e.g. avx512amx's tile
  path against avx512vnni) vs MKL over the dequantized fp32 weights, GMAC/s;
- **attention**: one layer's prefill attention, the paged C++ kernel
  (kernels/paged_attention.py, the decode step's arithmetic) vs torch's SDPA, milliseconds.

``--random-weights``: SmolLM2's shapes and formats filled with random blocks
(``tools.bench.engine.bench_engine.random_smollm2``), for a host without the bundled GGUF.

Appends to ``results/bench_prefill.json`` and prints markdown rows naming the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from engine.engine import LLMEngine
from kernels.attention import AttentionBatch, PrefillSeq, prefill_attention, write_kv
from kernels.quant_linear import SERVING_VARIANTS, QuantKernel, QuantLinear, host_variant, runs_here
from tools.bench.engine.bench_engine import append_result, machine, make_engine, random_prompts
from tools.bench.engine.bench_weights import prefill_seconds

RESULTS = Path("results/bench_prefill.json")
CONFIGS = {   # name -> (weights, paged attention kernel, row ops kernel)
    "native": ("native", True, True), "native-torch-rows": ("native", True, False),
    "native-sdpa": ("native", False, True),
    "dequantize": ("dequantize", True, True), "dequantize-sdpa": ("dequantize", False, True)}


def best_of(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_rows(eng: LLMEngine, m: int, rounds: int, variants: list[str]) -> list[dict]:
    """Each projection of layer 0 at M = m: the native kernel's builds vs MKL on the dequantized
    weights, rounds alternated; ``native_GMACps`` is the host's build."""
    kernels = {v: QuantKernel.load(v) for v in variants}
    layer = eng.model.layers[0]
    rows = []
    for name in ("qkv", "o", "gate_up", "down"):
        lin = getattr(layer, name)
        lins = {v: QuantLinear(lin.parts, k) for v, k in kernels.items()}     # the same packed blocks
        w = torch.cat([p.dequantize() for p in lin.parts]).t().contiguous()     # [in, out], MKL's layout
        x = torch.randn(m, lin.in_features)
        gmac = m * lin.in_features * lin.out_features / 1e9
        tq: dict[str, list[float]] = {v: [] for v in lins}
        tm = []
        for _ in range(rounds):                                                  # alternated
            for v, one in lins.items():
                tq[v].append(best_of(lambda one=one, x=x: one(x), 2))
            tm.append(best_of(lambda x=x, w=w: x @ w, 2))
        rows.append({"matrix": name, "m": m, "shape": [lin.out_features, lin.in_features],
                     "native_GMACps": gmac / min(tq[variants[0]]), "mkl_GMACps": gmac / min(tm),
                     "builds_GMACps": {v: gmac / min(t) for v, t in tq.items()}})
    return rows


def attention_row(eng: LLMEngine, t: int, rounds: int) -> dict:
    """One layer's prefill attention over t new tokens in 16-token blocks: the paged C++
    kernel (the decode step's arithmetic) vs torch's SDPA."""
    cfg, kernel = eng.model.config, eng.model.attention_kernel
    q = torch.randn(t, cfg.num_heads, cfg.head_dim)
    k, v = (torch.randn(t, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
    blocks = -(-t // 16)
    k_cache, v_cache = (torch.zeros(blocks, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
    batch = AttentionBatch(slots=torch.arange(t), is_prefill=True,
                           prefill=[PrefillSeq(0, t, t, torch.arange(blocks))])
    write_kv(k_cache, v_cache, k, v, batch)
    rows = batch.paged_rows(torch.arange(t))
    scale = eng.model.scale
    new, old = [], []
    for _ in range(rounds):
        new.append(best_of(lambda: kernel.attend(q, k_cache, v_cache, *rows, scale), 2))
        old.append(best_of(lambda: prefill_attention(q, k, v, k_cache, v_cache, batch, scale), 2))
    ref = prefill_attention(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), batch, scale)
    err = (kernel.attend(q, k_cache, v_cache, *rows, scale).double() - ref).abs().max()
    return {"tokens": t, "kernel_ms": min(new) * 1e3, "sdpa_ms": min(old) * 1e3,
            "speedup": min(old) / min(new), "kernel_max_err_vs_fp64": float(err)}


def run(lengths: list[int], rounds: int, random_weights: bool = False, variants: list[str] | None = None) -> dict:
    load_before = os.getloadavg()
    variants = variants or [host_variant()]
    engines = {}
    for name, (weights, paged, rows) in CONFIGS.items():
        eng = make_engine("float32", random_weights, weights=weights, kv_blocks=max(lengths) // 16 + 64,
                          enable_prefix_caching=False)
        if not paged:
            eng.model.attention_kernel = None
        if not rows:
            eng.model.row_ops = None
        engines[name] = eng
    assert engines["native"].model.attention_kernel is not None, "no paged attention kernel on this host"
    assert engines["native"].model.row_ops is not None, "no row ops kernel on this host"
    out: dict = {"bench": "prefill", "rounds": rounds, "lengths": lengths, "random_weights": random_weights,
                 "variants": variants}
    for n in lengths:
        prompts = random_prompts(engines["native"].tokenizer, rounds + 1, [n] * (rounds + 1), seed=n)
        secs: dict[str, list[float]] = {name: [] for name in engines}
        for eng in engines.values():
            prefill_seconds(eng, prompts[-1])                  # warm-up: first shapes, first pages
        for r in range(rounds):
            for name, eng in engines.items():
                secs[name].append(prefill_seconds(eng, prompts[r]))
        out[f"prefill_{n}"] = {name: {"best_s": min(s), "rounds_s": s} for name, s in secs.items()}
        out[f"matmuls_{n}"] = matmul_rows(engines["native"], n, rounds, variants)
        out[f"attention_{n}"] = attention_row(engines["native"], n, rounds)
    out.update(load_avg_before=load_before, load_avg_after=os.getloadavg())
    return out


def report(r: dict) -> list[str]:
    cpu = f"{r['machine']['cpu']} ({', '.join(r['machine']['isa'])}), {r['machine']['torch_threads']} threads"
    rows = [("| CPU | tokens | native + kernel attention + row ops | native + torch row ops | native + SDPA "
             "| fp32 MKL + kernel attention | fp32 MKL + SDPA | one layer's attention: kernel / SDPA |"),
            "|---|---|---|---|---|---|---|---|"]
    for n in r["lengths"]:
        p, a = r[f"prefill_{n}"], r[f"attention_{n}"]
        rows.append(f"| {cpu} | {n} | **{p['native']['best_s']:.3f} s** | {p['native-torch-rows']['best_s']:.3f} s "
                    f"| {p['native-sdpa']['best_s']:.3f} s | {p['dequantize']['best_s']:.3f} s "
                    f"| {p['dequantize-sdpa']['best_s']:.3f} s "
                    f"| {a['kernel_ms']:.1f} / {a['sdpa_ms']:.1f} ms ({a['speedup']:.1f}x) |")
    builds = r.get("variants") or ["native"]
    rows += ["", "| M | matrix [out, in] | " + " | ".join(f"{b} GMAC/s" for b in builds) + " | MKL fp32 GMAC/s |",
             "|---|---|" + "---|" * (len(builds) + 1)]
    for n in r["lengths"]:
        for m in r[f"matmuls_{n}"]:
            per = m.get("builds_GMACps") or {builds[0]: m["native_GMACps"]}
            rows.append(f"| {n} | {m['matrix']} {m['shape']} | " + " | ".join(f"{per[b]:.1f}" for b in builds)
                        + f" | {m['mkl_GMACps']:.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2's shapes and formats with random blocks (no bundled GGUF needed)")
    ap.add_argument("--variants", choices=("host", "all"), default="host",
                    help="matmul rows: the host's build, or every serving build this CPU runs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    print(json.dumps(info))
    variants = ([host_variant()] if args.variants == "host"
                else [v for v in SERVING_VARIANTS if runs_here(v)])
    r = run([int(x) for x in args.lengths.split(",")], args.rounds, args.random_weights, variants)
    r.update(machine=info, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(json.dumps({k: v for k, v in r.items() if k != "machine"}))
    for line in report(r):
        print(line)
    append_result(Path(args.out), r)


if __name__ == "__main__":
    main()
