"""Shared plumbing of the two-process transfer benchmarks
(``bench_kv_transfer.py``, ``probe_transfer_floor.py``): the event loop the
daemons use, the receiver process and its address per transport, the
results file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import transports

ROOT = Path(__file__).resolve().parents[1]


def run_on_uvloop(coro: Any) -> Any:
    """Run ``coro`` on uvloop, as the node daemons run (kvd/cli.py)."""
    import uvloop  # noqa: PLC0415

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def receiver_url(transport: str, tmp: str) -> str:
    """Where a benchmark's receiver listens: a socket file in ``tmp`` for
    zmq+ipc, loopback with a free port otherwise."""
    return f"zmq+ipc://{tmp}/recv.sock" if transport == "zmq+ipc" else f"{transport}://127.0.0.1:0"


@contextlib.asynccontextmanager
async def receiver(script: str, url: str, args: list[str], options: transports.TransportOptions,
                   curve: Any = None) -> AsyncIterator[transports.Connection]:
    """Start ``python SCRIPT --serve URL ARGS...`` (it prints the address it
    bound, then serves until its stdin closes) and yield a connection to it
    (with ``curve``: transports.keys.CurveClient, authenticated); on the way
    out, close both."""
    proc = subprocess.Popen([sys.executable, script, "--serve", url, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    bound = proc.stdout.readline().strip()
    if not bound:
        proc.kill()
        raise RuntimeError(f"receiver for {url} did not start")
    try:
        conn = await transports.connect(bound, options=options, curve=curve)
        try:
            yield conn
        finally:
            await conn.close()
    finally:
        proc.stdin.close()
        proc.wait(10)


FREE_PORT_FLOOR = 20000       # free_port's ports lie between this and the kernel's ephemeral range


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999                   # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a daemon to bind
    later: a random one below the kernel's ephemeral range (the ports it hands
    to binds on port 0 and to outgoing connections, so no other process's
    daemon or client takes it meanwhile), or one from that range when none
    below it is free."""
    lo, _ = _ephemeral_range()
    rng = random.Random()                    # not the global one: tests seed it
    if lo - FREE_PORT_FLOOR >= 1000:
        for _ in range(64):
            port = rng.randrange(FREE_PORT_FLOOR, lo)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> str | None:
    """Poll ``url``/health until it answers 200: None, or why not (``proc`` exited,
    or ``timeout`` seconds passed)."""
    import urllib.request  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(0.3)
    return f"did not answer /health within {timeout:.0f} s"


def write_results(path: str | os.PathLike, rows: list[dict], **extra: Any) -> None:
    """``{"machine", "time", "rows", **extra}`` as JSON at ``path`` (its folder made)."""
    import torch  # noqa: PLC0415

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "python": platform.python_version(), "torch": torch.__version__},
                               "time": time.time(), "rows": rows, **extra}, indent=2))
    print(f"\nwrote {out}")


def stop_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, ``kill``) raise SystemExit in the main thread, so the
    ``finally`` of a benchmark that started daemons stops them (``stop_processes``)
    instead of leaving them running; only where SIGTERM still has its default action."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def stop_processes(procs: list[subprocess.Popen], grace: float = 30.0) -> None:
    """SIGTERM every process, then wait for each; one still alive after
    ``grace`` seconds is killed."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
