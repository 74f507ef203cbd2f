"""Pairs and run-time roles, the pure parts: the config's pairs
(kvd/cluster_config.py), who is paired with whom at the coordinator, which
role switches are allowed, where a paired node replicates
(kvd/coordinator/roles.py, recovery.py), and the CLI's refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvd import protocol
from kvd.cluster_config import ConfigError, load_cluster_config, parse_cluster
from kvd.cluster_pairs import pair_map, with_pair
from kvd.coordinator.membership import NodeInfo
from kvd.coordinator.recovery import RecoveryPolicy, ring_peers
from kvd.coordinator.roles import PairBook, redundant_blocks

ROOT = Path(__file__).resolve().parents[2]


def node(name: str, role: str = "mixed", draining: bool = False) -> NodeInfo:
    return NodeInfo(name, f"zmq+tcp://127.0.0.1:{ord(name[-1])}", "i", "tiny", 2048, 16, {"device": 8}, 0.0,
                    role=role, admin_drained=draining)


def test_pairs_in_order_and_by_name():
    cfg = load_cluster_config(ROOT / "etc" / "kvd.example-pairs.toml")
    assert pair_map(cfg) == {"n1": "n2", "n2": "n1", "n3": "n4", "n4": "n3"} and cfg.replicas == 1
    named = parse_cluster({"nodes": {"a": {"pair": "b"}, "b": {}, "c": {}}})
    assert (named.partner_of("a"), named.partner_of("b"), named.partner_of("c")) == ("b", "a", "")
    assert named.replicas == 1
    assert parse_cluster({}).replicas == 0
    assert with_pair(parse_cluster({}), "n1", "n2").partner_of("n2") == "n1"


@pytest.mark.parametrize("data, message", [
    ({"cluster": {"pairs": True}, "nodes": {"a": {}, "b": {}, "c": {}}}, "even number"),
    ({"nodes": {"a": {"pair": "a"}}}, "itself"),
    ({"nodes": {"a": {"pair": "z"}}}, "no \\[nodes.z\\] table"),
    ({"nodes": {"a": {"pair": "b"}, "b": {}, "c": {"pair": "b"}}}, "paired twice"),
    ({"nodes": {"a": {"pair": "b"}, "b": {"pair": "c"}, "c": {}}}, "nodes.b.pair is 'c'"),
    ({"nodes": {"a": {"pair": "b", "role": "prefill"}, "b": {}}}, "must decode"),
    ({"cluster": {"pairs": True}, "nodes": {"a": {"pair": "b"}, "b": {}}}, "drop the nodes.NAME.pair"),
    ({"cluster": {"pairs": "yes"}}, "must be bool"),
    ({"nodes": {"a": {"pair": "bad name!"}}}, "node name"),
])
def test_bad_pairs_are_config_errors(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_cluster(data)


def test_a_hello_paired_with_itself_is_malformed():
    with pytest.raises(ValueError, match="itself"):
        protocol.Hello(node="n1", address="zmq+tcp://x:1", blocks_per_tier={}, block_size=16, pair="n1")


def test_only_mutual_registered_pairs_count():
    book = PairBook()
    nodes = {n.name: n for n in (node("n1"), node("n2"), node("n3"))}
    book.announce("n1", "n2")
    assert book.paired("n1") and book.partner("n1", nodes) is None       # n2 has not named n1
    book.announce("n2", "n1")
    assert book.partner("n1", nodes).name == "n2" and book.partner("n2", nodes).name == "n1"
    assert book.partner("n1", {"n1": nodes["n1"]}) is None               # n2 not registered
    book.announce("n2", "")
    assert book.partner("n1", nodes) is None


def test_a_paired_node_replicates_to_its_partner_and_the_rest_in_a_ring():
    rec = RecoveryPolicy(replicas=0)
    nodes = [node("n1"), node("n2"), node("n3", role="decode"), node("n4")]
    rec.pairs.announce("n1", "n2")
    rec.pairs.announce("n2", "n1")
    assert rec.peer_of("n1", nodes).name == "n2" and rec.peer_of("n2", nodes).name == "n1"
    assert rec.peer_of("n3", nodes) is None                    # replicas = 0: no ring
    rec.replicas = 1
    assert (rec.peer_of("n3", nodes).name, rec.peer_of("n4", nodes).name) == ("n4", "n3")
    nodes[1].role = "prefill"                                  # a prefilling partner keeps its copies
    assert rec.peer_of("n1", nodes).name == "n2"
    assert rec.peer_of("n1", [n for n in nodes if n.name != "n2"]) is None     # the survivor serves alone
    assert set(ring_peers(nodes, paired=("n1", "n2"))) == {"n3", "n4"}


@pytest.mark.parametrize("switch, message", [
    (("n9", "decode"), "unknown node"),
    (("n1", "leader"), "role must be one of"),
    (("n3", "prefill"), None),
    (("n1", "prefill"), None),
])
def test_switches_a_lone_cluster_allows(switch, message):
    book = PairBook()
    nodes = {n.name: n for n in (node("n1"), node("n2"), node("n3"))}
    if message is None:
        book.check_switch(nodes, *switch)
    else:
        with pytest.raises(ValueError, match=message):
            book.check_switch(nodes, *switch)


def test_switches_that_would_leave_nobody_to_decode_or_take_prompts_are_refused():
    book = PairBook()
    nodes = {n.name: n for n in (node("n1", "prefill"), node("n2"), node("n3", draining=True))}
    with pytest.raises(ValueError, match="no node that decodes"):
        book.check_switch(nodes, "n2", "prefill")
    book.check_switch(nodes, "n2", "decode")                   # n1 takes the prompts
    book.check_switch(nodes, "n1", "prefill")                  # no change: allowed
    nodes["n1"].role = "decode"
    with pytest.raises(ValueError, match="no node that takes prompts"):
        book.check_switch(nodes, "n2", "decode")


def test_a_paired_node_prefills_only_while_its_partner_decodes():
    book = PairBook()
    nodes = {n.name: n for n in (node("n1"), node("n2"), node("n3"))}
    book.announce("n1", "n2")
    book.announce("n2", "n1")
    book.check_switch(nodes, "n1", "prefill")
    nodes["n2"].role = "prefill"
    with pytest.raises(ValueError, match="a pair needs a node that decodes"):
        book.check_switch(nodes, "n1", "prefill")
    nodes["n2"].role = "mixed"
    del nodes["n2"]
    with pytest.raises(ValueError, match="not registered"):
        book.check_switch(nodes, "n1", "prefill")


def test_redundant_blocks_count_full_blocks_held():
    by_holder = {"n2": {"n1": {"r1": 40, "r2": 15}, "n3": {"r3": 16}}}
    assert redundant_blocks(by_holder, node("n2")) == 2 + 0 + 1
    assert redundant_blocks(by_holder, node("n1")) == 0


@pytest.mark.parametrize("argv, message", [
    (["serve", "--nodes", "3", "--pairs"], "--pairs needs --nodes 2N"),
    (["serve", "--nodes", "4", "--prefill", "1", "--pairs"], "--pairs needs --nodes 2N"),
    (["node", "--name", "n1", "--pair", "n1", "--insecure"], "itself"),
    (["node", "--name", "n1", "--pair", "n2", "--role", "prefill", "--insecure"], "must decode"),
])
def test_bad_pair_flags_exit_2_with_one_line(argv, message):
    r = subprocess.run([sys.executable, "-m", "kvd.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_kvd_serve_pairs_its_node_processes_in_order(tmp_path):
    import shutil

    from kvd.cluster_config import ClusterConfig
    from kvd.local_cluster import LocalCluster

    lc = LocalCluster(None, ClusterConfig(pairs=True, insecure=True), 4, [])
    try:
        pairs = [lc._command(f"n{i}", "zmq+tcp://127.0.0.1:1")[-2:] for i in range(1, 5)]
    finally:
        shutil.rmtree(lc.runtime_dir, ignore_errors=True)
    assert pairs == [["--pair", "n2"], ["--pair", "n1"], ["--pair", "n4"], ["--pair", "n3"]]


def test_kvctl_role_and_handoff_requests_and_a_bad_role_is_a_usage_error(capsys):
    from kvd import ctl

    parser = ctl.build_parser()
    assert ctl.to_request(parser.parse_args(["role", "n1", "prefill"]), parser) == {
        "cmd": "set-role", "node": "n1", "role": "prefill"}
    assert ctl.to_request(parser.parse_args(["handoff", "cmpl-1"]), parser) == {"cmd": "handoff", "request": "cmpl-1"}
    with pytest.raises(SystemExit) as exc:
        ctl.main(["--socket", "/nonexistent.sock", "role", "n1", "leader"])
    assert exc.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
