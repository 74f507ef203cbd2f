"""DGFM over time (docs/benchmarks.md; docs/cluster.md, "Borrowed KV memory"; the shape of
Infinite-LLM's Figure 10): the share of borrowed KV blocks on a four-node trace with DGFM
on and off.

A real coordinator and four node processes (``n1``..``n4``, each pinned to core
``i % cpus``; the tiny model, float32, batch-invariant, prefix caching off), every node
lending and borrowing, 192 KV blocks each. The trace is ``--waves`` waves, one after the
other, of four long requests (94 prompt blocks, 128 in all: the model's context), placed
so that their debts form one cycle: routing pinned to n1 (the other nodes drained), a
placeholder loan (the bench speaking for the node that owes n1 already, with its key)
holds n1's free blocks but 92 while n1's long request is admitted, so it keeps 11 chunks
(88 blocks) at home and borrows 40, from n2 (the ledger's most lendable, by name); the
placeholder is given back; then n2's long borrows from n3, n3's from n4 and n4's from n1
(the one with room left): n1 -> n2 -> n3 -> n4 -> n1. A wave ends when its four requests do.

While it runs, the coordinator's ledger is sampled every ``--sample`` seconds: the share
of borrowed blocks = blocks lent, all nodes, over blocks in use (lent ones included).

Each round runs both modes, in alternating order: **on** (``--dgfm-interval``: DGFM's
rounds bring the cycle's KV home) and **off** (``--dgfm-interval 0``). Reported per
mode: the mean and peak share; blocks lent x seconds; the seconds during which every
long request of a wave still had its whole loan out (the cycle standing); the trace's
duration and output tokens per second (remote attention on a shared host's loopback
costs a decode step more than local attention); DGFM's moves done and failed and the
local blocks they took; and whether every completion's text is the same in both modes
(each is the single-node text: the exactness tests hold it; here, on equals off).

    .venv/bin/python -m tools.bench.cluster.bench_dgfm [--rounds 2] [--waves 3] [--dgfm-interval 1.0]

Prints a table and writes JSON (the time series included) to results/.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import transports  # noqa: E402
from kvd import protocol  # noqa: E402
from kvd.ctl import AdminUnavailable  # noqa: E402
from kvd.ctl import request as admin_request  # noqa: E402
from tools._twoproc import free_port, stop_processes, write_results  # noqa: E402
from tools.bench.cluster.bench_recovery import stream  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402
from transports.keys import CurveClient, generate_keypair, load_keypair  # noqa: E402

NODES = ("n1", "n2", "n3", "n4")
BS = 16


@contextlib.contextmanager
def cluster(tag: str, args: argparse.Namespace, tmp: str, dgfm_interval: float):
    """Coordinator + four nodes that lend and borrow; yields (base URL, admin socket)."""
    keys = os.path.join(tmp, f"keys-{tag}")
    for name in ("coordinator", *NODES):
        generate_keypair(keys, name)
    url = lambda: f"zmq+tcp://127.0.0.1:{free_port()}"  # noqa: E731
    coord_url, port, sock = url(), free_port(), os.path.join(tmp, f"coord-{tag}.sock")
    common = ["--curve-keys-dir", keys, "--heartbeat-interval", "0.25", "--heartbeat-deadline", "3"]
    logs = open(os.path.join(tmp, f"{tag}.log"), "ab")
    procs = [subprocess.Popen([sys.executable, "-m", "kvd.cli", "coordinator", "--listen", coord_url,
                               "--port", str(port), "--model", args.model, "--admin-socket", sock, *common,
                               "--dgfm-interval", str(dgfm_interval), "--dgfm-min-blocks", str(args.min_blocks)],
                              cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)]
    for core, name in enumerate(NODES):
        procs.append(subprocess.Popen(
            ["taskset", "-c", str(core % os.cpu_count()), sys.executable, "-m", "kvd.cli", "node", "--name", name,
             "--listen", url(), "--coordinator", coord_url, "--model", args.model, "--dtype", "float32",
             "--num-threads", "1", "--block-size", str(BS), "--kv-blocks", str(KV_BLOCKS), "--host-kv-blocks", "0",
             "--max-model-len", "2048", "--lend-kv-blocks", str(KV_BLOCKS * 5 // 6),
             "--borrow-kv-blocks", str(KV_BLOCKS), "--no-prefix-caching", "--batch-invariant", *common], cwd=REPO, stdout=logs, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(AdminUnavailable, OSError, ValueError, KeyError):
                if len(admin_request(sock, {"cmd": "nodes"})["nodes"]) == len(NODES):
                    break
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise SystemExit(f"bench_dgfm: {tag} cluster did not start; see {logs.name}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", sock, keys
    finally:
        stop_processes(procs)


# A wave's sizes (tiny, 2048-token context, KV_BLOCKS blocks a node): a placeholder loan holds
# a node's free blocks but ADMITTED_FREE while its long request (94 prompt blocks, 128 in all)
# is admitted, so the long keeps 11 chunks (88 blocks) at home and borrows 40; the placeholder
# is given back at once, leaving the room a neighbour's long borrows and a recall lands in
KV_BLOCKS, ADMITTED_FREE = 192, 92
LONG_PROMPT, LONG_TOKENS = 94 * BS, 2040 - 94 * BS


def waves(args: argparse.Namespace, seed: int) -> list[list[list[int]]]:
    """Per wave, per node: its long request's prompt."""
    rng = random.Random(seed)
    return [[[rng.randrange(1, 40000) for _ in range(LONG_PROMPT)] for _ in NODES] for _ in range(args.waves)]


def call_as(keys: str, url: str, as_name: str, server: str, msg: protocol.Message) -> protocol.Message:
    """``msg`` to node ``server`` at ``url`` under node ``as_name``'s key; its reply."""
    async def go() -> protocol.Message:
        curve = CurveClient(*load_keypair(Path(keys) / f"{as_name}.key_secret"),
                            server_key=load_keypair(Path(keys) / f"{server}.key")[0])
        conn = await transports.connect(url, curve=curve)
        try:
            return await protocol.call(conn, msg, timeout=10)
        finally:
            await conn.close()
    return asyncio.run(go())


def pin(sock: str, node: str | None) -> None:
    """Route to ``node`` only (every other node drained); None: to every node."""
    for n in NODES:
        admin_request(sock, {"cmd": "undrain" if node in (None, n) else "drain", "node": n})


def ledger_line(sock: str, node: str) -> dict:
    return next((n for n in admin_request(sock, {"cmd": "ledger"})["nodes"] if n["node"] == node), {})


def until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_dgfm: no {what} within {timeout:g} s")
        time.sleep(0.05)


def ledger_share(sock: str, kv_blocks: int, failures: dict[str, int]) -> tuple[float, int, int]:
    """(share of borrowed blocks, blocks lent, blocks in use) from the coordinator's ledger;
    the reasons of DGFM's failed moves in its last round are counted into ``failures``
    (a round's, once: keyed by the rounds count)."""
    book = admin_request(sock, {"cmd": "ledger"})
    lent = sum(sum(n["lent"].values()) for n in book["nodes"])
    used = sum(kv_blocks - n["free"] for n in book["nodes"])
    key = f"round {book['dgfm_counts']['rounds']}"
    if key not in failures:
        failures[key] = 0
        for move in book["dgfm_last_round"]:
            if not move["ok"]:
                why = move["reason"].split(": ", 2)[-1][:80]
                failures[why] = failures.get(why, 0) + 1
    return (lent / used if used > 0 else 0.0), lent, used


def run_mode(args: argparse.Namespace, tmp: str, mode: str, rnd: int, trace) -> dict:
    interval = args.dgfm_interval if mode == "on" else 0.0
    with cluster(f"dgfm-{rnd}-{mode}", args, tmp, interval) as (base, sock, keys):
        stream(base, trace[0][0][:32], 2)                               # warm-up
        urls = {n["name"]: n["address"] for n in admin_request(sock, {"cmd": "nodes"})["nodes"]}
        samples: list[tuple[float, float, int, int]] = []
        failures: dict[str, int] = {}
        done = threading.Event()
        t0 = time.perf_counter()

        def sample() -> None:
            while not done.is_set():
                with contextlib.suppress(AdminUnavailable, OSError, ValueError, KeyError):
                    samples.append((time.perf_counter() - t0, *ledger_share(sock, KV_BLOCKS, failures)))
                done.wait(args.sample)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results = []
        with concurrent.futures.ThreadPoolExecutor(2 * len(NODES)) as pool:
            for wave in trace:                  # n1's long borrows from n2, n2's from n3, ..., n4's from n1
                longs = []
                for i, (node, long) in enumerate(zip(NODES, wave)):
                    owes_it = NODES[i - 1]                  # the placeholder's debtor: already n_i's (n4 for n1)
                    pin(sock, node)
                    blocks = ledger_line(sock, node)["free"] - ADMITTED_FREE
                    held = call_as(keys, urls[node], owes_it, node, protocol.BorrowRequest(debtor=owes_it, blocks=blocks))
                    if not isinstance(held, protocol.BorrowReply) or not held.ok:
                        raise SystemExit(f"bench_dgfm: no placeholder on {node}: {held}")
                    longs.append(pool.submit(stream, base, long, LONG_TOKENS))
                    until(lambda: sum(ledger_line(sock, node).get("borrowed", {}).values()) > 0, f"loan of {node}")
                    call_as(keys, urls[node], owes_it, node, protocol.ReturnLoan(debtor=owes_it, loan_id=held.loan_id))
                    time.sleep(0.6)                         # two beats: the ledger without the placeholder
                pin(sock, None)
                results += longs
                concurrent.futures.wait(longs)
            results = [f.result() for f in results]
        duration = time.perf_counter() - t0
        done.set()
        sampler.join(timeout=10)
        counts = admin_request(sock, {"cmd": "ledger"})["dgfm_counts"]
    errors = [e for _, _, e in results if e]
    if errors:
        raise SystemExit(f"bench_dgfm: {mode}: {len(errors)} request(s) failed: {errors[0]}")
    shares = [s for _, s, _, _ in samples]
    tokens = sum(len(times) for times, _, _ in results)
    gaps = [(b[0] - a[0], a) for a, b in zip(samples, samples[1:])]
    return {"mode": mode, "mean_share": statistics.mean(shares) if shares else 0.0,
            # blocks lent x seconds, and the time every long of a wave held its whole loan at once
            "lent_block_s": sum(dt * a[2] for dt, a in gaps),
            "all_lent_s": sum(dt for dt, a in gaps if a[2] >= len(NODES) * (128 - 88)),
            "peak_share": max(shares, default=0.0), "duration_s": duration, "tokens_per_s": tokens / duration,
            "dgfm": counts, "failed_moves": {k: n for k, n in failures.items() if not k.startswith("round ")},
            "samples": [[round(t, 3), round(s, 4), lent, used] for t, s, lent, used in samples],
            "texts": [text for _, text, _ in results]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--waves", type=int, default=3, help="waves of four long requests, one after another")
    p.add_argument("--dgfm-interval", type=float, default=1.0, help="seconds between DGFM rounds, mode on")
    p.add_argument("--min-blocks", type=int, default=16, help="[cluster].dgfm_min_blocks")
    p.add_argument("--sample", type=float, default=0.25, help="seconds between ledger samples")
    p.add_argument("--out", default="", help="JSON path (default results/bench_dgfm.json)")
    p.add_argument("--logs", default="", help="keep the daemons' logs in this directory (default: dropped)")
    args = p.parse_args(argv)
    if args.model != "tiny":
        p.error("the waves' sizes are the tiny model's (its 2048-token context)")
    if args.rounds < 1 or args.waves < 1 or not args.dgfm_interval > 0 or args.min_blocks < 1 or not args.sample > 0:
        p.error("need rounds >= 1, waves >= 1, dgfm-interval > 0, min-blocks >= 1, sample > 0")
    rows = []
    with (contextlib.nullcontext(args.logs) if args.logs else tempfile.TemporaryDirectory()) as tmp:
        os.makedirs(tmp, exist_ok=True)
        for rnd in range(args.rounds):
            trace = waves(args, seed=rnd)
            modes = ("on", "off") if rnd % 2 == 0 else ("off", "on")       # alternate which runs first
            got = {mode: run_mode(args, tmp, mode, rnd, trace) for mode in modes}
            row = {"round": rnd, "same_text": got["on"]["texts"] == got["off"]["texts"],
                   **{mode: {k: v for k, v in r.items() if k != "texts"} for mode, r in got.items()}}
            rows.append(row)
            for mode in ("off", "on"):
                r = row[mode]
                print(f"round {rnd} DGFM {mode:3s}: borrowed share mean {r['mean_share']:.3f} peak "
                      f"{r['peak_share']:.3f}, lent {r['lent_block_s']:.0f} block-s, every loan out "
                      f"{r['all_lent_s']:.1f} s, {r['duration_s']:.1f} s, {r['tokens_per_s']:.1f} tok/s, moves "
                      f"{r['dgfm']['moves_done']} done {r['dgfm']['moves_failed']} failed, "
                      f"{r['dgfm']['blocks_home']} blocks home", flush=True)
            print(f"round {rnd}: same text {row['same_text']}", flush=True)
    summary = {mode: {key: statistics.median(r[mode][key] for r in rows)
                      for key in ("mean_share", "peak_share", "lent_block_s", "all_lent_s", "duration_s", "tokens_per_s")}
               for mode in ("on", "off")}
    summary["same_text"] = all(r["same_text"] for r in rows)
    print(summary)
    write_results(args.out or str(REPO / "results" / "bench_dgfm.json"), rows, summary=summary, args=vars(args),
                  host=machine_info())
    return 0 if summary["same_text"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
