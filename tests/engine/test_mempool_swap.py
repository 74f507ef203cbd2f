"""MemPool.swap_out_request: a preempted request's whole table to the host tier, nothing left pinned."""

import pytest

from engine.memory.mempool import MemPool

from .test_mempool import BS, stamp, storage, toks, values


def pool_with_request(device_blocks: int, host_blocks: int):
    """A pool over fresh storage and, on it, a request whose table is a 2-block
    cached prefix (its lookup) plus 2 private blocks: (storage, pool, lookup, table)."""
    kv = storage(device_blocks, host_blocks)
    pool = MemPool(device_blocks, host_blocks, BS, storage=kv)
    pool.insert(toks(1, 2), pool.alloc_mem(2))
    hit = pool.match(toks(1, 2, 3))
    table = [r.block_id for r in hit.blocks] + pool.alloc_mem(2)
    stamp(kv, "device", table, [1.0, 2.0, 3.0, 4.0])
    return kv, pool, hit, table


def test_the_whole_table_goes_to_host_and_the_prefix_lock_is_released():
    kv, pool, hit, table = pool_with_request(4, 8)
    assert pool.available() == 0
    host = pool.swap_out_request(table, hit)
    assert kv.calls["copy"] == 1 and values(kv, "host", host) == [1.0, 2.0, 3.0, 4.0]
    assert hit.released and pool.live_hits == 0
    dev = pool.stats()["device"]
    assert dev["cached"] == 2 and dev["evictable"] == 2 and dev["request_owned"] == 0
    assert pool.available() == pool.capacity() == 4         # nothing pinned: the table fits back
    back = pool.swap_in_private(host)
    assert back is not None and values(kv, "device", back) == [1.0, 2.0, 3.0, 4.0]
    assert pool.stats()["device"]["cached"] == 0             # evicted to make room: the copies are private
    pool.free_mem(back)
    pool.check_integrity()


def test_a_short_host_tier_changes_nothing():
    kv, pool, hit, table = pool_with_request(4, 3)
    before = pool.stats()
    assert pool.swap_out_request(table, hit) is None
    assert not hit.released and pool.stats() == before and kv.calls["copy"] == 0
    pool.release(hit)
    pool.free_mem(table[2:])
    pool.check_integrity()


def test_a_table_that_is_not_prefix_then_private_is_refused():
    kv, pool, hit, table = pool_with_request(8, 8)
    before = pool.stats()
    for ids, lock in ((table[2:] + table[:2], hit),          # cached blocks not first
                      (table, None),                          # cached blocks claimed private
                      (table[:1], hit)):                      # shorter than its lookup
        with pytest.raises(ValueError):
            pool.swap_out_request(ids, lock)
    assert pool.stats() == before and not hit.released
    pool.release(hit)
    with pytest.raises(ValueError):
        pool.swap_out_request(table, hit)                     # a released lookup
    pool.free_mem(table[2:])
    pool.check_integrity()
