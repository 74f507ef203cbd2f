"""Layer-wise KV streaming vs by-request vs colocated: TTFT and TTST of 1P1D,
and where disaggregation starts to pay (``[cluster].prefill_threshold``).

Three clusters, all running at once on this machine, each a real
coordinator and node processes (authenticated, as always), the node
processes pinned with ``taskset`` and one torch thread each:

- ``layers``:   prefill node on core 0, decode node on core 1; the prompt's
                KV streams layer by layer while the prefill computes
                (``[cluster].kv_stream = "layers"``, the default);
- ``request``:  the same, KV sent once the prefill ends (``kv_stream = "request"``);
- ``colocated``: one mixed node on core 0, no transfer (what a decode node
                does when it prefills locally).

Samples are interleaved: for each repetition and prompt length, one greedy
streamed completion of a fresh random prompt (no prefix-cache hits) per
mode, in turn, so the host's load (shared, noisy) falls on every mode alike;
``os.getloadavg()`` is recorded with each sample. Time to first token
(TTFT: sampled on the prefill node) and time to second token (TTST: the
first token the decode node computes, after the whole KV landed), medians.

The threshold columns: ``extra`` = TTST layers − TTST colocated (what a
request pays for going through a prefill node), ``stall`` = TTFT colocated
− TTFT colocated at the shortest length (the prefill compute a decode node
would spend on the prompt itself, stalling its running decodes).
Disaggregation pays from the first length where stall ≥ extra.

    .venv/bin/python -m tools.bench.cluster.bench_disagg [--lengths 256,1024,4096] [--reps 3]
        [--model smollm2] [--transport zmq+tcp]
    .venv/bin/python -m tools.bench.cluster.bench_disagg --lengths 16,32,64,128,256,512 --reps 5   # the threshold

Prints a markdown table and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
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

MODES = ("layers", "request", "colocated")


@contextlib.contextmanager
def cluster(mode: str, args: argparse.Namespace, tmp: str, nodes: dict[str, tuple[str, int]] | None = None,
            node_args: tuple[str, ...] = (), coordinator_args: tuple[str, ...] = ()):
    """Start the mode's daemons (``nodes``: name -> (role, core), by default
    the mode's; ``node_args`` added to every ``kvd node``, ``coordinator_args``
    to the coordinator); yield the HTTP base URL; stop them."""
    keys = os.path.join(tmp, f"keys-{mode}")
    if nodes is None:
        nodes = {"n1": ("mixed", 0)} if mode == "colocated" else {"p1": ("prefill", 0), "d1": ("decode", 1)}
    for name in ["coordinator", *nodes]:
        generate_keypair(keys, name)
    url = lambda: f"{args.transport}://127.0.0.1:{free_port()}"  # noqa: E731
    coord_url, port, sock = url(), free_port(), os.path.join(tmp, f"coord-{mode}.sock")
    common = ["--transport", args.transport, "--curve-keys-dir", keys, "--heartbeat-interval", "0.5",
              "--heartbeat-deadline", "30", "--kv-stream", "request" if mode == "request" else "layers",
              "--prefill-threshold", "0", "--kv-transfer-timeout", "600"]
    logs = open(os.path.join(tmp, f"{mode}.log"), "ab")
    procs = [subprocess.Popen([sys.executable, "-m", "kvd.cli", "coordinator", "--listen", coord_url,
                               "--port", str(port), "--model", args.model, "--admin-socket", sock, *common,
                               *coordinator_args],
                              cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)]
    max_len = max(args.lengths) + 64
    for name, (role, core) in nodes.items():
        procs.append(subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, "-m", "kvd.cli", "node", "--name", name, "--role", role,
             "--listen", url(), "--coordinator", coord_url, "--model", args.model, "--num-threads", "1",
             "--max-model-len", str(max_len), "--host-kv-blocks", "0",
             "--kv-blocks", str(getattr(args, "kv_blocks", 0) or 2 * max_len // 16 + 64),
             *common, *node_args], cwd=REPO, stdout=logs, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(AdminUnavailable, OSError, ValueError, KeyError):
                if len(admin_request(sock, {"cmd": "nodes"})["nodes"]) == len(nodes):
                    break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"bench_disagg: {mode} cluster did not start; see {logs.name}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_processes(procs)


def first_two(client: httpx.Client, base: str, ids: list[int]) -> tuple[float, float]:
    """(TTFT, TTST) of one greedy streamed completion, seconds."""
    model = client.get(base + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": ids, "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                times.append(time.perf_counter() - t0)
    if len(times) < 2:
        raise RuntimeError(f"expected >= 2 token events, got {len(times)}")
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--transport", default="zmq+tcp")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_disagg.json"))
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    samples: dict[tuple[str, int], list[dict]] = {(m, n): [] for m in MODES for n in args.lengths}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp, httpx.Client() as client, \
            contextlib.ExitStack() as stack:
        bases = {mode: stack.enter_context(cluster(mode, args, tmp)) for mode in MODES}
        for base in bases.values():
            first_two(client, base, [rng.randrange(1, 40000) for _ in range(64)])    # warm-up
        for rep in range(args.reps):
            for n in args.lengths:
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    load = os.getloadavg()[0]
                    ttft, ttst = first_two(client, bases[mode], [rng.randrange(1, 40000) for _ in range(n)])
                    samples[(mode, n)].append({"ttft_s": ttft, "ttst_s": ttst, "load1": load})
                    print(f"rep {rep} {mode:9s} {n:5d} tokens: TTFT {ttft:.3f} s, TTST {ttst:.3f} s "
                          f"(load {load:.2f})", flush=True)
    rows = [{"mode": m, "tokens": n, "reps": args.reps,
             "ttft_s": statistics.median(x["ttft_s"] for x in xs), "ttst_s": statistics.median(x["ttst_s"] for x in xs),
             "load1": [x["load1"] for x in xs], "samples": xs}
            for (m, n), xs in samples.items()]
    by = {(r["mode"], r["tokens"]): r for r in rows}
    loads = [x for r in rows for x in r["load1"]]
    print(f"\nCPU: {machine_info().get('cpu_model', '?')}, transport {args.transport}, model {args.model}, "
          f"1-min load average during the samples {min(loads):.2f}–{max(loads):.2f}\n")
    print("| tokens | TTFT layers / request / colocated (s) | TTST layers / request / colocated (s) "
          "| TTST layers ÷ colocated | TTST layers ÷ request | extra (s) | stall (s) |")
    print("|---|---|---|---|---|---|---|")
    floor = by[("colocated", args.lengths[0])]["ttft_s"]
    for n in args.lengths:
        lw, rq, co = by[("layers", n)], by[("request", n)], by[("colocated", n)]
        print(f"| {n} | {lw['ttft_s']:.3f} / {rq['ttft_s']:.3f} / {co['ttft_s']:.3f} "
              f"| {lw['ttst_s']:.3f} / {rq['ttst_s']:.3f} / {co['ttst_s']:.3f} "
              f"| {lw['ttst_s'] / co['ttst_s']:.2f} | {lw['ttst_s'] / rq['ttst_s']:.2f} "
              f"| {lw['ttst_s'] - co['ttst_s']:.3f} | {co['ttft_s'] - floor:.3f} |")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
