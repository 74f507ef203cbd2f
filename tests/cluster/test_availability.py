"""A coordinator and 2 node processes over zmq+tcp: a coordinator that stalls
declares no live node dead, and /health tells a load balancer when no node
can serve. Tests run in file order; the last kills the nodes."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest

from .conftest import MODEL, Cluster, admin, running_cluster

NODES = ["n1", "n2"]
DEADLINE = 3.0          # conftest.HEARTBEAT


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("availability"), "zmq+tcp", NODES) as c:
        yield c


def health(c: Cluster) -> httpx.Response:
    return httpx.get(c.base + "/health", timeout=10)


def stall_by_fault(c: Cluster) -> None:
    """The coordinator's event loop busy for 1.5 deadlines (admin fault: a blocking call on it)."""
    assert admin(c.admin_socket, "fail", timeout=30, mode="stall", seconds=DEADLINE * 1.5) == {
        "ok": True, "stalled_s": DEADLINE * 1.5}


def stall_by_sigstop(c: Cluster) -> None:
    """The coordinator process paused for 1.5 deadlines."""
    c.coordinator.proc.send_signal(signal.SIGSTOP)
    time.sleep(DEADLINE * 1.5)
    c.coordinator.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("stall", [stall_by_fault, stall_by_sigstop])
def test_a_stalled_coordinator_declares_no_live_node_dead(cluster, stall):
    """With --nodes 3 a 7.5 MiB prompt froze the coordinator for 14 s and both
    live nodes were declared dead. Here the coordinator stalls for 1.5
    deadlines while streams run on both nodes."""
    client = cluster.client(timeout=120)
    stalls = admin(cluster.admin_socket, "status")["loop_stalls"]

    def stream(i: int) -> str | None:
        finish = None
        for chunk in client.completions.create(model=MODEL, prompt=f"story {i}", max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True}):
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
        return finish
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        deadline = time.monotonic() + 20
        while len(admin(cluster.admin_socket, "requests")["requests"]) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        stall(cluster)
        finishes = [f.result(timeout=120) for f in futures]
    assert finishes == ["length"] * 4
    status = admin(cluster.admin_socket, "status")
    assert status["node_failures"] == 0 and status["nodes"] == NODES
    assert status["loop_stalls"] > stalls
    assert health(cluster).status_code == 200


def test_health_is_503_while_every_node_is_draining(cluster):
    for n in NODES:
        admin(cluster.admin_socket, "drain", node=n)
    try:
        r = health(cluster)
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "unavailable" and body["error"]["code"] == "no_node_available"
        assert "draining" in body["error"]["message"]
    finally:
        for n in NODES:
            admin(cluster.admin_socket, "undrain", node=n)
    assert health(cluster).status_code == 200


def test_health_is_503_when_no_node_is_left_and_200_when_one_is_back(cluster):
    """After every node died /health said 200 {"status":"ok"} while every request got 503."""
    for n in NODES:
        cluster.nodes[n].kill9()
    for n in NODES:
        cluster.wait_gone(n, timeout=DEADLINE * 3)
    r = health(cluster)
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["status"] == "unavailable"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "no_node_available" and "none is registered" in body["error"]["message"]
    g = httpx.post(cluster.base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert g.status_code == 503
    cluster.start_node("n1")
    cluster.wait_nodes(["n1"])
    deadline = time.monotonic() + 10
    while health(cluster).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health(cluster).json() == {"status": "ok"}
