"""Engine benchmarks for the single-node issue, each a side-by-side ratio in one run.

    python -m tools.bench.engine.bench_engine decode            # single-stream tok/s vs the bandwidth bound: native
                                                   # weights, torch path, dequantized (--dtype), side by side
                                                   # [--random-weights: SmolLM2's shapes, random blocks]
    python -m tools.bench.engine.bench_engine batch             # 32 x (256 in, 128 out): kvd vs HF generate
    python -m tools.bench.engine.bench_engine mixed             # 64 mixed lengths: kvd vs HF static batch
    python -m tools.bench.engine.bench_engine ttft              # 1,024-token prompt, 960 cached vs uncached
    python -m tools.bench.engine.bench_engine all [--dtype bfloat16|float32]

Prints what it measured and the machine, appends results to
``results/bench_engine.json`` and prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from engine.engine import DTYPES, EngineConfig, LLMEngine, build_model, resolve_dtype
from engine.model.config import LlamaConfig
from engine.model.llama import LlamaModel
from engine.model.registry import resolve_model
from engine.model.weights import LoadedWeights, expected_shapes
from engine.request import SamplingParams
from kernels import native
from kernels.quant import BLOCK, FORMATS, QuantTensor
from kernels.quant_linear import QuantKernel

RESULTS = Path("results/bench_engine.json")


def machine() -> dict:
    flags = native.cpu_flags()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "isa": sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")),
            "torch": torch.__version__, "python": platform.python_version()}


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """Best-of-N read bandwidth (bytes/s): a sum over a buffer far larger than cache."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t))
    return best


def append_result(path: Path, record: dict) -> None:
    """Append ``record`` to the JSON list in ``path`` (made, with its folder, if missing)."""
    out = json.loads(path.read_text()) if path.exists() else []
    out.append(record)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def random_prompts(tok, n: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tok.eos_token_ids) | ({tok.bos_token_id} if tok.bos_token_id is not None else set())
    vocab = [i for i in range(min(tok.vocab_size, 49152)) if i not in special and i > 16]
    return [[rng.choice(vocab) for _ in range(lengths[i])] for i in range(n)]


def make_engine(dtype: str, random_weights: bool = False, **kw) -> LLMEngine:
    """An engine on the bundled SmolLM2, or (``random_weights``) on ``random_smollm2()``
    with the bundled tokenizer; ``kw`` overrides EngineConfig fields."""
    cfg = dict(model="smollm2", dtype=dtype, kv_blocks=4096, host_kv_blocks=0, max_num_seqs=64,
               max_num_batched_tokens=8192)
    cfg.update(kw)
    config = EngineConfig(**cfg)
    if not random_weights:
        return LLMEngine.from_config(config)
    w = random_smollm2()
    w = w if config.weights == "native" else w.dequantized()
    return LLMEngine(config, build_model(config, w), resolve_model("smollm2").load_tokenizer(), w.source)


def smollm2_served(weights: str) -> LlamaModel:
    """SmolLM2 as served (quantized blocks on this CPU's kernel): the bundled GGUF's
    (``weights`` "bundled") or ``random_smollm2()``'s ("random")."""
    w = random_smollm2() if weights == "random" else resolve_model("smollm2").load_weights(quantized=True)
    return LlamaModel(w.config, w.tensors, quant_kernel=QuantKernel.create())


def random_smollm2(seed: int = 0) -> LoadedWeights:
    """SmolLM2-135M's config and tensors in the bundled file's formats (Q4_1 layers,
    Q8_0 tied embedding), filled with random blocks: for a host without the bundled
    GGUF. A step reads the same bytes and does the same arithmetic as on the real
    weights, so its time is the real model's (its tokens are not).

    Q4_1 blocks get scale 2^-7 and minimum -2^-4 (weights in [-0.0625, 0.055]),
    Q8_0 blocks scale 2^-11: finite, model-like magnitudes; the nibbles and
    int8s are uniform random bytes."""
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=8192, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape)
            continue
        fmt = "Q8_0" if "embed" in name else "Q4_1"
        tensors[name] = QuantTensor(FORMATS[fmt], shape, random_blocks(shape[0], shape[1], fmt, gen))
    return LoadedWeights(cfg, tensors, f"random-smollm2:seed={seed}")


def random_blocks(rows: int, cols: int, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """[rows, cols / 32 * block_bytes] uint8: ``fmt`` ("Q4_1" or "Q8_0") blocks with
    random quants and fixed fp16 scales, Q4_1 d = 2^-7 and m = -2^-4, Q8_0 d = 2^-11
    (the stand-in blocks of ``random_smollm2`` and tools/random_gguf.py)."""
    fmt_ = FORMATS[fmt]
    blocks = torch.randint(0, 256, (rows, cols // BLOCK, fmt_.block_bytes), dtype=torch.uint8, generator=gen)
    scales = (2.0 ** -7, -2.0 ** -4) if fmt == "Q4_1" else (2.0 ** -11,)
    for i, scale in enumerate(scales):
        blocks[:, :, 2 * i:2 * i + 2] = torch.tensor([scale], dtype=torch.float16).view(torch.uint8)
    return blocks.reshape(rows, -1).contiguous()


def hf_model(dtype: str):
    import transformers

    from engine.model.registry import bundled_gguf_path
    path = bundled_gguf_path()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          torch_dtype=torch.float32)
    return m.to(DTYPES[dtype]).eval()


# ------------------------------------------------------------------ decode
def decode_rates(eng: LLMEngine, ids: list[int], rounds: int = 3) -> list[float]:
    """Tokens/s of single-stream greedy decode (128 tokens), one figure per round."""
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    eng.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    rates = []
    for _ in range(rounds):
        eng.add_request("d", ids, sp)
        eng.step()                                   # prefill: not part of decode speed
        t = time.perf_counter()
        n = 0
        while eng.has_unfinished():
            n += len(eng.step())
        rates.append(n / (time.perf_counter() - t))
    return rates


def bench_decode(dtype: str, random_weights: bool = False) -> dict:
    """What ``dtype = "auto"`` serves (the plan executor on native weights), the same
    with the torch path (``decode_kernel="torch"``), and the dequantized weights in
    ``dtype`` (``weights = "dequantize"``: the fused kernel in bf16 where it runs),
    rounds alternated, against one bound (the default path's bytes per token)."""
    engines = {"default": make_engine("auto", random_weights, kv_blocks=256),
               "torch": make_engine("auto", random_weights, kv_blocks=256, decode_kernel="torch"),
               "dequantize": make_engine(dtype, random_weights, kv_blocks=256, weights="dequantize")}
    ids = engines["default"].tokenizer.encode("The history of the Roman Empire begins")
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(3):
        for name, eng in engines.items():
            rates[name] += decode_rates(eng, ids, rounds=1)
    phases = decode_phases(engines["default"], ids)
    bw = read_bandwidth()
    wbytes = engines["default"].model.weight_bytes_per_token()
    limit = bw / wbytes
    tps = statistics.median(rates["default"])
    torch_tps = statistics.median(rates["torch"])
    deq = engines["dequantize"]
    fused = engines["default"].runner.fused
    return {"bench": "decode", "dtype": dtype, "fused": fused is not None,
            "decoder": type(fused).__name__ if fused is not None else "torch",
            "random_weights": random_weights, "tokens_per_s": tps, "torch_tokens_per_s": torch_tps,
            "dequantized_tokens_per_s": statistics.median(rates["dequantize"]),
            "dequantized_fused": deq.runner.fused is not None, "dequantized_dtype": str(deq.model.dtype),
            "weight_bytes_per_token": wbytes,
            "read_bandwidth_GBps": bw / 1e9, "limit_tokens_per_s": limit, "fraction_of_limit": tps / limit,
            "torch_fraction_of_limit": torch_tps / limit, "fused_phase_ms_per_token": phases}


def decode_phases(eng: LLMEngine, ids: list[int]) -> dict[str, float] | None:
    """Milliseconds per token in each phase of the fused step (one more 128-token
    run, timed by the kernel itself; a phase includes waiting for the slower
    thread), plus the engine's time outside the kernel. None without the kernel."""
    fused = eng.runner.fused
    if fused is None:
        return None
    from kernels.fused_decode import PHASES
    eng.add_request("p", ids, SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True))
    eng.step()                                       # prefill
    fused.phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)
    t = time.perf_counter()
    n = 0
    while eng.has_unfinished():
        n += len(eng.step())
    elapsed = time.perf_counter() - t
    seconds = fused.phase_seconds.tolist()
    fused.phase_seconds = None
    per_token = {name: s * 1e3 / n for name, s in zip(PHASES, seconds)}
    per_token["outside_kernel"] = (elapsed - sum(seconds)) * 1e3 / n
    return {k: round(v, 4) for k, v in per_token.items()}


# ------------------------------------------------------------------ batch
def run_kvd(eng: LLMEngine, prompts, outs) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    got = eng.generate(prompts, params)
    el = time.perf_counter() - t
    assert [len(g) for g in got] == list(outs)
    return el, sum(outs)


def run_hf(model, prompts, outs, pad_id: int) -> tuple[float, int]:
    """One static batch: left-padded prompts, decode until the longest output is done."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    n = max(outs)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=pad_id)
    el = time.perf_counter() - t
    return el, sum(outs)                                # useful tokens: what each request asked for


def bench_batch(dtype: str, mixed: bool) -> dict:
    eng = make_engine(dtype)
    rng = random.Random(1)
    if mixed:
        n = 64
        in_lens = [rng.randint(32, 512) for _ in range(n)]
        out_lens = [rng.randint(16, 256) for _ in range(n)]
    else:
        n = 32
        in_lens, out_lens = [256] * n, [128] * n
    prompts = random_prompts(eng.tokenizer, n, in_lens, seed=2)
    run_kvd(eng, prompts[:2], [4, 4])                   # warm-up
    kvd_s, tokens = run_kvd(make_engine(dtype), prompts, out_lens)
    del eng
    hf = hf_model(dtype)
    pad = 0                                             # <|endoftext|>; masked out anyway
    run_hf(hf, prompts[:2], [4, 4], pad)
    hf_s, _ = run_hf(hf, prompts, out_lens, pad)
    return {"bench": "mixed64" if mixed else "batch32", "dtype": dtype, "requests": n,
            "output_tokens": tokens, "kvd_tokens_per_s": tokens / kvd_s, "hf_tokens_per_s": tokens / hf_s,
            "ratio": hf_s / kvd_s, "kvd_s": kvd_s, "hf_s": hf_s,
            "in_lens": [min(in_lens), max(in_lens)], "out_lens": [min(out_lens), max(out_lens)]}


# ------------------------------------------------------------------ ttft
def bench_ttft(dtype: str) -> dict:
    eng = make_engine(dtype, kv_blocks=512)
    prefix = random_prompts(eng.tokenizer, 1, [960], seed=3)[0]
    tails = random_prompts(eng.tokenizer, 8, [64] * 8, seed=4)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(engine: LLMEngine, prompt: list[int]) -> float:
        t = time.perf_counter()
        engine.add_request(f"t{time.perf_counter_ns()}", prompt, sp)
        while not engine.step():
            pass
        return time.perf_counter() - t

    cold_engine = make_engine(dtype, kv_blocks=512, enable_prefix_caching=False)
    ttft(cold_engine, prefix + tails[0])                 # warm-up
    cold = statistics.median(ttft(cold_engine, prefix + t) for t in tails[1:6])
    ttft(eng, prefix + tails[0])                         # caches the 960-token prefix
    hits0 = eng.stats.prefix_hit_tokens
    warm = statistics.median(ttft(eng, prefix + t) for t in tails[1:6])
    assert eng.stats.prefix_hit_tokens - hits0 == 5 * 960
    return {"bench": "ttft", "dtype": dtype, "prompt_tokens": 1024, "cached_tokens": 960,
            "uncached_s": cold, "cached_s": warm, "speedup": cold / warm}


def report(r: dict) -> str:
    b = r["bench"]
    if b == "decode":
        path = r.get("decoder", "fused kernel" if r["fused"] else "torch (no fused kernel here)")
        return (f"| single-stream decode ({r['dtype']}) | {path} {r['tokens_per_s']:.1f} tok/s, "
                f"torch path {r['torch_tokens_per_s']:.1f} tok/s | limit "
                f"{r['limit_tokens_per_s']:.1f} tok/s = {r['read_bandwidth_GBps']:.1f} GB/s ÷ "
                f"{r['weight_bytes_per_token'] / 1e6:.0f} MB/token | **{r['fraction_of_limit']:.2f}** "
                f"of limit (torch {r['torch_fraction_of_limit']:.2f}) | dequantized "
                f"{r['dequantized_dtype'].removeprefix('torch.')}"
                f"{' (fused kernel)' if r['dequantized_fused'] else ''} {r['dequantized_tokens_per_s']:.1f} tok/s |")
    if b in ("batch32", "mixed64"):
        return (f"| {b} ({r['dtype']}) | kvd {r['kvd_tokens_per_s']:.1f} tok/s | HF generate "
                f"{r['hf_tokens_per_s']:.1f} tok/s | **{r['ratio']:.2f}x** |")
    return (f"| TTFT 1,024 tokens, 960 cached ({r['dtype']}) | cached {r['cached_s'] * 1e3:.0f} ms | "
            f"uncached {r['uncached_s'] * 1e3:.0f} ms | **{r['speedup']:.1f}x** |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["decode", "batch", "mixed", "ttft", "all"])
    ap.add_argument("--dtype", default=str(resolve_dtype("auto")).removeprefix("torch."),
                    choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--random-weights", action="store_true",
                    help="decode only: SmolLM2's shapes and formats with random blocks (no bundled GGUF needed)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    todo = ["decode", "batch", "mixed", "ttft"] if args.which == "all" else [args.which]
    runs = {"decode": lambda: bench_decode(args.dtype, args.random_weights), "batch": lambda: bench_batch(args.dtype, False),
            "mixed": lambda: bench_batch(args.dtype, True), "ttft": lambda: bench_ttft(args.dtype)}
    info = machine()
    print(json.dumps(info))
    out = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for name in todo:
        r = runs[name]()
        r.update(machine=info, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        print(json.dumps({k: v for k, v in r.items() if k != "machine"}))
        print(report(r))
        out.append(r)
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
