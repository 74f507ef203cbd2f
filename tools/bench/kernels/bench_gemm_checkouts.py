"""The quantized matmul of another checkout against this one's, in one process, alternated.

For a change to kernels/csrc/quant_gemm.h (the many-row GEMM that prefills and batched
decode steps run): make a git worktree of the commit before it, then

    .venv/bin/python -m tools.bench.kernels.bench_gemm_checkouts --baseline /tmp/base [--rows 4,16,64,512]
        [--prefill 128,512] [--rounds 5] [--threads 2] [--variant avx512vnni]

The baseline's ``quant_matmul`` library (``--variant``, default the host's build) is built
in its own tree (``kernels.native.build`` there) and loaded beside this tree's, into
one process over the same packed weights (the bundled SmolLM2's):

- **matmuls**: layer 0's four projections at M = each ``--rows``, the two libraries
  called in turn, best of ``--rounds``; GMAC/s of the four together;
- **prefill**: an engine prefill of one prompt of each ``--prefill`` length, every
  QuantLinear of the model pointed at one library then the other, alternated, best of
  ``--rounds`` (the rest of the prefill is the same code).

Every matmul output of the two must be equal bit for bit (the kernels' contract): the
run stops otherwise. Names the CPU; appends to
``results/bench_gemm_checkouts.json`` and prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kernels import native  # noqa: E402
from kernels.quant_linear import LIBRARY, QuantKernel, QuantLinear, host_variant, library_flags  # noqa: E402
from tools.bench.engine.bench_engine import append_result, machine, make_engine, random_prompts  # noqa: E402
from tools.bench.engine.bench_weights import prefill_seconds  # noqa: E402

RESULTS = REPO / "results" / "bench_gemm_checkouts.json"
MATRICES = ("qkv", "o", "gate_up", "down")


def baseline_library(repo: Path, variant: str) -> Path:
    """Build (if needed) ``repo``'s quant_matmul for ``variant`` in its own tree; its path."""
    code = (f"from kernels import native; from kernels.quant_linear import library_flags; "
            f"print(native.build({LIBRARY!r}, library_flags({LIBRARY!r}, {variant!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def point_at(model, kernel: QuantKernel) -> None:
    """Every layer matrix of ``model`` a QuantLinear over ``kernel`` (the same packed weights:
    packing packed parts keeps them as they are)."""
    for layer in model.layers:
        for name in MATRICES:
            setattr(layer, name, QuantLinear(getattr(layer, name).parts, kernel))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a checkout (git worktree) whose library to compare")
    ap.add_argument("--rows", default="4,16,64,512")
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variant", default=None, help="the build to compare (default: the host's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variant = args.variant or host_variant()
    paths = {"baseline": baseline_library(Path(args.baseline).resolve(), variant),
             "this tree": native.build(LIBRARY, library_flags(LIBRARY, variant))}
    kernels = {k: QuantKernel(ctypes.CDLL(str(p)), variant) for k, p in paths.items()}
    eng = make_engine("float32", False, weights="native", kv_blocks=1024 // 16 + 64, enable_prefix_caching=False)
    layer = eng.model.layers[0]
    result: dict = {"bench": "gemm_checkouts", "machine": machine(), "variant": variant,
                    "libraries": {k: str(p) for k, p in paths.items()}, "rounds": args.rounds,
                    "matmuls": [], "prefill": []}
    for m in [int(r) for r in args.rows.split(",")]:
        best = {k: 0.0 for k in kernels}
        for name in MATRICES:
            lin = getattr(layer, name)
            x = torch.randn(m, lin.in_features, generator=torch.Generator().manual_seed(m))
            lins = {k: QuantLinear(lin.parts, kern) for k, kern in kernels.items()}
            times: dict[str, list[float]] = {k: [] for k in kernels}
            outs = {}
            for _ in range(args.rounds + 1):
                for k, one in lins.items():
                    t = time.perf_counter()
                    outs[k] = one(x)
                    times[k].append(time.perf_counter() - t)
            if not torch.equal(outs["baseline"], outs["this tree"]):
                raise SystemExit(f"{name} at M = {m}: the two libraries' outputs differ")
            for k in kernels:
                best[k] += min(times[k][1:])
        macs = m * sum(getattr(layer, n).in_features * getattr(layer, n).out_features for n in MATRICES)
        result["matmuls"].append({"rows": m, **{f"{k} GMAC/s": macs / s / 1e9 for k, s in best.items()}})
    tok = eng.tokenizer
    for n in [int(p) for p in args.prefill.split(",")]:
        prompts = random_prompts(tok, args.rounds + 1, [n] * (args.rounds + 1), seed=n)
        secs: dict[str, list[float]] = {k: [] for k in kernels}
        for r, prompt in enumerate(prompts):
            for k in (kernels if r % 2 == 0 else list(kernels)[::-1]):
                point_at(eng.model, kernels[k])
                secs[k].append(prefill_seconds(eng, prompt))
        result["prefill"].append({"tokens": n, **{f"{k} s": min(s[1:]) for k, s in secs.items()},
                                  "rounds_s": secs})
    point_at(eng.model, kernels["this tree"])
    append_result(RESULTS, result)
    cpu = f"{result['machine']['cpu']}, {torch.get_num_threads()} threads, {variant}"
    print("\n| CPU | M (rows of x) | baseline GMAC/s | this tree GMAC/s | speed-up |\n|---|---|---|---|---|")
    for row in result["matmuls"]:
        b, t = row["baseline GMAC/s"], row["this tree GMAC/s"]
        print(f"| {cpu} | {row['rows']} | {b:.1f} | {t:.1f} | {t / b:.2f}x |")
    print("\n| CPU | prefill tokens | baseline | this tree | speed-up |\n|---|---|---|---|---|")
    for row in result["prefill"]:
        b, t = row["baseline s"], row["this tree s"]
        print(f"| {cpu} | {row['tokens']} | {b * 1e3:.0f} ms | {t * 1e3:.0f} ms | {b / t:.2f}x |")


if __name__ == "__main__":
    main()
