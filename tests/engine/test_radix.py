"""RadixTree: prefix index over full token blocks, locks, LRU eviction, events."""

import pytest
from hypothesis import given, settings, strategies as st

from engine.memory.radix import ROOT_HASH, BlockRef, BlockRemoved, BlockStored, RadixTree

BS = 4


def dev(i: int) -> BlockRef:
    return BlockRef("device", i, "local")


def host(i: int) -> BlockRef:
    return BlockRef("host", i, "local")


class Ids:
    """Hands out fresh refs."""

    def __init__(self) -> None:
        self.n = 0

    def take(self, k: int, tier: str = "device") -> list[BlockRef]:
        out = [BlockRef(tier, self.n + j, "local") for j in range(k)]
        self.n += k
        return out


def toks(*blocks: int) -> list[int]:
    """One block of BS equal tokens per argument."""
    return [b for b in blocks for _ in range(BS)]


def test_insert_then_match_full_blocks_only():
    tree = RadixTree(BS)
    assert tree.insert(toks(1, 2, 3) + [9, 9], [dev(0), dev(1), dev(2)]) == 0
    m = tree.match(toks(1, 2, 3, 4))
    assert m.blocks == [dev(0), dev(1), dev(2)] and m.num_tokens == 3 * BS
    m = tree.match(toks(1, 2) + [3, 3])            # partial third block: not a hit
    assert m.blocks == [dev(0), dev(1)] and m.num_tokens == 2 * BS
    assert tree.match(toks(7)).num_tokens == 0
    assert tree.match([]).blocks == []
    tree.check_integrity()


def test_insert_reports_present_and_never_replaces():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2), [dev(0), dev(1)])
    assert tree.insert(toks(1, 2, 3), [dev(5), dev(6), dev(2)]) == 2
    assert tree.match(toks(1, 2, 3)).blocks == [dev(0), dev(1), dev(2)]
    assert not tree.holds(dev(5))
    assert tree.insert(toks(1, 2, 3), [dev(7), dev(8), dev(9)]) == 3
    assert tree.num_cached("device") == 3
    tree.check_integrity()


def test_diverging_insert_splits_and_both_match():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2, 3, 4), [dev(0), dev(1), dev(2), dev(3)])
    assert tree.insert(toks(1, 2, 8), [dev(10), dev(11), dev(4)]) == 2
    assert tree.match(toks(1, 2, 3, 4)).blocks == [dev(0), dev(1), dev(2), dev(3)]
    assert tree.match(toks(1, 2, 8)).blocks == [dev(0), dev(1), dev(4)]
    assert tree.match(toks(1, 2, 9)).blocks == [dev(0), dev(1)]
    tree.check_integrity()


def test_insert_validation():
    tree = RadixTree(BS)
    with pytest.raises(ValueError):
        tree.insert(toks(1, 2), [dev(0)])
    tree.insert(toks(1), [dev(0)])
    with pytest.raises(ValueError):
        tree.insert(toks(2), [dev(0)])           # ref already cached elsewhere
    with pytest.raises(ValueError):
        tree.insert(toks(3, 4), [dev(1), dev(1)])
    tree.check_integrity()
    assert tree.num_cached() == 1


def test_lock_protects_and_unlock_below_zero_raises():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2, 3), [dev(0), dev(1), dev(2)])
    m = tree.match(toks(1, 2))                   # splits: the lock covers 2 blocks
    tree.lock(m.last_node)
    assert tree.evictable("device") == 1
    assert tree.evict(10) == [dev(2)]
    assert tree.match(toks(1, 2, 3)).blocks == [dev(0), dev(1)]
    tree.check_integrity()
    tree.unlock(m.last_node)
    with pytest.raises(ValueError):
        tree.unlock(m.last_node)
    assert sorted(tree.evict(10)) == [dev(0), dev(1)]
    tree.check_integrity()
    with pytest.raises(ValueError):
        tree.lock(m.last_node)                   # removed node: stale handle


def test_evict_lru_order_and_exact_count():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2), [dev(0), dev(1)])
    tree.insert(toks(3, 4), [dev(2), dev(3)])
    tree.insert(toks(5, 6), [dev(4), dev(5)])
    tree.match(toks(1, 2))                       # 1,2 is now most recent
    assert tree.evict(3) == [dev(3), dev(2), dev(5)]   # deepest first within a leaf
    assert tree.match(toks(5)).blocks == [dev(4)]
    assert tree.evict(0) == []
    tree.check_integrity()


def test_evict_only_counts_requested_tier():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2), [dev(0), host(0)])     # device prefix, host extension
    tree.insert(toks(3), [host(1)])
    assert tree.evictable("device") == 1 and tree.evictable("host") == 2
    # the device block hides under a host leaf: evict removes both
    assert tree.evict(1, "device") == [host(0), dev(0)]
    assert tree.num_cached("host") == 1            # the unrelated host leaf stays
    assert tree.evict(5, "device") == []
    tree.check_integrity()


def test_evict_does_not_remove_useless_other_tier_leaves():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2), [dev(0), host(0)])
    m = tree.match(toks(1))
    tree.lock(m.last_node)
    assert tree.evict(5, "device") == []
    assert tree.num_cached() == 2
    tree.unlock(m.last_node)
    tree.check_integrity()


def test_delete_contract():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2, 3), [dev(0), dev(1), dev(2)])
    tree.insert(toks(1, 2, 4), [dev(9), dev(8), dev(3)])
    assert tree.delete(toks(1, 2)) == []          # shared with longer prompts
    assert tree.delete(toks(1)) == []             # ends inside a node
    assert tree.delete(toks(1, 2, 3)) == [dev(2)] # 1,2 still used by 1,2,4
    assert tree.delete(toks(1, 2, 4)) == [dev(3), dev(1), dev(0)]
    assert tree.num_cached() == 0
    tree.insert(toks(5, 6), [dev(5), dev(6)])
    m = tree.match(toks(5))
    tree.lock(m.last_node)
    assert tree.delete(toks(5, 6)) == [dev(6)]    # stops at the locked node
    assert tree.delete(toks(7)) == []
    tree.check_integrity()


def test_relocate_splits_by_tier_and_keeps_match():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2, 3, 4), [dev(0), dev(1), dev(2), dev(3)])
    m = tree.match(toks(1, 2, 3, 4))
    tree.lock(m.last_node)
    tree.relocate([(dev(1), host(7)), (dev(3), host(8))])
    assert tree.match(toks(1, 2, 3, 4)).blocks == [dev(0), host(7), dev(2), host(8)]
    tree.check_integrity()
    tree.unlock(m.last_node)                       # handle still covers the whole path
    assert tree.evictable("device") == 2 and tree.evictable("host") == 2
    with pytest.raises(ValueError):
        tree.relocate([(dev(1), host(9))])         # not cached
    with pytest.raises(ValueError):
        tree.relocate([(dev(0), host(7))])         # target already cached
    tree.check_integrity()


def test_swap_candidates_lru_deepest_first_and_unlocked():
    tree = RadixTree(BS)
    tree.insert(toks(1, 2), [dev(0), dev(1)])
    tree.insert(toks(3, 4), [dev(2), dev(3)])
    m = tree.match(toks(3, 4))
    assert tree.swap_candidates(3) == [dev(1), dev(0), dev(3)]
    tree.lock(m.last_node)
    assert tree.swap_candidates(10) == [dev(1), dev(0)]
    tree.unlock(m.last_node)
    # a device node whose only child is host is a candidate
    tree.relocate([(dev(1), host(1))])
    assert tree.swap_candidates(1) == [dev(0)]
    assert tree.swap_candidates(0) == []
    tree.check_integrity()


def test_events_chain_and_drain():
    tree = RadixTree(BS, node_id="n1")
    a, b = BlockRef("device", 0, "n1"), BlockRef("device", 1, "n1")
    tree.insert(toks(1, 2), [a, b])
    ev = tree.take_events()
    assert [type(e) for e in ev] == [BlockStored, BlockStored]
    h1 = hash((ROOT_HASH, tuple(toks(1))))
    assert ev[0] == BlockStored("n1", ROOT_HASH, h1, tuple(toks(1)), a)
    assert ev[1].parent_hash == h1 and ev[1].block_hash == hash((h1, tuple(toks(2))))
    assert tree.take_events() == []
    tree.evict(1)
    assert tree.take_events() == [BlockRemoved("n1", ev[1].block_hash)]
    tree.insert(toks(1, 2), [a, b])                # a is present: only b is stored
    assert [e.ref for e in tree.take_events()] == [b]


def test_events_cap_and_disable():
    tree = RadixTree(BS, max_events=3)
    tree.insert(toks(1, 2, 3, 4, 5), Ids().take(5))
    ev = tree.take_events()
    assert len(ev) == 3 and tree.events_dropped == 2
    assert ev[-1].tokens == tuple(toks(5))         # the newest are kept
    quiet = RadixTree(BS, enable_events=False)
    quiet.insert(toks(1, 2), [dev(0), dev(1)])
    quiet.evict(2)
    assert quiet.take_events() == []
    quiet.check_integrity()


# ---------------------------------------------------------------- properties

prompt = st.lists(st.integers(0, 2), min_size=0, max_size=6).map(
    lambda bs: [b for b in bs for _ in range(2)])    # block size 2, tiny alphabet: lots of sharing

ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), prompt, st.sampled_from(["device", "host"])),
    st.tuples(st.just("match"), prompt, st.booleans()),
    st.tuples(st.just("unlock"), st.integers(0, 9), st.none()),
    st.tuples(st.just("evict"), st.integers(0, 5), st.sampled_from(["device", "host"])),
    st.tuples(st.just("delete"), prompt, st.none()),
    st.tuples(st.just("swap"), st.integers(0, 4), st.sampled_from(["device", "host"])),
), max_size=50)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_ops_against_model(ops):
    """The tree agrees with a dict of cached block-paths and never loses a ref."""
    tree = RadixTree(2)
    ids = Ids()
    model: dict[tuple[int, ...], BlockRef] = {}     # full-block prefix -> ref
    locks = []
    for op, arg, extra in ops:
        if op == "insert":
            nb = len(arg) // 2
            refs = ids.take(nb, extra)
            present = tree.insert(arg, refs)
            expect = 0
            while expect < nb and tuple(arg[:2 * (expect + 1)]) in model:
                expect += 1
            assert present == expect
            for j in range(present, nb):
                model[tuple(arg[:2 * (j + 1)])] = refs[j]
        elif op == "match":
            m = tree.match(arg)
            k = 0
            while k < len(arg) // 2 and tuple(arg[:2 * (k + 1)]) in model:
                k += 1
            assert m.num_tokens == 2 * k
            assert m.blocks == [model[tuple(arg[:2 * (j + 1)])] for j in range(k)]
            if extra:
                tree.lock(m.last_node)
                locks.append((m.last_node, list(m.blocks)))
        elif op == "unlock" and locks:
            handle, _ = locks.pop(arg % len(locks))
            tree.unlock(handle)
        elif op == "evict":
            before = tree.evictable(extra)
            gone = tree.evict(arg, extra)
            assert sum(r.tier == extra for r in gone) == min(arg, before)
            for r in gone:
                key = next(k for k, v in model.items() if v == r)
                del model[key]
        elif op == "delete":
            for r in tree.delete(arg):
                del model[next(k for k, v in model.items() if v == r)]
        elif op == "swap":
            to = "host" if extra == "device" else "device"
            cands = tree.swap_candidates(arg, extra)
            assert len(cands) == min(arg, tree.evictable(extra))
            moves = list(zip(cands, ids.take(len(cands), to)))
            tree.relocate(moves)
            inv = {v: k for k, v in model.items()}
            for o, n in moves:
                model[inv[o]] = n
        tree.check_integrity()
        assert set(tree.cached_refs()) == set(model.values())
        # model stays prefix-closed: eviction takes leaves first
        assert all(k[:-2] in model or len(k) == 2 for k in model)
        for _, blocks in locks:                     # locked blocks survive, unmoved
            assert all(tree.holds(b) for b in blocks)
    for handle, _ in locks:
        tree.unlock(handle)
    tree.check_integrity()
    assert tree.evictable("device") == tree.num_cached("device")
    assert tree.evictable("host") == tree.num_cached("host")


def test_snapshot_replays_the_stored_events_of_the_cached_blocks():
    """``snapshot`` = the stored events of exactly the cached blocks, parents
    first, whatever splits, evictions and tier moves happened since."""
    tree, ids = RadixTree(BS, "n1"), Ids()
    tree.insert(toks(1, 2, 3, 4), ids.take(4))
    tree.insert(toks(1, 2, 7), ids.take(3))
    tree.insert(toks(5), ids.take(1))
    tree.relocate([(tree.match(toks(1, 2, 3, 4)).blocks[3], BlockRef("host", 0, "n1"))])
    tree.evict(1, "device")
    events = tree.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = {e.block_hash for e in events if isinstance(e, BlockRemoved)}
    assert removed                       # the eviction took a block
    snap = tree.snapshot()
    assert len(snap) == tree.num_cached() == len({e.ref for e in snap})
    assert {e.ref for e in snap} == set(tree.cached_refs())
    seen = {ROOT_HASH}
    for e in snap:                       # parents first, hashes chained as the events had them
        assert e.parent_hash in seen and e.block_hash == hash((e.parent_hash, e.tokens))
        seen.add(e.block_hash)
    by_hash = {e.block_hash: e for e in stored if e.block_hash not in removed}
    assert {e.block_hash for e in snap} <= {e.block_hash for e in stored}
    assert all(by_hash[e.block_hash].tokens == e.tokens for e in snap if e.block_hash in by_hash)
    assert tree.take_events() == []      # a snapshot emits nothing
