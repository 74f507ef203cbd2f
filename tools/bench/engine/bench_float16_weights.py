"""A 16-bit checkpoint served in its own dtype against widened to fp32 at load, side by side.

    .venv/bin/python -m tools.bench.engine.bench_float16_weights [--dtype bfloat16] [--threads 2] [--rounds 3]
        [--batches 1,16,64] [--model PATH.gguf] [--bf16-compute]

The bundled SmolLM2's weights (dequantized from its GGUF) rounded to ``--dtype`` and
written as a Hugging Face directory (a temporary one), then served by two fp32 engines
(both decode on the plan executor): ``weights = "native"`` keeps the checkpoint's 16-bit
matrices (widened in registers by the executor, per call by torch's prefill) and
``"dequantize"`` widens them to fp32 at load. Both compute with the same values, so their
tokens must be equal. Rounds alternate; the headline is each side's fastest round (the host
may be shared: interference only slows a round down):

- single-stream greedy decode, 128 tokens: tok/s and the fraction of the bandwidth bound
  (read bandwidth measured here ÷ the weight bytes a step reads);
- prefill of one prompt of 32 and of 512 tokens: seconds (up to
  engine.model.llama.DENSE_PREFILL_ROWS rows run on the executor's dense matmul over
  16-bit matrices, more on MKL over each matrix widened per call);
- decode steps of B rows (``--batches``; 100-token contexts): median ms a step.

``--bf16-compute`` adds a third engine computing in bf16 over the same checkpoint (the fused
bf16 decode kernel where the CPU has AVX512-BF16, else torch): other activations, so its
tokens are not compared. ``--model`` takes the weights from another GGUF (e.g. one
tools/random_gguf.py made, with its tokenizer) instead of the bundled SmolLM2.

Names the CPU and the executor's build; appends to ``results/bench_float16_weights.json``
and prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.engine import EngineConfig, LLMEngine, build_model  # noqa: E402
from engine.model.registry import resolve_model  # noqa: E402
from engine.model.weights import LoadedWeights, save_hf_dir  # noqa: E402
from tools.bench.engine.bench_engine import append_result, decode_rates, machine, random_prompts, read_bandwidth  # noqa: E402
from tools.bench.engine.bench_float_decode import run_batch  # noqa: E402
from tools.bench.engine.bench_weights import prefill_seconds  # noqa: E402

RESULTS = Path("results/bench_float16_weights.json")
MODES = ("native", "dequantize")
BF16_COMPUTE = "bf16-compute"


def engines(dtype: torch.dtype, tmp: Path, max_batch: int, model: str, modes: tuple[str, ...]
            ) -> dict[str, LLMEngine]:
    origin = resolve_model(model)
    w = origin.load_weights()
    save_hf_dir(LoadedWeights(w.config, {n: t.to(dtype) for n, t in w.tensors.items()}, w.source), tmp / "m")
    del w
    source, tok = resolve_model(str(tmp / "m")), origin.load_tokenizer()
    out = {}
    for mode in modes:
        cfg = EngineConfig(model=str(tmp / "m"), dtype="bfloat16" if mode == BF16_COMPUTE else "float32",
                           weights="dequantize" if mode == "dequantize" else "native", enable_prefix_caching=False,
                           prefill_chunk_tokens=0, max_num_seqs=max(64, max_batch),
                           max_num_batched_tokens=max(8192, max_batch * 100), host_kv_blocks=0,
                           kv_blocks=max_batch * 130 // 16 + 96)
        out[mode] = LLMEngine(cfg, build_model(cfg, source.load_weights(quantized=mode != "dequantize")), tok, "m")
        assert mode == BF16_COMPUTE or out[mode].runner.fused is not None, f"{mode}: the executor did not take it"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--model", default="smollm2", help="the GGUF whose weights are rounded (default: bundled)")
    ap.add_argument("--bf16-compute", action="store_true", help="add an engine computing in bf16")
    args = ap.parse_args()
    modes = MODES + ((BF16_COMPUTE,) if args.bf16_compute else ())
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        eng = engines(getattr(torch, args.dtype), Path(tmp), max(batches), args.model, modes)
    tok = eng["native"].tokenizer
    stream_prompt, short_prompt, long_prompt = random_prompts(tok, 3, [32, 32, 512], seed=1)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    prefill: dict[str, list[float]] = {m: [] for m in modes}
    prefill_short: dict[str, list[float]] = {m: [] for m in modes}
    steps: dict[str, dict[int, list[float]]] = {m: {b: [] for b in batches} for m in modes}
    tokens: dict[str, list] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            e = eng[mode]
            rates[mode] += decode_rates(e, stream_prompt, rounds=1)
            prefill[mode].append(prefill_seconds(e, long_prompt))
            prefill_short[mode].append(prefill_seconds(e, short_prompt))
            for b in batches:
                t, toks = run_batch(e, b, 100, 12)
                steps[mode][b].append(t)
                if r == 0:
                    tokens[mode].append(toks)
    same = tokens["native"] == tokens["dequantize"]
    bw = read_bandwidth()
    m = machine()
    build = eng["native"].kernels()["decode"]
    rows = {}
    for mode in modes:
        wbytes = eng[mode].model.weight_bytes_per_token()
        best = max(rates[mode])
        rows[mode] = {"matrices": eng[mode].kernels()["matrices"], "decode": eng[mode].kernels()["decode"],
                      "weight_bytes_per_token": wbytes,
                      "decode_tokens_per_s": best, "decode_rounds": rates[mode],
                      "fraction_of_bound": best * wbytes / bw, "prefill_512_s": min(prefill[mode]),
                      "prefill_32_s": min(prefill_short[mode]), "prefill_32_rounds": prefill_short[mode],
                      "prefill_rounds": prefill[mode],
                      "step_ms": {b: min(v) * 1e3 for b, v in steps[mode].items()},
                      "step_rounds_ms": {b: [x * 1e3 for x in v] for b, v in steps[mode].items()}}
    append_result(RESULTS, {"bench": "float16_weights", "machine": m, "dtype": args.dtype, "model": args.model,
                            "decode_build": build,
                            "rounds": args.rounds, "read_bandwidth_GBps": bw / 1e9, "same_tokens": same,
                            "modes": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    cpu = f"{m['cpu']}, {m['torch_threads']} threads, {build}"
    print(f"\nread bandwidth {bw / 1e9:.1f} GB/s; same greedy tokens: {'yes' if same else 'NO'}\n")
    print("| CPU | checkpoint | weights | matrices | bytes/token | decode | fraction of bound | prefill 32 | "
          "prefill 512 | " + " | ".join(f"step of {b}" for b in batches) + " |")
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(batches))
    for mode, row in rows.items():
        print(f"| {cpu} | {args.dtype} | {mode} ({row['decode']}) | {row['matrices']} | {row['weight_bytes_per_token'] / 1e6:.0f} MB | "
              f"{row['decode_tokens_per_s']:.1f} tok/s | {row['fraction_of_bound']:.2f} | "
              f"{row['prefill_32_s'] * 1e3:.0f} ms | {row['prefill_512_s'] * 1e3:.0f} ms | " + " | ".join(f"{row['step_ms'][b]:.1f} ms" for b in batches)
              + " |")


if __name__ == "__main__":
    main()
