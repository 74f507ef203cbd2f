"""MemPool: MemServe's verbs over block pools, the radix index and a KVStorage."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.memory.kv_cache import KVCache
from engine.memory.mempool import MemPool
from engine.memory.radix import BlockRef, BlockStored
from engine.memory.region import Purpose

BS = 4


def toks(*blocks: int) -> list[int]:
    return [b for b in blocks for _ in range(BS)]


class CountingKV(KVCache):
    """A real KVCache that counts storage calls (one per batch is the contract)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = {"copy": 0, "export": 0, "import": 0}

    def copy_blocks(self, *a):
        self.calls["copy"] += 1
        super().copy_blocks(*a)

    def export_blocks(self, *a):
        self.calls["export"] += 1
        return super().export_blocks(*a)

    def import_blocks(self, *a):
        self.calls["import"] += 1
        super().import_blocks(*a)


def storage(device=8, host=8) -> CountingKV:
    return CountingKV(2, 1, 2, BS, device, host, torch.float64)


def two_pools() -> tuple[MemPool, CountingKV, MemPool, CountingKV]:
    """Pools of nodes "a" and "b" (8 device + 8 host blocks each) and their storages."""
    a_kv, b_kv = storage(), storage()
    return MemPool(8, 8, BS, node_id="a", storage=a_kv), a_kv, MemPool(8, 8, BS, node_id="b", storage=b_kv), b_kv


def stamp(kv: KVCache, tier: str, ids, values) -> None:
    """Fill each block with one value, so a block's identity is its bytes."""
    for i, v in zip(ids, values):
        kv.tier(tier)[:, :, i] = v


def values(kv: KVCache, tier: str, ids) -> list[float]:
    t = kv.tier(tier)
    out = []
    for i in ids:
        block = t[:, :, i]
        assert bool((block == block.flatten()[0]).all())
        out.append(float(block.flatten()[0]))
    return out


# ------------------------------------------------------------- memory blocks

def test_alloc_free_and_shortage():
    pool = MemPool(4, 2, BS)
    a = pool.alloc_mem(3)
    assert len(a) == 3 and pool.alloc_mem(2) is None
    assert pool.alloc_mem(2, "host") is not None and pool.alloc_mem(1, "host") is None
    pool.free_mem(a)
    with pytest.raises(ValueError):
        pool.free_mem(a)
    with pytest.raises(ValueError):
        pool.alloc_mem(1, "gpu")
    pool.check_integrity()


def test_alloc_evicts_lru_cached_and_changes_nothing_when_impossible():
    pool = MemPool(4, 0, BS)
    a = pool.alloc_mem(2)
    b = pool.alloc_mem(2)
    pool.insert(toks(1, 2), a)
    pool.insert(toks(3, 4), b)
    pool.release(pool.match(toks(1, 2)))          # 1,2 more recent than 3,4
    got = pool.alloc_mem(2)
    assert sorted(got) == sorted(b)               # evicted the LRU prompt
    assert pool.match(toks(3)).num_tokens == 0
    hit = pool.match(toks(1, 2))                  # locked
    assert pool.alloc_mem(1) is None
    assert pool.stats()["device"]["cached"] == 2  # nothing evicted by the failed alloc
    pool.release(hit)
    with pytest.raises(ValueError):
        pool.release(hit)
    pool.check_integrity()


def test_free_mem_of_cached_block_raises():
    pool = MemPool(4, 0, BS)
    a = pool.alloc_mem(1)
    pool.insert(toks(1), a)
    with pytest.raises(ValueError):
        pool.free_mem(a)
    pool.check_integrity()


# --------------------------------------------------------------------- index

def test_insert_frees_duplicates_but_not_shared_hit_blocks():
    pool = MemPool(10, 0, BS)
    a = pool.alloc_mem(2)
    assert pool.insert(toks(1, 2), a) == 2
    # a second request computed the same prefix itself: its copies are freed
    b = pool.alloc_mem(3)
    assert pool.insert(toks(1, 2, 3), b) == 1
    assert pool.stats()["device"]["used"] == 3
    # a third request started from the hit and reuses the cached blocks
    hit = pool.match(toks(1, 2, 3, 4) + [7])
    assert hit.num_tokens == 3 * BS
    own = pool.alloc_mem(2)                       # block 4 and the partial tail
    ids = [r.block_id for r in hit.blocks] + own
    assert pool.insert(toks(1, 2, 3, 4) + [7], ids) == 1
    pool.release(hit)
    s = pool.stats()["device"]
    assert s["cached"] == 4 and s["request_owned"] == 1   # the tail stays owned
    pool.free_mem(own[1:])
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.insert(toks(5, 6), pool.alloc_mem(1))       # too few ids
    with pytest.raises(ValueError):
        pool.insert(toks(5), [9])                         # not allocated


def test_cache_running_indexes_a_running_requests_blocks_and_grows_its_lock():
    pool = MemPool(10, 0, BS)
    pool.insert(toks(1), pool.alloc_mem(1))
    hit = pool.match(toks(1, 2, 3) + [9])                  # block 1 cached, locked
    ids = [r.block_id for r in hit.blocks] + pool.alloc_mem(3)
    lock = pool.cache_running(toks(1, 2, 3) + [9], ids, hit)
    assert lock is not None and hit.released and lock.num_tokens == 3 * BS
    assert [r.block_id for r in lock.blocks] == ids[:3]     # its own blocks: the table stays valid
    assert pool.stats()["live_hits"] == 1                   # one lookup, grown, not two
    assert pool.match(toks(1, 2, 3)).num_tokens == 3 * BS   # a newcomer hits them
    assert pool.tree.evictable("device") == 0               # locked while it runs
    assert pool.cache_running(toks(1, 2, 3) + [9], ids, lock) is None   # nothing new
    # finishing: the same ids go back through insert (recognised, not duplicates)
    assert pool.insert(toks(1, 2, 3, 4), ids) == 1
    pool.release(lock)
    pool.check_integrity()


def test_cache_running_changes_nothing_when_another_request_indexed_them_first():
    pool = MemPool(10, 0, BS)
    first, second = pool.match(toks(1, 2)), pool.match(toks(1, 2))    # two misses
    a, b = pool.alloc_mem(2), pool.alloc_mem(2)
    lock_a = pool.cache_running(toks(1, 2), a, first)
    assert lock_a is not None
    before = pool.stats()["device"]
    assert pool.cache_running(toks(1, 2), b, second) is None          # a's are indexed: b keeps its copies
    assert not second.released and pool.stats()["device"] == before
    pool.insert(toks(1, 2), b)                                         # b finishes: duplicates freed
    pool.release(second)
    pool.release(lock_a)
    s = pool.stats()["device"]
    assert s["cached"] == 2 and s["request_owned"] == 0
    pool.check_integrity()


def test_match_counts_and_flush():
    pool = MemPool(8, 0, BS)
    pool.insert(toks(1, 2), pool.alloc_mem(2))
    hit = pool.match(toks(1, 2, 3))
    assert hit.num_tokens == 2 * BS
    pool.release(hit)
    assert pool.stats()["hit_tokens"] == 2 * BS and pool.stats()["miss_tokens"] == BS
    assert pool.flush() == {"device": 2, "host": 0}
    assert pool.stats()["device"]["free"] == 8
    pool.check_integrity()


def test_events_passthrough():
    pool = MemPool(4, 0, BS, node_id="n7")
    pool.insert(toks(1), pool.alloc_mem(1))
    ev = pool.take_events()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored) and ev[0].node_id == "n7"
    assert pool.take_events() == []
    assert MemPool(4, 0, BS, enable_events=False).take_events() == []


# ------------------------------------------------------------------ swapping

def test_swap_out_and_in_move_exact_bytes_in_one_call():
    kv = storage()
    pool = MemPool(8, 8, BS, storage=kv)
    ids = pool.alloc_mem(3)
    stamp(kv, "device", ids, [10.0, 11.0, 12.0])
    pool.insert(toks(1, 2, 3), ids)
    assert pool.swap_out(2) == 2 and kv.calls["copy"] == 1
    hit = pool.match(toks(1, 2, 3))
    assert [r.tier for r in hit.blocks] == ["device", "host", "host"]
    host_refs = [r for r in hit.blocks if r.tier == "host"]
    assert values(kv, "host", [r.block_id for r in host_refs]) == [11.0, 12.0]
    assert pool.stats()["device"]["free"] == 7
    dev = pool.swap_in(host_refs)
    assert kv.calls["copy"] == 2 and values(kv, "device", dev) == [11.0, 12.0]
    pool.release(hit)
    hit = pool.match(toks(1, 2, 3))
    assert all(r.tier == "device" for r in hit.blocks)
    assert values(kv, "device", [r.block_id for r in hit.blocks]) == [10.0, 11.0, 12.0]
    pool.release(hit)
    assert pool.stats()["host"]["free"] == 8
    pool.check_integrity()


def test_swap_out_skips_locked_and_evicts_host_when_full():
    pool = MemPool(8, 1, BS)
    pool.insert(toks(1), pool.alloc_mem(1))
    pool.insert(toks(2), pool.alloc_mem(1))
    hit = pool.match(toks(2))
    assert pool.swap_out(5) == 1                  # only the unlocked one, host has 1
    pool.release(hit)
    assert pool.swap_out(5) == 1                  # host full: evicts host LRU first
    assert pool.match(toks(1)).num_tokens == 0    # it was dropped from host
    assert pool.stats()["host"]["cached"] == 1
    assert MemPool(4, 0, BS).swap_out(3) == 0
    pool.check_integrity()


def test_swap_in_returns_none_when_device_short():
    pool = MemPool(2, 4, BS)
    pool.insert(toks(1, 2), pool.alloc_mem(2))
    assert pool.swap_out(2) == 2
    hold = pool.alloc_mem(2)                      # device full of request blocks
    hit = pool.match(toks(1, 2))
    assert pool.swap_in(hit.blocks) is None
    assert all(r.tier == "host" for r in hit.blocks)
    with pytest.raises(ValueError):
        pool.swap_in([BlockRef("device", 0, "local")])
    pool.free_mem(hold)
    assert len(pool.swap_in(hit.blocks)) == 2
    pool.release(hit)
    pool.check_integrity()


def test_shorten_keeps_the_leading_blocks_locked_and_counts_the_rest_as_misses():
    pool = MemPool(8, 8, BS)
    pool.insert(toks(1, 2, 3), pool.alloc_mem(3))
    assert pool.swap_out(2) == 2                          # blocks 2 and 3 go to host
    hit = pool.match(toks(1, 2, 3, 4))
    assert (hit.num_tokens, pool.stats()["hit_tokens"], pool.stats()["miss_tokens"]) == (3 * BS, 3 * BS, BS)
    short = pool.shorten(hit, toks(1, 2, 3, 4), 1)
    assert hit.released and not short.released
    assert (short.num_tokens, [r.tier for r in short.blocks]) == (BS, ["device"])
    assert (pool.stats()["hit_tokens"], pool.stats()["miss_tokens"], pool.live_hits) == (BS, 3 * BS, 1)
    # the kept block stays locked; the host blocks became evictable again
    assert pool.stats()["device"]["evictable"] == 0 and pool.stats()["host"]["evictable"] == 2
    with pytest.raises(ValueError):
        pool.release(hit)                                 # the old lock is gone
    pool.release(short)
    assert pool.live_hits == 0 and pool.stats()["device"]["evictable"] == 1
    pool.check_integrity()


def test_shorten_to_nothing_and_to_everything():
    pool = MemPool(8, 8, BS)
    pool.insert(toks(1, 2), pool.alloc_mem(2))
    hit = pool.match(toks(1, 2, 3))
    none = pool.shorten(hit, toks(1, 2, 3), 0)
    assert none.num_tokens == 0 and none.blocks == []
    pool.release(none)
    hit = pool.match(toks(1, 2, 3))
    same = pool.shorten(hit, toks(1, 2, 3), 2)
    assert same.num_tokens == 2 * BS
    pool.release(same)
    assert pool.stats()["device"]["evictable"] == 2 and pool.live_hits == 0
    pool.check_integrity()


def test_shorten_refuses_misuse_and_changes_nothing():
    pool = MemPool(8, 8, BS)
    pool.insert(toks(1, 2), pool.alloc_mem(2))
    hit = pool.match(toks(1, 2))
    stats = pool.stats()
    for tokens, k in ((toks(1, 2), 3), (toks(1, 2), -1), (toks(1, 5), 1), (toks(1), 1)):
        with pytest.raises(ValueError):
            pool.shorten(hit, tokens, k)
    assert not hit.released and pool.stats() == stats
    pool.release(hit)
    with pytest.raises(ValueError):
        pool.shorten(hit, toks(1, 2), 1)                  # released already
    pool.check_integrity()


def test_private_swap_round_trip():
    kv = storage(4, 4)
    pool = MemPool(4, 4, BS, storage=kv)
    ids = pool.alloc_mem(3)
    stamp(kv, "device", ids, [1.0, 2.0, 3.0])
    host = pool.swap_out_private(ids)
    assert kv.calls["copy"] == 1 and values(kv, "host", host) == [1.0, 2.0, 3.0]
    assert pool.stats()["device"]["free"] == 4
    assert pool.swap_out_private(pool.alloc_mem(2)) is None  # host short: 1 free
    back = pool.swap_in_private(host)
    assert back is None                                       # device: 2 free, need 3
    pool.free_mem([i for i in range(4) if pool.pools["device"].is_used(i)])
    back = pool.swap_in_private(host)
    assert values(kv, "device", back) == [1.0, 2.0, 3.0] and kv.calls["copy"] == 2
    with pytest.raises(ValueError):
        pool.swap_in_private(host)                            # already freed
    pool.check_integrity()


# ------------------------------------------------------------------ transfer

def move_prefix(src: MemPool, dst: MemPool, tokens: list[int]) -> int | None:
    """Transfer with insert between two pools with the verbs the node uses
    across a transport (kvd/node/transfer.py): the sender locks its cached
    prefix, the receiver reserves a PREFIX region (its own prefix locked,
    blocks for the rest), the KV lands with one ``fill``, ``commit`` indexes
    it. Returns the blocks newly cached at ``dst``; None when it is short."""
    lock = src.lock_prefix(tokens)
    try:
        region = dst.reserve_region(tokens, len(lock.blocks), purpose=Purpose.PREFIX)
        if region is None:
            return None
        layout = src.kv_layout()
        L = layout.num_layers
        out = torch.empty(L, 2, len(lock.blocks), *layout.block_shape[2:], dtype=layout.dtype)
        src.gather(lock.blocks, out, (0, L))
        region.fill(out, (0, L), skip=region.have_blocks)
        before = dst.stats()["device"]["cached"]
        region.commit()
        return dst.stats()["device"]["cached"] - before
    finally:
        src.unlock(lock)


def test_prefix_region_makes_receiver_hit():
    a, a_kv, b, b_kv = two_pools()
    ids = a.alloc_mem(4)
    stamp(a_kv, "device", ids, [1.0, 2.0, 3.0, 4.0])
    prompt = toks(1, 2, 3) + [9, 9]               # 3 full blocks + a partial tail
    a.insert(prompt, ids)
    a.free_mem(ids[3:])
    assert move_prefix(a, b, prompt) == 3
    hit = b.match(toks(1, 2, 3))
    assert hit.num_tokens == 3 * BS and all(r.node_id == "b" for r in hit.blocks)
    assert values(b_kv, "device", [r.block_id for r in hit.blocks]) == [1.0, 2.0, 3.0]
    b.release(hit)
    assert [type(e) for e in b.take_events()] == [BlockStored] * 3
    # the receiver already has the prefix: only the new block is reserved and written
    ids2 = a.alloc_mem(1)
    stamp(a_kv, "device", ids2, [8.0])
    have = a.lock_prefix(toks(1, 2, 3))
    a.insert(toks(1, 2, 3, 8), [r.block_id for r in have.blocks] + ids2)
    a.unlock(have)
    region = b.reserve_region(toks(1, 2, 3, 8), 4, purpose=Purpose.PREFIX)
    assert region.have_blocks == 3 and len(region.block_ids) == 1
    region.cancel()
    assert move_prefix(a, b, toks(1, 2, 3, 8)) == 1
    hit = b.match(toks(1, 2, 3, 8))
    assert values(b_kv, "device", [r.block_id for r in hit.blocks]) == [1.0, 2.0, 3.0, 8.0]
    b.release(hit)
    assert b.stats()["device"]["request_owned"] == 0
    assert b.stats()["hit_tokens"] == 7 * BS       # the transfers' lookups are not counted
    a.check_integrity()
    b.check_integrity()


def test_prefix_region_short_receiver_changes_nothing():
    b = MemPool(2, 0, BS, node_id="b")
    b.insert(toks(1), b.alloc_mem(1))
    held = b.alloc_mem(1)
    assert b.reserve_region(toks(1, 2, 3), 3, purpose=Purpose.PREFIX) is None
    assert b.stats()["device"]["cached"] == 1     # its prefix was locked, not evicted
    b.free_mem(held)
    region = b.reserve_region(toks(1, 2), 2, purpose=Purpose.PREFIX)
    assert region.have_blocks == 1 and len(region.block_ids) == 1
    region.commit()
    assert b.stats()["device"]["cached"] == 2
    with pytest.raises(ValueError, match="committed"):
        region.cancel()
    b.check_integrity()


# ---------------------------------------------------------------- properties

prompt = st.lists(st.integers(0, 2), min_size=1, max_size=5).map(
    lambda bs: [b for b in bs for _ in range(2)])

op = st.one_of(
    st.tuples(st.just("request"), prompt, st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 9)),
    st.tuples(st.just("alloc"), st.integers(0, 6), st.sampled_from(["device", "host"])),
    st.tuples(st.just("free"), st.integers(0, 9)),
    st.tuples(st.just("flush"), prompt),
    st.tuples(st.just("swap_out"), st.integers(0, 5)),
    st.tuples(st.just("swap_in"), st.integers(0, 9)),
    st.tuples(st.just("private"), st.integers(0, 9)),
)


def sig(prefix: list[int]) -> float:
    """The bytes a block computed for this token prefix would hold."""
    return float(hash(tuple(prefix)) % 1_000_003)


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=40))
def test_random_ops_keep_integrity_and_data(ops):
    """Random engine-like traffic: integrity holds after every op, shortage is
    None (never an exception), and every cached block still holds the bytes
    of the prefix it indexes, through swaps and evictions."""
    kv = CountingKV(1, 1, 1, 2, 10, 6, torch.float64)
    pool = MemPool(10, 6, 2, storage=kv)
    hits = []
    owned: list[tuple[str, list[int]]] = []
    for o in ops:
        kind = o[0]
        if kind == "request":
            # match, (optionally) swap in, compute the rest, insert, release
            tokens = o[1]
            hit = pool.match(tokens)
            nb = len(tokens) // 2
            have = [r.block_id if r.tier == "device" else None for r in hit.blocks]
            host = [r for r in hit.blocks if r.tier == "host"]
            if host:
                dev = pool.swap_in(host)
                if dev is None:
                    pool.release(hit)
                    pool.check_integrity()
                    continue
                it = iter(dev)
                have = [h if h is not None else next(it) for h in have]
            new = pool.alloc_mem(nb - len(have))
            if new is None:
                pool.release(hit)
            else:
                stamp(kv, "device", new, [sig(tokens[:2 * (len(have) + j + 1)])
                                          for j in range(len(new))])
                pool.insert(tokens, have + new)
                if o[2]:
                    hits.append(hit)
                else:
                    pool.release(hit)
        elif kind == "release" and hits:
            pool.release(hits.pop(o[1] % len(hits)))
        elif kind == "alloc":
            got = pool.alloc_mem(o[1], o[2])
            if got is not None:
                owned.append((o[2], got))
        elif kind == "free" and owned:
            tier, ids = owned.pop(o[1] % len(owned))
            pool.free_mem(ids, tier)
        elif kind == "flush":
            pool.flush()
        elif kind == "swap_out":
            pool.swap_out(o[1])
        elif kind == "swap_in":
            refs = [r for r in pool.tree.cached_refs() if r.tier == "host"][:o[1] % 4]
            pool.swap_in(refs)
        elif kind == "private" and owned:
            j = o[1] % len(owned)
            tier, ids = owned[j]
            moved = (pool.swap_out_private(ids) if tier == "device"
                     else pool.swap_in_private(ids))
            if moved is not None:
                owned[j] = ("host" if tier == "device" else "device", moved)
        pool.check_integrity()
        # every cached block holds its prefix's bytes (nothing lost or mixed up)
        stack = [(pool.tree._root, [])]
        while stack:
            node, prefix = stack.pop()
            for j, ref in enumerate(node.refs):
                blk = prefix + list(node.key[:2 * (j + 1)])
                assert values(kv, ref.tier, [ref.block_id]) == [sig(blk)]
            for c in node.children.values():
                stack.append((c, prefix + list(node.key)))
        s = pool.stats()
        assert s["device"]["request_owned"] == sum(len(i) for t, i in owned if t == "device")
        assert s["host"]["request_owned"] == sum(len(i) for t, i in owned if t == "host")
    for hit in hits:
        pool.release(hit)
    assert pool.live_hits == 0
    pool.check_integrity()


# ---------------------------------------------------- KV movement (kvd's door)

def test_flush_frees_every_unlocked_cached_block_per_tier():
    kv = storage()
    pool = MemPool(8, 8, BS, storage=kv)
    pool.insert(toks(1, 2), pool.alloc_mem(2))
    pool.insert(toks(7), pool.alloc_mem(1))
    assert pool.swap_out(1) == 1                         # one cached block now sits in the host tier
    held = pool.lock_prefix(toks(7))                     # a transfer holds this prefix
    before = {t: pool.stats()[t]["cached"] for t in ("device", "host")}
    freed = pool.flush()
    assert sum(freed.values()) == 2 and freed["host"] == 1
    assert freed == {t: before[t] - pool.stats()[t]["cached"] for t in ("device", "host")}
    pool.check_integrity()
    assert pool.stats()["device"]["cached"] + pool.stats()["host"]["cached"] == 1   # the locked one stays
    pool.unlock(held)
    assert sum(pool.flush().values()) == 1
    assert pool.stats()["device"]["free"] == 8 and pool.stats()["host"]["free"] == 8
    pool.check_integrity()


def test_lock_prefix_keeps_blocks_from_eviction_until_unlocked_once():
    pool = MemPool(2, 0, BS, storage=storage(2, 0))
    pool.insert(toks(1, 2), pool.alloc_mem(2))
    lock = pool.lock_prefix(toks(1, 2, 3))
    assert lock.num_tokens == 2 * BS and len(lock.blocks) == 2
    assert pool.alloc_mem(1) is None                     # locked: not evictable
    assert pool.stats()["hit_tokens"] == 0               # not a lookup for the statistics
    pool.unlock(lock)
    with pytest.raises(ValueError, match="twice"):
        pool.unlock(lock)
    assert pool.alloc_mem(1) is not None
    miss = pool.lock_prefix(toks(9))
    assert miss.blocks == [] and miss.num_tokens == 0
    pool.unlock(miss)
    pool.check_integrity()


def test_prefix_region_fill_and_commit_move_exact_bytes():
    a, a_kv, b, b_kv = two_pools()
    ids = a.alloc_mem(3)
    stamp(a_kv, "device", ids, [5.0, 6.0, 7.0])
    a.insert(toks(1, 2, 3), ids)
    b_first = b.alloc_mem(1)
    stamp(b_kv, "device", b_first, [5.0])
    b.insert(toks(1), b_first)                           # the receiver has the first block
    lock = a.lock_prefix(toks(1, 2, 3))
    grant = b.reserve_region(toks(1, 2, 3), 3, purpose=Purpose.PREFIX)
    assert grant.have_blocks == 1 and len(grant.block_ids) == 2
    layout = a.kv_layout()
    L = layout.num_layers
    out = torch.empty(L, 2, 3, *layout.block_shape[2:], dtype=layout.dtype)
    a.gather(lock.blocks, out, (0, L))
    grant.fill(out, (0, L), skip=grant.have_blocks)
    a.unlock(lock)
    assert grant.commit() is None and b.cached_tokens(toks(1, 2, 3)) == 3 * BS
    hit = b.match(toks(1, 2, 3))
    assert hit.num_tokens == 3 * BS
    assert values(b_kv, "device", [r.block_id for r in hit.blocks]) == [5.0, 6.0, 7.0]
    b.release(hit)
    a.check_integrity()
    b.check_integrity()


def test_prefix_commit_frees_blocks_cached_meanwhile_and_cancel_frees_all():
    pool = MemPool(8, 0, BS, storage=storage(8, 0))
    grant = pool.reserve_region(toks(1, 2), 2, purpose=Purpose.PREFIX)
    other = pool.alloc_mem(2)
    pool.insert(toks(1, 2), other)                       # the same prefix cached meanwhile
    grant.commit()
    assert pool.stats()["device"]["cached"] == 2 and pool.stats()["device"]["request_owned"] == 0
    pool.check_integrity()
    grant = pool.reserve_region(toks(5, 6), 2, purpose=Purpose.PREFIX)
    grant.cancel()
    assert pool.stats()["device"]["free"] == 6
    assert pool.reserve_region(toks(1, 2, 3, 4, 5, 6, 7, 8, 9), 9, purpose=Purpose.PREFIX) is None
    assert pool.stats()["device"]["free"] == 6 and pool.stats()["device"]["cached"] == 2
    pool.check_integrity()
