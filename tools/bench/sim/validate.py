"""How far to trust ``kvd simulate``: measured runs beside simulated ones.

For each configuration (``one``: one node; ``mixed2``: two mixed nodes;
``1p1d``: ``--nodes 2 --prefill 1``; ``tree3``: three nodes, prompt-tree
routing), trace (``random``; ``prefix``: prefix_repetition, where routing
and the prefix cache matter) and rate, it starts a real ``kvd serve`` on
loopback, runs ``kvd-loadgen`` against it, then simulates the same flags on
the profile (tools/sim/run.py) and reports, per run, the relative errors of
p50 and p99 TTFT and TPOT and the difference in SLO attainment (points).
Multi-node configurations run every node on this host, so they are
simulated ``colocated``: the nodes share the host's last-level cache
(kvd/sim/warmth.py). With fewer cores than nodes the nodes also share cores,
which the simulator does not model; ``--node-profile`` names a profile
measured with the per-node thread count for them.

    .venv/bin/python -m tools.bench.sim.validate --profile results/sim/profile-smollm2.json \\
        [--node-profile P.json] [--configs one,mixed2,1p1d,tree3] [--rates 0.5,1] \\
        [--traces random,prefix] [--num-prompts 16] [--input-len 64] [--output-len 16] \\
        [--measured results/sim/validate.json]   # the simulated side only, against those runs

Writes results/sim/validate.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tools.sim.measure import OVERHEAD_WARMUP, measured, overhead_flags, simulated  # noqa: E402
from tools._twoproc import stop_processes  # noqa: E402
from tools.bench.serving.bench_n_copies import serve as start_server  # noqa: E402

CONFIGS = {"one": (0, 0, None), "mixed2": (2, 0, "least-load"), "1p1d": (2, 1, None),
           "tree3": (3, 0, "prompt-tree")}
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def trace_flags(trace: str, args) -> list[str]:
    if trace == "random":
        return ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len)]
    if trace == "sonnet":              # longer prompts of varying length around one shared prefix
        return ["--dataset-name", "sonnet", "--sonnet-input-len", str(2 * args.input_len),
                "--sonnet-prefix-len", str(args.input_len), "--sonnet-output-len", str(args.output_len)]
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "2",
            "--prefix-repetition-prefix-len", str(args.input_len), "--prefix-repetition-suffix-len", "16",
            "--prefix-repetition-output-len", str(args.output_len)]


def serve(model: str, nodes: int, prefill: int, cfg: Path, split_cpus: str) -> tuple[subprocess.Popen, str]:
    """A ``kvd serve`` of the configuration, healthy (bench_n_copies' starter), warmed
    by a few requests (a fresh server's first ones pay one-off costs)."""
    args = ["--model", model, "-c", str(cfg)]
    if nodes:
        args += ["--nodes", str(nodes), "--split-cpus", split_cpus]
    if prefill:
        args += ["--prefill", str(prefill)]
    proc, url = start_server(args)
    with tempfile.TemporaryDirectory() as tmp:
        measured(url, overhead_flags(model, OVERHEAD_WARMUP * max(nodes, 1), "inf", seed=1), Path(tmp) / "warmup.json")
    return proc, url


def flush_cache(sock: Path) -> None:
    """Drop every node's cached prefixes (``kvctl cache flush`` on the admin socket)."""
    subprocess.run([sys.executable, "-m", "kvd.ctl", "--socket", str(sock), "cache", "flush"], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL, timeout=60)  # noqa: S603


def errors(real: dict, sim: dict) -> dict:
    out = {}
    for k in METRICS:
        r, s = real.get(k), sim.get(k)
        out[k] = round((s - r) / r, 3) if r and s is not None else None
    ra, sa = real.get("slo_attainment"), sim.get("slo_attainment")
    out["attainment_points"] = round(100 * (sa - ra), 1) if ra is not None and sa is not None else None
    return out


# the validation's targets: |error| within this share (latencies) or these points (attainment)
TARGETS = {"median_ttft_ms": 0.10, "p99_ttft_ms": 0.20, "median_tpot_ms": 0.10, "p99_tpot_ms": 0.20,
           "attainment_points": 3.0}


def summary(rows: list[dict]) -> str:
    """Per configuration, the runs within each target and the range of its errors (markdown)."""
    lines = ["| config | " + " | ".join(TARGETS) + " |", "|---|" + "---|" * len(TARGETS)]
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    total, latencies = 0, [k for k in TARGETS if k != "attainment_points"]
    for name, runs in by.items():
        cells = []
        for k, limit in TARGETS.items():
            es = [r["errors"][k] for r in runs if r["errors"].get(k) is not None]
            ok = sum(abs(e) <= limit + 1e-9 for e in es)
            total += ok if k in latencies else 0
            scale, unit = (1, " pts") if k == "attainment_points" else (100, "%")
            cells.append(f"{ok}/{len(runs)}" + (f" ({min(es) * scale:+.0f}{unit} to {max(es) * scale:+.0f}{unit})"
                                                 if es else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"latency cells within target: {total} of {len(latencies) * len(rows)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--node-profile", default=None, help="profile for the multi-node configurations")
    ap.add_argument("--model", default=None, help="default: the profile's")
    ap.add_argument("--configs", default="one,mixed2,1p1d,tree3")
    ap.add_argument("--traces", default="random,prefix,sonnet")
    ap.add_argument("--rates", default="0.5,1,1.5")
    ap.add_argument("--config", default=None,
                    help="a kvd config (its [engine] table: threads, CPUs) for every run; no [cluster] table")
    ap.add_argument("--split-cpus", default="off", choices=("off", "cores"),
                    help="the multi-node configurations' [cluster].split_cpus (cores: a node per core)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--slo", default="ttft:2000 tpot:150", help="goodput SLOs, kvd-loadgen's KEY:MS")
    ap.add_argument("--measured", default=None,
                    help="a validate JSON whose measured runs to reuse (no server is started): the "
                         "simulator's side again, e.g. after a change to its model or a new profile")
    ap.add_argument("--out", default=str(ROOT / "results/sim/validate.json"))
    args = ap.parse_args()
    reuse = None
    if args.measured:
        reuse = {(r["config"], r["trace"], float(r["rate"])): r["measured"]
                 for r in json.loads(Path(args.measured).read_text())["rows"]}
    model = args.model or json.loads(Path(args.profile).read_text())["model"]
    base = Path(args.config).read_text() if args.config else ""
    if "[cluster]" in base:
        raise SystemExit("validate: error: --config may not hold a [cluster] table (each configuration sets it)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            nodes, prefill, routing = CONFIGS[name]
            profile = args.node_profile if nodes and args.node_profile else args.profile
            cfg = Path(tmp) / f"{name}.toml"
            sock = Path(tmp) / f"{name}.sock"
            cfg.write_text(f'{base}\n[cluster]\nrouting = "{routing or "prompt-tree"}"\nadmin_socket = "{sock}"\n')
            proc, url = serve(model, nodes, prefill, cfg, args.split_cpus) if reuse is None else (None, "")
            try:
                for trace in args.traces.split(","):
                    for rate in args.rates.split(","):
                        flags = [*trace_flags(trace, args), "--request-rate", rate, "--num-prompts",
                                 str(args.num_prompts), "--seed", "0", "--tokenizer", model,
                                 "--metric-percentiles", "50,99", "--goodput", *args.slo.split()]
                        if reuse is None:
                            flush_cache(sock)      # each run starts cold, as its simulation does
                            real = measured(url, flags, Path(tmp) / f"{name}-{trace}-{rate}.json")
                        elif (name, trace, float(rate)) in reuse:
                            real = reuse[(name, trace, float(rate))]
                        else:
                            raise SystemExit(f"validate: error: {args.measured} has no run of {name} {trace} {rate}")
                        sim = simulated(profile, nodes, prefill, routing, cfg, flags, colocated=True)
                        row = {"config": name, "trace": trace, "rate": float(rate),
                               "measured": {k: real.get(k) for k in (*METRICS, "slo_attainment", "request_goodput")},
                               "simulated": {k: sim.get(k) for k in (*METRICS, "slo_attainment", "request_goodput")},
                               "errors": errors(real, sim)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                if proc is not None:
                    stop_processes([proc])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from tools.loadgen.report import machine_info
    out.write_text(json.dumps({"machine": machine_info(), "profile": args.profile, "rows": rows}, indent=1))
    print(markdown(rows))
    print(summary(rows))
    print(f"wrote {out}")


def markdown(rows: list[dict]) -> str:
    lines = ["| config | trace | rate | p50 TTFT ms (meas / sim) | p99 TTFT | p50 TPOT | p99 TPOT | attain. pts |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, s, e = r["measured"], r["simulated"], r["errors"]

        def cell(k: str) -> str:
            if m.get(k) is None or s.get(k) is None:
                return "n/a"
            return f"{m[k]:.0f} / {s[k]:.0f} ({e[k]:+.0%})"
        lines.append(f"| {r['config']} | {r['trace']} | {r['rate']:g} | {cell('median_ttft_ms')} | "
                     f"{cell('p99_ttft_ms')} | {cell('median_tpot_ms')} | {cell('p99_tpot_ms')} | "
                     f"{e['attainment_points']:+.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
