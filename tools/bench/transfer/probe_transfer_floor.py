"""What a layer-major KV transfer can reach on this host, with no kvd code.

``tools/bench/transfer/bench_kv_transfer.py`` compares kvd's KV transfer with plain bytes
over the same transport. This probe measures the ceiling for that ratio:
the same two processes and transport, the same one request and one reply
per sample, but no protocol, no radix tree, no allocation — only the copies
that KV in a layer-major pool ([L, 2, blocks, bs, kvh, hd]) cannot avoid.
Per sample, alternated (shared, noisy host), medians:

  plain     one frame of N bytes; the receiver replies at once (as the bench's
            plain baseline does).
  +1 copy   one frame of N bytes; the receiver copies it into its resident
            pool, ``pool[:, :, a:a+n].copy_(frame)``, then replies. The floor
            for a zero-copy sender (kvd's "pool pieces").
  +2 copies the sender first gathers the blocks from its own pool into a
            staging tensor (one strided copy), then as "+1 copy". The floor
            for a sender that must gather (kvd's "staged": a run of blocks
            whose per-layer slice is under 64 KiB, e.g. 1 MiB here).

A ratio below 0.8 for "+1 copy" means no implementation of a KV transfer into
a layer-major pool over that transport reaches 0.8 of plain bytes on this
host; the bench's figures sit under these.

    .venv/bin/python -m tools.bench.transfer.probe_transfer_floor [--sizes 1,16] [--transports zmq+tcp,zmq+ipc,ucx]

Writes results/probe_transfer_floor.json; prints markdown rows.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import transports  # noqa: E402
from tools._twoproc import receiver, receiver_url, run_on_uvloop, write_results  # noqa: E402
from transports import TransportOptions  # noqa: E402

MiB = 1 << 20
SHAPE = (16, 2, 16, 8, 64)     # the bench's KV: L, K|V, block size, kv heads, head dim (fp32: 1 MiB/block)
OPTIONS = TransportOptions(send_timeout=120, request_timeout=120, max_frame_bytes=1 << 31)
warnings.filterwarnings("ignore", message=".*non-writable.*")   # frombuffer on zmq's read-only frames


def _pool(blocks: int) -> torch.Tensor:
    L, two, bs, kvh, hd = SHAPE
    return torch.zeros(L, two, blocks, bs, kvh, hd)      # zeros: resident, as a serving node's pool


async def serve(url: str, blocks: int) -> None:
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), lambda: sys.stdin.read() or os._exit(0))
    pool = _pool(blocks)
    L, two, bs, kvh, hd = SHAPE
    listener = await transports.listen(url, options=OPTIONS)
    print(listener.url, flush=True)
    while True:
        incoming = await listener.recv()
        if incoming.header == b'{"copy":1}':
            src = torch.frombuffer(incoming.frames[0], dtype=torch.float32).view(L, two, -1, bs, kvh, hd)
            pool[:, :, 1:1 + src.shape[2]].copy_(src)
        await listener.reply(incoming, b'{}')


async def probe(url: str, sizes: list[int], runs: int) -> list[dict]:
    blocks = max(sizes) + 2
    pool = _pool(blocks)
    pool.normal_()
    L, two, bs, kvh, hd = SHAPE
    rows = []
    async with receiver(str(Path(__file__).resolve()), url, ["--blocks", str(blocks)], OPTIONS) as conn:
        for size in sizes:                        # MiB = blocks
            plain_buf = bytearray(size * MiB)
            contiguous = torch.randn(L, two, size, bs, kvh, hd)
            staging = torch.empty(L, two, size, bs, kvh, hd)
            t_plain, t_one, t_two = [], [], []
            for i in range(runs + 1):             # sample 0 warms up
                t0 = time.perf_counter()
                await conn.request(b'{"plain":1}', [plain_buf])
                t1 = time.perf_counter()
                await conn.request(b'{"copy":1}', [contiguous])
                t2 = time.perf_counter()
                staging.copy_(pool[:, :, 1:1 + size])
                await conn.request(b'{"copy":1}', [staging])
                t3 = time.perf_counter()
                if i:
                    t_plain.append(t1 - t0)
                    t_one.append(t2 - t1)
                    t_two.append(t3 - t2)
            p, one, two_ = (statistics.median(t) for t in (t_plain, t_one, t_two))
            rows.append({"transport": url.split("://")[0], "size_mib": size, "runs": runs,
                         "plain_ms": p * 1e3, "one_copy_ms": one * 1e3, "two_copies_ms": two_ * 1e3,
                         "one_copy_ratio": p / one, "two_copies_ratio": p / two_})
            print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict) -> str:
    return (f"| {r['transport']} | {r['size_mib']} | {r['plain_ms']:.2f} | {r['one_copy_ms']:.2f} "
            f"| {r['one_copy_ratio']:.2f} | {r['two_copies_ms']:.2f} | {r['two_copies_ratio']:.2f} |")


async def main_async(args) -> list[dict]:
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [t for t in args.transports.split(",") if t != "ucx" or importlib.util.find_spec("ucxx")]
    print("| transport | MiB | plain ms | +1 copy ms | ratio | +2 copies ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    tmp = tempfile.mkdtemp(prefix="kvd-probe-")
    for name in names:
        url = receiver_url(name, tmp)
        rows += await probe(url, sizes, args.runs)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16", help="MiB (= blocks of the bench's KV)")
    ap.add_argument("--transports", default="zmq+tcp,zmq+ipc,ucx")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "results" / "probe_transfer_floor.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)          # as the bench: two processes share the host's cores
    if args.serve:
        run_on_uvloop(serve(args.serve, args.blocks))
        return
    rows = run_on_uvloop(main_async(args))
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
