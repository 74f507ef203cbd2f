"""PromptTreeRouter scores many nodes as arrays: the same picks as its
plain loop, on randomized clusters (holdings, evictions, pending prefixes,
requests ending, heartbeats, node subsets, weights, ties, decay)."""

import random

import pytest

from engine.memory.radix import ROOT_HASH, block_hash
from kvd import protocol
from kvd.coordinator.cache_router import CostWeights, PromptTreeRouter
from kvd.coordinator.membership import Membership
from kvd.coordinator.prompt_tree import REMOVED, STORED, Op, PromptTrees

BS = 4


def play(seed: int, array_pick_nodes: int) -> list:
    """One randomized run; everything a pick decided or counted, in order."""
    rng = random.Random(seed)
    n = rng.choice([48, 60, 90])
    m = Membership(deadline=5.0)
    for i in range(n):
        m.register(protocol.Hello(id="h", node=f"n{i:03d}", address=f"inproc://n{i}", incarnation="x",
                                  block_size=BS, blocks_per_tier={"device": 64}), now=0.0)
    infos = list(m.nodes.values())
    weights = rng.choice([CostWeights(), CostWeights(load_decay=0.0), CostWeights(recent_weight=0.0),
                          CostWeights(max_imbalance=0, load_weight=0.5), CostWeights(recent_weight=3.0, load_decay=0.5),
                          CostWeights(overlap_weight=0.0, max_imbalance=2)])
    trees = PromptTrees(BS, pending_ttl=rng.choice([0.0, 0.05, 30.0]))
    router = PromptTreeRouter(trees, weights)
    router.array_pick_nodes = array_pick_nodes
    clock = [0.0]
    router.clock = lambda: clock[0]
    heads = [[rng.randrange(1, 500) for _ in range(rng.randrange(0, 6) * BS)] for _ in range(6)]
    flying: list[tuple] = []
    out = []
    for r in range(400):
        if rng.random() < 0.1:                              # heartbeats say how many run
            for node in rng.sample(infos, 5):
                node.heartbeat = protocol.Heartbeat(id="b", node=node.name, seq=1, load=0, waiting=0,
                                                    free_blocks={}, running=rng.randrange(3))
        nodes = infos if rng.random() < 0.8 else sorted(rng.sample(infos, 40), key=lambda x: x.name)
        prompt = rng.choice(heads) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 3 * BS))]
        rid = f"r{r}" if rng.random() < 0.9 else None
        node = router.pick(nodes, prompt, rid)
        out.append((node.name, router.cache_routed, router.guarded))
        if rid is not None and rng.random() < 0.8:
            node.in_flight.add(rid)
            flying.append((node, rid))
        while flying and rng.random() < 0.45:               # requests end, in any order
            done, drid = flying.pop(rng.randrange(len(flying)))
            done.in_flight.discard(drid)
        tree = trees.for_node(node.name)
        held, ops, parent = tree.held(node.name), [], ROOT_HASH
        for p in range(0, len(prompt) - BS, BS):            # the node caches the prompt's blocks
            blk = tuple(prompt[p:p + BS])
            h = block_hash(parent, blk)
            if h not in held:
                ops.append(Op(STORED, parent, h, blk))
                held[h] = (parent, blk)
            parent = h
        tree.apply(node.name, ops)
        if rng.random() < 0.3:                              # another node evicts a leaf block
            victim = rng.choice(infos).name
            mine = tree.held(victim)
            leaves = [h for h in mine if not any(v[0] == h for v in mine.values())]
            if leaves:
                tree.apply(victim, [Op(REMOVED, 0, rng.choice(leaves))])
        clock[0] += rng.choice([0.0, 0.0, 0.001, 0.02, 0.3, 5.0])
    out.append(router.recent.snapshot(clock[0]))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_array_scoring_picks_what_the_loop_picks(seed):
    assert play(seed, array_pick_nodes=1) == play(seed, array_pick_nodes=1 << 30)


def test_the_cases_are_not_all_alike():
    picks = [play(seed, array_pick_nodes=1) for seed in range(12)]
    chosen = {name for run in picks for name, *_ in run[:-1]}
    assert len(chosen) > 40                                  # spread over the nodes, not one winner
    assert any(cached for run in picks for _, cached, _ in run[:-1])
    assert any(guarded for run in picks for _, _, guarded in run[:-1])
