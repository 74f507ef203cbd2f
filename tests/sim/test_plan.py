"""``kvd plan`` picks a configuration that meets the SLOs on a toy profile,
writes it as a config kvd reads, and names the binding constraint when no
configuration in the budget meets them."""

from __future__ import annotations

import pytest

from tools.kvd_command import main
from kvd.cluster_config import load_cluster_config
from kvd.config import load_config
from tools.sim.plan import ClosedForm

WORKLOAD = ["--num-prompts", "40", "--random-input-len", "96", "--random-output-len", "12"]


def plan(profile, *flags):
    return main(["plan", "--profile", str(profile), *flags, *WORKLOAD])


def test_plan_meets_the_slos_with_the_fewest_nodes_it_can_and_writes_a_config(toy_profile, tmp_path, capsys):
    out = tmp_path / "best.toml"
    # 80 req/s of ~25 ms prefills: more than one node's time, so TTFT grows without bound on one
    assert plan(toy_profile, "--request-rate", "80", "--slo-ttft", "150", "--slo-tpot", "50",
                "--max-nodes", "3", "--output", str(out)) == 0
    captured = capsys.readouterr()
    assert "eq. 1" in captured.err and "goodput/node" in captured.out
    text = out.read_text()
    assert "# serve with: kvd serve -c CONFIG.toml --nodes" in text
    assert load_cluster_config(out, {}).routing in ("prompt-tree", "least-load", "session")
    assert load_config(out).engine.prefill_chunk_tokens in (0, 256)
    nodes = int(text.split("--nodes ")[1].split()[0])
    assert nodes >= 2                                     # one node is overloaded at this rate


def test_an_impossible_ttft_slo_names_ttft_as_binding(toy_profile, capsys):
    assert plan(toy_profile, "--request-rate", "5", "--slo-ttft", "1", "--slo-tpot", "50", "--max-nodes", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvd plan: error: no configuration within 2 node(s) meets the SLOs: TTFT binds")


def test_a_small_node_budget_names_the_budget_as_binding(toy_profile, capsys):
    assert plan(toy_profile, "--request-rate", "200", "--slo-ttft", "100", "--slo-tpot", "50",
                "--max-nodes", "1") == 2
    assert "the node budget binds" in capsys.readouterr().err


@pytest.mark.parametrize("flags, why", [
    (["--slo-ttft", "100", "--slo-tpot", "50"], "are required"),
    (["--slo-ttft", "-1", "--slo-tpot", "50", "--max-nodes", "2"], "positive"),
    (["--slo-ttft", "100", "--slo-tpot", "50", "--max-nodes", "0"], "--max-nodes"),
])
def test_bad_plan_flags_exit_2(toy_profile, capsys, flags, why):
    assert plan(toy_profile, *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0]


def test_eq1_gives_more_prompt_machines_to_longer_prompts():
    short = ClosedForm(prompt_s=0.01, token_s=0.001, output_tokens=100, overhead=1.1, min_nodes_memory=1)
    long = ClosedForm(prompt_s=0.2, token_s=0.001, output_tokens=100, overhead=1.1, min_nodes_memory=1)
    assert short.prefill_share() == pytest.approx(1.1 * 0.01 / (1.1 * 0.01 + 0.1))
    assert long.prefill_share() > short.prefill_share()


def test_with_a_fault_the_plan_weighs_replicas(write_profile, tmp_path, capsys):
    """A node dies mid-run: every candidate is tried with replicas 0 and 1,
    and the config written says which (with recovery from the replica)."""
    from tests.sim.conftest import TOY_COSTS
    slow = write_profile("slow.json", costs={**TOY_COSTS, "decode_fixed_s": 0.04})
    out = tmp_path / "best.toml"
    assert main(["plan", "--profile", str(slow), "--fail", "n1@1", "--request-rate", "4", "--slo-ttft", "4000",
                 "--slo-tpot", "200", "--max-nodes", "2", "--top", "40", "--output", str(out), "--num-prompts",
                 "16", "--random-input-len", "64", "--random-output-len", "48"]) == 0
    table = capsys.readouterr().out
    assert "replicas 0" in table and "replicas 1" in table
    cluster = load_cluster_config(out, {})
    assert cluster.replicas in (0, 1) and cluster.recovery == "replica"
