"""Start real ``kvd serve`` processes on loopback for HTTP tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tools._twoproc import free_port

from ..probes import kvd_metrics

ROOT = Path(__file__).resolve().parents[2]


class ServeProcess:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvd.cli", "serve", "--port", str(self.port), *args]
        self.log = open(os.devnull, "w") if not os.environ.get("KVD_TEST_LOGS") else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT if self.log else None)

    def wait_ready(self, timeout: float = 180.0) -> "ServeProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("kvd serve did not become healthy")

    def metrics(self) -> dict[str, float]:
        return kvd_metrics(self.base)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self.log.close()
        return self.proc.returncode


TINY_ARGS = ("--model", "tiny", "--dtype", "float32", "--kv-blocks", "256", "--host-kv-blocks", "64",
             "--max-model-len", "512", "--num-threads", "1")


@contextlib.contextmanager
def running_serve(*args: str) -> Iterator[ServeProcess]:
    """A healthy ``kvd serve`` with ``args``, stopped on exit (for module fixtures)."""
    s = ServeProcess(*args)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server():
    with running_serve(*TINY_ARGS) as s:
        yield s
