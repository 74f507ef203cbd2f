"""The weights' cache model (kvd/sim/warmth.py): its dynamics, its place in a
simulated step, colocated nodes, the profile's ``cache`` object and the fits
``kvd profile`` makes (tools/sim/profile_cache.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.sim.profile_file import ProfileError, load_profile
from kvd.sim.warmth import CacheCosts, Warmth
from tests.sim.conftest import TOY_COSTS
from tools.sim.measure import simulated
from tools.sim.profile_cache import (IDLE_GAPS, fit_cooling, fit_idle, fit_warm_steps, llc_bytes, measure_cache,
                                     neighbour_cooling)

SPARSE = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "4",
          "--num-prompts", "6", "--request-rate", "0.05", "--seed", "0"]     # one request at a time
COLD = {"decode_cold_s": 0.01, "warm_steps": 4, "prefill_cools": 1.0, "neighbour_cools": 0.0}


def test_a_prefill_cools_and_decode_steps_warm_back_linearly():
    w = Warmth(CacheCosts(**COLD))
    assert w.step_extra(prefill=False, decode=True) == 0.0           # a served node starts warm
    assert w.step_extra(prefill=True, decode=False) == 0.0            # a prefill alone pays nothing here
    extras = [w.step_extra(prefill=False, decode=True) for _ in range(6)]
    assert extras == pytest.approx([0.01, 0.0075, 0.005, 0.0025, 0.0, 0.0])
    # a step with both parts: the prefill part runs first and cools the decode part
    assert w.step_extra(prefill=True, decode=True) == pytest.approx(0.01)


def test_a_batched_steps_compute_hides_the_cold_weights_read():
    w = Warmth(CacheCosts(**COLD))
    w.step_extra(prefill=True, decode=False)                          # w = 0: 10 ms to read from memory
    assert w.step_extra(prefill=False, decode=True, hidden=0.004) == pytest.approx(0.006)
    assert w.step_extra(prefill=False, decode=True, hidden=0.02) == 0.0   # 7.5 ms, all under the compute
    assert w.w == pytest.approx(0.5)                                  # a hidden read still warms the cache


def test_a_burst_decoding_as_a_batch_pays_no_cold_steps_when_its_compute_hides_them(write_profile):
    burst = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "6",
             "--num-prompts", "2", "--request-rate", "inf", "--seed", "0"]
    table = {**TOY_COSTS,
             "decode_batch_s": [[1, 0.003], [2, 0.02]]}             # batch 2: 17 ms past one row's step
    plain = simulated(write_profile(costs=table), 0, 0, None, None, burst)
    cold = simulated(write_profile("cold.json", costs=table, cache=COLD), 0, 0, None, None, burst)
    assert cold["completed"] == plain["completed"] == 2
    # the second prompt's prefill shares a step with the first's one-row decode, which pays
    # its cold 10 ms (over 5 intervals; the median of two averages them); the batched steps
    # after it (7.5, 5, 2.5 ms cold) are hidden under their 17 ms of extra compute
    assert cold["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"] + 1.0, abs=1e-6)
    alone = simulated(write_profile("a.json", costs=table, cache=COLD), 0, 0, None, None, SPARSE)
    assert alone["median_tpot_ms"] > simulated(write_profile("p.json", costs=table), 0, 0, None, None,
                                               SPARSE)["median_tpot_ms"] + 5.0   # one row: nothing hides it


def test_a_neighbours_step_cools_by_its_share_and_no_cache_model_is_always_warm():
    w = Warmth(CacheCosts(**{**COLD, "neighbour_cools": 0.5}))
    w.neighbour_step()
    assert w.step_extra(prefill=False, decode=True) == pytest.approx(0.005)
    plain = Warmth(None)
    plain.neighbour_step()
    assert plain.step_extra(prefill=True, decode=True) == 0.0


def test_a_neighbours_prefill_evicts_as_this_nodes_own_would():
    costs = CacheCosts(**{**COLD, "prefill_cools": 0.8, "neighbour_cools": 0.5})
    w = Warmth(costs)
    w.neighbour_step(prefill=True, decode=False)                      # the shared cache: prefill_cools
    assert w.w == pytest.approx(0.2)
    w = Warmth(costs)
    w.neighbour_step(prefill=True, decode=True)                       # then its decode part's share
    assert w.w == pytest.approx(0.1)


def test_one_node_pays_the_cold_steps_after_each_prefill(write_profile):
    plain = simulated(write_profile(), 0, 0, None, None, SPARSE)
    cold = simulated(write_profile("cold.json", cache=COLD), 0, 0, None, None, SPARSE)
    assert cold["completed"] == plain["completed"] == 6
    assert cold["median_ttft_ms"] == pytest.approx(plain["median_ttft_ms"], abs=1e-6)
    # 3 decode steps after the prefill: 10 + 7.5 + 5 ms more over 3 intervals
    assert cold["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"] + 7.5, abs=1e-6)


def test_colocated_nodes_cool_each_other_and_separate_hosts_do_not(write_profile):
    # a prefill evicts everything from the shared cache; a neighbour's decode step nothing
    prof = write_profile("n.json", cache={**COLD, "prefill_cools": 1.0, "neighbour_cools": 0.0})
    plain = simulated(write_profile(), 2, 1, None, None, SPARSE)
    apart = simulated(prof, 2, 1, None, None, SPARSE)
    together = simulated(prof, 2, 1, None, None, SPARSE, colocated=True)
    assert plain["completed"] == apart["completed"] == together["completed"] == 6
    assert apart["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"], abs=1e-6)
    # the prefill node's step (the request's own prefill) left the decode node cold
    assert together["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"] + 7.5, abs=1e-6)


def test_idle_time_cools_in_proportion_up_to_its_full_share():
    w = Warmth(CacheCosts(**{**COLD, "idle_cools": 0.8, "idle_full_s": 0.02}))
    w.idle(0.01)                                                      # half the way: 0.4 of it lost
    assert w.w == pytest.approx(0.6)
    w.idle(5.0)                                                       # past idle_full_s: all 0.8
    assert w.w == pytest.approx(0.12)
    w.idle(0.0)
    assert w.w == pytest.approx(0.12)
    keeps = Warmth(CacheCosts(**COLD))                                # no idle fields: an idle node keeps it
    keeps.idle(100.0)
    assert keeps.w == 1.0


@pytest.mark.parametrize("nodes, prefill", [(0, 0), (2, 1)])
def test_a_node_that_waited_for_work_decodes_cold(write_profile, nodes, prefill):
    # prefills evict nothing here: only the wait between sparse requests cools
    warm = {**COLD, "prefill_cools": 0.0}
    plain = simulated(write_profile("w.json", cache=warm), nodes, prefill, None, None, SPARSE)
    idle = simulated(write_profile("i.json", cache={**warm, "idle_cools": 1.0, "idle_full_s": 0.01}),
                     nodes, prefill, None, None, SPARSE)
    assert plain["completed"] == idle["completed"] == 6
    assert idle["median_ttft_ms"] == pytest.approx(plain["median_ttft_ms"], abs=1e-6)
    # the request's decode node waited seconds: its 3 decode steps pay 10 + 7.5 + 5 ms more
    assert idle["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"] + 7.5, abs=1e-6)


@pytest.mark.parametrize("cache, why", [
    ([1], "must be an object"), ({"decode_cold_s": 0.01}, "lacks warm_steps"),
    ({**COLD, "decode_cold_s": -0.1}, "decode_cold_s"), ({**COLD, "warm_steps": 0.5}, "warm_steps"),
    ({**COLD, "prefill_cools": 1.5}, "prefill_cools"), ({**COLD, "neighbour_cools": "all"}, "neighbour_cools"),
    ({**COLD, "warm_steps": True}, "warm_steps"), ({**COLD, "idle_cools": 1.5}, "idle_cools"),
    ({**COLD, "idle_full_s": 0}, "idle_full_s"), ({**COLD, "idle_full_s": None}, "idle_full_s")])
def test_a_bad_cache_object_is_refused(write_profile, cache, why):
    with pytest.raises(ProfileError, match=why):
        load_profile(write_profile(cache=cache), model="tiny")


def test_the_fits_recover_the_model_they_fit():
    truth = CacheCosts(decode_cold_s=0.005, warm_steps=6.5, prefill_cools=0.7, neighbour_cools=0.4)
    warm = 0.004

    def after(w0: float, n: int, done: int = 0) -> list[float]:
        w = Warmth(truth)
        w.w = w0
        for _ in range(done):
            w.step_extra(False, True)
        return [warm + w.step_extra(False, True) for _ in range(n)]
    k = fit_warm_steps(warm, truth.decode_cold_s, after(0.0, 16))
    assert k == truth.warm_steps
    assert fit_cooling(warm, truth.decode_cold_s, k, after(1 - truth.prefill_cools, 16, 1), done=1) \
        == pytest.approx(truth.prefill_cools)
    # two nodes in turn: iterate the model to its equilibrium, then fit
    a = Warmth(truth)
    for _ in range(200):
        step = warm + a.step_extra(False, True)
        a.neighbour_step()
    assert neighbour_cooling(warm, truth.decode_cold_s, k, step) == pytest.approx(truth.neighbour_cools, abs=1e-9)
    assert fit_warm_steps(warm, 0.0, [warm] * 4) == 1.0 and neighbour_cooling(warm, 0.0, 4, warm) == 0.0
    # the idle gaps' coldness, from a model whose full share comes at the third gap
    full = IDLE_GAPS[2]
    assert fit_idle({g: 0.9 * min(1.0, g / full) for g in IDLE_GAPS}) == pytest.approx((0.9, full))
    assert fit_idle({g: 0.0 for g in IDLE_GAPS}) == (0.0, 1.0)


def test_measure_cache_on_a_real_engine_gives_a_valid_model():
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    config = EngineConfig(model="tiny", dtype="float32", kv_blocks=64, block_size=16)
    engine = LLMEngine.from_config(config)
    rng = np.random.default_rng(0)
    costs = measure_cache(engine, lambda: LLMEngine.from_config(config),
                          lambda n: rng.integers(10, 1000, size=n).tolist(), steps=4, rounds=1)
    assert isinstance(costs, CacheCosts)                 # validated on construction
    assert not engine.has_unfinished()
    assert llc_bytes() >= 1 << 20


BURST = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "2",
         "--num-prompts", "3", "--request-rate", "inf", "--seed", "0"]


def test_colocated_nodes_share_the_hosts_cores(write_profile):
    # three nodes of 2 threads each, a prompt each at once: on 2 cores every step takes 3x
    prof = write_profile()
    apart = simulated(prof, 3, 0, "least-load", None, BURST)
    roomy = simulated(write_profile("r.json", host_cpus=6), 3, 0, "least-load", None, BURST, colocated=True)
    shared = simulated(write_profile("s.json", host_cpus=2), 3, 0, "least-load", None, BURST, colocated=True)
    assert apart["completed"] == roomy["completed"] == shared["completed"] == 3
    assert roomy["median_ttft_ms"] == pytest.approx(apart["median_ttft_ms"], abs=1e-6)
    prefill_ms = 1e3 * (0.004 + 64 * (2e-4 + 1e-7 * 32))           # the toy profile's 64-token prefill
    assert shared["median_ttft_ms"] == pytest.approx(apart["median_ttft_ms"] + 2 * prefill_ms, abs=1e-6)


def test_host_cores_are_checked(write_profile):
    from tools.sim.run import SimUsageError, load_shape

    with pytest.raises(SimUsageError, match="needs --colocated"):
        load_shape(None, str(write_profile()), 2, 0, None, False, 2)
    with pytest.raises(SimUsageError, match="host-cores"):
        load_shape(None, str(write_profile()), 2, 0, None, True, 0)
    assert load_shape(None, str(write_profile(host_cpus=4)), 2, 0, None, True).host_cores == 4
    assert load_shape(None, str(write_profile(host_cpus=4)), 2, 0, None, True, 8).host_cores == 8
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ProfileError, match="host_cpus"):
            load_profile(write_profile(host_cpus=bad), model="tiny")
