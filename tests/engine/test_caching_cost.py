"""The context-caching cost model: its decision, and the scheduler acting on it.

Unit tests use hand-chosen coefficients (seconds); engine tests run a tiny
random model whose cached prefix is forced into the host tier
(``MemPool.swap_out``) and check that swapping it in and recomputing it give
the same greedy tokens and return every block.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from engine.config import EngineConfig
from engine.memory.caching_cost import CachingCostModel
from engine.memory.mempool import MemPool
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

BS = 16
D, H = False, True                       # a hit block on the device / host tier


def model(a=1e-3, b=0.0, fixed=0.0, s=1e-4) -> CachingCostModel:
    return CachingCostModel(token_s=a, attention_s=b, fixed_s=fixed, swap_block_s=s)


# ------------------------------------------------------------------ the model

def test_prefill_seconds_is_linear_plus_attention_over_the_context():
    m = model(a=1e-3, b=1e-6, fixed=0.01)
    assert m.prefill_seconds(0, 500) == pytest.approx(0.01)
    # 10 tokens at positions 100..109: a each, plus b times their mean position 105
    assert m.prefill_seconds(10, 100) == pytest.approx(0.01 + 10 * 1e-3 + 10 * 1e-6 * 105)


def test_cheap_swap_keeps_the_whole_hit():
    m = model(a=1e-3, s=1e-5)                           # a block's swap: 1/1600 of its recompute
    assert m.reuse_blocks([D, D, H, H], 100, BS) == 4
    assert m.reuse_blocks([H, H, H], 100, BS) == 3


def test_dear_swap_keeps_the_device_part_only():
    m = model(a=1e-3, s=1.0)                            # a block's swap: 60x its recompute
    assert m.reuse_blocks([D, D, H, H], 100, BS) == 2
    assert m.reuse_blocks([H, H, H], 100, BS) == 0


def test_no_host_blocks_and_no_hit():
    m = model(s=1e9)
    assert m.reuse_blocks([D, D, D], 100, BS) == 3
    assert m.reuse_blocks([], 1, BS) == 0


def test_ties_go_to_reuse():
    assert model(a=0.0, s=0.0).reuse_blocks([D, H, H], 100, BS) == 3


def test_position_decides_under_attention_cost():
    """The same two host blocks: recomputed at the prompt's start, swapped in
    deep in a long context, where their attention makes them dear."""
    m = model(a=0.0, b=1e-6, s=BS * 1e-6 * 100)        # break-even near position 100
    assert m.reuse_blocks([H, H], 600, BS) == 0          # positions 0..31
    assert m.reuse_blocks([D] * 10 + [H, H], 600, BS) == 12   # positions 160..191


def test_interleaved_tiers_pick_a_run_boundary():
    m = model(a=1e-3, s=1.0)
    assert m.reuse_blocks([D, H, D, H], 100, BS) == 1
    assert model(a=1e-3, s=1e-5).reuse_blocks([D, H, D, H], 100, BS) == 4


@pytest.mark.parametrize("seed", range(20))
def test_reuse_blocks_is_the_best_of_every_cut(seed):
    """Pricing only run boundaries (the cost is concave within a host run) finds
    the cheapest of all cuts ``0..n`` of the hit."""
    rng = random.Random(seed)
    m = model(a=rng.uniform(0, 1e-3), b=rng.uniform(0, 1e-5), fixed=0.01, s=rng.uniform(0, 0.05))
    n = rng.randint(0, 12)
    on_host = [rng.random() < 0.5 for _ in range(n)]
    prompt = n * BS + rng.randint(1, 300)
    # the device blocks before the first host block are always reused
    lead = on_host.index(True) if H in on_host else n
    best = min(m.cost_of_keeping(on_host, k, prompt, BS) for k in range(n + 1))
    k = m.reuse_blocks(on_host, prompt, BS)
    assert k >= lead
    assert m.cost_of_keeping(on_host, k, prompt, BS) == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_hit_covering_the_prompt_is_refused():
    with pytest.raises(ValueError, match="nothing"):
        model().reuse_blocks([D, H], 2 * BS, BS)


@pytest.mark.parametrize("field, value", list(itertools.product(
    ("token_s", "attention_s", "fixed_s", "swap_block_s"), (-1e-3, math.nan, math.inf, "1"))))
def test_bad_coefficients_are_refused(field, value):
    kw = dict(token_s=1e-3, attention_s=0.0, fixed_s=0.0, swap_block_s=0.0)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        CachingCostModel(**kw)


@pytest.mark.parametrize("field", ("cost_token_s", "cost_attention_s", "cost_fixed_s", "cost_swap_block_s"))
@pytest.mark.parametrize("value", (-1.0, math.nan, math.inf))
def test_engine_config_refuses_bad_coefficients(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_policies_are_validated():
    with pytest.raises(ValueError, match="host_hit_policy"):
        EngineConfig(host_hit_policy="never")
    with pytest.raises(ValueError, match="caching_cost"):
        SchedulerConfig(host_hit_policy="cost")
    assert EngineConfig(host_hit_policy="swap").scheduler_config(0).caching_cost is None


# ------------------------------------------------------------------ the scheduler

SWAP_WINS = model(a=1e-3, s=1e-6)
RECOMPUTE_WINS = model(a=1e-3, s=10.0)


def host_hit_scheduler(policy: str, caching_cost=None, host_blocks=3):
    """A scheduler over a bookkeeping pool (no storage) whose cache holds a
    5-block prefix, its last ``host_blocks`` blocks in the host tier."""
    pool = MemPool(32, 32, BS, storage=None)
    prefix = list(range(1000, 1000 + 5 * BS))
    pool.insert(prefix, pool.alloc_mem(5))
    assert pool.swap_out(host_blocks) == host_blocks
    sched = Scheduler(SchedulerConfig(block_size=BS, host_hit_policy=policy, caching_cost=caching_cost), pool)
    req = Request(request_id="r", prompt_ids=prefix + [7, 8, 9],
                  params=SamplingParams(max_tokens=4, temperature=0.0))
    sched.add(req)
    return sched, pool, req


@pytest.mark.parametrize("policy, cost, kept, swapped, recomputed", [
    ("swap", None, 5, 3, 0),
    ("recompute", None, 2, 0, 3),
    ("cost", SWAP_WINS, 5, 3, 0),
    ("cost", RECOMPUTE_WINS, 2, 0, 3),
])
def test_admission_acts_on_the_policy(policy, cost, kept, swapped, recomputed):
    sched, pool, req = host_hit_scheduler(policy, cost)
    batch = sched.schedule()
    assert batch.prefill == [req] and batch.prefill_lens == [len(req.prompt_ids) - kept * BS]
    assert (batch.host_blocks_swapped_in, batch.host_blocks_recomputed) == (swapped, recomputed)
    assert req.num_computed == req.num_cached_tokens == kept * BS
    assert req.num_prefix_blocks == kept and len(req.block_ids) == 6
    assert pool.stats()["device"]["cached"] == 2 + swapped
    assert pool.stats()["hit_tokens"] == kept * BS
    assert pool.stats()["host"]["cached"] == 3 - swapped        # recomputed blocks stay cached on host
    sched.release_memory(req)
    pool.check_integrity()
    assert pool.live_hits == 0 and pool.stats()["device"]["request_owned"] == 0
    assert sum(pool.flush().values()) == 5
    assert pool.stats()["device"]["free"] == 32 and pool.stats()["host"]["free"] == 32


def test_recompute_cut_that_cannot_be_admitted_releases_its_lock():
    """A request whose shortened hit finds no fresh blocks waits, holding nothing."""
    sched, pool, req = host_hit_scheduler("recompute")
    hog = pool.alloc_mem(pool.stats()["device"]["free"])             # device: only the 2 cached blocks
    assert sched.schedule() is None and sched.waiting[0] is req
    assert pool.live_hits == 0 and pool.stats()["device"]["evictable"] == 2
    pool.free_mem(hog)
    assert sched.schedule().prefill == [req]
    sched.release_memory(req)
    pool.check_integrity()


# ------------------------------------------------------------------ the engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompt_pair(seed: int = 21) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(100, 40000) for _ in range(75)]       # 4 full blocks + 11
    return base, base + [rng.randrange(100, 40000) for _ in range(9)]


@pytest.mark.parametrize("chunk", [256, 16])
@pytest.mark.parametrize("on_host", [4, 2])          # all of the cached prefix, or its last half
def test_swap_or_recompute_of_a_host_prefix_gives_the_same_tokens(make_tiny, chunk, on_host):
    base, prompt = prompt_pair()
    cold = make_tiny(enable_prefix_caching=False).generate([prompt], GREEDY)[0]
    runs = {"swap": {}, "recompute": {},
            "cost-swaps": dict(host_hit_policy="cost", cost_token_s=1e-3, cost_swap_block_s=1e-6),
            "cost-recomputes": dict(host_hit_policy="cost", cost_token_s=1e-3, cost_swap_block_s=10.0)}
    counts = {}
    for name, kw in runs.items():
        eng = make_tiny(prefill_chunk_tokens=chunk, **({"host_hit_policy": name} if not kw else kw))
        eng.generate([base[:4 * BS + 1]], SamplingParams(max_tokens=1, temperature=0.0))   # caches 4 blocks
        assert eng.pool.stats()["device"]["cached"] == 4
        assert eng.pool.swap_out(on_host) == on_host
        assert eng.generate([prompt], GREEDY)[0] == cold, name
        counts[name] = (eng.stats.host_blocks_swapped_in, eng.stats.host_blocks_recomputed,
                        eng.stats.prefix_hit_tokens)
        eng.check_integrity()
        pool = eng.pool.stats()
        assert pool["live_hits"] == 0
        assert pool["device"]["request_owned"] == 0 and pool["host"]["request_owned"] == 0
        eng.pool.flush()
        pool = eng.pool.stats()
        assert pool["device"]["free"] == pool["device"]["total"]
        assert pool["host"]["free"] == pool["host"]["total"]
    swapped, recomputed = (on_host, 0, 4 * BS), (0, on_host, (4 - on_host) * BS)
    assert counts == {"swap": swapped, "cost-swaps": swapped,
                      "recompute": recomputed, "cost-recomputes": recomputed}
