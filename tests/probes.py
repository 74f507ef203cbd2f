"""Blocking probes a test makes on a running daemon: one request on its
admin Unix socket, one scrape of its ``/metrics``."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx


def admin(path: str | Path, cmd: str, timeout: float = 15.0, **args) -> dict:
    """One line-delimited JSON request on an admin Unix socket; the reply object."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


def kvd_metrics(base: str) -> dict[str, float]:
    """The ``kvd_*`` samples of ``base``/metrics, keyed by name and labels."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvd_") and " " in line:
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
