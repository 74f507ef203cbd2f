"""Operating a cluster: systemd notify, admin commands, restarts, graceful node stop.

One coordinator and two ``kvd node`` processes over zmq+tcp for the module.
The coordinator and n1 get ``$NOTIFY_SOCKET`` (a datagram socket bound here,
drained by a thread as systemd would) and a 1 s watchdog. Tests run in file
order; the destructive ones (coordinator kill -9, SIGTERM on n1) come last.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from kernels.quant_linear import host_variant
from kvd import ctl

from .conftest import MODEL, ROOT, TINY, Cluster, admin, free_port

DEADLINE = 3.0          # --heartbeat-deadline in conftest.HEARTBEAT


class NotifySocket:
    """A Unix datagram socket standing in for systemd's: records (time, fields)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, list[str]]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        # Always read: a full queue would block the daemon's sendto.
        while not self._closed:
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with self._lock:
                self.messages.append((time.monotonic(), data.decode().split("\n")))

    def fields(self, since: float = 0.0) -> list[tuple[float, str]]:
        with self._lock:
            return [(t, f) for t, fs in self.messages if t >= since for f in fs]

    def wait_for(self, prefix: str, timeout: float, since: float = 0.0) -> tuple[float, str]:
        """The first field starting with ``prefix`` received at or after ``since``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, f in self.fields(since):
                if f.startswith(prefix):
                    return t, f
            time.sleep(0.02)
        raise TimeoutError(f"no {prefix!r} on {self.path.name} within {timeout}s: {self.fields(since)[-10:]}")

    def count(self, field: str, since: float) -> int:
        return sum(f == field for _, f in self.fields(since))

    def close(self) -> None:
        self._closed = True
        self._thread.join(1)
        self.sock.close()


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ops")
    notify = {name: NotifySocket(tmp / f"{name}.notify") for name in ("coordinator", "n1")}
    with pytest.MonkeyPatch.context() as mp:   # the daemons inherit this process's environment
        mp.setenv("WATCHDOG_USEC", "1000000")
        mp.setenv("NOTIFY_SOCKET", str(notify["coordinator"].path))
        c = Cluster(tmp, "zmq+tcp")
        mp.setenv("NOTIFY_SOCKET", str(notify["n1"].path))
        c.start_node("n1")
        mp.delenv("NOTIFY_SOCKET")
        mp.delenv("WATCHDOG_USEC")
        c.start_node("n2")
    c.notify = notify
    try:
        c.wait_nodes(["n1", "n2"])
        yield c
    finally:
        c.stop()
        for n in notify.values():
            n.close()


def prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(n)]


def complete(c: Cluster, ids: list[int], max_tokens: int = 2):
    return c.client(timeout=60).completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens,
                                                   temperature=0, extra_body={"ignore_eos": True})


def routed(c: Cluster) -> dict[str, int]:
    return {n["name"]: n["routed"] for n in admin(c.admin_socket, "nodes")["nodes"]}


def kvctl(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert ctl.main(["--json", *argv]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------ sd_notify
def test_ready_after_serving_then_watchdog_and_status(ops):
    coord, n1 = ops.notify["coordinator"], ops.notify["n1"]
    coord.wait_for("READY=1", 60)
    # READY means serving: HTTP answers at once, without retries
    assert httpx.get(ops.base + "/health", timeout=2).status_code == 200
    t_ready, _ = n1.wait_for("READY=1", 60)
    registered_at_ready = [f for t, f in n1.fields() if t <= t_ready]
    assert any(f.startswith("STATUS=node n1: registering") for f in registered_at_ready)
    assert "n1" in ops.nodes_up()
    # WATCHDOG=1 every 0.5 s (half of WATCHDOG_USEC), from both daemons
    since = time.monotonic()
    time.sleep(1.8)
    assert coord.count("WATCHDOG=1", since) >= 3
    assert n1.count("WATCHDOG=1", since) >= 3
    # the engine's tier names end to end: the node's Hello and beats, the coordinator's table
    node = admin(ops.admin_socket, "nodes")["nodes"][0]
    assert set(node["blocks_per_tier"]) == set(node["free_blocks"]) == {"device", "host"}
    assert 0 < node["free_blocks"]["device"] <= node["blocks_per_tier"]["device"]
    coord.wait_for("STATUS=serving 2 nodes, 0 requests", 5)
    assert any(f.startswith("STATUS=node n1: running 0, waiting 0, free blocks") for _, f in n1.fields())


def test_kvd_serve_notifies_ready_when_healthy_and_stopping_on_sigterm(tmp_path):
    notify = NotifySocket(tmp_path / "serve.notify")
    port = free_port()
    env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"}
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--port", str(port), *TINY],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        t_ready, _ = notify.wait_for("READY=1", 60)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        assert any(f.startswith("STATUS=loading tiny") for t, f in notify.fields() if t < t_ready)
        assert any(f == "WATCHDOG=1" for t, f in notify.fields() if t < t_ready)   # while loading too
        since = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1", 5, since=since)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


# ------------------------------------------------------------------- cache
def test_cache_flush_empties_the_prefix_cache(ops, capsys):
    ids = prompt(1)
    complete(ops, ids)
    again = complete(ops, ids)                           # affinity: same node, served from its cache
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    stats = admin(ops.admin_socket, "cache stats")
    assert stats["ok"] and sorted(stats["nodes"]) == ["n1", "n2"]
    assert stats["kv"]["device"]["cached"] >= 4
    per_node = [stats["nodes"][n]["kv"]["device"]["total"] for n in ("n1", "n2")]
    assert stats["kv"]["device"]["total"] == sum(per_node) > 0      # summed over the nodes

    flushed = kvctl(capsys, "-s", str(ops.admin_socket), "cache", "flush")
    assert flushed["errors"] == [] and flushed["freed"]["device"] >= 4
    for name in ("n1", "n2"):
        kv = admin(ops.node_admin(name), "cache stats")["kv"]
        assert kv["device"]["cached"] == 0 and kv["host"]["cached"] == 0
        assert kv["device"]["free"] == kv["device"]["total"]
    after = complete(ops, ids)
    assert after.usage.prompt_tokens_details.cached_tokens == 0

    # one node, through the coordinator and on its own socket
    complete(ops, ids)
    one = admin(ops.admin_socket, "cache flush", node="n1")
    assert one["ok"] and list(one["nodes"]) == ["n1"]
    assert admin(ops.node_admin("n2"), "cache flush")["ok"]
    assert complete(ops, ids).usage.prompt_tokens_details.cached_tokens == 0


def test_admin_commands_validate_their_arguments(ops):
    bad = [
        (ops.admin_socket, "fail", {"node": "n1", "mode": "explode"}, "fail mode must be one of"),
        (ops.admin_socket, "fail", {"node": "n9", "mode": "stop"}, "unknown node 'n9'"),
        (ops.admin_socket, "fail", {"mode": "stop"}, "node"),
        (ops.admin_socket, "drain", {"node": 3}, "must be str"),
        (ops.admin_socket, "undrain", {"node": "n9"}, "unknown node"),
        (ops.admin_socket, "cache flush", {"node": "n9"}, "unknown node"),
        (ops.admin_socket, "cache stats", {"bogus": 1}, "bogus"),
        (ops.admin_socket, "log-level", {"level": "loud"}, "level must be one of"),
        (ops.node_admin("n1"), "fail", {"mode": "explode"}, "fail mode must be one of"),
        (ops.node_admin("n1"), "cache flush", {"node": "n1"}, "node"),
        (ops.node_admin("n1"), "transfer", {"to": "n2", "address": "zmq+tcp://127.0.0.1:1",
                                            "token_ids": [1, -2]}, "non-negative"),
    ]
    for sock, cmd, args, message in bad:
        reply = admin(sock, cmd, **args)
        assert reply["ok"] is False and message in reply["error"], (cmd, args, reply)
    # and the daemons still serve
    assert admin(ops.admin_socket, "status")["nodes"] == ["n1", "n2"]
    assert admin(ops.node_admin("n1"), "log-level", level="debug", logger="kvd.node")["ok"]
    assert admin(ops.node_admin("n1"), "log-level", level="info", logger="kvd.node")["previous"] == "debug"
    assert sorted(admin(ops.admin_socket, "requests")["requests"]) == []


def test_cluster_drain_refuses_new_requests_and_undrain_restores(ops, capsys):
    assert kvctl(capsys, "-s", str(ops.admin_socket), "drain") == {"ok": True, "draining": "cluster"}
    try:
        with pytest.raises(openai.APIStatusError) as err:
            complete(ops, prompt(2))
        assert err.value.status_code == 503
        assert httpx.get(ops.base + "/health", timeout=2).status_code == 503
        assert admin(ops.admin_socket, "status")["draining"] is True
        ops.notify["coordinator"].wait_for("STATUS=serving 2 nodes, 0 requests, draining", 5)
    finally:
        kvctl(capsys, "-s", str(ops.admin_socket), "undrain")
    assert complete(ops, prompt(2)).usage.completion_tokens == 2
    assert httpx.get(ops.base + "/health", timeout=2).status_code == 200


def test_drop_transfers_refuses_kv_transfers_until_resume(ops):
    ids = prompt(3)
    before = routed(ops)
    complete(ops, ids)
    src = next(n for n, v in routed(ops).items() if v > before.get(n, 0))
    dst = "n2" if src == "n1" else "n1"
    transfer = {"to": dst, "address": ops.node_urls[dst], "token_ids": ids}

    assert admin(ops.admin_socket, "fail", node=dst, mode="drop-transfers")["mode"] == "drop-transfers"
    status = admin(ops.node_admin(dst), "status")
    assert status["drop_transfers"] is True
    # what computes each part of a step, for the operator (tiny: float weights)
    assert status["kernels"]["weights"] == "float" and status["kernels"]["matmul"] == "torch"
    assert status["kernels"]["attention"] == (host_variant() or "torch")
    refused = admin(ops.node_admin(src), "transfer", **transfer)
    assert refused["ok"] and refused["transferred"] is False and "drops KV transfers" in refused["reason"]
    assert admin(ops.node_admin(dst), "status")["transfers"]["dropped"] == 1
    # a dropping node does not send either
    out = admin(ops.node_admin(dst), "transfer", to=src, address=ops.node_urls[src], token_ids=ids)
    assert out["ok"] is False and "drops KV transfers" in out["error"]

    assert admin(ops.admin_socket, "fail", node=dst, mode="resume")["ok"]
    done = admin(ops.node_admin(src), "transfer", **transfer)
    assert done["ok"] and done["transferred"] is True and done["inserted_tokens"] > 0
    # both nodes still serve (the refused allocation, if any, was not leaked)
    assert admin(ops.node_admin(dst), "cache stats")["kv"]["device"]["cached"] >= 4


# ------------------------------------------------------------ restarts, stop
def test_coordinator_kill9_and_restart_nodes_rejoin_within_the_deadline(ops):
    coord = ops.notify["coordinator"]
    ops.coordinator.kill9()
    since = time.monotonic()
    os.environ["NOTIFY_SOCKET"] = str(coord.path)          # the new process reports here too
    try:
        ops.coordinator.start()                            # same registration address, port, socket
    finally:
        del os.environ["NOTIFY_SOCKET"]
    t_ready, _ = coord.wait_for("READY=1", 60, since=since)
    while set(ops.nodes_up()) != {"n1", "n2"}:
        assert time.monotonic() - t_ready < DEADLINE, ops.nodes_up()
        time.sleep(0.05)
    rejoined = time.monotonic() - t_ready
    assert rejoined < DEADLINE
    for i in range(4):
        assert complete(ops, prompt(10 + i)).usage.completion_tokens == 2
    assert sum(routed(ops).values()) == 4


def test_sigterm_on_a_node_drains_it_says_goodbye_and_routing_stops_at_once(ops):
    n1 = ops.notify["n1"]
    admin(ops.admin_socket, "drain", node="n2")            # so the long request runs on n1
    result: dict = {}

    def long_stream() -> None:
        finish = None
        for chunk in ops.client(timeout=60).completions.create(
                model=MODEL, prompt=prompt(20, 16), max_tokens=480, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        result.update(finish=finish)

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not admin(ops.admin_socket, "requests")["requests"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert [r["node"] for r in admin(ops.admin_socket, "requests")["requests"].values()] == ["n1"]
    finally:
        admin(ops.admin_socket, "undrain", node="n2")
    before = routed(ops)
    failures = admin(ops.admin_socket, "status")["node_failures"]
    since = time.monotonic()
    ops.nodes["n1"].proc.terminate()
    n1.wait_for("STOPPING=1", 5, since=since)
    n1.wait_for("STATUS=node n1: draining 1 request", 1, since=since)
    # the coordinator stops routing to n1 within one beat: new requests go to n2
    deadline = time.monotonic() + 1.0
    while not next(n for n in admin(ops.admin_socket, "nodes")["nodes"] if n["name"] == "n1")["draining"]:
        assert time.monotonic() < deadline, "n1 still routable after SIGTERM"
        time.sleep(0.02)
    assert result == {}, "the long request should still be running"
    for i in range(3):
        assert complete(ops, prompt(30 + i)).usage.completion_tokens == 2
    after = routed(ops)
    assert after["n1"] == before["n1"] and after["n2"] == before["n2"] + 3
    # the in-flight request finishes, then n1 says Goodbye and exits 0
    t.join(60)
    assert result["finish"] == "length"
    assert ops.nodes["n1"].proc.wait(30) == 0
    assert "n1" not in ops.nodes_up()                      # Goodbye: gone now, not after the deadline
    assert admin(ops.admin_socket, "status")["node_failures"] == failures
