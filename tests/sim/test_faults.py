"""Faults in the simulator: a node killed at a time; its requests move where
kvd's RecoveryPolicy says (the replica holder, a re-prefill elsewhere, or
an error), after the heartbeat deadline."""

from __future__ import annotations

import json

import pytest

from tools.kvd_command import main
from tools.sim.run import load_shape, parse, simulate, workload_of

FLAGS = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "48",
         "--num-prompts", "24", "--request-rate", "8", "--seed", "0"]


def run(tmp_path, profile, recovery: str, replicas: int, fail: str = "n1@2"):
    cfg = tmp_path / f"{recovery}{replicas}.toml"
    cfg.write_text(f'[cluster]\nrecovery = "{recovery}"\nreplicas = {replicas}\nheartbeat_deadline = 1.0\n'
                   f'heartbeat_interval = 0.25\nrouting = "least-load"\n')
    own, args = parse(["--profile", str(profile), "--fail", fail, *FLAGS])
    shape = load_shape(str(cfg), str(profile), 3, 0, None)
    conversations, opts, encode, _ = workload_of(args)
    records, _, cluster = simulate(shape, conversations, opts, encode, faults=own.faults)
    return records, cluster


@pytest.fixture
def slow_profile(write_profile):
    """Decode steps of 40 ms: 48 tokens take about 2 s, so n1 dies with requests mid-stream."""
    from tests.sim.conftest import TOY_COSTS
    return write_profile("slow.json", costs={**TOY_COSTS, "decode_fixed_s": 0.04})


def test_replicas_resume_on_the_ring_peer_and_every_request_completes(tmp_path, slow_profile):
    records, cluster = run(tmp_path, slow_profile, "replica", 1)
    assert all(r.success for r in records) and len(records) == 24
    moves = cluster.failover.moves
    # tokens decoded on n1 resume where they were replicated; a request sent to n1 after it
    # died (before the deadline) has none and goes where the router says
    replicated = [m for m in moves if m[3]]
    assert len(replicated) >= 2 and all(dead == "n1" and new == "n2" for _, dead, new, _ in replicated)
    assert all(new != "n1" for _, _, new, _ in moves)
    outcomes = cluster.describe()["recovery"]
    assert outcomes["replica_resumed"] == len(replicated)
    assert outcomes.get("reprefill_resumed", 0) == len(moves) - len(replicated)
    assert cluster.failover.faults[0]["ok"] and cluster.failover.faults[0]["sent_s"] == 2.0
    paused = {rid for rid, *_ in replicated}
    # a moved stream paused at least until the death was noticed (deadline after the last beat)
    for r in records:
        if f"sim-{r.index}" in paused:
            assert max(r.itl) >= 0.9, r.index


def test_without_replicas_the_router_picks_and_the_prompt_is_recomputed(tmp_path, slow_profile):
    records, cluster = run(tmp_path, slow_profile, "replica", 0)
    assert all(r.success for r in records)
    moves = cluster.failover.moves
    assert moves and all(tokens == 0 and new in ("n2", "n3") for _, _, new, tokens in moves)
    assert {new for *_, new, _ in moves} == {"n2", "n3"}            # least-load spreads them
    assert cluster.describe()["recovery"]["reprefill_resumed"] == len(moves)


def test_recovery_fail_ends_the_dead_nodes_requests_with_an_error(tmp_path, slow_profile):
    _, moved = run(tmp_path, slow_profile, "replica", 1)
    records, cluster = run(tmp_path, slow_profile, "fail", 1)
    failed = [r for r in records if not r.success]
    assert len(failed) == len(moved.failover.moves) > 0
    assert all("n1 died" in r.error for r in failed)
    assert not cluster.failover.moves


def test_a_fault_after_the_run_changes_nothing(tmp_path, slow_profile):
    late, _ = run(tmp_path, slow_profile, "replica", 1, fail="n1@500")
    clean, _ = run(tmp_path, slow_profile, "replica", 1, fail="n1@10000")
    assert [r.ttft for r in late] == [r.ttft for r in clean] and all(r.success for r in late)


@pytest.mark.parametrize("bad, why", [("n9@1", "n1..n3"), ("n1@-1", "seconds"), ("n1", "NODE@SECONDS"),
                                      ("n1@1:pause", "mode")])
def test_bad_faults_are_one_line_and_exit_2(tmp_path, toy_profile, capsys, bad, why):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--profile", str(toy_profile), "--nodes", "3", "--fail", bad, *FLAGS])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0]


def test_the_result_lists_the_fault(tmp_path, toy_profile):
    assert main(["simulate", "--profile", str(toy_profile), "--nodes", "2", "--fail", "n2@0.5", *FLAGS,
                 "--save-result", "--result-dir", str(tmp_path), "--result-filename", "f.json"]) in (0, 1)
    doc = json.loads((tmp_path / "f.json").read_text())
    assert doc["faults"][0]["node"] == "n2" and doc["faults"][0]["ok"]


def test_when_every_node_is_dead_requests_are_refused(tmp_path, slow_profile):
    own, args = parse(["--profile", str(slow_profile), "--fail", "n1@3", *FLAGS, "--num-prompts", "64"])
    shape = load_shape(None, str(slow_profile), 1, 0, None)
    conversations, opts, encode, _ = workload_of(args)
    records, _, cluster = simulate(shape, conversations, opts, encode, faults=own.faults)
    late = [r for r in records if r.start > 3.0]
    assert late and not any(r.success for r in late)
    # sent once n1 was declared dead (heartbeat_deadline 3 s after its last beat): nowhere to go
    refused = [r for r in late if r.start > 3.0 + 3.0]
    assert refused and all("no node is routable" in r.error for r in refused)
    assert any(r.success for r in records)                     # those done before the death
