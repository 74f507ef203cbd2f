"""``kvd serve --nodes 2``: a coordinator and two node processes from one command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from .conftest import ROOT, TINY, free_port


def test_serve_with_two_local_nodes_and_sigterm(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--nodes", "2", "--port", str(port),
                             "--transport", "zmq+ipc", *TINY], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        m = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'kvd_cluster_nodes{state="routable"} 2.0' in m
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for pid in children:                                      assert not os.path.exists(f"/proc/{pid}"), f"node process {pid} outlived kvd serve"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
