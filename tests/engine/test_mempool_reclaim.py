"""MemPool's Reclaimer (engine/memory/mempool.py; a pair's redundant
copies, kvd/node/replica_store.py): ``available`` counts the blocks it
would give up; ``alloc_mem`` evicts the cache first and asks it only for
what is still short, never for a copy's own growth (``reclaim=False``);
a shortage neither can cover changes nothing."""

from __future__ import annotations

from engine.memory.mempool import MemPool


class Copies:
    """A Reclaimer over blocks it allocated from ``pool`` (one list a copy,
    oldest first): what a node's copies are to its pool."""

    def __init__(self, pool: MemPool) -> None:
        self.pool, self.copies = pool, []
        self.asked: list[int] = []

    def hold(self, n: int) -> None:
        self.copies.append(self.pool.alloc_mem(n, reclaim=False))

    def reclaimable(self, tier: str) -> int:
        return sum(map(len, self.copies)) if tier == "device" else 0

    def reclaim(self, tier: str, n: int) -> int:
        self.asked.append(n)
        freed = 0
        while freed < n and self.copies:
            ids = self.copies.pop(0)
            self.pool.free_mem(ids)
            freed += len(ids)
        return freed


def cached(pool: MemPool, tokens: list[int]) -> int:
    hit = pool.match(tokens)
    pool.release(hit)
    return hit.num_tokens


def test_the_cache_goes_first_then_copies_least_recent_first_and_never_for_a_copy():
    pool = MemPool(device_blocks=10, host_blocks=0, block_size=4)
    copies = Copies(pool)
    pool.reclaimer = copies
    copies.hold(3)
    copies.hold(3)
    ids = pool.alloc_mem(2)
    pool.insert(list(range(8)), ids)                   # 2 evictable cached blocks
    assert pool.available() == 2 + 2 + 6               # free, evictable, the copies'
    assert pool.alloc_mem(5, reclaim=False) is None    # a copy's growth takes no copy's blocks
    assert len(copies.copies) == 2 and cached(pool, list(range(8))) == 8
    got = pool.alloc_mem(5)                            # 2 free + 2 evicted + 1 short: the oldest copy goes
    assert got is not None and len(got) == 5 and copies.asked == [1]
    assert len(copies.copies) == 1 and cached(pool, list(range(8))) == 0
    assert pool.alloc_mem(6) is None                   # 2 free + 3 of copies: short, nothing changes
    assert len(copies.copies) == 1 and copies.asked == [1]
