"""GlobalPromptTree: events from the nodes, validation, pending prefixes, reports."""

import pytest

from engine.memory.radix import ROOT_HASH
from kvd import protocol
from kvd.cache_events import pack, unpack
from kvd.coordinator.prompt_tree import (REMOVED, STORED, GlobalPromptTree, InvalidEvents, Op,
                                         PromptTrees, block_hashes)
from engine.memory.radix import BlockRef, BlockRemoved, BlockStored

BS = 4


def chain(*blocks: int, parent: int = ROOT_HASH) -> list[Op]:
    """STORED ops for a path of blocks, each BS copies of one token."""
    ops = []
    for b in blocks:
        tokens = (b,) * BS
        h = hash((parent, tokens))
        ops.append(Op(STORED, parent, h, tokens))
        parent = h
    return ops


def toks(*blocks: int) -> list[int]:
    return [b for b in blocks for _ in range(BS)]


def removed(op: Op) -> Op:
    return Op(REMOVED, 0, op.block_hash)


def state(tree: GlobalPromptTree) -> dict:
    return {n: tree.held(n) for n in tree.nodes()}


def test_stores_and_removes_track_holders():
    tree = GlobalPromptTree(BS)
    a = chain(1, 2, 3)
    tree.apply("n1", a)
    tree.apply("n2", a[:2])
    assert tree.match(toks(1, 2, 3, 4)) == {"n1": 3, "n2": 2}
    assert tree.num_blocks() == 3 and tree.num_blocks("n2") == 2
    tree.apply("n1", [removed(a[2]), removed(a[1])])
    assert tree.match(toks(1, 2, 3)) == {"n1": 1, "n2": 2}
    tree.apply("n2", [removed(a[1]), removed(a[0])])
    assert tree.num_blocks() == 1 and tree.nodes() == ["n1"]
    tree.check_integrity()


def test_match_needs_a_consecutive_prefix_and_checks_tokens():
    tree = GlobalPromptTree(BS)
    tree.apply("n1", chain(1, 2))
    assert tree.match(toks(2, 1)) == {}
    assert tree.match(toks(1)[:-1]) == {}           # no full block
    assert tree.match(toks(1, 9, 2)) == {"n1": 1}


@pytest.mark.parametrize("bad, why", [
    (lambda a: [Op(STORED, ROOT_HASH, a[0].block_hash, (1,) * (BS - 1))], "tokens"),
    (lambda a: [Op(STORED, ROOT_HASH, a[0].block_hash + 1, a[0].tokens)], "hash"),
    (lambda a: [a[1]], "parent"),
    (lambda a: [a[0], a[0]], "twice"),
    (lambda a: [a[0], a[1], removed(a[0])], "children"),
    (lambda a: [removed(a[0])], "not held"),
    (lambda a: [a[0], Op(7, 0, a[0].block_hash)], "kind"),
])
def test_invalid_batches_change_nothing(bad, why):
    tree = GlobalPromptTree(BS)
    a = chain(1, 2)
    tree.apply("n2", chain(5))
    before = state(tree)
    with pytest.raises(InvalidEvents, match=why):
        tree.apply("n1", [*chain(7), *bad(a)])        # a valid op first: it must not stick
    assert state(tree) == before
    tree.check_integrity()


def test_a_hash_collision_is_refused():
    tree = GlobalPromptTree(BS)
    a = chain(1)
    tree.apply("n1", a)
    tree._blocks[a[0].block_hash].tokens = (9,) * BS      # pretend another block has this hash
    with pytest.raises(InvalidEvents, match="collision"):
        tree.apply("n2", a)


def test_replace_is_a_resync_and_drop_forgets_a_node():
    tree = GlobalPromptTree(BS)
    tree.apply("n1", chain(1, 2, 3))
    tree.apply("n2", chain(1, 2))
    tree.replace("n1", chain(4))
    assert tree.held("n1") == {o.block_hash: (o.parent, o.tokens) for o in chain(4)}
    assert tree.match(toks(1, 2, 3)) == {"n2": 2}
    with pytest.raises(InvalidEvents):
        tree.replace("n1", [removed(chain(4)[0])])
    with pytest.raises(InvalidEvents):
        tree.replace("n1", [chain(5, 6)[1]])           # its parent is not in it
    assert tree.match(toks(4)) == {"n1": 1}           # unchanged by the refused snapshots
    tree.drop("n2")
    assert tree.match(toks(1, 2)) == {} and tree.nodes() == ["n1"]
    tree.check_integrity()


def test_pending_prefixes_count_until_confirmed_or_expired():
    tree = GlobalPromptTree(BS, pending_ttl=10.0)
    tree.apply("n1", chain(1))
    tree.add_pending("n2", block_hashes(toks(1, 2, 3), BS), now=100.0)
    assert tree.match(toks(1, 2, 3, 4), now=101.0) == {"n1": 1, "n2": 3}
    tree.apply("n2", chain(1, 2))                     # confirms two of the three
    assert tree.num_pending() == 1
    assert tree.match(toks(1, 2, 3), now=109.0) == {"n1": 1, "n2": 3}
    assert tree.match(toks(1, 2, 3), now=111.0) == {"n1": 1, "n2": 2}   # expired, not confirmed
    tree.expire(now=111.0)
    assert tree.num_pending() == 0
    tree.add_pending("n3", block_hashes(toks(8), BS), now=0.0)
    tree.drop("n3")
    assert tree.num_pending() == 0


def test_describe_shows_blocks_tokens_and_shared_prefixes_without_tokens():
    trees = PromptTrees(BS)
    tree = trees.of_role("mixed")
    system = chain(1, 2, 3)
    tree.apply("n1", [*system, *chain(4, parent=system[-1].block_hash),
                      *chain(5, parent=system[-1].block_hash)])
    tree.apply("n2", system[:2])
    d = trees.describe()["mixed"]
    n1 = d["nodes"]["n1"]
    assert (n1["blocks"], n1["tokens"]) == (5, 5 * BS)
    # the 3-block system prompt branches two ways; 2 blocks of it are on both nodes
    assert [(p["blocks"], p["nodes"], p["branches"]) for p in n1["shared_prefixes"]] == [
        (3, ["n1"], 2), (2, ["n1", "n2"], 1)]
    assert all(set(p) == {"blocks", "tokens", "hash", "nodes", "branches"} for p in n1["shared_prefixes"])


def test_roles_keep_their_own_trees():
    trees = PromptTrees(BS)
    trees.set_role("p1", "prefill")
    trees.for_node("p1").apply("p1", chain(1))
    assert trees.of_role("mixed").match(toks(1)) == {}
    trees.set_role("p1", "mixed")                     # a role switch leaves the old tree
    assert trees.of_role("prefill").nodes() == []


def roundtrip(msg: protocol.Message):
    header, frames = protocol.encode(msg)
    return protocol.decode(header, [bytes(f) for f in frames])


def test_events_travel_as_two_int64_frames():
    a = chain(1, 2)
    events = [BlockStored("n1", o.parent, o.block_hash, o.tokens, BlockRef("device", i, "n1"))
              for i, o in enumerate(a)] + [BlockRemoved("n1", a[1].block_hash)]
    msg = roundtrip(pack("n1", 7, BS, events))
    assert isinstance(msg, protocol.CacheEvents) and msg.seq == 7
    assert unpack(msg) == [*a, removed(a[1])]
    assert unpack(roundtrip(pack("n1", 0, BS, []))) == []


@pytest.mark.parametrize("change", [
    lambda b: b.update(block_size=BS + 1),                                       # tokens rows
    lambda b: b["frames"][0].update(shape=[1, 4]),                               # ops not [n, 3]
    lambda b: b["frames"][1].update(dtype="int32"),
    lambda b: b.update(snapshot=True),                                           # a removal in it
    lambda b: b.update(seq=-1),
])
def test_malformed_cache_events_are_rejected(change):
    import orjson
    a = chain(1)
    events = [BlockStored("n1", a[0].parent, a[0].block_hash, a[0].tokens, BlockRef("device", 0, "n1")),
              BlockRemoved("n1", a[0].block_hash)]
    header, frames = protocol.encode(pack("n1", 0, BS, events))
    body = orjson.loads(header)
    change(body)
    frames = [bytes(f) for f in frames]
    if body["frames"][1]["dtype"] == "int32":
        frames[1] = frames[1][:len(frames[1]) // 2]
    if body["frames"][0]["shape"] == [1, 4]:
        frames[0] = frames[0][:32]
    out = protocol.decode(orjson.dumps(body), frames)
    assert isinstance(out, protocol.ProtocolError) and out.reason == "invalid_field", out


def test_bad_kinds_and_negative_tokens_are_rejected():
    from array import array
    ops = array("q", [2, 0, 5])
    toks_ = array("q", [-1] * BS)
    for o, t, shape in ((ops, array("q"), (0, BS)), (array("q", [1, 0, 5]), toks_, (1, BS))):
        with pytest.raises(ValueError):
            protocol.CacheEvents(node="n1", seq=0, block_size=BS, tensors=(
                protocol.RawTensor("int64", (1, 3), memoryview(o).cast("B")),
                protocol.RawTensor("int64", shape, memoryview(t).cast("B"))))


@pytest.mark.parametrize("seed", range(6))
def test_match_counts_each_nodes_own_leading_blocks_on_random_trees(seed):
    """``match`` against a walk of each node's own holdings and pending
    entries, on trees many nodes share (stores, evictions, pending, expiry)."""
    import random
    rng = random.Random(seed)
    tree = GlobalPromptTree(BS, pending_ttl=5.0)
    nodes = [f"n{i}" for i in range(30)]
    pending: dict[tuple[str, int], float] = {}
    prompts = [toks(*[rng.randrange(3) for _ in range(rng.randrange(1, 7))]) for _ in range(40)]
    now = 0.0
    for _ in range(300):
        node, prompt = rng.choice(nodes), rng.choice(prompts)
        hashes = block_hashes(prompt, BS)
        if rng.random() < 0.5:                         # the node caches a prefix of the prompt
            held = tree.held(node)
            k = rng.randrange(1, len(hashes) + 1)
            ops = [Op(STORED, ([ROOT_HASH] + hashes)[i], hashes[i], tuple(prompt[i * BS:(i + 1) * BS]))
                   for i in range(k) if hashes[i] not in held]
            tree.apply(node, ops)
            for op in ops:
                pending.pop((node, op.block_hash), None)
        elif rng.random() < 0.5:                       # a routing decision: pending on the node
            tree.add_pending(node, hashes, now)
            pending.update(dict.fromkeys(((node, h) for h in hashes), now + 5.0))
        else:                                          # the node evicts a leaf
            held = tree.held(node)
            leaves = [h for h in held if not any(p == h for p, _ in held.values())]
            if leaves:
                tree.apply(node, [Op(REMOVED, 0, rng.choice(leaves))])
        now += rng.choice([0.0, 0.5, 2.0])
        prompt = rng.choice(prompts) + [7] * rng.randrange(2 * BS)
        expected = {}
        for n in nodes:
            held, depth = tree.held(n), 0
            for h in block_hashes(prompt, BS):
                if h not in held and pending.get((n, h), -1.0) <= now:
                    break
                depth += 1
            if depth:
                expected[n] = depth
        assert tree.match(prompt, now) == expected
    tree.check_integrity()
