"""BlockPool: lowest ids first, all-or-nothing allocation, misuse raises."""

import pytest
from hypothesis import given, settings, strategies as st

from engine.memory.blocks import BlockPool
from engine.memory.kv_cache import block_runs


def test_allocate_lowest_ids_first():
    pool = BlockPool("device", 4)
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free == 2 and pool.num_used == 2 and pool.num_blocks == 4
    pool.free([1, 0])
    assert pool.allocate(4) == [0, 1, 2, 3]        # ascending: one run
    pool.check_integrity()
    pool.free([3])
    pool.free([2, 1])
    assert pool.allocate(3) == [1, 2, 3]


def test_reuse_keeps_allocations_in_runs():
    """Allocations and frees in any interleaving: a fresh allocation of
    everything free comes out as the free ids ascending, so it has exactly as
    many runs as the free ids do (the old FIFO split them at every wrap)."""
    pool = BlockPool("device", 264)
    for n in (1, 16, 256) * 3:
        ids = pool.allocate(n)
        assert ids == sorted(ids) and len(block_runs(ids)) == 1, ids[:4]
        pool.free(ids[::-1])
    held = pool.allocate(40)
    pool.free(held[10:20])                         # a hole in the middle
    ids = pool.allocate(30)
    assert ids == list(range(10, 20)) + list(range(40, 60))
    pool.check_integrity()


def test_short_returns_none_and_changes_nothing():
    pool = BlockPool("host", 3)
    assert pool.allocate(4) is None
    assert pool.num_free == 3
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) is None
    pool.check_integrity()


def test_misuse_raises():
    pool = BlockPool("device", 2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError):
        pool.free(ids)                # double free
    with pytest.raises(ValueError):
        pool.free([7])                # foreign id
    a = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([a[0], a[0]])       # repeated in one call
    assert pool.num_used == 2         # the failed free changed nothing
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool("device", -1)
    pool.check_integrity()


def test_zero_sized_pool():
    pool = BlockPool("host", 0)
    assert pool.allocate(1) is None and pool.allocate(0) == []
    pool.check_integrity()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_random_ops_keep_partition(ops):
    pool = BlockPool("device", 8)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            got = pool.allocate(n)
            if n > pool.num_free + (len(got) if got else 0):
                assert got is None
            if got is not None:
                assert len(got) == n and not set(got) & set(held)
                held += got
            else:
                assert n > pool.num_free
        else:
            give, held = held[:n], held[n:]
            pool.free(give)
        pool.check_integrity()
        assert pool.num_used == len(held)
