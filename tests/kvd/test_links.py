"""kvd.links and kvd.trust: no port without keys unless insecure; who may send what."""

from __future__ import annotations

import logging

import pytest

from kvd import links, protocol, trust
from kvd.cluster_config import ClusterConfig, ConfigError

KEYS = ClusterConfig(curve_keys_dir="/some/keys")
NONE = ClusterConfig()
INSECURE = ClusterConfig(insecure=True)


@pytest.mark.parametrize("url", ["zmq+tcp://127.0.0.1:5550", "zmq+ipc:///run/kvd/n1.sock",
                                 "ucx://127.0.0.1:5550", "zmq+tcp://0.0.0.0:5550"])
def test_a_port_without_keys_is_refused_unless_insecure(url):
    with pytest.raises(ConfigError, match="refusing to listen.*insecure"):
        links.check_listen(NONE, url)
    links.check_listen(KEYS, url)                   # keys: fine anywhere
    links.check_listen(NONE, "inproc://node-n0")    # no port at all


@pytest.mark.parametrize("url, where", [
    ("zmq+tcp://127.0.0.1:5550", "on loopback only"), ("zmq+tcp://[::1]:5550", "on loopback only"),
    ("zmq+ipc:///run/kvd/n1.sock", "on loopback only"), ("zmq+tcp://0.0.0.0:5550", "BEYOND LOOPBACK"),
    ("zmq+tcp://10.1.2.3:5550", "BEYOND LOOPBACK"), ("zmq+tcp://*:5550", "BEYOND LOOPBACK"),
    ("ucx://127.0.0.1:5550", "BEYOND LOOPBACK"),    # ucxx binds every interface
])
def test_insecure_says_so_and_how_far_the_port_reaches(url, where, caplog):
    with caplog.at_level(logging.WARNING, logger="kvd.links"):
        links.check_listen(INSECURE, url)
    assert len(caplog.records) == 1 and where in caplog.records[0].getMessage()


def test_a_node_obeys_only_the_coordinators_key_and_takes_kv_only_from_nodes():
    gen = protocol.GenerateRequest(request_id="r", prompt_token_ids=(1,))
    admin = protocol.AdminCommand(command="drain")
    req = protocol.KVTransferRequest(transfer_id="t", src_node="n2", dst_node="n1", token_ids=(1,) * 16,
                                     num_blocks=1, num_layers=4, dtype="float32")
    data = protocol.KVData(transfer_id="t")
    refuse = trust.node_refusal
    for msg in (gen, admin, protocol.Abort(request_id="r")):
        assert refuse(msg, "coordinator", True) is None
        assert "only the coordinator" in refuse(msg, "n2", True)
        assert refuse(msg, None, True) == "the sender is not authenticated"
        assert refuse(msg, None, False) is None                        # insecure: anything goes
    assert refuse(req, "n2", True) is None and refuse(data, "n2", True) is None
    assert "src_node" in refuse(req, "n3", True)                       # n3 may not speak as n2
    assert "from a node" in refuse(data, "coordinator", True)


def test_the_coordinator_hears_each_node_about_itself_only():
    beat = protocol.Heartbeat(node="n1", seq=1, load=0.0, running=0, waiting=0, free_blocks={})
    bye = protocol.Goodbye(node="n1")
    refuse = trust.coordinator_refusal
    for msg in (beat, bye):
        assert refuse(msg, "n1", True) is None
        assert "speaks for itself" in refuse(msg, "n2", True)
        assert "coordinator" in refuse(msg, "coordinator", True)
        assert refuse(msg, "n2", False) is None
