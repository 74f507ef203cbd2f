"""PromptTreeRouter: requests go where their prefix is cached, balanced
against load, with the guard both ways; policies by name."""

import pytest

from kvd import protocol
from kvd.coordinator.cache_router import (POLICIES, CostWeights, PromptTreeRouter, make_router,
                                          policy_name)
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


def route(router, m: Membership, prompt: list[int], hold: bool = True) -> str:
    """Pick for ``prompt``; with ``hold`` the request stays in flight there."""
    node = router.pick(m.routable(), prompt)
    if hold:
        node.in_flight.add(f"r{len(node.in_flight)}-{id(prompt)}")
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
