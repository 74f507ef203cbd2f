"""``kvd plan``'s check: every candidate a small plan considered, run for
real, and the share of the best measured goodput the plan's pick reaches.

It runs ``kvd plan``'s search (tools/sim/plan.py) on a profile with the given
workload and SLOs, then, for each candidate it simulated, starts a real
``kvd serve`` of that shape on loopback (``--nodes N [--prefill P]``, the
candidate's routing and chunk size in a config; one node: the embedded
``kvd serve``), runs ``kvd-loadgen`` with the same workload flags and SLOs
(tools/sim/measure.py), and compares the measured goodput per node (the
plan's objective) of the candidate it picked with the best measured one.
Every node runs on this host: with fewer cores than nodes they share them,
which the simulator does not model (docs/planning.md).

    .venv/bin/python -m tools.bench.sim.check_plan --profile results/sim/profile-smollm2.json \\
        [--max-nodes 2] [--slo-ttft 2000] [--slo-tpot 150] [--rate 1.5] [--num-prompts 16] [--routing P]

Writes results/sim/check_plan.json; prints a markdown table and the share.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tools.sim.plan import PROG, _extra, search  # noqa: E402
from tools.sim.measure import OVERHEAD_WARMUP, measured, overhead_flags  # noqa: E402
from tools.sim.run import parse  # noqa: E402
from tools._twoproc import stop_processes  # noqa: E402
from tools.bench.serving.bench_n_copies import serve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--max-nodes", type=int, default=2)
    ap.add_argument("--slo-ttft", type=float, default=2000.0)
    ap.add_argument("--slo-tpot", type=float, default=150.0)
    ap.add_argument("--percentile", type=float, default=90.0)
    ap.add_argument("--routing", default=None, help="one routing policy (default: the plan's two)")
    ap.add_argument("--rate", default="1.5")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--config", default=None,
                    help="a kvd config (its [engine] table: threads) for every candidate; no [cluster] table")
    ap.add_argument("--split-cpus", default="off", choices=("off", "cores"),
                    help="the multi-node candidates' [cluster].split_cpus (cores: a node per core)")
    ap.add_argument("--out", default=str(ROOT / "results/sim/check_plan.json"))
    args = ap.parse_args()
    base = Path(args.config).read_text() if args.config else ""
    if set(re.findall(r"^\s*\[([^]]*)\]", base, re.M)) - {"engine"} or "prefill_chunk_tokens" in base:
        raise SystemExit("check_plan: error: --config may hold only an [engine] table, without "
                         "prefill_chunk_tokens (each candidate sets it)")
    model = json.loads(Path(args.profile).read_text())["model"]
    workload = ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--request-rate", args.rate,
                "--num-prompts", str(args.num_prompts), "--seed", "0", "--tokenizer", model]
    own, largs = parse(["--profile", args.profile, "--slo-ttft", str(args.slo_ttft), "--slo-tpot",
                        str(args.slo_tpot), "--max-nodes", str(args.max_nodes), "--percentile",
                        str(args.percentile), *(["--routing", args.routing] if args.routing else []),
                        "--colocated",           # the candidates run on this one host
                        *workload], PROG, _extra)
    plan = search(own, largs)
    pick = plan.ranked[0]
    flags = [*workload, "--metric-percentiles", f"50,{args.percentile:g},99", "--goodput",
             f"ttft:{args.slo_ttft:g}", f"tpot:{args.slo_tpot:g}"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, k in enumerate(plan.tried):
            cfg = Path(tmp) / f"c{i}.toml"
            engine = base if "[engine]" in base else f"[engine]\n{base}"
            cfg.write_text(f"{engine}\nprefill_chunk_tokens = {k.chunk}\n\n[cluster]\nrouting = \"{k.routing}\"\n")
            extra = ["--nodes", str(k.nodes), "--split-cpus", args.split_cpus] if k.nodes > 1 else []
            proc, url = serve(["--model", model, "-c", str(cfg), *extra,
                               *(["--prefill", str(k.prefill)] if k.prefill else [])])
            try:       # warm (a fresh server's first requests pay one-off costs), on prompts the run does not send
                measured(url, overhead_flags(model, OVERHEAD_WARMUP * k.nodes, "inf", seed=1), Path(tmp) / "w.json")
                real = measured(url, flags, Path(tmp) / f"c{i}.json")
            finally:
                stop_processes([proc])
            row = {"candidate": k.label, "nodes": k.nodes, "picked": k is pick,
                   "simulated_goodput_per_node": round(k.metrics["request_goodput"] / k.nodes, 3),
                   "measured_goodput_per_node": round(real["request_goodput"] / k.nodes, 3),
                   "measured_attainment": real.get("slo_attainment")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    best = max(r["measured_goodput_per_node"] for r in rows)
    mine = next(r["measured_goodput_per_node"] for r in rows if r["picked"])
    share = mine / best if best > 0 else 1.0
    from tools.loadgen.report import machine_info
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "profile": args.profile, "args": vars(args),
                               "rows": rows, "pick_share_of_best": round(share, 3)}, indent=1))
    print("| candidate | nodes | simulated goodput/node | measured goodput/node | measured attainment |\n"
          "|---|---|---|---|---|")
    for r in rows:
        mark = " **(pick)**" if r["picked"] else ""
        print(f"| {r['candidate']}{mark} | {r['nodes']} | {r['simulated_goodput_per_node']} | "
              f"{r['measured_goodput_per_node']} | {r['measured_attainment']:.0%} |")
    print(f"the pick reaches {share:.1%} of the best measured goodput per node ({len(rows)} candidates)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
