"""engine/team.py: each decode step's team size from measured step times, and the engine
stepping on it: the same tokens whatever sizes the steps ran on."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.team import TeamSizer


def run(sizer: TeamSizer, rows: int, steps: int, seconds: dict[int, float]) -> list[int]:
    """``steps`` steps of ``rows`` rows, each size taking ``seconds[size]``: the sizes used."""
    used = []
    for _ in range(steps):
        size = sizer.pick(rows)
        sizer.record(rows, size, seconds[size])
        used.append(size)
    return used


def test_every_candidate_is_measured_then_the_fastest_runs_with_rare_exploring_steps():
    sizer = TeamSizer([2, 1], explore_every=8)
    used = run(sizer, 1, 64, {2: 0.004, 1: 0.010})
    assert used[:2] == [2, 1]                               # each measured once, the default first
    assert used[2:].count(1) == 8 and sizer.best(1) == 2    # then 2, one step in eight on the other


def test_a_neighbour_that_slows_the_whole_team_moves_steps_to_fewer_threads_and_back():
    """The host changes under it: the whole team becomes the slow choice (a busy process
    shares one of its CPUs), then fast again once the neighbour is gone."""
    sizer = TeamSizer([2, 1], explore_every=8)
    run(sizer, 1, 32, {2: 0.004, 1: 0.006})
    assert sizer.best(1) == 2
    used = run(sizer, 1, 64, {2: 0.040, 1: 0.006})
    assert sizer.best(1) == 1 and used[-16:].count(1) >= 14
    run(sizer, 1, 64, {2: 0.004, 1: 0.006})
    assert sizer.best(1) == 2


def test_batch_size_classes_are_measured_apart():
    sizer = TeamSizer([2, 1], explore_every=8)
    run(sizer, 1, 32, {2: 0.010, 1: 0.004})                 # one row: one thread wins
    run(sizer, 32, 32, {2: 0.040, 1: 0.070})                # 32 rows: the team wins
    assert sizer.best(1) == 1 and sizer.best(32) == 2
    assert sizer.best(3) == 2                               # its class unmeasured: the default
    assert set(sizer.seconds()) == {"<= 1 rows", "> 16 rows"}


def test_bad_candidates_are_refused_and_one_candidate_is_never_explored():
    with pytest.raises(ValueError):
        TeamSizer([])
    with pytest.raises(ValueError):
        TeamSizer([2, 0])
    with pytest.raises(ValueError):
        TeamSizer([2, 1], explore_every=1)
    only = TeamSizer([3, 3])
    assert only.sizes == (3,) and run(only, 1, 10, {3: 0.01}) == [3] * 10
    only.record(1, 7, 0.5)                                   # not a candidate: ignored
    assert only.seconds() == {"<= 1 rows": {3: 0.01}}


def engine(decode_threads: int) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", kv_blocks=128, host_kv_blocks=0, num_threads=2,
                                              decode_threads=decode_threads))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=5)])
def test_steps_on_changing_team_sizes_give_the_tokens_of_a_fixed_team(sampling):
    """The plan executor's bits do not depend on the thread count: an engine whose steps
    run on the sizes the sizer picks (exploring every other step here) decodes exactly the
    tokens of one fixed to a single thread, greedy and seeded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        adaptive, fixed = engine(0), engine(1)
        if adaptive.runner.team is None:
            pytest.skip("no one-call decoder with small teams on this host")
        adaptive.runner.team = TeamSizer(adaptive.runner.team.sizes, explore_every=2)
        assert adaptive.kernels()["decode_threads"].startswith("adaptive: 2, 1")
        assert fixed.runner.team is None and fixed.kernels()["decode_threads"].startswith("1 ")
        params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
        prompts = [[11, 12, 13, 14], [200, 3, 3, 40, 41, 42, 43], [7] * 20]
        assert adaptive.generate(prompts, params) == fixed.generate(prompts, params)
        assert set(adaptive.runner.team.seconds()["<= 4 rows"]) == {1, 2}      # both sizes ran
    finally:
        torch.set_num_threads(threads)
