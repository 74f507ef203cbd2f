"""A float model's decode steps: the plan executor against the torch path, side by side.

    python -m tools.bench.engine.bench_float_decode [--threads 2] [--batches 1,4,16,32,64] [--context 100]
        [--steps 12] [--rounds 2]

The bundled SmolLM2 with ``weights = "dequantize"`` (fp32 float matrices, 538 MB a
token), in two engines: ``decode_kernel = "auto"`` (decode steps on the plan
executor, kernels/csrc/dense_gemm.h; matrices in the rows layout) and ``"torch"``
(LlamaModel.forward through MKL, matrices [in, out]). For each batch size, B greedy
requests of ``--context`` prompt tokens are prefilled (whole, in one step), then
their ``--steps`` decode steps of all B rows are timed as whole ``LLMEngine.step``
calls (scheduling, sampling and outputs included); the engines alternate,
``--rounds`` times. The figure is the fastest round's median step (the host is
shared: interference only slows a round down); every round is in the JSON. Also the
greedy tokens of both engines, which must be equal. ``KVD_CPU_CAPABILITY`` and
torch's own caps (``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``) set to AVX2 run both sides as an AVX2-only CPU would.
Names the CPU, the executor's build and any caps; appends to
``results/bench_float_decode.json`` and prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.request import SamplingParams  # noqa: E402
from tools.bench.engine.bench_engine import append_result, machine, make_engine, read_bandwidth  # noqa: E402

RESULTS = Path("results/bench_float_decode.json")
KERNELS = ("auto", "torch")
# caps on the builds either side runs (kvd's; MKL's, oneDNN's and ATen's), recorded with the
# figures: e.g. all four at AVX2 to measure an AVX2-only host's paths on a newer CPU
CAPS = ("KVD_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def run_batch(eng, batch: int, context: int, steps: int) -> tuple[float, list[list[int]]]:
    """Median seconds of the decode steps of ``batch`` requests, and their tokens."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, [(17 * i + 3 * t) % 40000 + 100 for t in range(context)], params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    times = []
    while eng.requests:
        prefill = any(not r.output_ids for r in eng.requests.values())
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if not prefill and len(outs) == batch:      # a step of the whole batch, decode only
            times.append(dt)
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
    return statistics.median(times[:-1] or times), [tokens[r] for r in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {k: make_engine("float32", weights="dequantize", decode_kernel=k, enable_prefix_caching=False,
                              prefill_chunk_tokens=0, max_num_batched_tokens=max(8192, max(batches) * args.context),
                              kv_blocks=(max(batches) * (args.context + args.steps + 16)) // 16 + 64)
               for k in KERNELS}
    assert engines["auto"].runner.fused is not None, "the plan executor did not take the float model"
    assert engines["torch"].runner.fused is None
    rows: dict[int, dict] = {}
    for b in batches:
        rounds: dict[str, list[float]] = {k: [] for k in KERNELS}
        same = True
        for r in range(args.rounds):
            order = KERNELS if r % 2 == 0 else KERNELS[::-1]
            toks = {}
            for k in order:
                t, toks[k] = run_batch(engines[k], b, args.context, args.steps)
                rounds[k].append(t)
            same = same and toks["auto"] == toks["torch"]
        rows[b] = {"plan_ms": min(rounds["auto"]) * 1e3, "torch_ms": min(rounds["torch"]) * 1e3,
                   "plan_rounds_ms": [x * 1e3 for x in rounds["auto"]],
                   "torch_rounds_ms": [x * 1e3 for x in rounds["torch"]], "same_tokens": same}
        print(json.dumps({"batch": b, **rows[b]}), flush=True)
    bw = read_bandwidth()
    wbytes = engines["auto"].model.weight_bytes_per_token()
    m = machine()
    build = engines["auto"].kernels()["decode"]
    caps = {k: os.environ[k] for k in CAPS if k in os.environ}
    result = {"bench": "float_decode", "machine": m, "decode_build": build, "caps": caps,
              "context": args.context, "steps": args.steps,
              "rounds": args.rounds, "read_bandwidth_GBps": bw / 1e9, "weight_bytes_per_token": wbytes,
              "batches": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    append_result(RESULTS, result)
    cpu = f"{m['cpu']}, {m['torch_threads']} threads, {build}" + "".join(f", {k}={v}" for k, v in caps.items())
    print(f"\nbandwidth bound: {wbytes / 1e6:.0f} MB per step / {bw / 1e9:.1f} GB/s = {wbytes / bw * 1e3:.1f} ms\n")
    print("| CPU | batch | plan executor: step | torch: step | change | same greedy tokens |")
    print("|---|---|---|---|---|---|")
    for b, row in rows.items():
        print(f"| {cpu} | {b} | {row['plan_ms']:.1f} ms | {row['torch_ms']:.1f} ms | "
              f"{row['plan_ms'] / row['torch_ms'] - 1:+.0%} | {'yes' if row['same_tokens'] else 'no'} |")


if __name__ == "__main__":
    main()
