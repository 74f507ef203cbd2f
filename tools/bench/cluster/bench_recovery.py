"""Fault tolerance, side by side (docs/benchmarks.md): replication overhead and recovery time.

Two-node clusters started one after the other on this machine (a real
coordinator and node processes, authenticated), each node pinned to its own
core with ``taskset`` and one torch thread:

- ``--mode overhead``: ``replicas = 1`` vs ``0``, alternating ``--rounds``
  times, ``--concurrency`` greedy streamed completions at once: median TPOT
  per request and output tokens per second, each pair in the same run.
- ``--mode recovery``: for each context length, a streamed greedy completion
  whose node is crashed (admin ``fail exit``: ``os._exit``, no goodbye)
  by a thread of its own ``--settle`` seconds after the client read
  ``--kill-after`` tokens; the client's pause (the longest gap between two
  tokens that spans or follows the crash; the reader never stops, so no token
  computed before the crash counts) under ``recovery = replica`` and
  ``reprefill``, and for ``fail`` the
  time until a client that retries from scratch gets its first token again.
  All three include the failure detection (``--deadline`` seconds of missed
  heartbeats), the same for each; the text must equal an uninterrupted run.

    .venv/bin/python -m tools.bench.cluster.bench_recovery --mode overhead [--concurrency 32] [--max-tokens 64]
    .venv/bin/python -m tools.bench.cluster.bench_recovery --mode recovery [--lengths 256,1024,4096]

Prints a table and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kvd.ctl import AdminUnavailable  # noqa: E402
from kvd.ctl import request as admin_request  # noqa: E402
from tools._twoproc import free_port, stop_processes, write_results  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402
from transports.keys import generate_keypair  # noqa: E402


@contextlib.contextmanager
def cluster(tag: str, args: argparse.Namespace, tmp: str, flags: list[str], node_flags: tuple[str, ...] = ()):
    """Coordinator + n1 (core 0) + n2 (core 1); yields (base URL, admin socket). ``flags``
    go to every daemon, ``node_flags`` (engine flags) to the nodes only."""
    keys = os.path.join(tmp, f"keys-{tag}")
    for name in ("coordinator", "n1", "n2"):
        generate_keypair(keys, name)
    url = lambda: f"zmq+tcp://127.0.0.1:{free_port()}"  # noqa: E731
    coord_url, port, sock = url(), free_port(), os.path.join(tmp, f"coord-{tag}.sock")
    common = ["--curve-keys-dir", keys, "--heartbeat-interval", str(args.deadline / 4),
              "--heartbeat-deadline", str(args.deadline), *flags]
    logs = open(os.path.join(tmp, f"{tag}.log"), "ab")
    procs = [subprocess.Popen([sys.executable, "-m", "kvd.cli", "coordinator", "--listen", coord_url,
                               "--port", str(port), "--model", args.model, "--admin-socket", sock, *common],
                              cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)]
    max_len = max(args.lengths) + args.max_tokens + 64
    for core, name in enumerate(("n1", "n2")):
        procs.append(subprocess.Popen(
            ["taskset", "-c", str(core % os.cpu_count()), sys.executable, "-m", "kvd.cli", "node", "--name", name,
             "--listen", url(), "--coordinator", coord_url, "--model", args.model, "--num-threads", "1",
             "--max-model-len", str(max_len), "--kv-blocks", str(max(2048, 3 * max_len // 16)),
             "--host-kv-blocks", str(max(2048, 3 * max_len // 16)), *common, *node_flags],
            cwd=REPO, stdout=logs, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(AdminUnavailable, OSError, ValueError, KeyError):
                if len(admin_request(sock, {"cmd": "nodes"})["nodes"]) == 2:
                    break
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise SystemExit(f"bench_recovery: {tag} cluster did not start; see {logs.name}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", sock
    finally:
        stop_processes(procs)


def stream(base: str, ids: list[int], max_tokens: int, on_token=None) -> tuple[list[float], str, str | None]:
    """(arrival time of each token event, text, error) of one greedy streamed completion."""
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times, text, error = [], [], None
    with httpx.Client(timeout=600) as client:
        body["model"] = client.get(base + "/v1/models").json()["data"][0]["id"]
        with client.stream("POST", base + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    error = msg["error"].get("message", "error")
                    break
                if msg.get("choices") and msg["choices"][0].get("text"):
                    times.append(time.perf_counter())
                    text.append(msg["choices"][0]["text"])
                    if on_token is not None:
                        on_token(len(times))
    return times, "".join(text), error


def overhead(args: argparse.Namespace, tmp: str) -> list[dict]:
    rows = []
    rng = random.Random(1)
    for rnd in range(args.rounds):
        # the same prompts for both settings of a round: only replication differs
        warm = [rng.randrange(1, 40000) for _ in range(32)]
        prompts = [[rng.randrange(1, 40000) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
        for replicas in ((1, 0) if rnd % 2 == 0 else (0, 1)):      # alternate which runs first
            tag = f"overhead-{rnd}-r{replicas}"
            flags = ["--replicas", str(replicas), "--replication-interval", str(args.replication_interval)]
            with cluster(tag, args, tmp, flags) as (base, _):
                stream(base, warm, 4)       # warm-up
                t0 = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                    res = list(pool.map(lambda p: stream(base, p, args.max_tokens), prompts))
                wall = time.perf_counter() - t0
                tpots = [(t[-1] - t[0]) / (len(t) - 1) for t, _, _ in res if len(t) > 1]
                row = {"mode": "overhead", "round": rnd, "replicas": replicas, "concurrency": args.concurrency,
                       "replication_interval_s": args.replication_interval,
                       "tpot_median_s": statistics.median(tpots), "output_tok_s": sum(len(t) for t, _, _ in res) / wall,
                       "errors": sum(e is not None for _, _, e in res), "loadavg": os.getloadavg()[0]}
                rows.append(row)
                print(f"round {rnd} replicas={replicas}: TPOT {row['tpot_median_s'] * 1e3:.1f} ms, "
                      f"{row['output_tok_s']:.1f} out tok/s, errors {row['errors']}", flush=True)
    by = {(r["round"], r["replicas"]): r for r in rows}
    pairs = [(by[(rnd, 1)], by[(rnd, 0)]) for rnd in range(args.rounds)]
    ratios = [on["tpot_median_s"] / off["tpot_median_s"] for on, off in pairs]
    tput = [on["output_tok_s"] / off["output_tok_s"] for on, off in pairs]
    summary = {"mode": "overhead-summary", "tpot_ratio_median": statistics.median(ratios),
               "tpot_ratios": ratios, "output_tok_s_ratio_median": statistics.median(tput)}
    print(f"replicas 1 vs 0, median of {len(ratios)} paired rounds: TPOT {summary['tpot_ratio_median']:.3f}x "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}), output tok/s {summary['output_tok_s_ratio_median']:.3f}x")
    return rows + [summary]


def recovery(args: argparse.Namespace, tmp: str) -> list[dict]:
    """A fresh cluster per (policy, length): the crashed node stays down."""
    rows = []
    rng = random.Random(2)
    prompts = {n: [rng.randrange(1, 40000) for _ in range(n)] for n in args.lengths}
    for n in args.lengths:
        for policy in ("replica", "reprefill", "fail"):
            # replicas only under ``replica``: a holder's replica sits in its prefix cache,
            # where a reprefill would find it and not recompute
            flags = ["--recovery", policy, "--replicas", "1" if policy == "replica" else "0"]
            with cluster(f"recovery-{policy}-{n}", args, tmp, flags) as (base, sock):
                stream(base, [rng.randrange(1, 40000) for _ in range(32)], 4)           # warm-up
                killed: dict = {}
                counted = threading.Event()

                def on_token(k: int) -> None:
                    if k == args.kill_after:
                        counted.set()

                def crash() -> None:
                    # from a thread of its own: the reader keeps draining the stream,
                    # so no token produced before the crash is read after it
                    if not counted.wait(600):
                        return
                    time.sleep(args.settle)                # let the replica catch up, as in steady state
                    node = next(iter(admin_request(sock, {"cmd": "requests"})["requests"].values()))["node"]
                    killed["t"], killed["node"] = time.perf_counter(), node
                    admin_request(sock, {"cmd": "fail", "node": node, "mode": "exit"})

                crasher = threading.Thread(target=crash, daemon=True)
                crasher.start()
                times, text, error = stream(base, prompts[n], args.max_tokens, on_token)
                crasher.join(60)
                if "t" not in killed:
                    raise SystemExit("bench_recovery: the stream ended before the crash; raise --max-tokens")
                if policy == "fail":
                    if error is None:
                        raise SystemExit("bench_recovery: a fail-policy stream did not end with an error")
                    retry, _, _ = stream(base, prompts[n], 1)
                    gap = retry[0] - killed["t"]
                else:
                    if error is not None:
                        raise SystemExit(f"bench_recovery: {policy} stream failed: {error}")
                    # the pause the client sees: the longest gap between two tokens that
                    # spans or follows the crash (tokens already in flight may still arrive)
                    after = [t for t in times if t > killed["t"]]
                    before = max((t for t in times if t <= killed["t"]), default=killed["t"])
                    gap = max(b - a for a, b in zip([before, *after], after)) if after else float("nan")
                rows.append({"mode": "recovery", "policy": policy, "context": n, "gap_s": gap,
                             "deadline_s": args.deadline, "tokens": len(times), "text": text if error is None else "",
                             "loadavg": os.getloadavg()[0]})
                print(f"{policy:9s} context {n:5d}: client's pause at the crash {gap:.2f} s "
                      f"(detection deadline {args.deadline} s)", flush=True)
    for n in args.lengths:
        texts = {r["text"] for r in rows if r["context"] == n and r["policy"] != "fail"}
        print(f"context {n}: replica and reprefill texts {'identical' if len(texts) == 1 else 'DIFFER'}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("overhead", "recovery"), required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replication-interval", type=float, default=0.05,
                    help="[cluster].replication_interval of the replicas = 1 runs")
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--kill-after", type=int, default=16)
    ap.add_argument("--settle", type=float, default=0.3)
    ap.add_argument("--deadline", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")] if args.mode == "recovery" else [args.prompt_len]
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        rows = overhead(args, tmp) if args.mode == "overhead" else recovery(args, tmp)
    print(f"\nCPU: {machine_info().get('cpu_model', '?')}, model {args.model}")
    write_results(args.out or str(REPO / "results" / f"bench_recovery_{args.mode}.json"), rows)


if __name__ == "__main__":
    main()
