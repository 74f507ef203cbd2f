"""``kvd simulate`` writes kvd-loadgen's result format, runs kvd's routing
decisions (disaggregation, prompt-tree locality) and refuses bad input with exit 2."""

from __future__ import annotations

import json

import pytest

from tools.kvd_command import main
from tools.sim.run import load_shape, simulate
from tools.sim.workload import WorkloadOptions
from tools.loadgen.cli import main as loadgen_main
from tools.loadgen.datasets import Conversation, Turn

WORKLOAD = ["--num-prompts", "30", "--request-rate", "20", "--random-input-len", "64",
            "--random-output-len", "8", "--goodput", "ttft:2000", "tpot:500"]


def run(tmp_path, toy_profile, *flags, name):
    code = main(["simulate", "--profile", str(toy_profile), *flags, *WORKLOAD, "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", name])
    return code, json.loads((tmp_path / name).read_text())


def test_simulate_writes_a_loadgen_result_that_compare_reads(tmp_path, toy_profile, capsys):
    code, one = run(tmp_path, toy_profile, "--nodes", "1", name="one.json")
    assert code == 0
    m = one["metrics"]
    assert m["completed"] == 30 and m["total_output_tokens"] == 240
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput",
                "request_goodput", "slo_attainment"):
        assert m[key] is not None and m[key] >= 0, key
    assert one["tool"] == "kvd-loadgen" and one["config"]["simulated"]["nodes"] == 1
    code, two = run(tmp_path, toy_profile, "--nodes", "2", "--prefill", "1", name="pd.json")
    assert code == 0 and two["config"]["simulated"]["roles"] == ["prefill", "decode"]
    busy = two["config"]["simulated"]["busy_seconds"]
    assert busy["n1"] > 0 and busy["n2"] > 0                 # both legs ran: the prefill node prefilled
    capsys.readouterr()
    assert loadgen_main(["compare", str(tmp_path / "one.json"), str(tmp_path / "pd.json")]) == 0
    table = capsys.readouterr().out
    assert "median_ttft_ms" in table and "one" in table and "pd" in table


def test_prompt_tree_routing_sends_a_repeated_prefix_where_it_is_cached(toy_profile):
    shape = load_shape(None, str(toy_profile), 3, 0, "prompt-tree")
    prefixes = [[1000 + 50 * p + i for i in range(64)] for p in range(3)]
    convs = [Conversation((Turn(f"q{i}", 70, 4),)) for i in range(30)]
    prompts = {f"q{i}": prefixes[i % 3] + [7, 8, 9, i % 200 + 10, 11, 12] for i in range(30)}
    records, duration, cluster = simulate(shape, convs, WorkloadOptions(request_rate=10.0, seed=1),
                                          lambda text: list(prompts[text]))
    assert all(r.success for r in records) and duration > 0
    hits = sum(n.pool.hit_tokens for n in cluster.nodes.values())
    assert hits >= 0.5 * 27 * 64                  # after the first of each prefix nearly all hit
    assert cluster.router.cache_routed >= 20


@pytest.mark.parametrize("flags, why", [
    (["--nodes", "2", "--prefill", "2"], "--prefill P needs"),
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--routing", "random"], "--routing must be one of"),
    (["--dataset-name", "nope"], "nope"),
    (["--request-rate", "-1"], "rate"),
])
def test_bad_flags_are_one_line_and_exit_2(toy_profile, capsys, flags, why):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--profile", str(toy_profile), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0]


def test_a_missing_or_mismatched_profile_is_refused(write_profile, tmp_path, capsys):
    for argv in (["simulate"], ["simulate", "--profile", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    cfg = tmp_path / "kvd.toml"
    cfg.write_text('[engine]\nmodel = "smollm2"\n')
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "-c", str(cfg), "--profile", str(write_profile())])
    assert exc.value.code == 2
    assert "the profile is of model 'tiny'" in capsys.readouterr().err
