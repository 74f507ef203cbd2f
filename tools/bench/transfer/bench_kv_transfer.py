"""Benchmark KV transfer between two node processes vs plain bytes, per transport.

For each transport (zmq+tcp, zmq+ipc, ucx if installed) and size (1, 16, 256
MiB of KV) this process (the sender) holds an LLMEngine whose radix tree caches
a prefix of that many bytes of KV, and a receiver process holds another
engine. One sample is

  (a) plain: the same number of bytes as ONE raw frame in a request, the
      receiver acks (one round trip, nothing else);
  (b) transfer: ``kvd.node.transfer.send_prefix`` — the MemServe steps for
      real: allocation request -> KVAllocReply (the receiver's grant, bound
      to this link), then layer chunks of ~CHUNK_BYTES (<= num_layers of
      them; ONE for payloads up to WHOLE_MAX_BYTES, 32 MiB) sent without waiting, each
      imported on arrival (a copy per frame and run of block ids, from the
      received frames), the last inserts -> KVAck. Frames are views of the
      sender's pool (one per layer, K|V and run of blocks) when a run's slice
      is >= 64 KiB (16 and 256 MiB here), else gathered into a reused
      staging buffer (1 MiB = one block here). Afterwards the receiver drops
      the blocks again (not timed), so every sample moves everything.

Both alternate sample by sample (shared, noisy machine); the table reports
medians in GB/s, the ratio b/a (target >= 0.8) and the sends per transfer
(must be O(layers) at most: 1 + chunks). The receiver serves transfer
messages as the node daemon does (an allocation or a KVData right away when
its engine is idle, else in a task of its own; on uvloop), and its KV pool is made
resident first (as a serving node's is).
``--chunk-mib`` overrides the chunk size; ``--threads`` sets torch threads
per process (default 1: two processes share the host's cores; a node with
more torch threads never runs transfer work inline on its event loop, see
``EngineDriver``). ``--keys`` authenticates the link as the daemons do by
default (zmq: CURVE, which also encrypts every byte; ucx: the handshake
only), so both columns pay for it.

The KV model: the tiny Llama widened to 16 layers x 8 KV heads x 64 dims in
float32 (64 KiB per token) so that 256 MiB is 4096 tokens (the token ids
travel in the allocation request's JSON header).

    .venv/bin/python -m tools.bench.transfer.bench_kv_transfer [--sizes 1,16,256] [--transports zmq+tcp,zmq+ipc,ucx]

Writes results/bench_kv_transfer.json; prints markdown rows.
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
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import transports  # noqa: E402
from tools._twoproc import receiver, receiver_url, run_on_uvloop, write_results  # noqa: E402
from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model.config import tiny_config  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402
from engine.model.registry import resolve_model  # noqa: E402
from engine.model.weights import random_weights  # noqa: E402
from kvd import protocol  # noqa: E402
from kvd.node.engine_driver import EngineDriver  # noqa: E402
from kvd.node.inbox import KVInbox  # noqa: E402
from kvd.node.transfer import send_prefix  # noqa: E402
from transports import TransportOptions  # noqa: E402

MiB = 1 << 20
BLOCK = 16
TUNING: dict = {}      # send_prefix(chunk_bytes=) from the command line
THREADS = {"n": 1}     # torch threads per process (--threads)
OPTIONS = TransportOptions(send_timeout=120, request_timeout=120, max_frame_bytes=1 << 31)


def bench_engine(num_blocks: int) -> LLMEngine:
    cfg = replace(tiny_config(), num_layers=16, num_heads=8, num_kv_heads=8, head_dim=64)
    weights = random_weights(cfg, seed=0)
    model = LlamaModel(cfg, weights.tensors, dtype=torch.float32)
    econf = EngineConfig(model="tiny", dtype="float32", block_size=BLOCK, kv_blocks=num_blocks,
                         host_kv_blocks=0, max_model_len=2048, num_threads=THREADS["n"])
    return LLMEngine(econf, model, resolve_model("tiny").load_tokenizer(), "bench")


def bytes_per_block(engine: LLMEngine) -> int:
    return engine.pool.kv_layout().bytes_per_block


def _block_batch(engine: LLMEngine, n: int) -> tuple[int, ...]:
    """The shape of ``n`` blocks' KV: [L, 2, n, bs, kvh, hd]."""
    L, two, bs, kvh, hd = engine.pool.kv_layout().block_shape
    return (L, two, n, bs, kvh, hd)


def drop_cache(engine: LLMEngine) -> int:
    """Evict every cached block (engine thread). Returns how many."""
    return sum(engine.pool.flush().values())


# ─── receiver process ───────────────────────────────────────────────────────


async def serve(url: str, num_blocks: int, keys: str | None = None) -> None:
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), lambda: sys.stdin.read() or os._exit(0))
    engine = bench_engine(num_blocks)
    # a serving node's KV pool is resident; a fresh (calloc'd, untouched) pool
    # would charge first-touch page faults to whichever transfer lands first
    ids = engine.pool.alloc_mem(num_blocks)
    engine.pool.write_blocks(ids, torch.zeros(*_block_batch(engine, num_blocks)))
    engine.pool.free_mem(ids)
    driver = EngineDriver(engine)
    await driver.start()
    inbox = KVInbox(driver, transfer_timeout=60.0, request_timeout=60.0)
    listener = await transports.listen(url, options=OPTIONS, curve=_server_keys(keys) if keys else None)
    print(listener.url, flush=True)
    tasks: set[asyncio.Task] = set()

    async def reply_later(incoming, msg) -> None:
        # as the node daemon does (_reply_later): a task per transfer message the
        # engine cannot take at once, so later chunks are received meanwhile
        if not isinstance(msg, (protocol.KVTransferRequest, protocol.KVData)):
            raise SystemExit(f"bench receiver: unexpected {msg}")
        reply = await inbox.answer(msg, incoming)       # the region's link: the asking one
        await listener.reply(incoming, *protocol.encode(reply))

    while True:
        incoming = await listener.recv()
        if incoming.header.startswith(b'{"plain"'):
            await listener.reply(incoming, b'{"n":%d}' % len(incoming.frames[0]))
            continue
        if incoming.header.startswith(b'{"drop"'):
            n = await driver.call(drop_cache)
            await listener.reply(incoming, b'{"dropped":%d}' % n)
            continue
        msg = protocol.decode(incoming.header, incoming.frames)
        # as the node daemon: an idle engine answers right here, no task
        ack = inbox.answer_now(msg, incoming) if isinstance(msg, (protocol.KVData, protocol.KVTransferRequest)) else None
        if ack is not None:
            await listener.reply(incoming, *protocol.encode(ack))
            continue
        task = asyncio.create_task(reply_later(incoming, msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def _server_keys(keys: str):
    from transports.keys import CurveServer, KeyDirectory, load_secret_keypair

    return CurveServer(*load_secret_keypair(Path(keys) / "receiver.key_secret"), KeyDirectory(keys))


def _client_keys(keys: str):
    from transports.keys import CurveClient, load_keypair, load_secret_keypair

    return CurveClient(*load_secret_keypair(Path(keys) / "sender.key_secret"),
                       server_key=load_keypair(Path(keys) / "receiver.key")[0])


# ─── sender (this process) ──────────────────────────────────────────────────


def cache_prefix(engine: LLMEngine, tokens: list[int]) -> None:
    """Make ``tokens`` a cached prefix with random KV (engine thread)."""
    n = len(tokens) // BLOCK
    ids = engine.pool.alloc_mem(n)
    engine.pool.write_blocks(ids, torch.randn(*_block_batch(engine, n)))
    engine.pool.insert(tokens, ids)


async def bench_transport(url: str, sizes: list[int], driver: EngineDriver, runs: dict[int, int],
                          keys: str | None = None) -> list[dict]:
    max_blocks = max(sizes) * MiB // bytes_per_block(driver.engine) + 8
    rows = []
    args = ["--blocks", str(max_blocks), "--threads", str(THREADS["n"])] + (["--keys-dir", keys] if keys else [])
    async with receiver(str(Path(__file__).resolve()), url, args, OPTIONS,
                        curve=_client_keys(keys) if keys else None) as conn:
        for size in sizes:
            nblocks = size * MiB // bytes_per_block(driver.engine)
            tokens = [(size * 7919 + i) % 40000 + 1 for i in range(nblocks * BLOCK)]
            await driver.call(lambda e: cache_prefix(e, tokens))
            payload = bytearray(nblocks * bytes_per_block(driver.engine))
            plain, xfer, sends, frames = [], [], set(), set()
            for i in range(runs[size] + 1):         # sample 0 is a warm-up
                t0 = time.perf_counter()
                reply = await conn.request(b'{"plain":1}', [payload])
                dt_plain = time.perf_counter() - t0
                assert reply.header == b'{"n":%d}' % len(payload)
                res = await send_prefix(driver, conn, tokens, src_node="bench-a", dst_node="bench-b",
                                        timeout=120, **TUNING)
                assert res["transferred"] and res["sent_blocks"] == nblocks, res
                await conn.request(b'{"drop":1}')
                if i:
                    plain.append(dt_plain)
                    xfer.append(res["seconds"])
                    sends.add(res["sends"])
                    frames.add("pool pieces" if res["zero_copy"] else "staged")
            nbytes = len(payload)
            p, x = statistics.median(plain), statistics.median(xfer)
            rows.append({"transport": url.split("://")[0], "keys": bool(keys), "size_mib": size, "bytes": nbytes,
                         "blocks": nblocks, "layers": driver.engine.pool.kv_layout().num_layers, "runs": runs[size],
                         "plain_gbps": nbytes / p / 1e9, "transfer_gbps": nbytes / x / 1e9,
                         "ratio": p / x, "sends_per_transfer": max(sends),
                         "frames": "/".join(sorted(frames)),
                         "plain_ms": p * 1e3, "transfer_ms": x * 1e3})
            await driver.call(drop_cache)
            print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict) -> str:
    return (f"| {r['transport']}{' (keys)' if r.get('keys') else ''} | {r['size_mib']} | {r['plain_gbps']:.2f} | {r['transfer_gbps']:.2f} "
            f"| {r['ratio']:.2f} | {r['sends_per_transfer']} (blocks {r['blocks']}, layers {r['layers']}) "
            f"| {r['frames']} |")


async def main_async(args) -> list[dict]:
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [t for t in args.transports.split(",") if t != "ucx" or importlib.util.find_spec("ucxx")]
    max_blocks = max(sizes) * MiB // (16 * 2 * BLOCK * 8 * 64 * 4) + 8
    driver = EngineDriver(bench_engine(max_blocks))
    await driver.start()
    runs = {s: args.runs or (20 if s <= 1 else 10 if s <= 16 else 5) for s in sizes}
    print("| transport | MiB | plain GB/s | KV transfer GB/s | ratio | sends per transfer | frames |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    tmp = tempfile.mkdtemp(prefix="kvd-bench-")
    keys = None
    if args.keys:
        from transports.keys import generate_keypair

        keys = os.path.join(tmp, "keys")
        for name in ("sender", "receiver"):
            generate_keypair(keys, name)
    try:
        for name in names:
            url = receiver_url(name, tmp)
            rows += await bench_transport(url, sizes, driver, runs, keys)
    finally:
        await driver.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,256")
    ap.add_argument("--transports", default="zmq+tcp,zmq+ipc,ucx")
    ap.add_argument("--runs", type=int, default=0, help="samples per size (default 20/10/5)")
    ap.add_argument("--chunk-mib", type=float, help="streamed chunk size target")
    ap.add_argument("--keys", action="store_true",
                    help="authenticate the link as the daemons do (zmq: CURVE, ucx: the handshake)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--keys-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_kv_transfer.json"))
    args = ap.parse_args()
    THREADS["n"] = args.threads
    torch.set_num_threads(args.threads)
    if args.serve:
        run_on_uvloop(serve(args.serve, args.blocks, args.keys_dir))
        return
    if args.chunk_mib is not None:
        TUNING["chunk_bytes"] = int(args.chunk_mib * MiB)
    rows = run_on_uvloop(main_async(args))
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
