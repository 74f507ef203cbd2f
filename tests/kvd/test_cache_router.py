"""PromptTreeRouter: requests go where their prefix is cached, balanced
against load, with the guard both ways; policies by name."""

import pytest

from kvd import protocol
from kvd.coordinator.cache_router import (POLICIES, CostWeights, PromptTreeRouter, RecentWork,
                                          make_router, policy_name)
from kvd.coordinator.membership import Membership
from kvd.coordinator.prompt_tree import STORED, Op, PromptTrees
from kvd.coordinator.router import LeastLoadRouter
from engine.memory.radix import ROOT_HASH

BS = 4


def cluster(n: int = 3):
    m = Membership(deadline=5.0)
    for i in range(1, n + 1):
        m.register(protocol.Hello(id="h", node=f"n{i}", address=f"inproc://n{i}", incarnation="x",
                                  block_size=BS, blocks_per_tier={"device": 64}))
    return m


def cache(trees: PromptTrees, node: str, tokens: list[int]) -> None:
    """``node`` holds the full blocks of ``tokens`` (as its events would say)."""
    ops, parent = [], ROOT_HASH
    tree = trees.for_node(node)
    have = tree.held(node)
    for p in range(0, len(tokens) - BS + 1, BS):
        blk = tuple(tokens[p:p + BS])
        h = hash((parent, blk))
        if h not in have:
            ops.append(Op(STORED, parent, h, blk))
        parent = h
    tree.apply(node, ops)


_ids = iter(range(1 << 30))


def route(router, m: Membership, prompt: list[int], hold: bool = True) -> str:
    """Pick for ``prompt``; with ``hold`` the request stays in flight there,
    without it the request has ended by the next pick."""
    rid = f"r{next(_ids)}"
    node = router.pick(m.routable(), prompt, rid)
    if hold:
        node.in_flight.add(rid)
    return node.name


SYSTEM = list(range(100, 100 + 16 * BS))          # a 16-block shared system prompt


def test_a_request_goes_where_its_prefix_is_cached():
    m, trees = cluster(), PromptTrees(BS)
    cache(trees, "n2", SYSTEM)
    router = PromptTreeRouter(trees)
    assert route(router, m, SYSTEM + [1, 2, 3, 4, 5]) == "n2"
    assert router.cache_routed == 1


def test_misses_are_spread_by_load_not_sent_to_one_node():
    m, trees = cluster(), PromptTrees(BS, pending_ttl=0)    # no pending: pure misses
    router = PromptTreeRouter(trees)
    picks = [route(router, m, [i] * (4 * BS)) for i in range(6)]
    assert sorted(picks) == ["n1", "n1", "n2", "n2", "n3", "n3"]


def test_a_burst_sharing_a_new_prefix_does_not_scatter():
    m, trees = cluster(), PromptTrees(BS)
    router = PromptTreeRouter(trees)
    picks = {route(router, m, SYSTEM + [i]) for i in range(4)}
    assert len(picks) == 1                      # pending blocks pull the burst together


def test_an_overloaded_node_gets_no_cache_affine_work():
    m, trees = cluster(), PromptTrees(BS)
    cache(trees, "n1", SYSTEM)
    router = PromptTreeRouter(trees, CostWeights(max_imbalance=2, load_weight=0.0))
    picks = [route(router, m, SYSTEM + [i]) for i in range(6)]
    assert picks[:3] == ["n1"] * 3             # affinity while within the slack
    assert "n1" not in picks[3:4] and router.guarded >= 1
    loads = {n.name: n.load for n in m.routable()}
    assert max(loads.values()) - min(loads.values()) <= 3


def test_uneven_load_keeps_affinity_among_the_eligible_nodes():
    m, trees = cluster(), PromptTrees(BS)
    n1 = m.nodes["n1"]
    n1.in_flight.update({"a", "b", "c", "d", "e", "f"})    # n1 is overloaded
    cache(trees, "n1", SYSTEM)
    cache(trees, "n3", SYSTEM[:12 * BS])                  # n3 holds most of it
    router = PromptTreeRouter(trees)
    # n2 is idle and holds nothing: pure load balance would pick it; n3 is
    # within the slack and caches 12 of 16 blocks, so it wins.
    assert route(router, m, SYSTEM + [7]) == "n3"


def serve_one_at_a_time(router, m, trees, prompts):
    """Each request ends before the next arrives (no load in flight) and its
    node's events confirm the prompt's blocks: the low-load case."""
    picks = []
    for p in prompts:
        node = route(router, m, p, hold=False)
        cache(trees, node, p)
        picks.append(node)
    return picks


def test_a_hot_prefix_spreads_when_requests_end_before_the_next_arrives():
    m, trees = cluster(), PromptTrees(BS)
    router = PromptTreeRouter(trees)
    prompts = [SYSTEM + [1000 + i] * (2 * BS) + [7] for i in range(30)]   # 18 blocks, 16 shared
    picks = serve_one_at_a_time(router, m, trees, prompts)
    counts = [picks.count(n) for n in ("n1", "n2", "n3")]
    assert max(counts) / (sum(counts) / 3) <= 1.3, counts
    # each node computed the shared prefix once: every other pick was a hit
    assert router.cache_routed == 30 - 3


def test_without_the_recent_term_a_hot_prefix_stays_on_one_node():
    """What the decayed term fixes: in-flight counts alone are all 0 here."""
    m, trees = cluster(), PromptTrees(BS)
    router = PromptTreeRouter(trees, CostWeights(load_decay=0.0))
    prompts = [SYSTEM + [1000 + i] * (2 * BS) + [7] for i in range(12)]
    assert set(serve_one_at_a_time(router, m, trees, prompts)) == {"n1"}


def test_a_conversation_keeps_its_node_while_the_nodes_are_balanced():
    m, trees = cluster(), PromptTrees(BS)
    router = PromptTreeRouter(trees)
    convs = [SYSTEM + [2000 + c] * (8 * BS) for c in range(3)]
    first = serve_one_at_a_time(router, m, trees, [c + [1] for c in convs])
    # turn 2 of each: 8 blocks of its own history are cached only on its node
    assert serve_one_at_a_time(router, m, trees, [c + [1, 2] * BS + [3] for c in convs]) == first


def test_recent_work_decays_exponentially_and_zero_decay_is_off():
    work = RecentWork(decay=10.0)
    work.add("n1", 8.0, now=100.0)
    work.add("n1", 8.0, now=100.0)
    assert work.value("n1", 100.0) == 16.0
    assert work.value("n1", 100.0 + 10.0 * 0.6931471805599453) == pytest.approx(8.0)
    assert work.value("n2", 100.0) == 0.0
    off = RecentWork(decay=0.0)
    off.add("n1", 8.0, now=1.0)
    assert off.value("n1", 1.0) == 0.0


def test_work_in_flight_counts_only_once_it_has_ended():
    m = cluster()
    n1 = m.nodes["n1"]
    work = RecentWork(decay=10.0)
    work.open("n1", "a", 20.0)
    n1.in_flight.add("a")
    work.settle(m.routable(), now=5.0)
    assert work.value("n1", 5.0) == 0.0                 # still in flight: the load term's
    n1.in_flight.discard("a")
    work.settle(m.routable(), now=6.0)
    assert work.value("n1", 6.0) == 20.0
    work.open("gone", "b", 3.0)                         # its node left: settled too
    work.settle(m.routable(), now=6.0)
    assert work.value("gone", 6.0) == 3.0


@pytest.mark.parametrize("bad", [dict(load_decay=-1.0), dict(load_decay=float("nan")),
                                 dict(recent_weight=-0.5), dict(load_decay=float("inf"))])
def test_cost_weights_reject_bad_values(bad):
    with pytest.raises(ValueError):
        CostWeights(**bad)


def test_policies_by_name():
    trees = PromptTrees(BS)
    assert set(POLICIES) == {"prompt-tree", "session", "least-load"}
    for name in POLICIES:
        assert policy_name(make_router(name, trees)) == name
    assert isinstance(make_router("session", trees, affinity_tokens=0), LeastLoadRouter)
    with pytest.raises(ValueError, match="routing policy"):
        make_router("random", trees)
    with pytest.raises(ValueError):
        CostWeights(load_weight=-1)


def test_ended_work_is_summed_in_the_order_it_was_opened():
    m = cluster()
    n1 = m.nodes["n1"]
    work = RecentWork(decay=10.0)
    for rid, blocks in (("a", 1e16), ("b", 1.0), ("c", 1.0)):
        work.open("n1", rid, blocks)
    n1.in_flight.clear()
    work.settle(m.routable(), now=1.0)
    assert work.value("n1", 1.0) == (1e16 + 1.0) + 1.0       # not 1e16 + (1.0 + 1.0)
