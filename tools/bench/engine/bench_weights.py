"""GGUF weights served natively vs dequantized to fp32, side by side in one run.

    python -m tools.bench.engine.bench_weights [--threads N] [--rounds 3]

For the bundled SmolLM2 (Q4_1 layers, Q8_0 embedding / tied LM head), with
``weights = "native"`` (blocks kept, kernels/quant_linear.py; decode steps run
by the plan executor, kernels/plan_decode.py), the same with
``decode_kernel = "torch"`` (decode through LlamaModel.forward), and
``weights = "dequantize"`` (fp32 float matrices: decode steps on the plan
executor, kernels/csrc/dense_gemm.h, prefill on torch/MKL) with and without
``decode_kernel = "torch"``, rounds alternated:

- single-stream greedy decode, 128 tokens: tok/s, and the fraction of the
  bandwidth bound (read bandwidth measured in this run ÷ weight bytes a decode
  step reads);
- prefill of one 512-token prompt (no cached prefix): seconds;
- where a native decode step's time goes: the quantized matmuls alone (every
  layer's calls at M = 1, in order, from Python as the model makes them) and
  the rest (attention, norms, RoPE, sampling, Python dispatch).

Every row names the CPU. The host may be shared: the load average before and
after is recorded, and the headline figures are the best of the alternated
rounds (other jobs only ever slow a round down, so the fastest is the closest
to what the machine does alone; the bandwidth probe is a best-of-7 for the same
reason); every round and the medians are in the JSON. Appends to
``results/bench_weights.json`` and prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from engine.engine import LLMEngine
from engine.request import SamplingParams
from kernels.quant_linear import QuantLinear
from tools.bench.engine.bench_engine import (append_result, decode_rates, machine, make_engine, random_prompts,
                                read_bandwidth)

RESULTS = Path("results/bench_weights.json")
MODES = ("native", "native-torch", "dequantize", "dequantize-torch")   # -torch: decode_kernel = "torch"


def prefill_seconds(eng: LLMEngine, prompt: list[int]) -> float:
    """Wall time of the step that prefills ``prompt`` and samples its first token."""
    eng.add_request(f"p{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         ignore_eos=True))
    t = time.perf_counter()
    while not eng.step():
        pass
    return time.perf_counter() - t


def matmul_ms_per_token(eng: LLMEngine, reps: int = 10) -> float | None:
    """Milliseconds per token of the native model's quantized matmuls alone: each
    layer's four calls and the LM head at M = 1 (best of ``reps``). None for a
    float model."""
    model = eng.model
    if not model.quantized:
        return None
    calls = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    calls.append(model.lm_head)
    inputs = [torch.randn(1, m.in_features) for m in calls]

    def token() -> float:
        t = time.perf_counter()
        for m, x in zip(calls, inputs):
            m(x)
        return time.perf_counter() - t

    token()
    return min(token() for _ in range(reps)) * 1e3


def run(rounds: int) -> dict:
    load_before = os.getloadavg()
    engines = {mode: make_engine("float32", weights=mode.removesuffix("-torch"), kv_blocks=256,
                                 enable_prefix_caching=False,
                                 decode_kernel="torch" if mode.endswith("-torch") else "auto")
               for mode in MODES}
    tok = engines["native"].tokenizer
    ids = tok.encode("The history of the Roman Empire begins")
    prompts = random_prompts(tok, rounds + 1, [512] * (rounds + 1), seed=5)
    decode: dict[str, list[float]] = {m: [] for m in MODES}
    prefill: dict[str, list[float]] = {m: [] for m in MODES}
    for mode, eng in engines.items():                   # warm-up: first shapes, first pages
        prefill_seconds(eng, prompts[-1])
    for r in range(rounds):
        for mode, eng in engines.items():
            decode[mode] += decode_rates(eng, ids, rounds=1)
            prefill[mode].append(prefill_seconds(eng, prompts[r]))
    bw = read_bandwidth()
    out = {"bench": "weights", "rounds": rounds, "read_bandwidth_GBps": bw / 1e9,
           "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    for mode, eng in engines.items():
        wbytes = eng.model.weight_bytes_per_token()
        tps = max(decode[mode])
        row = {"weight_bytes_per_token": wbytes, "decode_tokens_per_s": tps, "decode_rounds": decode[mode],
               "decode_median_tokens_per_s": statistics.median(decode[mode]),
               "limit_tokens_per_s": bw / wbytes, "fraction_of_limit": tps * wbytes / bw,
               "prefill_512_s": min(prefill[mode]), "prefill_rounds": prefill[mode],
               "prefill_median_s": statistics.median(prefill[mode])}
        row["one_call_decoder"] = type(eng.runner.fused).__name__ if eng.runner.fused else None
        if mode.startswith("native"):
            lm = eng.model.lm_head
            row["kernel"] = lm.kernel.variant if isinstance(lm, QuantLinear) and lm.kernel else None
            mm = matmul_ms_per_token(eng)
            row["matmul_ms_per_token"] = mm
            row["rest_ms_per_token"] = None if mm is None else 1e3 / tps - mm
        out[mode] = row
    return out


def report(r: dict) -> list[str]:
    cpu = f"{r['machine']['cpu']}, {r['machine']['torch_threads']} threads"
    rows = []
    for mode in MODES:
        m = r[mode]
        decode = "plan executor" if m["one_call_decoder"] else "torch"
        what = (f"dequantized fp32 ({decode} decode)" if mode.startswith("dequantize") else
                f"native ({m.get('kernel')} kernel, {decode} decode)")
        rows.append(f"| {cpu} | {what} | {m['weight_bytes_per_token'] / 1e6:.0f} MB | "
                    f"{m['decode_tokens_per_s']:.1f} tok/s | {m['limit_tokens_per_s']:.0f} tok/s "
                    f"({r['read_bandwidth_GBps']:.1f} GB/s) | **{m['fraction_of_limit']:.2f}** | "
                    f"{m['prefill_512_s'] * 1e3:.0f} ms |")
    for mode in ("native", "native-torch"):
        n = r[mode]
        if n.get("matmul_ms_per_token") is not None:
            rows.append(f"{mode} decode step: {1e3 / n['decode_tokens_per_s']:.1f} ms/token = quantized matmuls "
                        f"called one by one from Python {n['matmul_ms_per_token']:.1f} ms + the rest "
                        f"{n['rest_ms_per_token']:.1f} ms")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    print(json.dumps(info))
    r = run(args.rounds)
    r.update(machine=info, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(json.dumps({k: v for k, v in r.items() if k != "machine"}))
    print("| CPU | weights | bytes/token | decode | bandwidth bound | fraction | prefill 512 |")
    print("|---|---|---|---|---|---|---|")
    for line in report(r):
        print(line)
    append_result(RESULTS, r)


if __name__ == "__main__":
    main()
