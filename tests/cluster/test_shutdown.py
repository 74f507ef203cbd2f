"""Shutdown of every process shape, with real signals and real streams (tiny model).

The contract (docs/operations.md, "Shutdown"): after SIGTERM a daemon drains
for ``drain_timeout`` seconds; what is still open then is ended -- at the
front door every stream with a final OpenAI-shaped error event (code
``shutdown``) and ``data: [DONE]``, every other request with a 503 -- and the
process exits shortly after. A second signal ends the drain at once. Shapes:
``kvd serve`` (embedded), ``kvd serve --nodes 2``, ``kvd coordinator`` and
``kvd node``. Each test counts its slack generously (the machine is shared);
the defect it guards against overran by two minutes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from .conftest import HEARTBEAT, MODEL, TINY, Cluster, Proc, admin, free_port

SLACK_S = 6.0          # exit after drain_timeout: END_GRACE_S + HTTP close + node stop, on a busy machine
MAX_TOKENS = 1900      # the tiny model's context allows no more: the tests run several streams
                       # at once, so every request is still running when it is ended


class Request(threading.Thread):
    """One HTTP request in a thread: its status, SSE events (or JSON body), when it ended."""

    def __init__(self, base: str, prompt: str, stream: bool = True) -> None:
        super().__init__(daemon=True)
        self.url = base + "/v1/completions"
        self.body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                     "stream": stream}
        self.started = threading.Event()       # the 200 and a first event arrived (or it failed)
        self.status: int | None = None
        self.events: list[str] = []
        self.json: dict | None = None
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=180) as r:
                self.status = r.status_code
                if not self.body["stream"] or r.status_code != 200:
                    self.json = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def ended_with(self, code: str) -> bool:
        """True if the stream never finished normally and its last events are an
        error with ``code``, then ``[DONE]`` (asserts otherwise)."""
        assert self.ended_at is not None, "still streaming"
        assert self.error is None, repr(self.error)
        assert self.status == 200 and len(self.events) >= 3, (self.status, self.events[-3:])
        assert self.events[-1] == "[DONE]", self.events[-3:]
        error = json.loads(self.events[-2])["error"]
        assert (error["code"], error["type"]) == (code, "service_unavailable"), error
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in self.events[:-2])
        return True


def open_streams(base: str, n: int) -> list[Request]:
    streams = [Request(base, f"stream {i}") for i in range(n)]
    for r in streams:
        assert r.started.wait(60), "a stream did not start"
        assert r.status == 200 and r.error is None, (r.status, r.error, r.json)
    return streams


def serve(tmp, *args: str) -> tuple[Proc, str]:
    """``kvd serve ARGS`` (tiny model), healthy; (process, base URL)."""
    port = free_port()
    proc = Proc("serve", [sys.executable, "-m", "kvd.cli", "serve", "--port", str(port), *TINY,
                          "--max-num-seqs", "48", *args], tmp)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.alive(), proc.log_text()[-3000:]
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, proc.log_text()[-3000:]
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                           text=True).stdout.split()]


def alive_pid(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except OSError:
        return False


def sigterm_and_check(proc: Proc, base: str, streams: list[Request], drain_timeout: float,
                      plain: Request | None = None) -> float:
    """SIGTERM; the drain refuses new work and lets the streams run, then ends
    them with a "shutdown" error event at drain_timeout; returns the exit time."""
    t0 = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert httpx.get(base + "/health").status_code == 503
    late = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    assert all(r.ended_at is None for r in streams)              # the drain lets them run on...
    code = proc.proc.wait(drain_timeout + SLACK_S)                # ...until drain_timeout, then exits
    exited = time.monotonic() - t0
    for r in [*streams, *([plain] if plain else [])]:
        r.join(5)
    assert code == 0, proc.log_text()[-3000:]
    assert all(r.ended_with("shutdown") for r in streams)
    assert all(r.ended_at - t0 >= drain_timeout for r in streams)
    if plain is not None:
        assert plain.status == 503 and plain.json["error"]["code"] == "shutdown", (plain.status, plain.json)
    assert drain_timeout <= exited < drain_timeout + SLACK_S
    return exited


def test_serve_ends_what_is_open_at_drain_timeout_and_exits(tmp_path):
    proc, base = serve(tmp_path, "--drain-timeout", "3")
    try:
        streams = open_streams(base, 40)
        plain = Request(base, "not streamed", stream=False)
        time.sleep(0.5)                                           # it reached the engine
        sigterm_and_check(proc, base, streams, 3.0, plain)
    finally:
        proc.stop()


def test_serve_second_signal_ends_the_drain_at_once(tmp_path):
    proc, base = serve(tmp_path, "--drain-timeout", "120")
    try:
        streams = open_streams(base, 8)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        sdk_stream = client.completions.create(model=MODEL, prompt="openai client", max_tokens=MAX_TOKENS,
                                               stream=True, extra_body={"ignore_eos": True})
        next(iter(sdk_stream))
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.alive() and all(r.ended_at is None for r in streams)       # draining
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(SLACK_S) == 0
        assert time.monotonic() - t0 < SLACK_S
        for r in streams:
            r.join(5)
        assert all(r.ended_with("shutdown") for r in streams)
        # the openai client raises the final error event as an APIError
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in sdk_stream:
                pass
    finally:
        proc.stop()


def test_serve_nodes_ends_what_is_open_at_drain_timeout_and_stops_its_nodes(tmp_path):
    proc, base = serve(tmp_path, "--nodes", "2", "--drain-timeout", "3", *HEARTBEAT)
    try:
        nodes = children(proc.proc.pid)
        assert len(nodes) == 2
        streams = open_streams(base, 16)
        sigterm_and_check(proc, base, streams, 3.0)
        assert children(proc.proc.pid) == [] and not any(alive_pid(pid) for pid in nodes)
    finally:
        proc.stop()


def test_coordinator_ends_what_is_open_at_drain_timeout_and_aborts_it_on_the_node(tmp_path):
    c = Cluster(tmp_path, extra=("--drain-timeout", "2"))
    try:
        c.start_node("n1")
        c.wait_nodes(["n1"])
        streams = open_streams(c.base, 6)
        assert len(admin(c.node_admin("n1"), "requests")["requests"]) == 6
        sigterm_and_check(c.coordinator, c.base, streams, 2.0)
        # the node was told: what the front door ended does not run on there
        deadline = time.monotonic() + 5
        while admin(c.node_admin("n1"), "requests")["requests"]:
            assert time.monotonic() < deadline, admin(c.node_admin("n1"), "requests")
            time.sleep(0.1)
        assert c.nodes["n1"].alive()
    finally:
        c.stop()


def test_node_honours_its_drain_timeout_and_a_second_signal(tmp_path):
    c = Cluster(tmp_path)
    try:
        # n1 drains for 2 s: its streams are given up then, and the clients are told. Eight
        # streams, not one: a lone stream of the tiny model can finish its MAX_TOKENS within
        # the 2 s on a fast host (the node then exits early, as it should)
        c.start_node("n1", "--drain-timeout", "2")
        c.wait_nodes(["n1"])
        streams = open_streams(c.base, 8)
        t0 = time.monotonic()
        c.nodes["n1"].proc.send_signal(signal.SIGTERM)
        assert c.nodes["n1"].proc.wait(2 + SLACK_S) == 0
        assert 2.0 <= time.monotonic() - t0 < 2 + SLACK_S
        for stream in streams:
            stream.join(5)
            assert stream.ended_with("engine_dead") and stream.ended_at - t0 >= 2.0
        # n2 would drain for 120 s: a second signal ends the drain at once
        c.start_node("n2", "--drain-timeout", "120")
        c.wait_nodes(["n2"])
        streams = open_streams(c.base, 8)
        c.nodes["n2"].proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert c.nodes["n2"].alive() and all(r.ended_at is None for r in streams)   # draining
        t0 = time.monotonic()
        c.nodes["n2"].proc.send_signal(signal.SIGTERM)
        assert c.nodes["n2"].proc.wait(SLACK_S) == 0
        assert time.monotonic() - t0 < SLACK_S
        for stream in streams:
            stream.join(5)
            assert stream.ended_with("engine_dead")
    finally:
        c.stop()
