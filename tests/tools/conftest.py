"""A real ``kvd serve --model tiny`` on loopback, shared by the tool tests that
drive it (kvd-loadgen, lm-evaluation-harness)."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tools._twoproc import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def kvd_server():
    """The base URL of a ``kvd serve --model tiny``; stopped with SIGTERM at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--model", "tiny",
                             "--host", "127.0.0.1", "--port", str(port)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        why = wait_healthy(url, proc, 120.0)
        if why:
            pytest.fail(f"kvd serve {why}: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
