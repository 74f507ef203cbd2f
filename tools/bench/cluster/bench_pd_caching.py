"""PD-Caching-3 vs PD-Caching-2 (MemServe §5.1): 1P1D on multi-turn sessions.

Two configurations of the same 1P1D cluster (a real coordinator, a prefill
node pinned to core 0 and a decode node pinned to core 1, one torch thread
each; ``tools.bench.cluster.bench_disagg.cluster``), alternated ``--rounds`` times:

- ``pd-caching-3``: ``--kv-return on`` (the default): when a turn finishes,
  the decode node pushes the KV of prompt and answer to the prefill node;
- ``pd-caching-2``: ``--kv-return off``: the prefill node caches the prompts
  it computed, never the answers.

The workload is ``kvd-loadgen``'s ``sessions`` dataset: ``--sessions``
conversations of ``--turns`` turns, each turn ``--user-len`` new tokens and
an answer of at most ``--output-len`` tokens (greedy: the same answers in
both configurations). Turn k+1 is sent ``--think-time`` seconds after turn
k's answer arrived, and its prompt is turn k's prompt, the answer, and the
new tokens
(chat messages by default: the template's delimiters keep the answer's
tokens what they were when generated; with ``/v1/completions`` the
concatenated text may tokenize differently where prompt and answer meet).
Reported: TTFT and JCT (end-to-end latency) of turn 1 and of turns >= 2,
mean and p50/p99, and the ratios; the coordinator's count of KV returns
and the prefill node's prefix-cache hit share (hit tokens over prompt
tokens looked up). With no think time the next turn races the return of the
answer's KV, and on this host usually wins (it then hits what PD-Caching-2
would).

    .venv/bin/python -m tools.bench.cluster.bench_pd_caching [--rounds 2] [--sessions 8] [--turns 4]
        [--user-len 128] [--output-len 128] [--session-rate 0.5] [--think-time 2]
        [--endpoint /v1/chat/completions]

Prints a markdown table and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kvd.ctl import request as admin_request  # noqa: E402
from tools._twoproc import write_results  # noqa: E402
from tools.bench.cluster.bench_disagg import cluster  # noqa: E402
from tools.loadgen.report import cpu_model  # noqa: E402

CONFIGS = {"pd-caching-3": "on", "pd-caching-2": "off"}
NODES = {"p1": ("prefill", 0), "d1": ("decode", 1)}


def run_once(config: str, args: argparse.Namespace, tmp: str, rnd: int) -> dict:
    name = f"{config}-{rnd}"
    with cluster(name, args, tmp, NODES, coordinator_args=("--kv-return", CONFIGS[config])) as base:
        out = os.path.join(tmp, f"{name}.json")
        cmd = [sys.executable, "-m", "tools.loadgen.cli", "run", "--base-url", base, "--tokenizer", args.model,
               "--endpoint", args.endpoint, "--dataset-name", "sessions", "--num-prompts", str(args.sessions),
               "--sessions-num-turns", str(args.turns), "--sessions-user-len", str(args.user_len),
               "--sessions-output-len", str(args.output_len), "--sessions-think-time", str(args.think_time), "--request-rate", str(args.session_rate),
               *(["--ignore-eos"] if args.ignore_eos else []), "--seed", str(args.seed), "--save-detailed", "--result-dir", tmp,
               "--result-filename", os.path.basename(out), "--disable-tqdm"]
        load0 = os.getloadavg()[0]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        sock = os.path.join(tmp, f"coord-{name}.sock")
        status = admin_request(sock, {"cmd": "status"})
        p1 = admin_request(sock, {"cmd": "cache stats", "node": "p1"})["nodes"]["p1"]["kv"]
        records = json.loads(Path(out).read_text())["requests"]
    failed = [r for r in records if not r["success"]]
    if failed:
        raise SystemExit(f"bench_pd_caching: {len(failed)} turn(s) failed in {name}: {failed[0]['error']}")
    row = {"config": config, "round": rnd, "load1_start": load0, "load1_end": os.getloadavg()[0],
           "kv_returns": status.get("kv_returns", {}),
           "prefill_hit_share": p1["hit_tokens"] / max(1, p1["hit_tokens"] + p1["miss_tokens"])}
    for label, keep in (("turn1", lambda t: t == 0), ("later", lambda t: t > 0)):
        rs = [r for r in records if keep(r["turn"])]
        for key in ("ttft", "e2el"):
            xs = sorted(r[key] for r in rs)
            row[f"{label}_{key}"] = {"mean": statistics.fmean(xs), "p50": statistics.median(xs),
                                     "p99": xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))], "n": len(xs)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-len", type=int, default=128, help="new tokens per turn (>= the prefill threshold, "
                    "64, or the decode node computes the turn itself)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--session-rate", type=float, default=0.5, help="conversations started per second")
    ap.add_argument("--think-time", type=float, default=2.0, help="seconds between an answer and the next turn "
                    "(the return of the answer's KV must land before the next turn's prefill to pay)")
    ap.add_argument("--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"])
    ap.add_argument("--ignore-eos", action="store_true", help="answers of exactly --output-len tokens (the "
                    "model then writes past its end-of-turn token, whose text the next turn's template "
                    "drops, so the next prompt leaves the answer's tokens there)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--transport", default="zmq+tcp")
    ap.add_argument("--kv-blocks", type=int, default=2048, help="per node")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_pd_caching.json"))
    args = ap.parse_args()
    args.lengths = [args.turns * (args.user_len + args.output_len) + 64]   # cluster(): max-model-len
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-pdcache-") as tmp:
        for rnd in range(args.rounds):
            for config in (list(CONFIGS) if rnd % 2 == 0 else list(CONFIGS)[::-1]):
                t0 = time.monotonic()
                r = run_once(config, args, tmp, rnd)
                rows.append(r)
                print(f"round {rnd} {config} ({time.monotonic() - t0:.0f} s, load {r['load1_start']:.2f}→"
                      f"{r['load1_end']:.2f}): turns>=2 TTFT mean {r['later_ttft']['mean'] * 1e3:.0f} ms, "
                      f"JCT mean {r['later_e2el']['mean']:.2f} s; kv returns {r['kv_returns']}, prefill hit share "
                      f"{r['prefill_hit_share']:.2f}", flush=True)
    cpu = cpu_model()
    print(f"\n{args.sessions} sessions x {args.turns} turns, {args.user_len} new tokens and {args.output_len} "
          f"answer tokens per turn, {args.session_rate} sessions/s; medians of {args.rounds} rounds\n")
    print("| CPU | config | turn 1 TTFT mean (ms) | turns ≥ 2 TTFT mean / p50 / p99 (ms) "
          "| turns ≥ 2 JCT mean / p99 (s) | prefill node hit share | KV returns |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for config in CONFIGS:
        rs = [r for r in rows if r["config"] == config]
        med = lambda label, key, stat: statistics.median(r[f"{label}_{key}"][stat] for r in rs)  # noqa: E731
        summary[config] = {"later_ttft_mean": med("later", "ttft", "mean"),
                           "later_jct_mean": med("later", "e2el", "mean")}
        print(f"| {cpu} | {config} | {med('turn1', 'ttft', 'mean') * 1e3:.0f} "
              f"| {med('later', 'ttft', 'mean') * 1e3:.0f} / {med('later', 'ttft', 'p50') * 1e3:.0f} / "
              f"{med('later', 'ttft', 'p99') * 1e3:.0f} | {med('later', 'e2el', 'mean'):.2f} / "
              f"{med('later', 'e2el', 'p99'):.2f} | {statistics.median(r['prefill_hit_share'] for r in rs):.2f} "
              f"| {rs[-1]['kv_returns']} |")
    three, two = summary["pd-caching-3"], summary["pd-caching-2"]
    print(f"\nturns >= 2, PD-Caching-3 vs PD-Caching-2: TTFT mean "
          f"{1 - three['later_ttft_mean'] / two['later_ttft_mean']:.0%} lower, JCT mean "
          f"{1 - three['later_jct_mean'] / two['later_jct_mean']:.0%} lower")
    write_results(args.out, rows, cpu=cpu, args=vars(args), summary=summary)


if __name__ == "__main__":
    main()
