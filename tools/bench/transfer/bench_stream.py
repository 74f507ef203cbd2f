"""Buffered copies (DéjàVu Figure 9): moving a non-contiguous KV region
through a staging buffer vs one copy per block.

A 1,024-token region (64 blocks of 16) of a SmolLM2-shaped KV pool (30
layers, 3 KV heads of 64, fp32 by default) whose block ids are scattered the
way a busy pool hands them out (runs of ``--run`` consecutive ids at random
places), moved into another pool's blocks, three ways, side by side in one
process:

- ``staged``: ``engine.stream.stream_out`` into a reusable staging buffer
  (one copy per run of ids per layer range), then ``stream_in`` (one copy per
  run of the destination's ids): what a layer-wise stream does;
- ``per_block``: one copy per block, straight from pool to pool (a strided
  [L, 2, bs, kvh, hd] slice each);
- ``per_block_layer``: one copy per (block, layer), DéjàVu's unbuffered baseline.

    .venv/bin/python -m tools.bench.transfer.bench_stream [--tokens 1024] [--run 1] [--dtype float32] [--reps 50]

Prints a markdown row and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from engine.memory.kv_cache import KVCache  # noqa: E402
from engine.memory.mempool import MemPool  # noqa: E402
from engine.memory.region import Purpose, Region  # noqa: E402
from engine.stream import STAGING, stream_in, stream_out  # noqa: E402
from tools._twoproc import write_results  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402


def scattered(n: int, total: int, run: int, rng: random.Random) -> list[int]:
    """``n`` distinct ids of ``[0, total)`` in runs of ``run`` consecutive ids."""
    starts = rng.sample(range(0, total - run, run), -(-n // run))
    return [s + i for s in starts for i in range(run)][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--run", type=int, default=1, help="consecutive ids per run (1: fully scattered)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_stream.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    L, kvh, hd, bs, total = 30, 3, 64, 16, 1024
    n = args.tokens // bs
    pools, kvs = [], []
    for _ in range(2):
        kv = KVCache(L, kvh, hd, bs, device_blocks=total, dtype=dtype)
        kv.tier("device").normal_()
        kvs.append(kv)
        pools.append(MemPool(total, 0, bs, storage=kv))
    src, dst = pools
    rng = random.Random(0)
    src_ids, dst_ids = scattered(n, total, args.run, rng), scattered(n, total, args.run, rng)
    skv, dkv = kvs[0].tier("device"), kvs[1].tier("device")
    # what stream_in writes into: a region over chosen scattered ids (not
    # reserved: the benchmark picks the layout the copies meet)
    region = Region(dst, Purpose.PROMPT, (), "device", dst_ids)

    def staged() -> None:
        buf, view = STAGING.acquire((L, 2, n, bs, kvh, hd), dtype)
        stream_out(src, src_ids, (0, L), view)
        stream_in(dst, region, view, (0, L))
        STAGING.release(buf)

    def per_block() -> None:
        for s, d in zip(src_ids, dst_ids):
            dkv[:, :, d].copy_(skv[:, :, s])

    def per_block_layer() -> None:
        for s, d in zip(src_ids, dst_ids):
            for layer in range(L):
                dkv[layer, :, d].copy_(skv[layer, :, s])

    ways = {"staged": staged, "per_block": per_block, "per_block_layer": per_block_layer}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for fn in ways.values():
        fn()                            # warm: staging buffer, page faults
    for _ in range(args.reps):          # interleaved rounds: the machine is shared
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    staged()
    assert torch.equal(dkv[:, :, dst_ids], skv[:, :, src_ids])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mib = n * src.kv_layout().bytes_per_block / 2**20
    row = {"tokens": args.tokens, "blocks": n, "run": args.run, "dtype": args.dtype, "mib": round(mib, 2),
           "threads": args.threads, **{f"{k}_ms": round(v, 3) for k, v in med.items()},
           "per_block_over_staged": round(med["per_block"] / med["staged"], 2),
           "per_block_layer_over_staged": round(med["per_block_layer"] / med["staged"], 2),
           "cpu": machine_info().get("cpu_model")}
    print(f"| {row['cpu']} | {args.tokens} tokens, {mib:.1f} MiB, runs of {args.run} | staged {med['staged']:.2f} ms "
          f"| per block {med['per_block']:.2f} ms ({row['per_block_over_staged']}×) "
          f"| per block×layer {med['per_block_layer']:.2f} ms ({row['per_block_layer_over_staged']}×) |")
    write_results(args.out, [row])


if __name__ == "__main__":
    main()
