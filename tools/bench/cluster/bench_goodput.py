"""Why disaggregate (DistServe's goodput): 1P1D vs two mixed nodes on the
same two cores, under a workload that mixes long prompts with chat.

Three configurations, each a real coordinator and two node processes, every
node pinned to one core with ``taskset`` (one torch thread each), started
one after the other and alternated ``--rounds`` times (the host is shared):

- ``1p1d``:  a prefill node on core 0, a decode node on core 1;
- ``mixed``: two mixed nodes, on core 0 and core 1 (each prefills and
             decodes its own requests, as a colocated engine does, with
             chunked prefill: kvd's default);
- ``mixed-unchunked``: the same with ``--prefill-chunk-tokens 0``, a
             colocated engine that runs each prompt whole (DistServe's
             baseline).

Nodes start as tools/bench/cluster/bench_disagg.py's ``cluster`` starts them, with
``--prefill-threshold 0``: in ``1p1d`` where each prompt is computed is the
coordinator's prefill-queue bound (``--prefill-queue-factor``, default the
coordinator's own; 0 sends every prompt to the prefill node).

The workload is two ``kvd-loadgen`` processes started together against the
coordinator: ``long`` (random prompts of 1,024–2,048 tokens, 8-token
answers) and ``chat`` (64-token prompts, ``--chat-output`` tokens, 256 by
default), Poisson arrivals at ``--long-rate`` and ``--chat-rate`` for
``--duration`` seconds. Reported for the whole workload and per class:
p50/p99 TPOT and ITL, and goodput (requests per second meeting the SLO: TPOT
``--slo-tpot`` for both classes, TTFT ``--slo-ttft`` for long prompts and
``--slo-chat-ttft`` for chats, by default the same; in ms); the total
goodput is the sum of both classes'. The
loadgen divides by each class's run time, drain included; the share of all
requests that met the SLO (DistServe's attainment) does not depend on it,
and is printed beside it.

    .venv/bin/python -m tools.bench.cluster.bench_goodput [--rounds 2] [--duration 60]
        [--long-rate 0.15] [--chat-rate 0.5] [--slo-ttft 10000] [--slo-chat-ttft MS] [--slo-tpot 100]

Prints a markdown table (medians over rounds) and writes JSON to results/.
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

from tools._twoproc import write_results  # noqa: E402
from tools.bench.cluster.bench_disagg import cluster  # noqa: E402
from tools.loadgen.client import RequestRecord  # noqa: E402
from tools.loadgen.metrics import compute_metrics, request_tpot  # noqa: E402
from tools.loadgen.report import cpu_model  # noqa: E402

CONFIGS = {"1p1d": {"p1": ("prefill", 0), "d1": ("decode", 1)},
           "mixed": {"n1": ("mixed", 0), "n2": ("mixed", 1)},
           "mixed-unchunked": {"n1": ("mixed", 0), "n2": ("mixed", 1)}}
NODE_ARGS = {"mixed-unchunked": ("--prefill-chunk-tokens", "0")}   # DistServe's colocated baseline
METRICS = ("median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms")


def loadgen(base: str, cls: str, args: argparse.Namespace, out: str) -> subprocess.Popen:
    """One kvd-loadgen process for workload class ``cls`` (long | chat)."""
    rate = args.long_rate if cls == "long" else args.chat_rate
    shape = (["--random-input-len", "1536", "--random-range-ratio", "0.33", "--random-output-len", "8"]
             if cls == "long" else
             ["--random-input-len", "64", "--random-output-len", str(args.chat_output)])
    return subprocess.Popen(
        [sys.executable, "-m", "tools.loadgen.cli", "run", "--base-url", base, "--tokenizer", args.model,
         "--dataset-name", "random", *shape, "--num-prompts", str(max(1, round(rate * args.duration))),
         "--request-rate", str(rate), "--ignore-eos", "--seed", str(args.seed + (cls == "chat")),
         "--goodput", f"ttft:{args.slo_ttft if cls == 'long' else args.slo_chat_ttft}", f"tpot:{args.slo_tpot}",
         "--percentile-metrics", "ttft,tpot,itl",
         "--metric-percentiles", "50,99", "--save-detailed", "--result-dir", os.path.dirname(out),
         "--result-filename", os.path.basename(out), "--disable-tqdm"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def run_once(config: str, args: argparse.Namespace, tmp: str, rnd: int) -> dict:
    factor = () if args.prefill_queue_factor is None else ("--prefill-queue-factor", str(args.prefill_queue_factor))
    with cluster(f"{config}-{rnd}", args, tmp, CONFIGS[config], NODE_ARGS.get(config, ()), factor) as base:
        load0 = os.getloadavg()
        outs = {cls: os.path.join(tmp, f"{config}-{rnd}-{cls}.json") for cls in ("long", "chat")}
        procs = {cls: loadgen(base, cls, args, out) for cls, out in outs.items()}
        for cls, p in procs.items():
            if p.wait(args.duration * 20 + 600) != 0:
                raise SystemExit(f"bench_goodput: kvd-loadgen ({config}, {cls}) exited {p.returncode}")
        result = {"config": config, "round": rnd, "load1_start": load0[0], "load1_end": os.getloadavg()[0]}
        records = []
        for cls, out in outs.items():
            doc = json.loads(Path(out).read_text())
            recs = [RequestRecord.from_json(x) for x in doc["requests"]]
            records += recs
            r = doc["metrics"]
            result[cls] = {k: r.get(k) for k in (*METRICS, "request_goodput", "slo_attainment", "num_requests",
                                                 "completed", "failed", "duration")}
            # (TTFT, TPOT) in seconds of each request that completed: other SLOs can be applied later
            result[cls]["ttft_tpot_s"] = [(x.ttft, request_tpot(x)) for x in recs if x.success]
        result["goodput"] = sum(result[c]["request_goodput"] or 0 for c in ("long", "chat"))
        # both classes as one workload: its TPOT and ITL percentiles, and the share meeting the SLO
        both = compute_metrics(records, max(result[c]["duration"] for c in ("long", "chat")), (50, 99))
        result["all"] = {k: both.get(k) for k in (*METRICS, "num_requests")}
        met = sum((result[c]["slo_attainment"] or 0) * result[c]["num_requests"] for c in ("long", "chat"))
        result["slo_attainment"] = met / both["num_requests"]
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per class")
    ap.add_argument("--long-rate", type=float, default=0.15)
    ap.add_argument("--chat-rate", type=float, default=0.5)
    ap.add_argument("--chat-output", type=int, default=256)
    ap.add_argument("--slo-ttft", type=float, default=10000.0, help="ms (long prompts)")
    ap.add_argument("--slo-chat-ttft", type=float, default=None, help="ms (chats; default: --slo-ttft)")
    ap.add_argument("--slo-tpot", type=float, default=100.0, help="ms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--transport", default="zmq+tcp")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="per node")
    ap.add_argument("--prefill-queue-factor", type=float, default=None,
                    help="the coordinator's [cluster].prefill_queue_factor (default: its default)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_goodput.json"))
    args = ap.parse_args()
    args.slo_chat_ttft = args.slo_ttft if args.slo_chat_ttft is None else args.slo_chat_ttft
    configs = args.configs.split(",")
    if "1p1d" not in configs or not set(configs) <= set(CONFIGS):
        ap.error(f"--configs: 1p1d and any of {', '.join(CONFIGS)}")
    args.lengths = [2048 + args.chat_output]        # cluster(): max-model-len and KV blocks
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-goodput-") as tmp:
        for rnd in range(args.rounds):
            for config in (configs if rnd % 2 == 0 else configs[::-1]):
                t0 = time.monotonic()
                rows.append(run_once(config, args, tmp, rnd))
                r = rows[-1]
                print(f"round {rnd} {config:15s} ({time.monotonic() - t0:.0f} s, load {r['load1_start']:.2f}"
                      f"→{r['load1_end']:.2f}): " + ", ".join(
                          f"{c} {r[c]['completed']} done, {r[c]['failed']} failed, TPOT p50/p99 "
                          f"{fmt(r[c]['median_tpot_ms'])}/{fmt(r[c]['p99_tpot_ms'])} ms "
                          f"ITL p50/p99 {fmt(r[c]['median_itl_ms'])}/{fmt(r[c]['p99_itl_ms'])} ms "
                          f"goodput {fmt(r[c]['request_goodput'], 3)}/s" for c in ("long", "chat")), flush=True)
    print(f"\nSLO: TTFT <= {args.slo_ttft:.0f} ms (long), {args.slo_chat_ttft:.0f} ms (chat), TPOT <= "
          f"{args.slo_tpot:.0f} ms; long {args.long_rate}/s, "
          f"chat {args.chat_rate}/s ({args.chat_output} tokens) for {args.duration:.0f} s; medians of "
          f"{args.rounds} rounds\n")
    print("| CPU | config | TPOT p50 / p99, all (ms) | chat TPOT p50 / p99 (ms) | long TPOT p50 / p99 (ms) "
          "| chat ITL p50 / p99 (ms) | long TTFT p50 / p99 (s) | goodput chat + long (req/s) "
          "| SLO met: all (chat, long) | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cpu, summary = cpu_model(), {}
    for config in configs:
        rs = [r for r in rows if r["config"] == config]

        def med(cls: str, k: str) -> float | None:
            xs = [r[cls][k] for r in rs if r[cls][k] is not None]
            return statistics.median(xs) if xs else None

        def p50_p99(cls: str, what: str, scale: float = 1.0, digits: int = 0) -> str:
            return " / ".join(fmt(None if (v := med(cls, f"{q}_{what}_ms")) is None else v / scale, digits)
                              for q in ("median", "p99"))
        summary[config] = {"p99_tpot_ms": med("all", "p99_tpot_ms"), "chat_p99_tpot_ms": med("chat", "p99_tpot_ms"),
                           "goodput": statistics.median(r["goodput"] for r in rs),
                           "slo_attainment": statistics.median(r["slo_attainment"] for r in rs)}
        print(f"| {cpu} | {config} | {p50_p99('all', 'tpot')} | {p50_p99('chat', 'tpot')} "
              f"| {p50_p99('long', 'tpot')} | {p50_p99('chat', 'itl')} | {p50_p99('long', 'ttft', 1e3, 1)} "
              f"| {summary[config]['goodput']:.3f} "
              f"({fmt(med('chat', 'request_goodput'), 3)} + {fmt(med('long', 'request_goodput'), 3)}) "
              f"| {pct(summary[config]['slo_attainment'])} ({pct(med('chat', 'slo_attainment'))}, "
              f"{pct(med('long', 'slo_attainment'))}) "
              f"| {min(r['load1_start'] for r in rs):.1f}–{max(r['load1_end'] for r in rs):.1f} |")
    d = summary["1p1d"]
    for name in [c for c in configs if c != "1p1d"]:
        m = summary[name]
        if d["p99_tpot_ms"] and m["p99_tpot_ms"] and m["goodput"]:
            print(f"\n{name} ÷ 1p1d p99 TPOT: {m['p99_tpot_ms'] / d['p99_tpot_ms']:.2f}x (target >= 2; chats "
                  f"alone {m['chat_p99_tpot_ms'] / d['chat_p99_tpot_ms']:.2f}x); 1p1d ÷ {name} goodput: "
                  f"{d['goodput'] / m['goodput']:.2f}x (target >= 1.3); SLO met {pct(d['slo_attainment'])} "
                  f"vs {pct(m['slo_attainment'])}")
    write_results(args.out, rows, cpu=cpu, args=vars(args), summary=summary)


def pct(x: float | None) -> str:
    """A share for the table, in percent; "n/a" when not computed."""
    return "n/a" if x is None else f"{100 * x:.0f}%"


def fmt(x: float | None, digits: int = 0) -> str:
    """A figure for the table; "n/a" for a metric the loadgen could not compute."""
    return "n/a" if x is None else f"{x:.{digits}f}"


if __name__ == "__main__":
    main()
