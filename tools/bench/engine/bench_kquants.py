"""Native decode of K-quant files beside the Q4_1 path, side by side in one run.

    .venv/bin/python -m tools.bench.engine.bench_kquants FILE.gguf [FILE.gguf ...] [--rounds 3] [--torch]

Each file (the bundled Q4_1 SmolLM2 is always the first, the baseline) is served
as ``kvd serve`` serves it (``weights = "native"``, fp32 activations, the plan
executor; K-quants repacked at load, kernels/kquant_repack.py), and decodes 128
tokens single-stream, greedy; rounds alternate between the files. Per file: the
best round's tokens/s, its ratio to the Q4_1 path's, the weight bytes a decode
step reads, and the fraction of the bandwidth bound (read bandwidth measured in
this run / those bytes). ``--torch``: each file also decoding on the torch path
(``decode_kernel = "torch"``), in the same alternated rounds. The host may be
shared: best of the rounds, load average before and after recorded. Appends to ``results/bench_kquants.json``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from engine.engine import EngineConfig, LLMEngine
from engine.model.registry import bundled_gguf_path
from tools.bench.engine.bench_engine import append_result, decode_rates, machine, read_bandwidth

RESULTS = Path("results/bench_kquants.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", type=Path, nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch", action="store_true", help="each file also decoding on the torch path")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    load_before = os.getloadavg()[0]
    files = [bundled_gguf_path(), *args.files]
    kernels = ("auto", "torch") if args.torch else ("auto",)
    engines = {f.name + ("" if k == "auto" else " (torch)"):
               LLMEngine.from_config(EngineConfig(model=str(f), dtype="float32", kv_blocks=64, decode_kernel=k))
               for f in files for k in kernels}
    ids = next(iter(engines.values())).tokenizer.encode("The history of the Roman Empire begins")
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            rates[name] += decode_rates(eng, ids, rounds=1)
    bandwidth = read_bandwidth()
    base = max(rates[files[0].name])
    rows = []
    for name, eng in engines.items():
        nbytes = eng.model.weight_bytes_per_token()
        best = max(rates[name])
        rows.append({"file": name, "tok_s": best, "vs_q4_1": best / base, "bytes_per_token": nbytes,
                     "bound_fraction": best * nbytes / bandwidth, "rounds": rates[name],
                     "decode": eng.kernels()["decode"]})
    record = {"bench": "kquants_decode", "machine": machine(), "read_GBps": bandwidth / 1e9,
              "load_before": load_before, "load_after": os.getloadavg()[0], "rows": rows}
    append_result(RESULTS, record)
    print(f"# {record['machine']['cpu']}, {record['machine']['torch_threads']} threads, "
          f"read {bandwidth / 1e9:.1f} GB/s, load {load_before:.1f} -> {record['load_after']:.1f}")
    for r in rows:
        print(f"| {r['file']} | {r['tok_s']:.1f} | {r['vs_q4_1']:.2f}x | {r['bytes_per_token'] / 1e6:.1f} MB | "
              f"{r['bound_fraction']:.2f} | {r['decode']} |")


if __name__ == "__main__":
    main()
