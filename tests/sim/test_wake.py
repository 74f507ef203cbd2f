"""A node's first step after a wait for work (kvd/sim/wake.py): the table, its
place in a simulated step, the profile's ``wake`` value and ``kvd profile``'s
measurement of it (tools/sim/profile_wake.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.sim.profile_file import ProfileError, load_profile
from kvd.sim.wake import WakeCosts, fit_wake
from tools.sim.measure import simulated

TABLE = [[0.5, 0.02], [2.0, 0.04]]
# six requests 20 s apart on average (Poisson; this seed's closest two are 4.4 s apart): every
# one after the first finds its node waiting past the table's last point
SPARSE = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "4",
          "--num-prompts", "6", "--request-rate", "0.05", "--seed", "2"]
BURST = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "4",
         "--num-prompts", "3", "--request-rate", "inf", "--seed", "0"]


def test_the_extra_is_linear_between_the_points_from_zero_and_flat_past_the_last():
    w = WakeCosts.from_object(TABLE)
    assert [w.extra(g) for g in (0.0, -1.0, 0.25, 0.5, 1.25, 2.0, 30.0)] == pytest.approx(
        [0.0, 0.0, 0.01, 0.02, 0.03, 0.04, 0.04])
    assert WakeCosts(()).extra(5.0) == 0.0
    assert w.as_list() == TABLE


def test_the_fit_keeps_a_longer_wait_at_least_as_dear():
    # a dip (noise) and a negative extra (a faster step than back to back) are levelled
    assert fit_wake([0.1, 0.5, 1.0, 2.0], [-0.001, 0.02, 0.015, 0.03]).as_list() == \
        [[0.1, 0.0], [0.5, 0.02], [1.0, 0.02], [2.0, 0.03]]


def test_every_request_after_a_wait_pays_it_once_on_its_first_step(write_profile):
    plain = simulated(write_profile(), 0, 0, None, None, SPARSE)
    woken = simulated(write_profile("w.json", wake=TABLE), 0, 0, None, None, SPARSE)
    assert plain["completed"] == woken["completed"] == 6
    # the first request meets a node that has not waited (the run starts with it); the
    # five others pay 40 ms on the first token each
    assert woken["median_ttft_ms"] == pytest.approx(plain["median_ttft_ms"] + 40, abs=1e-6)
    assert woken["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"], abs=1e-6)


def test_a_busy_node_pays_no_wake(write_profile):
    # three prompts at once: only the first step follows a wait, the client's hop to the node
    # (a fraction of a millisecond: microseconds of the table's first slope)
    plain = simulated(write_profile(), 0, 0, None, None, BURST)
    woken = simulated(write_profile("w.json", wake=TABLE), 0, 0, None, None, BURST)
    assert 0 < woken["median_ttft_ms"] - plain["median_ttft_ms"] < 0.05
    assert woken["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"], abs=1e-6)


def test_each_node_of_a_disaggregated_pair_wakes_for_its_own_leg(write_profile):
    plain = simulated(write_profile(), 2, 1, None, None, SPARSE)
    woken = simulated(write_profile("w.json", wake=TABLE), 2, 1, None, None, SPARSE)
    assert plain["completed"] == woken["completed"] == 6
    # the prefill node's step waited seconds; so did the decode node's first step, which
    # comes after the first token (the prefill node's): TTFT pays one wake, TPOT the other's share
    assert woken["median_ttft_ms"] == pytest.approx(plain["median_ttft_ms"] + 40, abs=1e-6)
    assert woken["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"] + 40 / 3, abs=1e-6)


@pytest.mark.parametrize("wake, why", [
    ({"gap": 1}, "list of"), ([[0.5]], "pairs"), ([[0, 0.01]], "pairs"), ([[0.5, -0.01]], "pairs"),
    ([[0.5, float("nan")]], "not a number"), ([[1.0, 0.01], [0.5, 0.02]], "must rise"), ([[True, 0.01]], "pairs"),
    ([[0.5, "0.01"]], "pairs"), ([[0.5, 0.01]] * 65, "at most 64")])
def test_a_bad_wake_table_is_refused(write_profile, wake, why):
    with pytest.raises(ProfileError, match=why):
        load_profile(write_profile(wake=wake), model="tiny")


def test_measure_wake_on_a_real_engine_gives_a_valid_table():
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from tools.sim.profile_wake import measure_wake

    engine = LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", kv_blocks=64, block_size=16))
    rng = np.random.default_rng(0)
    wake = measure_wake(engine, lambda n: rng.integers(10, 1000, size=n).tolist(), rounds=2, gaps=(0.01, 0.05))
    assert [g for g, _ in wake.table] == [0.01, 0.05]
    assert wake.table[0][1] <= wake.table[1][1]
    assert not engine.has_unfinished()
