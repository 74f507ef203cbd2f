"""[cluster]/[nodes.NAME] parsing: the example file, defaults, strictness."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvd.cluster_config import ConfigError, load_cluster_config, parse_cluster

ROOT = Path(__file__).resolve().parents[2]


def test_example_cluster_file_parses_and_the_engine_part_too():
    cfg = load_cluster_config(ROOT / "etc" / "kvd.example-cluster.toml")
    assert sorted(cfg.nodes) == ["n1", "n2", "n3"]
    assert cfg.node("n2").address == "zmq+tcp://127.0.0.1:5562"
    assert cfg.heartbeat_deadline > cfg.heartbeat_interval
    assert cfg.ucx_progress_mode == "blocking"
    from kvd.config import load_config

    load_config(ROOT / "etc" / "kvd.example-cluster.toml")      # the rest of the file is valid too


def test_example_1p1d_file_parses():
    cfg = load_cluster_config(ROOT / "etc" / "kvd.example-1p1d.toml")
    assert {n: c.role for n, c in cfg.nodes.items()} == {"p1": "prefill", "d1": "decode"}
    assert (cfg.kv_load_failure, cfg.kv_stream) == ("recompute", "layers")
    from kvd.config import load_config

    load_config(ROOT / "etc" / "kvd.example-1p1d.toml")


@pytest.mark.parametrize("data, message", [
    ({"cluster": {"bogus": 1}}, "unknown key"),
    ({"cluster": {"heartbeat_interval": "fast"}}, "must be float"),
    ({"cluster": {"heartbeat_interval": 2.0, "heartbeat_deadline": 1.0}}, "heartbeat_deadline"),
    ({"cluster": {"transport": "carrier-pigeon"}}, "transport"),
    ({"cluster": {"coordinator": "127.0.0.1:5550"}}, "coordinator"),
    ({"nodes": {"n1": {"adress": "zmq+tcp://127.0.0.1:1"}}}, "unknown key"),
    ({"nodes": {"bad name!": {}}}, "node name"),
    ({"cluster": {"transport": "inproc", "curve_keys_dir": "/k"}}, "curve_keys_dir"),
    ({"cluster": {"insecure": "yes"}}, "must be bool"),
    ({"nodes": {"coordinator": {}}}, "coordinator's key name"),
    ({"cluster": {"ucx_progress_mode": "spin"}}, "ucx_progress_mode"),
    ({"nodes": {"n1": {"role": "both"}}}, "role"),
    ({"cluster": {"prefill_threshold": -1}}, "prefill_threshold"),
    ({"cluster": {"prefill_queue_factor": -1}}, "prefill_queue_factor"),
    ({"cluster": {"prefill_queue_factor": float("nan")}}, "prefill_queue_factor"),
    ({"cluster": {"prefill_queue_factor": "4"}}, "prefill_queue_factor"),
    ({"cluster": {"kv_load_failure": "retry"}}, "kv_load_failure"),
    ({"cluster": {"kv_stream": "blocks"}}, "kv_stream"),
    ({"cluster": {"kv_transfer_timeout": 0}}, "kv_transfer_timeout"),
    ({"cluster": {"kv_return": "yes"}}, "must be bool"),
    ({"cluster": {"routing_recent_weight": -0.5}}, "routing_"),
    ({"cluster": {"routing_load_decay": float("nan")}}, "routing_"),
    ({"cluster": {"routing_load_decay": float("inf")}}, "routing_"),
    ({"cluster": {"split_cpus": "sockets"}}, "split_cpus"),
    ({"cluster": {"split_cpus": True}}, "must be str"),
])
def test_bad_cluster_config_is_an_error(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_cluster(data)


def test_defaults_and_overrides():
    cfg = parse_cluster({}, overrides={"heartbeat_interval": 0.25, "transport": None})
    assert cfg.heartbeat_interval == 0.25 and cfg.transport == "zmq+tcp"
    assert cfg.node("nX").address == ""
    assert cfg.default_address("nX").startswith("zmq+tcp://127.0.0.1:")


def test_coordinator_modules_import_no_torch():
    import subprocess

    code = ("import sys, kvd.coordinator.daemon, kvd.coordinator.settings, kvd.cluster_config, kvd.cli;"
            "from kvd.coordinator.settings import load_tokenizer; load_tokenizer('tiny');"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
