"""How far to trust ``kvd simulate``: measured runs beside simulated ones.

For each configuration (``one``: one node; ``mixed2``: two mixed nodes;
``1p1d``: ``--nodes 2 --prefill 1``; ``tree3``: three nodes, prompt-tree
routing; ``pair2``, not run by default: two nodes paired, ``[cluster].pairs``), trace (``random``; ``prefix``: prefix_repetition, where routing
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
        [--repeats 1] [--measured results/sim/validate.json ...]   # --measured: the simulated side only

With ``--repeats R`` every configuration's server is started afresh R times,
the configurations in turn (so a drift of the host's speed reaches them
all), and each run's measured side is the median of its R runs (each
metric on its own); ``--measured`` takes several validate JSONs and pools
their runs the same way. A row keeps every run (``measured_runs``), and the
summary says in how many cells the measured runs differ among themselves by
more than the target (the host's noise floor).

A profile describes the hour it was measured in: a shared host's speed
drifts by 15-20% within the hour. So before each measured run validate
takes a reading of the host's speed (tools/sim/speed_ref.py, on an engine
of its own kept for the whole validation, idle during the runs), and each
configuration is simulated on the profile brought to the median of its
runs' readings against the profile's own (``kvd.sim.profile_file.at_speed``;
the ratios are in each row's ``speed``). The table and the first summary
are on that profile; a second summary gives the plain profile's errors
(``errors_plain``). A profile without a reference, runs without readings,
or ``--no-reference``: the plain profile only.

Writes results/sim/validate.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import selectors
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from kvd.sim.profile_file import at_speed, write_profile  # noqa: E402
from tools.sim.measure import OVERHEAD_WARMUP, measured, overhead_flags, simulated  # noqa: E402
from tools._twoproc import stop_processes  # noqa: E402
from tools.bench.serving.bench_n_copies import serve as start_server  # noqa: E402

CONFIGS = {"one": (0, 0, None), "mixed2": (2, 0, "least-load"), "1p1d": (2, 1, None),
           "tree3": (3, 0, "prompt-tree"), "pair2": (2, 0, "least-load")}
PAIRED = {"pair2"}             # configurations whose nodes are paired ([cluster].pairs = true)
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


class Readings:
    """A ``tools.sim.speed_ref --repeat`` process, its engine built once (the
    ``model`` of ``config``'s [engine] table): ``take()`` is one reading of
    the host's speed now, or raises SystemExit after ``timeout`` seconds."""

    def __init__(self, model: str, config: Path | None, timeout: float = 180.0) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "tools.sim.speed_ref", "--model", model, *(["-c", str(config)] if config else []),
             "--repeat"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pending = True                   # the process's first reading, on its way

    def take(self) -> dict:
        if not self.pending:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        self.pending = False
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(self.timeout) else ""
        if not line:
            self.close()
            raise SystemExit(f"validate: error: no reading of the host's speed within {self.timeout:.0f} s")
        return json.loads(line)

    def close(self) -> None:
        stop_processes([self.proc])


def speed_of(doc: dict, readings: list[dict]) -> dict | None:
    """The host's speed during ``readings`` against the reference of the profile
    document ``doc`` (``{"prefill": ratio, "decode": ratio, "readings": n}``,
    >1: slower than when profiled); None when the profile has no reference,
    there are no readings, or they were taken with another thread count."""
    ref = doc.get("reference")
    readings = [r for r in readings if r.get("threads") == doc.get("threads")]
    if not ref or not readings:
        return None
    return {"prefill": statistics.median(r["prefill_s"] for r in readings) / ref["prefill_s"],
            "decode": statistics.median(r["decode_s"] for r in readings) / ref["decode_s"],
            "readings": len(readings)}


def pooled(runs: list[dict]) -> dict:
    """The median of ``runs`` (measured metrics), metric by metric."""
    out = {}
    for k in (*METRICS, "slo_attainment", "request_goodput"):
        vs = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vs) if vs else None
    return out


def spread(runs: list[dict]) -> dict:
    """Per latency metric, the runs' largest relative distance from their median
    (None with fewer than two runs)."""
    mid = pooled(runs)
    return {k: (round(max(abs(r[k] - mid[k]) / mid[k] for r in runs), 3) if len(runs) > 1 and mid[k] else None)
            for k in METRICS}


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


def summary(rows: list[dict], key: str = "errors") -> str:
    """Per configuration, the runs within each target and the range of its errors
    (markdown; ``key``: the rows' errors to count)."""
    lines = ["| config | " + " | ".join(TARGETS) + " |", "|---|" + "---|" * len(TARGETS)]
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    total, latencies = 0, [k for k in TARGETS if k != "attainment_points"]
    for name, runs in by.items():
        cells = []
        for k, limit in TARGETS.items():
            es = [r[key][k] for r in runs if r[key].get(k) is not None]
            ok = sum(abs(e) <= limit + 1e-9 for e in es)
            total += ok if k in latencies else 0
            scale, unit = (1, " pts") if k == "attainment_points" else (100, "%")
            cells.append(f"{ok}/{len(runs)}" + (f" ({min(es) * scale:+.0f}{unit} to {max(es) * scale:+.0f}{unit})"
                                                 if es else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"latency cells within target: {total} of {len(latencies) * len(rows)}")
    noisy = sum(1 for r in rows for k in latencies if (r.get("spread") or {}).get(k) is not None
                and r["spread"][k] > TARGETS[k] + 1e-9)
    runs = max((len(r.get("measured_runs", [])) for r in rows), default=0)
    if runs > 1:
        lines.append(f"cells whose {runs} measured runs stray from their own median by more than the target: "
                     f"{noisy} of {len(latencies) * len(rows)}")
    return "\n".join(lines)


def measure_runs(cells: list[tuple], args, model: str, setup, flags_of, tmp: Path) -> dict[tuple, list[dict]]:
    """Each configuration's cells on a fresh ``kvd serve`` of it, the configurations
    in turn, ``args.repeats`` times; a reading of the host's speed before each
    run (its ``reference``) unless ``--no-reference``. Cell -> its runs' metrics."""
    runs: dict[tuple, list[dict]] = {c: [] for c in cells}
    readings = Readings(model, Path(args.config) if args.config else None) if args.reference else None
    where = Path(args.keep) if args.keep else tmp
    where.mkdir(parents=True, exist_ok=True)
    try:
        for rep in range(args.repeats):
            for name in dict.fromkeys(c[0] for c in cells):
                nodes, prefill, _ = CONFIGS[name]
                cfg, sock = setup(name)
                proc, url = serve(model, nodes, prefill, cfg, args.split_cpus)
                try:
                    for cell in (c for c in cells if c[0] == name):
                        flush_cache(sock)      # each run starts cold, as its simulation does
                        reading = readings.take() if readings else None
                        real = measured(url, [*flags_of(*cell[1:]), *(["--save-detailed"] if args.keep else [])],
                                        where / f"{'-'.join(cell)}-{rep}.json")
                        runs[cell].append({**{k: real.get(k) for k in (*METRICS, "slo_attainment", "request_goodput")},
                                           **({"reference": reading} if reading else {})})
                        print(json.dumps({"run": rep, "cell": cell, "measured": runs[cell][-1]}), flush=True)
                finally:
                    stop_processes([proc])
    finally:
        if readings:
            readings.close()
    return runs


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
    ap.add_argument("--repeats", type=int, default=1, help="fresh servers per configuration, in turn (median)")
    ap.add_argument("--measured", nargs="+", default=None,
                    help="validate JSONs whose measured runs to reuse, pooled (no server is started): the "
                         "simulator's side again, e.g. after a change to its model or a new profile")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="keep each measured run's kvd-loadgen result, with its per-request records, in DIR")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="take no readings of the host's speed: simulate on the profile as measured")
    ap.add_argument("--out", default=str(ROOT / "results/sim/validate.json"))
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("validate: error: --repeats must be at least 1")
    reuse: dict[tuple, list[dict]] | None = None
    if args.measured:
        reuse = {}
        for path in args.measured:
            for r in json.loads(Path(path).read_text())["rows"]:
                reuse.setdefault((r["config"], r["trace"], float(r["rate"])), []).extend(
                    r.get("measured_runs") or [r["measured"]])
    model = args.model or json.loads(Path(args.profile).read_text())["model"]
    base = Path(args.config).read_text() if args.config else ""
    if "[cluster]" in base:
        raise SystemExit("validate: error: --config may not hold a [cluster] table (each configuration sets it)")
    cells = [(name, trace, rate) for name in args.configs.split(",") for trace in args.traces.split(",")
             for rate in args.rates.split(",")]
    for name, _, _ in cells:
        if name not in CONFIGS:
            raise SystemExit(f"validate: error: unknown configuration {name!r} (one of {', '.join(CONFIGS)})")
    runs: dict[tuple, list[dict]] = {c: [] for c in cells}
    with tempfile.TemporaryDirectory() as tmp:
        def setup(name: str) -> tuple[Path, Path]:
            cfg, sock = Path(tmp) / f"{name}.toml", Path(tmp) / f"{name}.sock"
            cfg.write_text(f'{base}\n[cluster]\nrouting = "{CONFIGS[name][2] or "prompt-tree"}"\n'
                           f'admin_socket = "{sock}"\n' + ("pairs = true\n" if name in PAIRED else ""))
            return cfg, sock

        def flags_of(trace: str, rate: str) -> list[str]:
            return [*trace_flags(trace, args), "--request-rate", rate, "--num-prompts", str(args.num_prompts),
                    "--seed", "0", "--tokenizer", model, "--metric-percentiles", "50,99", "--goodput",
                    *args.slo.split()]

        if reuse is None:
            runs = measure_runs(cells, args, model, setup, flags_of, Path(tmp))
        else:
            for cell in cells:
                key = (cell[0], cell[1], float(cell[2]))
                if key not in reuse:
                    raise SystemExit(f"validate: error: the measured runs have no run of {' '.join(cell)}")
                runs[cell] = reuse[key]
        rows, at = [], {}
        for cell in cells:
            name, trace, rate = cell
            nodes, prefill, routing = CONFIGS[name]
            profile = args.node_profile if nodes and args.node_profile else args.profile
            cfg, _ = setup(name)
            if name not in at:                          # the configuration's profile at its runs' speed
                doc = json.loads(Path(profile).read_text())
                speed = speed_of(doc, [r["reference"] for c in cells if c[0] == name for r in runs[c]
                                       if r.get("reference")]) if args.reference else None
                path = None
                if speed:
                    path = Path(tmp) / f"{name}-at-speed.json"
                    write_profile(at_speed(doc, speed["prefill"], speed["decode"]), path)
                at[name] = (speed, path)
            speed, path = at[name]
            real = pooled(runs[cell])
            keys = (*METRICS, "slo_attainment", "request_goodput")
            plain = simulated(profile, nodes, prefill, routing, cfg, flags_of(trace, rate), colocated=True)
            sim = simulated(str(path), nodes, prefill, routing, cfg, flags_of(trace, rate), colocated=True) \
                if path else plain
            rows.append({"config": name, "trace": trace, "rate": float(rate), "measured": real,
                         "measured_runs": runs[cell], "spread": spread(runs[cell]),
                         "speed": speed and {k: round(v, 4) for k, v in speed.items()},
                         "simulated": {k: sim.get(k) for k in keys}, "errors": errors(real, sim),
                         "simulated_plain": {k: plain.get(k) for k in keys}, "errors_plain": errors(real, plain)})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from tools.loadgen.report import machine_info
    out.write_text(json.dumps({"machine": machine_info(), "profile": args.profile, "rows": rows}, indent=1))
    print(markdown(rows))
    print(summary(rows))
    if any(r["speed"] for r in rows):
        print("at the host's speed of each configuration's runs (above); on the profile as measured:")
        print(summary(rows, "errors_plain"))
        print("speed against the profile (prefill, decode): " + ", ".join(
            f"{n} {s['prefill']:.3f}, {s['decode']:.3f}" for n, (s, _) in at.items() if s))
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
