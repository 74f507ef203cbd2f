"""Decode step time against batch size: the plan executor (native GGUF weights,
kernels/plan_decode.py) on SmolLM2, one ``PlanDecoder.decode`` call per step.

Each batch size runs ``--steps`` steps after a warm-up, every sequence at
position ``--context`` (its keys random, block tables distinct: in order, or with
``--scatter`` drawn at random from a pool of the default ``kv_blocks``); the figure is
the fastest step (the host is shared: interference only slows a step down)
and the median. ``--repos`` compares checkouts side by side (e.g. this tree
and a ``git worktree`` of an older commit): each is run in a subprocess of
its own, alternated ``--rounds`` times. ``--variants`` compares the kernel
builds this CPU runs (``all``: every serving build it has, e.g. AVX2 against
AVX-512 VNNI), each step of each build alternated in one process.
The weights and the KV cache are on 2 MiB pages where the OS allows
(kernels/weight_arena.py), as the engine has them. ``--pages both`` adds, for
each build, the same weights cloned into ordinary memory (4 KiB pages), and
the same KV cache copied into ordinary memory, each beside the engine's own
layout, steps alternated the same way.

``--kv-dtypes float32,float16`` adds, for each build, the same steps over a
float16 KV cache (``kv_cache_dtype = "float16"``: the same random keys rounded
to halves), alternated step by step with the fp32 cache's.

``--through engine`` times whole ``LLMEngine.step`` calls instead (B greedy
requests with random ``--context``-token prompts, prefilled first, the host's
build): the step as a server runs it, scheduling, sampling and detokenizing
included; the table adds, per step, the part spent outside the executor's call
(the engine's Python, which a step's streaming of the weights leaves with cold
caches).

``--weights random`` runs SmolLM2-135M's exact shapes and block formats (Q4_1
layers, Q8_0 tied embedding) filled with random blocks, for a host without the
bundled GGUF: a decode step reads the same bytes and does the same arithmetic,
so its time is the real model's (its logits are not). The single-sequence row
is also set against the bandwidth bound: read bandwidth measured in the run
(same thread count) ÷ the weight bytes a step reads.

    .venv/bin/python -m tools.bench.engine.bench_decode_batch [--threads 1] [--context 256]
        [--batches 1,2,3,4,6,8,12,16,32] [--repos .,/tmp/old] [--rounds 2]
        [--variants host|all|avx2,avx512vnni] [--weights bundled|random] [--pages huge|both] [--scatter]
        [--through executor|engine] [--kv-dtypes float32,float16]

Prints a table (ms per step; per sequence in brackets) and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


SCATTER_POOL = 2048        # blocks: etc/kvd.toml's kv_blocks, 1.5 GB of KV for SmolLM2


def on_plain_pages(model):
    """A shallow copy of ``model`` whose packed weights are clones in ordinary memory
    (torch's allocator: 4 KiB pages), for ``--pages both``."""
    import copy
    import dataclasses

    from kernels.quant import X8, QuantTensor
    from kernels.quant_linear import QuantLinear

    def clone(lin: QuantLinear) -> QuantLinear:
        p = lin.parts[0]
        return QuantLinear([QuantTensor(p.fmt, p.shape, p.data.clone(), X8)], lin.kernel)

    out = copy.copy(model)
    out.layers = [dataclasses.replace(layer, qkv=clone(layer.qkv), o=clone(layer.o), gate_up=clone(layer.gate_up),
                                      down=clone(layer.down)) for layer in model.layers]
    out.embed = clone(model.embed)
    out.lm_head = out.embed if model.lm_head is model.embed else clone(model.lm_head)
    return out


def measure_engine(threads: int, context: int, batches: list[int], steps: int, weights: str) -> dict:
    """``--through engine``: {host build: {batch: {min_ms, median_ms, host_ms}}} plus ``_bound``;
    host_ms is the median over steps of the step's time outside the executor's call."""
    import torch

    from engine.engine import EngineConfig, LLMEngine
    from engine.request import SamplingParams
    from kernels.decode_inputs import DecodeStaging
    from kernels.quant_linear import host_variant
    from tools.bench.engine.bench_engine import read_bandwidth

    if weights != "bundled":
        raise SystemExit("bench_decode_batch: --through engine runs the bundled model")
    torch.set_num_threads(threads)
    eng = LLMEngine.from_config(EngineConfig(num_threads=threads))
    dec = eng.runner.fused
    if dec is None:
        raise SystemExit("bench_decode_batch: the engine has no one-call decoder here (see the log)")
    inside = [0.0]
    run = DecodeStaging.run

    def timed(self, *args, **kw):                   # the executor's call as the engine makes it (its staging
        t = time.perf_counter()                     # was built with the runner: patched on the class)
        try:
            return run(self, *args, **kw)
        finally:
            inside[0] += time.perf_counter() - t
    DecodeStaging.run = timed
    rng = torch.Generator().manual_seed(0)
    out: dict = {host_variant(): {}}
    for b in batches:
        # every request decodes through the timed steps (the first ones prefilled decode meanwhile)
        params = SamplingParams(max_tokens=steps + 16 + b * context, temperature=0.0, ignore_eos=True)
        for i in range(b):
            prompt = torch.randint(0, eng.model.config.vocab_size, (context,), generator=rng).tolist()
            eng.add_request(f"b{b}-{i}", prompt, params)
        while any(r.prefilling or r.num_computed < len(r.prompt_ids) for r in eng.requests.values()):
            eng.step()
        for _ in range(3):
            eng.step()
        walls, hosts = [], []
        for _ in range(steps):
            inside[0] = 0.0
            t = time.perf_counter()
            eng.step()
            wall = time.perf_counter() - t
            walls.append(wall * 1e3)
            hosts.append((wall - inside[0]) * 1e3)
        for rid in list(eng.requests):
            eng.abort_request(rid)
        out[host_variant()][b] = {"min_ms": min(walls), "median_ms": statistics.median(walls),
                                  "host_ms": statistics.median(hosts)}
    DecodeStaging.run = run
    bw = read_bandwidth()
    wbytes = eng.model.weight_bytes_per_token()
    out["_bound"] = {"read_bandwidth_GBps": bw / 1e9, "weight_bytes_per_token": wbytes,
                     "bound_ms_per_step": wbytes / bw * 1e3, "weights": weights}
    return out


def measure(threads: int, context: int, batches: list[int], steps: int, variants: list[str],
            weights: str, pages: str = "huge", scatter: bool = False, kv_dtypes: tuple[str, ...] = ("float32",)
            ) -> dict:
    """Runs in the checkout under test (its engine and kernels on sys.path).
    Returns {variant: {batch: {min_ms, median_ms}}} plus ``_bound`` (bandwidth bound);
    with ``pages`` "both", also {"<variant>, 4 KiB pages": ...} (the weights on ordinary
    pages) and {"<variant>, KV on 4 KiB pages": ...}; with "float16" in ``kv_dtypes``, also
    {"<variant>, KV float16": ...} (the same keys, rounded to halves)."""
    import torch

    from engine.model.decode_kernels import plan_decoder
    from kernels.quant_linear import SERVING_VARIANTS, host_variant
    from kernels.weight_arena import huge_page_zeros
    from tools.bench.engine.bench_engine import read_bandwidth, smollm2_served

    torch.set_num_threads(threads)
    model = smollm2_served(weights)
    if variants == ["host"]:
        variants = [host_variant()]
    elif variants == ["all"]:
        from kernels.quant_linear import runs_here
        variants = [v for v in SERVING_VARIANTS if runs_here(v)]
    c, bs = model.config, 16
    per = context // bs + 2
    pool = max(max(batches) * per + 1, SCATTER_POOL if scatter else 0)
    kv_plain = torch.randn(c.num_layers, 2, pool, bs, c.num_kv_heads, c.head_dim)
    kv = huge_page_zeros(tuple(kv_plain.shape), kv_plain.dtype)   # as engine/memory/kv_cache.py has it
    kv.copy_(kv_plain)
    if len(variants) == 1 and variants[0] == host_variant():    # also a checkout from before variant=
        decoders = {variants[0]: plan_decoder(model, kv, bs)}
    else:
        decoders = {v: plan_decoder(model, kv, bs, variant=v) for v in variants}
    builds = list(variants)                                      # before --pages adds its columns
    if pages == "both":
        plain = on_plain_pages(model)
        decoders.update({f"{v}, 4 KiB pages": plan_decoder(plain, kv, bs, variant=v) for v in variants})
        decoders.update({f"{v}, KV on 4 KiB pages": decoders[v] for v in variants})    # same build, kv_plain
        variants = list(decoders)
    caches = {v: kv_plain if v.endswith("KV on 4 KiB pages") else kv for v in decoders}
    if "float16" in kv_dtypes:
        kv16 = huge_page_zeros(tuple(kv_plain.shape), torch.float16)
        kv16.copy_(kv_plain)
        for v in builds:
            decoders[f"{v}, KV float16"] = plan_decoder(model, kv16, bs, variant=v)
            caches[f"{v}, KV float16"] = kv16
        if "float32" not in kv_dtypes:
            decoders = {v: d for v, d in decoders.items() if v.endswith("KV float16")}
        variants = list(decoders)
    missing = [v for v, d in decoders.items() if d is None]
    if missing:
        raise SystemExit(f"bench_decode_batch: the plan executor does not run here for {missing} (see the log)")
    out: dict = {v: {} for v in variants}
    for b in batches:
        ids = torch.randint(0, c.vocab_size, (b,), generator=torch.Generator().manual_seed(b))
        pos = torch.full((b,), context, dtype=torch.int64)
        tables = (torch.randperm(kv.shape[2], generator=torch.Generator().manual_seed(b))[:b * per] if scatter
                  else torch.arange(b * per, dtype=torch.int64)).reshape(b, per)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for v, dec in decoders.items():
            for _ in range(3):
                dec.decode(ids, pos, tables, caches[v])
        for _ in range(steps):
            for v, dec in decoders.items():          # builds alternate step by step
                t = time.perf_counter()
                dec.decode(ids, pos, tables, caches[v])
                times[v].append((time.perf_counter() - t) * 1e3)
        for v in variants:
            out[v][b] = {"min_ms": min(times[v]), "median_ms": statistics.median(times[v])}
    bw = read_bandwidth()
    wbytes = model.weight_bytes_per_token()
    out["_bound"] = {"read_bandwidth_GBps": bw / 1e9, "weight_bytes_per_token": wbytes,
                     "bound_ms_per_step": wbytes / bw * 1e3, "weights": weights}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,2,3,4,6,8,12,16,32")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repos", default=".", help="comma-separated checkouts to compare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="host",
                    help="kernel builds: host (the one serving uses), all (every build this CPU runs), or a list")
    ap.add_argument("--weights", choices=("bundled", "random"), default="bundled",
                    help="the bundled GGUF, or random blocks in its shapes and formats")
    ap.add_argument("--pages", choices=("huge", "both"), default="huge",
                    help="both: also the weights, and the KV cache, on ordinary 4 KiB pages, alternated")
    ap.add_argument("--scatter", action="store_true",
                    help="block tables drawn at random from the pool (a long-running server's), not in order")
    ap.add_argument("--through", choices=("executor", "engine"), default="executor",
                    help="engine: time LLMEngine.step (the engine's Python included), host build only")
    ap.add_argument("--kv-dtypes", default="float32",
                    help="KV caches to compare, of float32 and float16 (kv_cache_dtype), e.g. float32,float16")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_decode_batch.json"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not args.kv_dtypes or set(args.kv_dtypes.split(",")) - {"float32", "float16"}:
        raise SystemExit(f"bench_decode_batch: --kv-dtypes takes float32 and/or float16, got {args.kv_dtypes!r}")
    variants = args.variants.split(",")
    if args.worker:
        sys.path.insert(0, os.getcwd())
        if args.through == "engine":
            print(json.dumps(measure_engine(args.threads, args.context, batches, args.steps, args.weights)))
        else:
            print(json.dumps(measure(args.threads, args.context, batches, args.steps, variants, args.weights,
                                     args.pages, args.scatter, tuple(args.kv_dtypes.split(",")))))
        return
    sys.path.insert(0, str(REPO))
    from tools._twoproc import write_results
    from tools.loadgen.report import cpu_model

    repos = [str(Path(r).resolve()) for r in args.repos.split(",")]
    rows = []
    for rnd in range(args.rounds):
        for repo in (repos if rnd % 2 == 0 else repos[::-1]):
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--threads",
                                   str(args.threads), "--context", str(args.context), "--batches", args.batches,
                                   "--steps", str(args.steps), "--variants", args.variants,
                                   "--weights", args.weights, *(["--pages", "both"] if args.pages == "both" else []),
                                   *(["--scatter"] if args.scatter else []), "--through", args.through,
                                   "--kv-dtypes", args.kv_dtypes],
                                  cwd=repo, capture_output=True, text=True,
                                  timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"bench_decode_batch: {repo}: {proc.stderr.strip()[-500:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            bound = result.pop("_bound")
            for variant, steps in result.items():
                rows.append({"repo": repo, "variant": variant, "round": rnd, "bound": bound,
                             "steps": {int(k): v for k, v in steps.items()}})
    cpu = cpu_model()
    columns = list(dict.fromkeys((r["repo"], r["variant"]) for r in rows))
    label = {col: (col[1] if len(repos) == 1 else f"{col[0]} ({col[1]})") for col in columns}
    bound = min(r["bound"]["bound_ms_per_step"] for r in rows)
    gbs = max(r["bound"]["read_bandwidth_GBps"] for r in rows)
    through = "LLMEngine.step" if args.through == "engine" else "the executor's decode"
    print(f"\n{cpu}, {args.threads} thread(s), context {args.context}, {args.weights} weights, {through}: "
          f"fastest step over {args.rounds} rounds, ms (per sequence); median of the rounds' median steps"
          + ("; [median ms of a step outside the executor's call]" if args.through == "engine" else "") + "\n")
    print("| batch | " + " | ".join(label[c] for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for b in batches:
        cells = []
        for col in columns:
            mine = [r["steps"][b] for r in rows if (r["repo"], r["variant"]) == col]
            best = min(m["min_ms"] for m in mine)
            host = (f" [{statistics.median(m['host_ms'] for m in mine):.3f}]"
                    if args.through == "engine" else "")
            med = statistics.median(m["median_ms"] for m in mine)
            cells.append(f"{best:.2f} ({best / b:.2f}); {med:.2f}{host}")
        print(f"| {b} | " + " | ".join(cells) + " |")
    if 1 in batches:
        print(f"\nbandwidth bound: {rows[0]['bound']['weight_bytes_per_token'] / 1e6:.1f} MB per step "
              f"÷ {gbs:.1f} GB/s = {bound:.2f} ms; a single sequence's step reaches "
              + ", ".join(f"{label[c]} {bound / min(r['steps'][1]['min_ms'] for r in rows if (r['repo'], r['variant']) == c):.2f}"
                          for c in columns) + " of it")
    write_results(args.out, rows, cpu=cpu, args=vars(args))


if __name__ == "__main__":
    main()
