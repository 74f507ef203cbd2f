"""The serving overhead: ``kvd profile`` measures it through a real ``kvd
serve`` (one node, and one prefill and one decode node) and the simulator
charges it to every request before routing and to a disaggregated
request's prefill leg."""

from __future__ import annotations

import json

import pytest

from tools.kvd_command import main
from tools.sim.measure import simulated
from kvd.sim.profile_file import ProfileError, load_profile

FLAGS = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "4",
         "--num-prompts", "6", "--request-rate", "2", "--seed", "0"]


def test_the_simulator_adds_the_overhead_to_each_request(write_profile):
    plain = simulated(write_profile(), 0, 0, None, None, FLAGS)
    slow = simulated(write_profile("slow.json", serving={"first_token_s": 0.25}), 0, 0, None, None, FLAGS)
    assert slow["completed"] == plain["completed"] == 6
    for key in ("median_ttft_ms", "p99_ttft_ms", "mean_e2el_ms"):
        assert slow[key] == pytest.approx(plain[key] + 250.0, abs=1e-6), key
    assert slow["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"])


def test_the_simulator_adds_the_token_cost_to_each_decode_step(write_profile):
    sparse = [*FLAGS[:-3], "0.05", *FLAGS[-2:]]           # mostly one request at a time
    plain = simulated(write_profile(), 0, 0, None, None, sparse)
    slow = simulated(write_profile("slow.json", serving={"token_s": 0.05}), 0, 0, None, None, sparse)
    assert slow["completed"] == plain["completed"] == 6
    assert slow["median_ttft_ms"] == pytest.approx(plain["median_ttft_ms"], abs=1e-6)
    assert slow["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"] + 50.0, abs=1e-6)


def test_the_token_cost_is_paid_once_per_step_whatever_its_batch(write_profile):
    burst = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "6",
             "--num-prompts", "3", "--request-rate", "inf", "--seed", "0"]    # one prefill, then batches of 3
    plain = simulated(write_profile(), 0, 0, None, None, burst)
    slow = simulated(write_profile("slow.json", serving={"token_s": 0.05}), 0, 0, None, None, burst)
    assert slow["completed"] == plain["completed"] == 3
    assert slow["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"] + 50.0, abs=1e-6)


def test_the_simulator_delays_a_disaggregated_requests_prefill_leg_only(write_profile):
    sparse = [*FLAGS[:-3], "0.05", *FLAGS[-2:]]           # one request at a time: no queueing moves
    slow = write_profile("slow.json", serving={"disagg_s": 0.25})
    for nodes, prefill, extra in ((2, 1, 250.0), (2, 0, 0.0), (0, 0, 0.0)):
        plain = simulated(write_profile(), nodes, prefill, None, None, sparse)
        late = simulated(slow, nodes, prefill, None, None, sparse)
        assert late["completed"] == plain["completed"] == 6
        assert late["median_ttft_ms"] == pytest.approx(plain["median_ttft_ms"] + extra, abs=1e-6), (nodes, prefill)
        assert late["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"], abs=1e-6)


@pytest.mark.parametrize("serving", [{"first_token_s": -1.0}, {"first_token_s": "30ms"}, [0.1],
                                     {"first_token_s": True}, {"first_token_s": 1e9}, {"token_s": -0.001},
                                     {"first_token_s": 0.01, "token_s": "1ms"}, {"disagg_s": -0.5},
                                     {"disagg_s": "10ms"}])
def test_a_bad_serving_overhead_is_refused(write_profile, serving):
    with pytest.raises(ProfileError, match="serving"):
        load_profile(write_profile(serving=serving), model="tiny")


def test_kvd_profile_measures_it_through_kvd_serve(tmp_path):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny", "--quick", "--serving-requests", "3", "--output", str(out)]) == 0
    serving = json.loads(out.read_text())["serving"]
    assert serving["requests"] == 3 and serving["measured_median_ttft_ms"] > 0
    assert serving["instances"] == 1 and serving["instances_ttft_ms"] == [serving["measured_median_ttft_ms"]]
    assert serving["first_token_s"] == pytest.approx(
        max(0.0, serving["measured_median_ttft_ms"] - serving["simulated_median_ttft_ms"]) / 1e3, abs=3e-6)
    assert serving["token_s"] == pytest.approx(
        max(0.0, serving["measured_median_tpot_ms"] - serving["simulated_median_tpot_ms"]) / 1e3, abs=3e-6)
    assert serving["disagg_measured_median_ttft_ms"] > 0 and serving["disagg_input_len"] == 128
    assert serving["disagg_s"] == pytest.approx(
        max(0.0, serving["disagg_measured_median_ttft_ms"] - serving["disagg_simulated_median_ttft_ms"]) / 1e3,
        abs=3e-6)
    loaded = load_profile(out, model="tiny")
    assert (loaded.serving_s, loaded.serving_token_s, loaded.serving_disagg_s) == (
        serving["first_token_s"], serving["token_s"], serving["disagg_s"])


def test_serving_requests_are_checked(tmp_path, capsys):
    assert main(["profile", "--model", "tiny", "--quick", "--serving-requests", "-1",
                 "--output", str(tmp_path / "p.json")]) == 2
    assert "--serving-requests" in capsys.readouterr().err
