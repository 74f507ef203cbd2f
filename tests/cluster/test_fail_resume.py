"""Operator commands on real daemons: `fail` through the coordinator reaches
a node it has declared dead; `log-level` sets the daemons' own loggers only.

A coordinator and one ``kvd node`` over zmq+tcp: ``fail n1 stop`` stops
n1's heartbeats, the coordinator declares it dead (and forgets its link);
``fail n1 resume`` through the coordinator must still reach it (at its last
address), and n1 registers again and serves.
"""

from __future__ import annotations

import pytest

from .conftest import MODEL, admin, running_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("resume"), "zmq+tcp", ["n1"]) as c:
        yield c


def test_resume_through_the_coordinator_brings_back_a_node_declared_dead(cluster):
    assert admin(cluster.admin_socket, "fail", node="n1", mode="stop")["registered"] is True
    cluster.wait_gone("n1", timeout=30)               # the deadline is 3 s (conftest.HEARTBEAT)
    assert admin(cluster.node_admin("n1"), "status")["heartbeats_paused"] is True

    reply = admin(cluster.admin_socket, "fail", node="n1", mode="resume")
    assert reply == {"ok": True, "node": "n1", "registered": False, "mode": "resume"}
    cluster.wait_nodes(["n1"], timeout=30)
    assert admin(cluster.node_admin("n1"), "status")["heartbeats_paused"] is False
    out = cluster.client(timeout=60).completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4,
                                                        temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    # the forwarding link was used for the one command and dropped: n1 is reached as usual again
    assert admin(cluster.admin_socket, "fail", node="n1", mode="resume")["registered"] is True


def test_a_name_never_registered_is_still_unknown(cluster):
    reply = admin(cluster.admin_socket, "fail", node="n9", mode="resume")
    assert reply["ok"] is False and "unknown node 'n9'" in reply["error"]


def test_log_level_on_the_daemons_sets_their_own_loggers_only(cluster):
    for sock, own in ((cluster.admin_socket, "kvd.coordinator"), (cluster.node_admin("n1"), "kvd.heartbeat")):
        for name in ("x" * 60_000, "kvd.node\x00", "kvd.flood1", "asyncio.x"):
            reply = admin(sock, "log-level", level="debug", logger=name)
            assert reply["ok"] is False and reply["error"].startswith("log-level: unknown logger "), reply
            assert own in reply["error"]                    # the daemon's loggers are listed
        assert admin(sock, "log-level", level="debug", logger=own)["ok"]
        assert admin(sock, "log-level", level="info", logger=own)["previous"] == "debug"
