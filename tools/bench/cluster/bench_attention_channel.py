"""One remote-attention round trip (a decode step's layer of a sequence on borrowed
blocks) on the remote-attention channel's two paths, side by side: the same host's
shared-memory ring (kvd/node/attention_ring.py) and zmq with CURVE
(kvd/node/attention_channel.py); and the creditor's answer alone.

The creditor is a process of its own (this module with ``--serve``, pinned to the
last CPU), as a lending node's: a real ``AttentionServer`` over a MemPool with
SmolLM2's attention shapes (30 layers, 9 query and 3 KV heads of 64, fp32 KV) lending
``--keys`` keys to debtor "a", behind a ``ChannelServer`` with CURVE keys. The
debtor (this process, pinned to CPU 0) runs ``ChannelLender.start(...).partials()``
as a debtor's engine thread does at every layer: one query row and the new K/V row of
the sequence's last position, layers in turn. Modes, alternating by round (rotated):

- ``ring``: the channel client with a ring open (every decode message fits it);
- ``zmq``: a second client of the same creditor without a ring;
- ``answer``: ``AttentionServer.serve`` on the same message in this process (no
  transport: the creditor's work, its Python and its kernel).

The figures are the median and the 10th percentile of each mode's trips in
microseconds; a trip's time is what a debtor's layer waits when its own attention
takes nothing (it hides behind the local micro-attention by the overlap).

    .venv/bin/python -m tools.bench.cluster.bench_attention_channel [--keys 512 4096] [--trips 300] [--rounds 3]

Prints a table and writes JSON to results/bench_attention_channel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BS, LO = 30, 9, 3, 64, 16, 1
TIMEOUT_S = 10.0


def creditor(keys: int):
    """(AttentionServer, loan id, RManager) lending ``keys`` keys (from chunk LO) to "a"."""
    import torch

    from engine.memory.kv_cache import KVCache
    from engine.memory.mempool import MemPool
    from engine.memory.rmanager import RManager
    from kernels.paged_attention import PagedAttention
    from kvd.node.remote_attention import AttentionServer

    torch.set_num_threads(1)
    kernel = PagedAttention.create()
    if kernel is None:
        raise SystemExit("bench_attention_channel: no paged attention kernel on this CPU")
    blocks = -(-keys // BS)
    kv = KVCache(LAYERS, KV_HEADS, HEAD_DIM, block_size=BS, device_blocks=blocks, host_blocks=0)
    pool = MemPool(blocks, 0, block_size=BS, storage=kv)
    rm = RManager(pool, lend_cap=blocks, lease_s=3600.0)
    loan = rm.lend("a", blocks, "loan", time.monotonic())
    server = AttentionServer(rm, kernel, HEAD_DIM ** -0.5, [None] * LAYERS, (HEADS, KV_HEADS, HEAD_DIM),
                             threading.Lock(), threads=1)
    return server, loan.loan_id, rm


def serve_main() -> int:
    """The creditor process: its keys and CPU on stdin (one JSON line), its channel's URL on
    stdout; serves until stdin closes."""
    from kvd.node.attention_channel import ChannelServer
    from kvd.node.attention_ring import RingPolicy
    from transports.keys import CurveServer

    cfg = json.loads(sys.stdin.readline())
    os.sched_setaffinity(0, {cfg["cpu"]})
    attention, loan_id, rm = creditor(cfg["keys"])
    curve = CurveServer(cfg["public"].encode(), cfg["secret"].encode(), {cfg["client"].encode(): "a"})
    policy = RingPolicy(lambda loan, debtor: None if (loan, debtor) == (loan_id, "a") else "no such loan",
                        lambda debtor: True, lambda: True)             # no engine here: always idle
    channel = ChannelServer("127.0.0.1", attention.serve, curve, policy, attention.lane)
    print(json.dumps({"url": channel.url, "loan": loan_id}), flush=True)
    sys.stdin.read()
    channel.close()
    return 0


def trips(lender, layer0: int, n: int, ctx: int, q, k, v, positions) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        lender.start((layer0 + i) % LAYERS, q, ctx, positions, k, v).partials(TIMEOUT_S)
        out.append(time.perf_counter() - t)
    return out


def measure(keys: int, n: int, rounds: int, cpus: list[int]) -> dict:
    import torch
    import zmq

    from kvd.node.attention_channel import ChannelClient
    from kvd.node.remote_attention import ChannelLender, attend_message
    from transports.keys import CurveClient

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench.cluster.bench_attention_channel", "--serve"],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps({"cpu": cpus[-1], "keys": keys, "public": server_public.decode(),
                                     "secret": server_secret.decode(), "client": client_public.decode()}) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("bench_attention_channel: the creditor process did not start")
        got = json.loads(line)
        keys_of = CurveClient(client_public, client_secret, server_public)
        ctx = zmq.Context()
        ring_client, zmq_client = ChannelClient(ctx, got["url"], keys_of), ChannelClient(ctx, got["url"], keys_of)
        try:
            if not ring_client.open_ring("a", got["loan"], TIMEOUT_S):
                raise SystemExit("bench_attention_channel: the creditor offered no ring")
            lenders = {"ring": ChannelLender(ring_client, "a", got["loan"], "r", LO, TIMEOUT_S),
                       "zmq": ChannelLender(zmq_client, "a", got["loan"], "r", LO, TIMEOUT_S)}
            attention, loan_id, _ = creditor(keys)              # this process's: the answer alone
            seq_len = LO * 128 + keys
            q, k, v = torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
            positions = torch.tensor([seq_len - 1])

            class Inline:
                def start(self, layer, q, ctx_, positions, k, v):
                    msg = attend_message("a", loan_id, "r", LO, TIMEOUT_S, layer, q, ctx_, positions, k, v)
                    reply = attention.serve(msg, "a")
                    assert reply.ok, reply.reason
                    return self

                def partials(self, timeout):
                    return None
            lenders["answer"] = Inline()
            for lender in lenders.values():
                trips(lender, 0, 20, seq_len, q, k, v, positions)            # warm-up
            times: dict[str, list[float]] = {m: [] for m in lenders}
            modes = list(lenders)
            for rnd in range(rounds):
                for mode in modes[rnd % len(modes):] + modes[:rnd % len(modes)]:
                    times[mode] += trips(lenders[mode], rnd, n, seq_len, q, k, v, positions)
            assert ring_client.counts["ring"] >= rounds * n and zmq_client.counts["ring"] == 0
        finally:
            ring_client.close()
            zmq_client.close()
            ctx.term()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)

    def us(x: float) -> float:
        return round(x * 1e6, 1)
    return {"keys": keys, **{f"{m}_median_us": us(statistics.median(x)) for m, x in times.items()},
            **{f"{m}_p10_us": us(statistics.quantiles(x, n=10)[0]) for m, x in times.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keys", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--trips", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="", help="JSON path (default results/bench_attention_channel.json)")
    args = p.parse_args(argv)
    if args.serve:
        return serve_main()
    if any(n < BS or n % 128 for n in args.keys) or args.trips < 10 or args.rounds < 1:
        p.error("--keys must be multiples of 128, --trips >= 10, --rounds >= 1")
    from tools._twoproc import write_results
    from tools.loadgen.report import machine_info

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})
    rows = []
    for keys in args.keys:
        row = measure(keys, args.trips, args.rounds, cpus)
        rows.append(row)
        print(f"{keys:6d} lent keys: round trip ring {row['ring_median_us']:7.1f} us (p10 {row['ring_p10_us']:.1f}), "
              f"zmq {row['zmq_median_us']:7.1f} us (p10 {row['zmq_p10_us']:.1f}); the creditor's answer alone "
              f"{row['answer_median_us']:.1f} us", flush=True)
    write_results(args.out or str(REPO / "results" / "bench_attention_channel.json"), rows, args=vars(args),
                  host=machine_info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
