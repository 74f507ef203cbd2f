"""Benchmark the transports between two processes: plain bytes vs protocol tensors.

For each transport (zmq+tcp, zmq+ipc, ucx if installed) and size (1, 16, 256
MiB) a client sends the payload to a server process as

  (a) plain bytes: one raw frame, the server reads its length;
  (b) a kvd.protocol KVData message with one bfloat16 tensor frame: the client
      encodes it, the server decodes it back to a torch tensor view (no copy).

and waits for a small ack, so one sample = encode + send + recv + decode + ack.
Both cases alternate sample by sample (the machine is shared and noisy) and
the table reports medians: GB/s for each and the ratio b/a (target >= 0.8:
the protocol must cost almost nothing on top of moving the bytes).

    .venv/bin/python -m tools.bench.transfer.bench_transport [--sizes 1,16,256] [--transports zmq+tcp,zmq+ipc,ucx]

The server is a fresh interpreter started with subprocess (nothing pickled):
`python -m tools.bench.transfer.bench_transport --serve URL`. Writes results/bench_transport.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

import transports  # noqa: E402
from kvd import protocol  # noqa: E402
from transports import TransportOptions  # noqa: E402

MiB = 1 << 20
OPTIONS = TransportOptions(send_timeout=60, request_timeout=60, max_frame_bytes=1 << 31)
ACK = b'{"ok":true}'


# ─── server process ──────────────────────────────────────────────────────────


async def serve(url: str) -> None:
    """Answer every message with an ack; stop on {"stop": true} or when the
    parent goes away (our stdin closes), so no server outlives its bench."""
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), lambda: sys.stdin.read() or os._exit(0))
    listener = await transports.listen(url, options=OPTIONS)
    print(listener.url, flush=True)  # the parent reads the bound address
    try:
        while True:
            incoming = await listener.recv()
            if incoming.header.startswith(b'{"stop"'):
                await listener.reply(incoming, ACK)
                return
            if incoming.header.startswith(b'{"plain"'):
                nbytes = len(incoming.frames[0])
            else:
                msg = protocol.decode(incoming.header, incoming.frames)
                if isinstance(msg, protocol.ProtocolError):
                    raise SystemExit(f"bench server: bad message {msg}")
                (kv,) = msg.as_torch()  # kv: [blocks, block_tokens, kv_dim], a view
                nbytes = kv.numel() * kv.element_size()
            await listener.reply(incoming, b'{"n":%d}' % nbytes)
    finally:
        await listener.close()


# ─── client (parent) ─────────────────────────────────────────────────────────


def start_server(url: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    bound = proc.stdout.readline().strip()
    if not bound:
        proc.kill()
        raise RuntimeError(f"bench server for {url} did not start")
    return proc, bound


async def sample_plain(conn, payload: np.ndarray) -> float:
    t0 = time.perf_counter()
    reply = await conn.request(b'{"plain":1}', [payload])
    dt = time.perf_counter() - t0
    assert reply.header == b'{"n":%d}' % payload.nbytes
    return dt


async def sample_tensor(conn, kv: torch.Tensor, seq: int) -> float:
    t0 = time.perf_counter()
    header, frames = protocol.encode(protocol.KVData(id=str(seq), transfer_id="bench", seq=seq,
                                                     layer_end=1, tensors=(kv,)))
    reply = await conn.request(header, frames)
    dt = time.perf_counter() - t0
    assert reply.header == b'{"n":%d}' % (kv.numel() * kv.element_size())
    return dt


def runs_for(size_mib: int) -> int:
    return 30 if size_mib <= 1 else 12 if size_mib <= 16 else 6


async def bench_transport(url: str, sizes: list[int]) -> list[dict]:
    proc, bound = start_server(url)
    rows = []
    conn = await transports.connect(bound, options=OPTIONS)
    try:
        for size in sizes:
            nbytes = size * MiB
            payload = np.random.default_rng(size).integers(0, 255, nbytes, dtype=np.uint8)
            # kv: [blocks, 16 tokens, kv_dim] in bfloat16, the same byte count
            kv = torch.from_numpy(payload).view(torch.bfloat16).reshape(-1, 16, 64)
            await sample_plain(conn, payload)  # warm-up: connection, page faults
            await sample_tensor(conn, kv, 0)
            plain, tensor = [], []
            for i in range(runs_for(size)):
                # Alternate in ABBA order, so drift and after-effects (the
                # previous message's buffers being freed) hit both cases alike.
                if i % 2 == 0:
                    plain.append(await sample_plain(conn, payload))
                tensor.append(await sample_tensor(conn, kv, i + 1))
                if i % 2 == 1:
                    plain.append(await sample_plain(conn, payload))
            a, b = statistics.median(plain), statistics.median(tensor)
            rows.append({"transport": url.split("://")[0], "size_mib": size, "runs": len(plain),
                         "plain_gbps": nbytes / a / 1e9, "tensor_gbps": nbytes / b / 1e9,
                         "ratio": a / b, "plain_median_ms": a * 1e3, "tensor_median_ms": b * 1e3})
            print(f"  {rows[-1]['transport']:8s} {size:4d} MiB  plain {rows[-1]['plain_gbps']:6.2f} GB/s"
                  f"  tensor {rows[-1]['tensor_gbps']:6.2f} GB/s  b/a {rows[-1]['ratio']:.2f}",
                  flush=True)
        try:
            await conn.request(b'{"stop":true}', timeout=10)
        except transports.PeerGone:
            pass    # the server closed (linger 0) before its ack left: it is stopping either way
    finally:
        await conn.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version()}
    if importlib.util.find_spec("ucxx"):
        import ucxx

        info["ucxx"] = ucxx.__version__
    return info


def markdown(rows: list[dict]) -> str:
    lines = ["| transport | size | plain bytes GB/s | KVData tensor GB/s | b/a |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['transport']} | {r['size_mib']} MiB | {r['plain_gbps']:.2f} | "
              f"{r['tensor_gbps']:.2f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    wanted = args.transports.split(",")
    if "ucx" in wanted and not importlib.util.find_spec("ucxx"):
        print("ucx: skipped (pip install 'kvd[ucx]')")
        wanted.remove("ucx")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"zmq+tcp": "zmq+tcp://127.0.0.1:0", "zmq+ipc": f"zmq+ipc://{tmp}/bench.sock",
                "ucx": "ucx://127.0.0.1:0"}
        for name in wanted:
            rows += await bench_transport(urls[name], sizes)
    result = {"benchmark": "transport", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": machine(), "target_ratio": 0.8, "rows": rows}
    out = ROOT / "results" / "bench_transport.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nmachine: {result['machine']}\n")
    print(markdown(rows))
    print(f"\nwrote {out.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,16,256", help="MiB, comma-separated")
    parser.add_argument("--transports", default="zmq+tcp,zmq+ipc,ucx")
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
