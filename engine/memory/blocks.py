"""Block pools: fixed-size KV blocks of one memory tier, handed out by id.

Pure Python bookkeeping (no torch, no I/O). A ``BlockPool`` knows nothing about
what a block holds or whether the prompt index refers to it; ``MemPool`` layers
that on top. One pool per tier ("device", "host"); on a CPU both tiers are host
memory, but they are still separate pools with separate budgets.

Free ids sit in a min-heap and the lowest free ids are handed out first, in
ascending order: allocations come out as runs of consecutive ids as far as
the free ids allow, and KV copies and transfers move a run in one copy or
frame (``kv_cache.block_runs``). A FIFO of freed ids (the policy before)
fragmented with every wrap-around: after a few hundred transfers of a
benchmark, a 256-block allocation held a 1-block run, and its transfer lost
its zero-copy frames. Cached blocks are not free (the radix tree owns them
until evicted), so the order of reuse does not touch prefix caching.
Allocation order stays deterministic. Used ids sit in a set.

Shortage is not an error: ``allocate`` returns ``None`` and changes nothing.
Freeing a block twice, or freeing an id this pool never owned, is a bug in the
caller and raises.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class BlockPool:
    """Fixed set of block ids ``0 .. num_blocks-1`` of one tier."""

    __slots__ = ("tier", "_num_blocks", "_free", "_used")

    def __init__(self, tier: str, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if not tier:
            raise ValueError("tier must be a non-empty name")
        self.tier = tier
        self._num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))     # a min-heap (sorted is one)
        self._used: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def is_used(self, block_id: int) -> bool:
        return block_id in self._used

    def all_used(self, ids: Iterable[int]) -> bool:
        """Whether every id in ``ids`` is currently allocated."""
        return self._used.issuperset(ids)

    def used_ids(self) -> frozenset[int]:
        """Snapshot of the allocated ids (for integrity checks and tests)."""
        return frozenset(self._used)

    def allocate(self, n: int) -> list[int] | None:
        """Take the ``n`` lowest free block ids, ascending.

        Returns the ids, or ``None`` when fewer than ``n`` are free; never a
        partial allocation, and nothing changes on ``None``. ``n == 0`` gives [].
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        free = self._free
        if n > len(free):
            return None
        if n > 8 and n * 4 > len(free):      # a large share: one sort beats n pops
            free.sort()                      # (a sorted list is still a heap)
            ids = free[:n]
            del free[:n]
        else:
            pop = heapq.heappop
            ids = [pop(free) for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks to the pool.

        Raises ``ValueError`` on an id that is not currently allocated (double
        free, a foreign id, or an id repeated in ``ids``); in that case nothing
        is freed.
        """
        ids = list(ids)
        used = self._used
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.tier}: duplicate ids in free(): {sorted(ids)}")
        bad = [i for i in ids if i not in used]
        if bad:
            raise ValueError(f"{self.tier}: free of blocks not allocated: {bad[:8]}")
        used.difference_update(ids)
        free = self._free
        if len(ids) * 4 > len(free):
            free.extend(ids)
            heapq.heapify(free)
        else:
            push = heapq.heappush
            for i in ids:
                push(free, i)

    def check_integrity(self) -> None:
        """Assert free and used partition ``0 .. num_blocks-1`` exactly."""
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.tier}: duplicate id in free heap"
        assert not (free & self._used), f"{self.tier}: ids both free and used"
        assert len(free) + len(self._used) == self._num_blocks, (
            f"{self.tier}: free {len(free)} + used {len(self._used)} != {self._num_blocks}")
        assert free | self._used == set(range(self._num_blocks)), f"{self.tier}: foreign ids"

    def __repr__(self) -> str:
        return (f"BlockPool(tier={self.tier!r}, num_blocks={self._num_blocks}, "
                f"free={self.num_free}, used={self.num_used})")
