"""A pair's redundant copies under memory pressure, over real daemons
(docs/cluster.md, "Pairs and roles"): a copy sits in the partner's device
tier while it has room, and is the first thing the partner gives up when
its own request needs the blocks (no preemption, no wait for the copy's
request to end); the coordinator hands the request whose copy was given up
to nobody until its copy is rebuilt; every text stays exact (greedy)."""

from __future__ import annotations

import pytest

from .conftest import Cluster, admin
from .test_pairs import Stream, expected, in_flight, nodes, until

# n2: 40 device blocks (the copy of n1's request and n2's own request do not fit together) and a
# host tier too small for the copy (once given up, it cannot be rebuilt until n2's request ends)
N1 = ("--replication-interval", "0.05", "--pair", "n2")
N2 = ("--replication-interval", "0.05", "--pair", "n1", "--kv-blocks", "40", "--host-kv-blocks", "8")
PROMPT = 320                      # 20 blocks of 16
LONG, SHORT = 180, 24             # prompt + LONG within the reference engine's context (512)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("pairmem"), "zmq+tcp", extra=("--recovery", "replica"))
    c.start_node("n1", *N1)
    c.start_node("n2", *N2)
    try:
        c.wait_nodes(["n1", "n2"])
        yield c
    finally:
        c.stop()


def ids(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 1 for i in range(PROMPT)]


def holder(c: Cluster, node: str) -> dict:
    return admin(c.node_admin(node), "status")["replication"]["holder"]


def test_own_work_takes_the_copys_device_blocks_and_the_copy_is_not_handed_off(pair, reference_engine):
    greedy = {"temperature": 0.0}
    want = expected(reference_engine, [ids(1)], [greedy], LONG)[0], \
        expected(reference_engine, [ids(2)], [greedy], SHORT)[0]
    assert admin(pair.admin_socket, "set-role", node="n2", role="decode")["ok"]       # the first prompt: n1
    first = Stream(pair, ids(1), None, LONG)
    rid = until(lambda: next(iter(in_flight(pair)), None))
    until(lambda: holder(pair, "n2")["device_blocks"] >= PROMPT // 16)               # its copy, on n2's device
    assert admin(pair.admin_socket, "set-role", node="n2", role="mixed")["ok"]
    assert admin(pair.admin_socket, "set-role", node="n1", role="decode")["ok"]       # the second prompt: n2
    second = Stream(pair, ids(2), None, SHORT)
    # n2 gives the copy up for its own request; the copy cannot come back while that one runs
    until(lambda: holder(pair, "n2")["reclaimed"] >= 1, 30)
    if first.is_alive() and second.is_alive():
        reply = admin(pair.admin_socket, "handoff", request=rid)
        assert not reply["ok"] and "incomplete" in reply["error"], reply
    second.join(60)
    first.join(60)
    assert (first.error, second.error) == (None, None)
    assert "".join(first.text) == want[0] and "".join(second.text) == want[1]
    st = holder(pair, "n2")
    assert st["reclaimed_blocks"] >= PROMPT // 16, st
    shown = until(lambda: (c := nodes(pair)["n2"]["copies"])["reclaimed"] >= 1 and c, 10)     # its next heartbeat
    assert shown["reclaimed_blocks"] == st["reclaimed_blocks"], (shown, st)
    metrics = pair.metrics()
    preempted = [v for k, v in metrics.items() if k.startswith("kvd_preemptions_total{")]
    assert preempted and not any(preempted), preempted    # n2's request took the copy's blocks, nobody's KV
    assert metrics['kvd_node_copies_reclaimed_total{node="n2"}'] >= 1
    assert admin(pair.admin_socket, "set-role", node="n1", role="mixed")["ok"]
