"""``kvd serve --model smollm2`` with ``--weights native`` (the default) and ``dequantize``:
real daemons on loopback, the official ``openai`` client, the same greedy completions."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kernels.quant_linear import host_variant
from tools._twoproc import free_port

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def start(*flags: str):
    """A ``kvd serve`` of SmolLM2 with ``flags``, started: (process, url). ``ready`` waits for it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--model", "smollm2", "--host",
                             "127.0.0.1", "--port", str(port), "--dtype", "float32", "--kv-blocks", "256",
                             "--log-level", "info", *flags],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def ready(proc, url: str) -> None:
    """Returns once ``url`` answers /health; fails the test if the daemon exits or 300 s pass."""
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            pytest.fail(f"kvd serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("kvd serve did not answer /health within 300 s")
        time.sleep(0.5)


def stop(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def completions(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
    out = []
    for p in PROMPTS:
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=24, temperature=0)
        assert r.usage.completion_tokens == 24 or r.choices[0].finish_reason == "stop"
        out.append(r.choices[0].text)
    return out


def test_native_and_dequantized_weights_serve_the_same_completions():
    # both daemons start at once (their starts overlap on the host's cores), then are asked in turn
    daemons = [start(), start("--weights", "dequantize")]       # --weights native is the default
    try:
        for proc, url in daemons:
            ready(proc, url)
        native, fp32 = (completions(url) for _, url in daemons)
    finally:
        log, _ = (stop(proc) for proc, _ in daemons)
    assert f"quantized weights ({host_variant()} kernel)" in log, log[-2000:]     # this host's build
    assert native == fp32
    assert "Paris" in native[0]


def test_a_bad_weights_value_is_refused_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--weights", "int4"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "weights must be one of native, dequantize" in proc.stderr
