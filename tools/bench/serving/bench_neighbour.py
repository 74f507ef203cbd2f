"""kvd serve and llama-server beside busy neighbours: how much of its quiet throughput each keeps.

    .venv/bin/python -m tools.bench.serving.bench_neighbour --llama-cpp /path/to/llama.cpp/build/bin
        [--threads 2] [--rounds 2] [--loads 1,32] [--backgrounds quiet,nice19,normal]
        [--kvd-nodes 1] [--fixed-team] [--neighbour-session same|own] [--gguf FILE] [--out FILE]

For each background load, each server and each HTTP load (``bench_llamacpp``'s: one
stream of 8 × (32 in, 128 out), and 32 concurrent of 64 × (300 in, 128 out), greedy,
the same dataset and seed), the server is started, the background started, and
``kvd-loadgen`` run against it; servers alternate within a round and the order of the
backgrounds swaps every round. Backgrounds:

- ``quiet``: nothing;
- ``nice19``: one ``nice -n 19`` busy process per CPU the server may use;
- ``normal``: one busy process at normal priority.

A busy process is ``python -c 'while True: pass'``, started in the benchmark's own
session (``--neighbour-session same``: the OS's priorities order it against the
servers, as for a service's own host processes) or in a session of its own (``own``:
where the kernel groups processes by session, ``sched_autogroup_enabled`` = 1, a
neighbour of another session competes as a peer group whatever its nice value, as a
job started from another login does).

The table gives each server's output tok/s per background (fastest round), the
fraction of its quiet throughput it keeps, and kvd's fraction over llama.cpp's (the
ratio of ratios). ``--kvd-nodes 2`` serves kvd as ``kvd serve --nodes 2`` (its nodes on
CPUs of their own). ``--fixed-team`` adds a third server, kvd with its decode team fixed
(``--decode-threads`` = the threads: every step on the whole team, engine/team.py's
adaptation off), for the feature on against off. Without ``--llama-cpp`` only kvd runs. Writes JSON to ``--out``
(default ``results/bench_neighbour.json``) and prints markdown rows for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from engine.model.registry import bundled_gguf_path  # noqa: E402
from tools._twoproc import free_port, stop_processes, wait_healthy, write_results  # noqa: E402
from tools.bench.engine.bench_llamacpp import HTTP_LOADS, loadgen, serve  # noqa: E402
from tools.loadgen.report import cpu_model  # noqa: E402

BUSY = (sys.executable, "-c", "while True: pass")
BACKGROUNDS = ("quiet", "nice19", "normal")
FIXED = "kvd fixed team"


def start_background(kind: str, cpus: int, own_session: bool) -> list[subprocess.Popen]:
    """The busy processes of background ``kind`` (none for quiet)."""
    if kind == "quiet":
        return []
    count, nice = (cpus, 19) if kind == "nice19" else (1, 0)
    return [subprocess.Popen(["nice", "-n", str(nice), *BUSY], start_new_session=own_session,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]


def serve_kvd_nodes(gguf: Path, threads: int, conc: int, port: int, nodes: int) -> subprocess.Popen:
    """``kvd serve --nodes N`` on ``port`` (the coordinator's HTTP), nodes on CPUs of their own."""
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--port", str(port), "--nodes", str(nodes),
           "--max-num-seqs", str(max(conc, 8)), "--model", str(gguf)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def serve_kvd_fixed(gguf: Path, threads: int, conc: int, port: int) -> subprocess.Popen:
    """``kvd serve`` with every decode step on ``threads`` threads (no adaptive team)."""
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--port", str(port), "--decode-threads", str(threads),
           "--max-num-seqs", str(max(conc, 8)), "--model", str(gguf)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_one(kind: str, background: str, load: tuple, args: argparse.Namespace, tmp: str, tag: str) -> dict:
    port = free_port()
    if kind == "kvd" and args.kvd_nodes > 1:
        proc = serve_kvd_nodes(args.gguf, args.threads, load[1], port, args.kvd_nodes)
    elif kind == FIXED:
        proc = serve_kvd_fixed(args.gguf, args.threads, load[1], port)
    else:
        proc = serve(kind, args.llama_cpp, args.gguf, args.threads, load[1], port)
    busy: list[subprocess.Popen] = []
    try:
        url = f"http://127.0.0.1:{port}"
        why = wait_healthy(url, proc, 300.0)
        if why:
            raise SystemExit(f"bench_neighbour: {kind} server {why}")
        busy = start_background(background, len(os.sched_getaffinity(0)), args.neighbour_session == "own")
        return loadgen(url, load, tmp, tag, args.gguf)
    finally:
        for b in busy:
            b.kill()
            b.wait()
        stop_processes([proc])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, default=None, help="folder with llama-server (omit: kvd only)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loads", default="1,32", help="HTTP loads by concurrency: 1, 32")
    ap.add_argument("--backgrounds", default=",".join(BACKGROUNDS))
    ap.add_argument("--kvd-nodes", type=int, default=1)
    ap.add_argument("--fixed-team", action="store_true", help="also kvd with its decode team fixed")
    ap.add_argument("--neighbour-session", choices=("same", "own"), default="same")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_neighbour.json"))
    args = ap.parse_args()
    args.gguf = args.gguf or bundled_gguf_path()
    backgrounds = args.backgrounds.split(",")
    if "quiet" not in backgrounds or any(b not in BACKGROUNDS for b in backgrounds):
        raise SystemExit(f"bench_neighbour: --backgrounds takes {', '.join(BACKGROUNDS)} and must include quiet")
    loads = [load for load in HTTP_LOADS if str(load[1]) in args.loads.split(",")]
    servers = ["kvd"] + ([FIXED] if args.fixed_team else []) + (["llama.cpp"] if args.llama_cpp else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-neighbour-") as tmp:
        for load in loads:
            for rnd in range(args.rounds):
                for background in (backgrounds if rnd % 2 == 0 else backgrounds[::-1]):
                    for kind in (servers if rnd % 2 == 0 else servers[::-1]):
                        r = run_one(kind, background, load, args, tmp, f"{kind}-{load[1]}-{background}-{rnd}")
                        rows.append({"load": load[0], "server": kind, "background": background, "round": rnd, **r})
                        print(f"{load[0]:14s} {background:7s} {kind:9s} round {rnd}: "
                              f"{r['output_throughput']:.1f} out tok/s ({r['completed']} done, {r['failed']} failed)",
                              flush=True)
    best = {}
    for r in rows:
        key = (r["load"], r["server"], r["background"])
        best[key] = max(best.get(key, 0.0), r["output_throughput"])
    cpu = cpu_model()
    kvd_name = "kvd" if args.kvd_nodes == 1 else f"kvd --nodes {args.kvd_nodes}"
    print(f"\nCPU: {cpu}, {args.threads} threads, neighbours in the {args.neighbour_session} session\n")
    llama = "llama.cpp" in servers
    print("| load | background | " + " | ".join(f"{s} out tok/s (kept)" for s in servers)
          + (" | kvd kept ÷ llama.cpp kept |" if llama else " |"))
    print("|---|---|" + "---|" * (len(servers) + (1 if llama else 0)))
    summary = []
    for load in loads:
        for background in backgrounds:
            kept = {s: best[(load[0], s, background)] / best[(load[0], s, "quiet")] for s in servers}
            cells = [f"{best[(load[0], s, background)]:.1f} ({kept[s]:.2f})" for s in servers]
            ror = kept["kvd"] / kept["llama.cpp"] if llama else None
            summary.append({"load": load[0], "background": background, "kept": kept, "ratio_of_ratios": ror,
                            "tok_s": {s: best[(load[0], s, background)] for s in servers}})
            print(f"| {load[0]} | {background} | " + " | ".join(cells) + (f" | {ror:.2f} |" if ror else " |"))
    write_results(args.out, rows, summary=summary, cpu=cpu, threads=args.threads, kvd=kvd_name,
                  neighbour_session=args.neighbour_session)


if __name__ == "__main__":
    main()
