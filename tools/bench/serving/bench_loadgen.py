"""Is kvd-loadgen ever the bottleneck?  Its request rate and CPU cost per chunk.

Starts the trivial SSE server (tools/loadgen/fake_server.py) in a child
process, then alternates two clients over the same workload in this process:

- ``loadgen``: kvd-loadgen's runner (arrival loop, concurrency limit, SSE
  parsing, timestamps, records) with the progress bar off;
- ``bare``: the least a Python client can do -- aiohttp, same concurrency,
  read every line and parse nothing.

For each it reports requests/s and the client's CPU time per request and per
SSE chunk (``data:`` event: the token chunks, the usage chunk, ``[DONE]``);
the loadgen's own overhead is its CPU time per chunk minus the bare client's.
Rounds alternate and the median round is reported, because the machine is
shared.  The server's CPU time is reported too: when it is near the wall
time, the server, not the client, set the rate.

    .venv/bin/python -m tools.bench.serving.bench_loadgen [--requests 4000] [--concurrency 32] [--tokens 4]

Prints a markdown table row and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tools.loadgen.client import build_body  # noqa: E402
from tools.loadgen.datasets import Conversation, Turn  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402
from tools.loadgen.runner import RunConfig, run  # noqa: E402


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tools.loadgen.fake_server", "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()          # "listening on http://127.0.0.1:PORT"
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"bench_loadgen: the fake server did not start: {line!r}")
    return proc, line.split()[-1]


def process_cpu_s(pid: int) -> float:
    """utime + stime of another process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bare_client(url: str, n: int, concurrency: int, tokens: int) -> int:
    """Send ``n`` streamed requests; returns the number of SSE data lines read."""
    body = build_body(model="fake", chat=False, prompt="w1 w2 w3", max_tokens=tokens,
                      ignore_eos=True, temperature=0.0)
    headers = {"Content-Type": "application/json"}
    limit = asyncio.Semaphore(concurrency)
    chunks = 0

    async def one() -> None:
        nonlocal chunks
        async with limit:
            async with http.post(url, data=body, headers=headers) as resp:
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        chunks += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        await asyncio.gather(*(one() for _ in range(n)))
    return chunks


async def loadgen_client(url: str, n: int, concurrency: int, tokens: int) -> int:
    convs = [Conversation((Turn("w1 w2 w3", 3, tokens),))] * n
    cfg = RunConfig(url=url, model="fake", chat=False, max_concurrency=concurrency,
                    ignore_eos=True, progress=False)
    result = await run(convs, cfg)
    failed = [r.error for r in result.records if not r.success]
    if failed:
        raise SystemExit(f"bench_loadgen: {len(failed)} requests failed, e.g. {failed[0]}")
    # token chunks + the usage chunk + [DONE]
    return sum(r.chunks + (1 if r.usage_reported else 0) + 1 for r in result.records)


def measure(kind: str, url: str, server_pid: int, args, runner: asyncio.Runner) -> dict:
    client = loadgen_client if kind == "loadgen" else bare_client
    cpu0, server0, t0 = time.process_time(), process_cpu_s(server_pid), time.perf_counter()
    chunks = runner.run(client(url, args.requests, args.concurrency, args.tokens))
    wall = time.perf_counter() - t0
    cpu, server_cpu = time.process_time() - cpu0, process_cpu_s(server_pid) - server0
    return {"kind": kind, "wall_s": wall, "client_cpu_s": cpu, "server_cpu_s": server_cpu,
            "requests": args.requests, "chunks": chunks, "req_per_s": args.requests / wall,
            "chunks_per_s": chunks / wall, "cpu_us_per_req": cpu / args.requests * 1e6,
            "cpu_us_per_chunk": cpu / chunks * 1e6}


def median_round(rounds: list[dict]) -> dict:
    return sorted(rounds, key=lambda r: r["req_per_s"])[len(rounds) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4000, help="requests per round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4, help="token chunks per response")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out-dir", default=str(REPO / "results"))
    args = p.parse_args()

    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    server, base = start_server()
    url = base + "/v1/completions"
    rounds: dict[str, list[dict]] = {"loadgen": [], "bare": []}
    try:
        with runner:
            measure("bare", url, server.pid, argparse.Namespace(**{**vars(args), "requests": 200}), runner)
            for _ in range(args.rounds):
                for kind in ("loadgen", "bare"):
                    rounds[kind].append(measure(kind, url, server.pid, args, runner))
    finally:
        server.terminate()
        server.wait(timeout=10)

    lg, bare = median_round(rounds["loadgen"]), median_round(rounds["bare"])
    overhead_us = lg["cpu_us_per_chunk"] - bare["cpu_us_per_chunk"]
    summary = {
        "loadgen_req_per_s": lg["req_per_s"], "bare_req_per_s": bare["req_per_s"],
        "loadgen_vs_bare_rate": lg["req_per_s"] / bare["req_per_s"],
        "loadgen_cpu_us_per_req": lg["cpu_us_per_req"], "loadgen_cpu_us_per_chunk": lg["cpu_us_per_chunk"],
        "bare_cpu_us_per_chunk": bare["cpu_us_per_chunk"], "overhead_us_per_chunk": overhead_us,
        "loadgen_cpu_limited_req_per_s": 1e6 / lg["cpu_us_per_req"],
        "server_cpu_share": lg["server_cpu_s"] / lg["wall_s"],
        "meets_500_req_per_s": lg["req_per_s"] >= 500,
    }
    now = dt.datetime.now()
    doc = {"benchmark": "bench_loadgen", "date": now.isoformat(timespec="seconds"),
           "params": vars(args), "machine": machine_info(), "summary": summary, "rounds": rounds}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_loadgen-{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(doc, indent=2))

    cpus = f"{os.cpu_count()} cpu"
    print("| date | machine | requests x chunks | concurrency | loadgen req/s | bare req/s | ratio "
          "| loadgen CPU µs/req | CPU µs/chunk (loadgen / bare) | overhead µs/chunk | server CPU share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {now:%Y-%m-%d} | {cpus} | {args.requests} x {lg['chunks'] // args.requests} | {args.concurrency} "
          f"| {lg['req_per_s']:.0f} | {bare['req_per_s']:.0f} | {summary['loadgen_vs_bare_rate']:.2f} "
          f"| {lg['cpu_us_per_req']:.0f} | {lg['cpu_us_per_chunk']:.1f} / {bare['cpu_us_per_chunk']:.1f} "
          f"| {overhead_us:.1f} | {summary['server_cpu_share']:.0%} |")
    print(f"median of {args.rounds} alternating rounds; loadgen CPU alone would allow "
          f"{summary['loadgen_cpu_limited_req_per_s']:.0f} req/s; JSON: {path}")
    return 0 if summary["meets_500_req_per_s"] else 1


if __name__ == "__main__":
    sys.exit(main())
