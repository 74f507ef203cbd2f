"""When the engine thread dies: the driver fails everything at once, and the
embedded ``kvd serve`` says so (/health 503 ``engine_dead``, 503 to open and
new requests, the cause in ``kvctl status``) and exits with status 3 for
systemd to restart it. The death is injected as an operator would
(``kvctl fail n0 --mode engine``), never by a client."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from engine.request import SamplingParams
from kvd.engine_client import EngineDead
from kvd.supervisor import ENGINE_DEAD_EXIT
from tools._twoproc import free_port

from ..probes import admin
from .conftest import ROOT
from .test_engine_driver import driver, hold_steps, start_request  # noqa: F401  (fixture)


async def test_a_dead_engine_thread_ends_every_stream_call_and_request(driver):
    """The thread raises after the step under way: its owner hears first
    (``on_dead``, with the stream still open), then the stream, a call queued
    behind the fault and every later request end with EngineDead naming the
    exception, at once rather than at a deadline."""
    heard = []
    driver.on_dead = lambda exc: heard.append((repr(exc), driver.num_in_flight()))
    in_step, release = hold_steps(driver)
    stream, first = start_request(driver)
    assert await asyncio.to_thread(in_step.wait, 10)
    dying = asyncio.ensure_future(driver.inject_failure("boom", timeout=10))
    await asyncio.sleep(0)                               # the fault is queued
    queued_call = asyncio.ensure_future(driver.call(lambda engine: "ran", timeout=30))
    await asyncio.sleep(0)                               # queued behind it (the step holds the lock)
    release.set()
    state = await dying
    assert state == {"state": "dead", "error": "InjectedFault: boom"}
    assert heard == [("InjectedFault('boom')", 1)]
    with pytest.raises(EngineDead, match="InjectedFault: boom"):    # the stream ends there
        await first
        await anext(stream)
    with pytest.raises(EngineDead, match="InjectedFault: boom"):
        await asyncio.wait_for(queued_call, 5)
    with pytest.raises(EngineDead, match="InjectedFault: boom"):
        await anext(driver.generate("later", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0)))
    assert "InjectedFault: boom" in driver.unavailable()
    assert driver.stats()["engine"] == state
    with pytest.raises(EngineDead):                      # nothing left to kill
        await driver.inject_failure("again", timeout=1)


# ------------------------------------------------------------ kvd serve
TINY = ("--model", "tiny", "--dtype", "float32", "--kv-blocks", "256", "--host-kv-blocks", "64",
        "--max-model-len", "2048", "--num-threads", "1")
LONG = 1900          # tokens of a stream that is still running when the fault is injected


def test_kvd_serve_with_a_dead_engine_answers_503_engine_dead_and_exits_3(tmp_path):
    """The issue: after the engine thread died, every request answered 400
    ``invalid_request_error`` "engine stopped" while /health said 200, and
    the process served nothing until an operator noticed. Now the stream in
    flight ends with an ``engine_dead`` error event, /health and new requests
    answer 503 ``engine_dead`` naming the cause, ``status`` names it too, and
    the server drains and exits with status 3. A request whose body is still
    arriving holds the drain open here, so the 503s can be asked for while
    the process still listens; it gets its own 503 when its body is in."""
    sock = tmp_path / "coordinator.sock"
    config = tmp_path / "kvd.toml"
    config.write_text(f'[cluster]\nadmin_socket = "{sock}"\n')
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "-c", str(config), "--port", str(port),
                                 "--drain-timeout", "60", *TINY], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        held_body = json.dumps({"model": "tiny", "prompt": "held", "max_tokens": 2}).encode()
        held = socket.create_connection(("127.0.0.1", port), timeout=30)
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(held_body) + held_body[:5])
        body = {"model": "tiny", "prompt": "a long one", "max_tokens": LONG, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
            reply = admin(sock, "fail", timeout=30, node="n0", mode="engine")
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert reply["ok"] and reply["engine"] == {
            "state": "dead", "error": "InjectedFault: fault injection (admin fail --mode engine)"}, reply
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["code"], error["type"]) == ("engine_dead", "service_unavailable"), error
        assert "InjectedFault" in error["message"]
        assert len(events) - 2 < LONG                    # it ended there, not after its tokens

        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["status"] == "engine_dead"
        assert health.json()["error"]["code"] == "engine_dead"
        assert "InjectedFault" in health.json()["error"]["message"]
        new = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                         timeout=10)
        assert new.status_code == 503, new.text
        assert (new.json()["error"]["code"], new.json()["error"]["type"]) == ("engine_dead", "service_unavailable")
        status = admin(sock, "status", timeout=30)
        assert status["engine"] == reply["engine"], status
        assert proc.poll() is None                       # the held request holds the drain open

        held.sendall(held_body[5:])
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = held.recv(65536)
            if not chunk:
                break
            answer += chunk
        held.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b'"code":"engine_dead"' in answer, answer
        assert proc.wait(60) == ENGINE_DEAD_EXIT, log_path.read_text()[-3000:]
        assert "kvd: error: the engine died: InjectedFault" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
