"""What one arithmetic per token costs: this checkout against one before it, side by side.

    git worktree add /tmp/base <commit before>      # e.g. the commit before paged attention
    .venv/bin/python -m tools.bench.engine.bench_exact_path --baseline /tmp/base [--rounds 3]

Each round runs one child process in each tree, alternated (the host may be
shared: another job only ever slows a round down, so the best round counts),
on the bundled SmolLM2 with native weights, as served:

- **decode, 1 stream**: tok/s of 128 greedy tokens after a 64-token prompt;
- **decode, 32 streams**: tok/s of 32 streams' decode steps (64-token prompts,
  64 tokens each, prefills not timed);
- **prefill 512, 1 prompt**: seconds from admitting a 512-token prompt to its
  first token (chunked prefill as configured: 256 tokens a step);
- **prefill 512 x 32**: seconds until 32 such prompts all have their first token.

Then, in this checkout only, float matrices (``weights = "dequantize"``, fp32)
with ``batch_invariant`` off and on, alternated: a 512-token prefill, and
1-stream decode (the same kernel either way).

Names the CPU; appends to ``results/bench_exact_path.json`` and prints rows for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "results" / "bench_exact_path.json"

# Run in a checkout's root (its own modules, its own kernels): prints one JSON line.
CHILD = r"""
import json, sys, time
import torch
from engine.request import SamplingParams
from tools.bench.engine.bench_engine import decode_rates, make_engine, random_prompts
from tools.bench.engine.bench_weights import prefill_seconds

eng = make_engine("float32", kv_blocks=2048)
tok = eng.tokenizer
out = {"decode_1": decode_rates(eng, random_prompts(tok, 1, [64], seed=1)[0], rounds=1)[0]}
prompts = random_prompts(tok, 32, [64] * 32, seed=2)
for i, p in enumerate(prompts):
    eng.add_request(f"b{i}", p, SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True))
started = set()
while len(started) < 32:
    for o in eng.step():
        started.add(o.request_id)
t, n = time.perf_counter(), 0
while eng.has_unfinished():
    n += sum(len(o.new_token_ids) for o in eng.step())
out["decode_32"] = n / (time.perf_counter() - t)
long = random_prompts(tok, 33, [512] * 33, seed=3)
prefill_seconds(eng, long[32])                       # warm-up: the first 512-row shapes
out["prefill_512"] = prefill_seconds(eng, long[0])
for i, p in enumerate(long[:32]):
    eng.add_request(f"p{i}", [7] + p[1:], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
t = time.perf_counter()
while eng.has_unfinished():
    eng.step()
out["prefill_512x32"] = time.perf_counter() - t
print(json.dumps(out))
"""

CHILD_FLOAT = r"""
import json, sys
from tools.bench.engine.bench_engine import decode_rates, make_engine, random_prompts
from tools.bench.engine.bench_weights import prefill_seconds

invariant = sys.argv[1] == "on"
eng = make_engine("float32", weights="dequantize", kv_blocks=1024, batch_invariant=invariant)
tok = eng.tokenizer
long = random_prompts(tok, 2, [512] * 2, seed=3)
prefill_seconds(eng, long[1])
print(json.dumps({"prefill_512": prefill_seconds(eng, long[0]),
                  "decode_1": decode_rates(eng, random_prompts(tok, 1, [64], seed=1)[0], rounds=1)[0],
                  "same_bits": eng.kernels()["same_bits"]}))
"""


def child(tree: Path, code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best(runs: list[dict], key: str, higher: bool) -> float:
    values = [r[key] for r in runs]
    return max(values) if higher else min(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a worktree of the commit to compare against")
    ap.add_argument("--candidate", type=Path, default=REPO,
                    help="the checkout measured against it (default: this one; a clean worktree of a commit "
                         "keeps others' uncommitted edits out of the figures)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-float", action="store_true", help="skip the batch_invariant float comparison")
    args = ap.parse_args()
    for tree in (args.baseline, args.candidate):
        if not (tree / "engine" / "engine.py").exists():
            raise SystemExit(f"{tree} is not a kvd checkout")
    sys.path.insert(0, str(REPO))
    from tools.bench.engine.bench_engine import append_result, machine

    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    for r in range(args.rounds):
        for name, tree in (("baseline", args.baseline), ("this", args.candidate)):
            runs[name].append(child(tree, CHILD))
            print(f"round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    keys = (("decode_1", True), ("decode_32", True), ("prefill_512", False), ("prefill_512x32", False))
    summary = {k: {"baseline": best(runs["baseline"], k, hi), "this": best(runs["this"], k, hi)} for k, hi in keys}
    record = {"bench": "exact_path", "machine": machine(), "load_avg": os.getloadavg(), "rounds": args.rounds,
              "baseline": str(args.baseline), "candidate": str(args.candidate), "runs": runs, "best": summary}
    if not args.no_float:
        floats: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for mode in floats:
                floats[mode].append(child(args.candidate, CHILD_FLOAT, mode))
        record["float"] = {m: {"prefill_512": best(v, "prefill_512", False), "decode_1": best(v, "decode_1", True),
                               "same_bits": v[0]["same_bits"]} for m, v in floats.items()}
    append_result(RESULTS, record)
    cpu = record["machine"]["cpu"]
    print(f"| what | CPU | this checkout | baseline | ratio |\n|---|---|---|---|---|")
    for k, hi in keys:
        b, t = summary[k]["baseline"], summary[k]["this"]
        unit = "tok/s" if hi else "s"
        print(f"| {k} | {cpu} | {t:.3f} {unit} | {b:.3f} {unit} | {(t / b if hi else b / t):.3f}x |")
    if "float" in record:
        f = record["float"]
        print(f"| float fp32 prefill 512, batch_invariant on / off | {cpu} | {f['on']['prefill_512']:.3f} s | "
              f"{f['off']['prefill_512']:.3f} s | {f['off']['prefill_512'] / f['on']['prefill_512']:.3f}x |")


if __name__ == "__main__":
    main()
