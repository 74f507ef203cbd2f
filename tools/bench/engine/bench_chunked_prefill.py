"""Inter-token latency of running streams while long prompts arrive: chunked prefill vs not, in one run.

    python -m tools.bench.engine.bench_chunked_prefill [--chunks 0,256,512] [--streams 8]
        [--prompt-len 4096] [--arrivals 2] [--threads N] [--weights native]

The bundled SmolLM2 on the engine (no HTTP: the figures are the engine's),
one model shared by one engine per setting of ``prefill_chunk_tokens``
(0 = unchunked), the settings run one after another in the same process:

1. ``--streams`` requests with 64-token prompts decode until each has 8 tokens
   (warm-up; the ITL of this phase is reported as ``decode_only``);
2. ``--arrivals`` prompts of ``--prompt-len`` random tokens arrive one at a
   time, the next when the previous one has its first token and the streams
   have decoded 4 more tokens;
3. ITL = the time between two consecutive tokens of one stream, a token's
   time being when ``step()`` returned it, over every gap that ends after the
   first arrival and before the last long prompt's first token + 4 steps.

Reported per setting: ITL p50 / p99 / max of the streams in that window, the
long prompts' TTFT (what chunking costs them), steps, and the ratio of each
p99 to the unchunked one. ``os.getloadavg()`` before and after each setting
goes into the record: the host may be shared. Appends to
``results/bench_chunked_prefill.json`` and prints a markdown row per setting.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch

from engine.engine import EngineConfig, LLMEngine, build_model
from engine.model.registry import resolve_model
from engine.request import SamplingParams
from tools.bench.engine.bench_engine import append_result, machine, random_prompts

RESULTS = Path("results/bench_chunked_prefill.json")
STREAM_PROMPT = 64
WARMUP_TOKENS = 8
AFTER_TOKENS = 4


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))] if q > 0 else s[0]


def run_setting(model, tok, chunk: int, streams: int, long_prompts: list[list[int]], seed: int) -> dict:
    kv_blocks = (streams * 2200 + len(long_prompts) * (len(long_prompts[0]) + 16)) // 16 + 16
    cfg = EngineConfig(model="smollm2", dtype="float32", kv_blocks=kv_blocks, host_kv_blocks=0,
                       max_num_seqs=64, enable_prefix_caching=False, prefill_chunk_tokens=chunk)
    eng = LLMEngine(cfg, model, tok, "smollm2")
    load_before = os.getloadavg()
    stream_params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    ids = [f"s{i}" for i in range(streams)]
    for rid, p in zip(ids, random_prompts(tok, streams, [STREAM_PROMPT] * streams, seed)):
        eng.add_request(rid, p, stream_params)
    times: dict[str, list[float]] = {rid: [] for rid in ids}

    def step() -> set[str]:
        outs = eng.step()
        now = time.perf_counter()
        got = set()
        for o in outs:
            got.add(o.request_id)
            if o.request_id in times and o.new_token_ids:
                times[o.request_id].append(now)
        return got

    while min(len(t) for t in times.values()) < WARMUP_TOKENS:
        step()
    warm_gaps = [b - a for t in times.values() for a, b in zip(t[1:], t[2:])]
    window_start = time.perf_counter()
    ttft, steps = [], 0
    for k, prompt in enumerate(long_prompts):
        rid = f"long{k}"
        t0 = time.perf_counter()
        eng.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while rid not in step():
            steps += 1
        ttft.append(time.perf_counter() - t0)
        for _ in range(AFTER_TOKENS):
            step()
            steps += 1
    window_end = time.perf_counter()
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:]) if b > window_start and b <= window_end]
    for rid in ids:
        eng.abort_request(rid)
    eng.check_integrity()
    del eng
    gc.collect()
    return {"prefill_chunk_tokens": chunk, "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "itl_max_s": max(gaps), "gaps": len(gaps), "ttft_s": ttft, "steps": steps,
            "decode_only_itl_p50_s": percentile(warm_gaps, 50), "decode_only_itl_p99_s": percentile(warm_gaps, 99),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="0,256,512", help="prefill_chunk_tokens settings; 0 = unchunked")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--arrivals", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--weights", default="native", choices=["native", "dequantize"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model("smollm2")
    tok = source.load_tokenizer()
    cfg = EngineConfig(model="smollm2", weights=args.weights)
    model = build_model(cfg, source.load_weights(quantized=args.weights == "native"))
    long_prompts = random_prompts(tok, args.arrivals, [args.prompt_len] * args.arrivals, args.seed + 1)
    rows = [run_setting(model, tok, int(c), args.streams, long_prompts, args.seed) for c in args.chunks.split(",")]
    base = next((r["itl_p99_s"] for r in rows if r["prefill_chunk_tokens"] == 0), None)
    for r in rows:
        r["p99_vs_unchunked"] = base / r["itl_p99_s"] if base else None
    record = {"bench": "chunked_prefill", "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(),
              "weights": args.weights, "dtype": str(model.dtype).removeprefix("torch."),
              "streams": args.streams, "prompt_len": args.prompt_len, "arrivals": args.arrivals, "rows": rows}
    append_result(RESULTS, record)
    cpu = record["machine"]["cpu"]
    print(f"| CPU | prefill_chunk_tokens | ITL p50 | ITL p99 | ITL max | p99 vs unchunked | "
          f"TTFT of the {args.prompt_len}-token prompts | load before / after |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['p99_vs_unchunked']:.1f}x lower" if r["p99_vs_unchunked"] else "-"
        print(f"| {cpu}, {torch.get_num_threads()} threads | {r['prefill_chunk_tokens'] or 'off'} | "
              f"{r['itl_p50_s'] * 1e3:.0f} ms | {r['itl_p99_s'] * 1e3:.0f} ms | {r['itl_max_s'] * 1e3:.0f} ms | "
              f"{ratio} | {', '.join(f'{t:.1f} s' for t in r['ttft_s'])} | "
              f"{r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f} |")


if __name__ == "__main__":
    main()
