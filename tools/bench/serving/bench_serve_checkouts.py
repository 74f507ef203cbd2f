"""``kvd serve`` from several checkouts, the same kvd-loadgen workload against each.

For a serving change that no in-process benchmark sees (threads, the event loop,
the HTTP path): make a git worktree of the commit before it, then

    .venv/bin/python -m tools.bench.serving.bench_serve_checkouts --repos /tmp/base,. [--concurrency 1]
        [--prompts 4] [--input-len 64] [--output-len 128] [--rounds 3] [--configs ";FLAGS"]
        [-- SERVE FLAGS...]

``--configs`` compares settings, not (only) checkouts: ';'-separated sets of extra
flags, each served from every checkout (``--repos . --configs ";--kv-cache-dtype
float16"``: the default against a float16 KV cache, the same tree). Where the first
set starts with a flag, join it with '=' (``"--configs=--split-cpus cores;--split-cpus
off"``), or argparse takes it for an option of its own.

Each round starts ``kvd serve`` (this interpreter, default flags plus SERVE FLAGS)
from every checkout in turn, the order reversed every other round, and runs
``kvd-loadgen`` (random prompts, greedy unless ``--temperature`` [``--top-p``, ``--top-k``], ``ignore_eos``) against it: output
tok/s, median TPOT and TTFT, and from the server process (/proc/PID/task) the
voluntary and involuntary context switches of all its threads per engine step
(kvd's /metrics ``kvd_engine_steps_total``). Medians over rounds are printed as
a markdown table; JSON goes to results/bench_serve_checkouts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tools._twoproc import stop_processes, write_results  # noqa: E402
from tools.bench.engine.bench_llamacpp import engine_step_counters, free_port, wait_healthy  # noqa: E402
from tools.loadgen.report import cpu_model  # noqa: E402

KEYS = ("output_tok_s", "tpot_ms", "ttft_ms", "voluntary_per_step", "involuntary_per_step", "threads")


def switches(pid: int) -> dict[str, tuple[int, int]]:
    """{thread id: (voluntary, involuntary) context switches} of process ``pid``."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{task}/status").read_text()
        except OSError:
            continue                    # a thread that just exited
        out[task] = (int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0]),
                     int(status.split("\nnonvoluntary_ctxt_switches:")[1].split()[0]))
    return out


def one_run(repo: Path, args: argparse.Namespace, tmp: str, extra: list[str] = ()) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--port", str(port), *args.serve, *extra],
                            cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        why = wait_healthy(url, proc, 180.0)
        if why:
            raise SystemExit(f"bench_serve_checkouts: kvd serve from {repo} {why}")
        from engine.model.registry import bundled_gguf_path
        steps0, sw0 = engine_step_counters(url)[0], switches(proc.pid)
        subprocess.run([sys.executable, "-m", "tools.loadgen.cli", "run", "--base-url", url,
                        "--tokenizer", str(bundled_gguf_path()), "--endpoint", "/v1/completions",
                        "--dataset-name", "random", "--random-input-len", str(args.input_len),
                        "--random-output-len", str(args.output_len), "--num-prompts", str(args.prompts),
                        "--max-concurrency", str(args.concurrency), "--request-rate", "inf", "--ignore-eos",
                        "--seed", "0", "--temperature", str(args.temperature),
                        *(["--top-p", str(args.top_p)] if args.top_p is not None else []),
                        *(["--top-k", str(args.top_k)] if args.top_k is not None else []),
                        "--save-result", "--result-dir", tmp,
                        "--result-filename", "run.json", "--disable-tqdm"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        steps, sw = engine_step_counters(url)[0] - steps0, switches(proc.pid)
        m = json.loads((Path(tmp) / "run.json").read_text())["metrics"]
        vol = sum(v - sw0.get(t, (0, 0))[0] for t, (v, _) in sw.items())
        inv = sum(n - sw0.get(t, (0, 0))[1] for t, (_, n) in sw.items())
        return {"output_tok_s": m["output_throughput"], "tpot_ms": m["median_tpot_ms"], "ttft_ms": m["median_ttft_ms"],
                "voluntary_per_step": vol / max(steps, 1), "involuntary_per_step": inv / max(steps, 1),
                "threads": len(sw), "failed": m.get("failed"), "engine_steps": steps}
    finally:
        stop_processes([proc])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repos", required=True, help="comma-separated checkouts (git worktrees) to serve from")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=None, help="the requests' top_p (default: not sent)")
    ap.add_argument("--top-k", type=int, default=None, help="the requests' top_k (default: not sent)")
    ap.add_argument("--configs", default="",
                    help="';'-separated sets of extra kvd serve flags, each served from every checkout")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_serve_checkouts.json"))
    ap.add_argument("serve", nargs="*", help="flags for kvd serve (after --)")
    args = ap.parse_args()
    repos = [Path(r).resolve() for r in args.repos.split(",")]
    configs = [c.split() for c in args.configs.split(";")] if args.configs else [[]]
    runs = [(repo, cfg) for repo in repos for cfg in configs]
    label = {(str(repo), " ".join(cfg)): f"{repo}" + (f" {' '.join(cfg)}" if cfg else "") for repo, cfg in runs}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-serve-ab-") as tmp:
        for rnd in range(args.rounds):
            for repo, cfg in (runs if rnd % 2 == 0 else runs[::-1]):
                r = one_run(repo, args, tmp, cfg)
                rows.append({"repo": str(repo), "config": " ".join(cfg), "round": rnd, **r})
                print(f"round {rnd} {label[str(repo), ' '.join(cfg)]}: "
                      + ", ".join(f"{k} {r[k]:.3f}" for k in KEYS), flush=True)
    cpu = cpu_model() or "unknown CPU"
    print(f"\n{cpu}, {os.cpu_count()} CPUs; {args.concurrency} concurrent, {args.prompts} x "
          f"({args.input_len} in, {args.output_len} out); medians of {args.rounds} rounds\n")
    print("| checkout | " + " | ".join(KEYS) + " |")
    print("|---|" + "---|" * len(KEYS))
    for key, name in label.items():
        mine = [r for r in rows if (r["repo"], r["config"]) == key]
        print(f"| {name} | " + " | ".join(f"{statistics.median(r[k] for r in mine):.3f}" for k in KEYS) + " |")
    write_results(args.out, rows, cpu=cpu, workload=vars(args) | {"repos": [str(r) for r in repos]})


if __name__ == "__main__":
    main()
