"""A region: blocks of one MemPool set aside for KV that another instance
sends, with one lifecycle whatever the KV is for (its ``Purpose``)::

    MemPool.reserve_region(tokens, num_blocks, tier, purpose, deadline)
        │  PREFIX:  the cached prefix of ``tokens`` locked (not a lookup), fresh blocks for the rest
        │  PROMPT:  the cached prefix of ``tokens[:-1]`` as a request's lookup (host blocks
        │           swapped in), fresh device blocks for every other token
        │  REPLICA: no prefix, no blocks yet: private blocks, in no index
        │  LENT:    ``num_blocks`` free blocks (never the prefix cache's), private,
        │           in no index: KV of another node's request (a loan, rmanager.py)
        ▼
    reserved ── fill / fill_pieces (layers into the fresh blocks)
        │       append (REPLICA: more private blocks, written whole)
        │       fill_blocks (LENT: layers of some of its blocks, as the debtor writes)
        ├── commit ──▶ committed   PREFIX:  indexed under ``tokens``, prefix unlocked
        │                          PROMPT:  the blocks and the lookup are the request's
        │                                   (``LLMEngine.add_prefilled``)
        │                          REPLICA: the blocks agreeing with the given tokens
        │                                   indexed, the rest freed; a lock on them
        │                          LENT:    the debtor returned the loan: blocks freed
        └── cancel ──▶ cancelled   fresh blocks freed, prefix given back: nothing indexed

``deadline`` (monotonic, or None: no deadline) is the holder's to act on:
a region past it is cancelled by whoever reserved it (the node's KV inbox,
kvd/node/inbox.py). ``commit`` and ``cancel`` each end a region once; a
second end raises ValueError. Shortages are ``None`` (or False) and
change nothing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.memory.mempool import MemPool, PrefixLock


class Purpose(str, enum.Enum):
    """What the KV a region receives is for."""

    PREFIX = "prefix"      # a cached prefix another instance sends (transfer with insert, MemServe §4.3)
    PROMPT = "prompt"      # a prompt's KV another instance computes (disaggregated prefill)
    REPLICA = "replica"    # a replica of a request another instance runs (DejaVu §4.2.3)
    LENT = "lent"          # blocks lent to another instance for its request's KV (Infinite-LLM §4.3)


class RegionState(str, enum.Enum):
    RESERVED = "reserved"
    COMMITTED = "committed"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Region:
    """Blocks of ``pool`` reserved for KV that arrives (module docstring).

    ``prefix``: the cached prefix the pool already had (``have_blocks``
    blocks, not sent; None for a replica), at device ids ``prefix_ids``
    for a prompt; ``block_ids`` of ``tier`` take the rest, in token order.
    Every method runs where the pool's owner runs it (the engine thread)."""

    pool: MemPool
    purpose: Purpose
    tokens: tuple[int, ...]
    tier: str
    block_ids: list[int]
    prefix: PrefixLock | None = None
    prefix_ids: list[int] = field(default_factory=list)
    deadline: float | None = None
    state: RegionState = RegionState.RESERVED

    @property
    def have_blocks(self) -> int:
        return len(self.prefix.blocks) if self.prefix is not None else 0

    @property
    def blocks(self) -> int:
        """Fresh blocks (the ones KV is written into)."""
        return len(self.block_ids)

    @property
    def all_ids(self) -> list[int]:
        """A prompt's whole block table: its prefix's device ids, then the fresh ones."""
        return self.prefix_ids + self.block_ids

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.monotonic() if now is None else now) > self.deadline

    # ----------------------------------------------------------------- fill
    def fill(self, payload: Any, layers: tuple[int, int], skip: int = 0) -> None:
        """Write layers ``[l0, l1)`` into the fresh blocks: ``payload``
        [l1-l0, 2, skip + n, bs, kvh, hd], its first ``skip`` blocks dropped;
        one copy per run of the region's ids."""
        self._open("fill")
        if self.block_ids:
            self.pool._storage().scatter(self.tier, self.block_ids, payload[:, :, skip:], layers=layers)

    def fill_pieces(self, pieces: Any, lengths: Any, layers: tuple[int, int], skip: int = 0) -> None:
        """``fill`` for KV that arrives as pieces (``KVCache.scatter_pieces``)."""
        self._open("fill")
        self.pool._storage().scatter_pieces(self.tier, self.block_ids, pieces, lengths, layers, skip)

    def fill_blocks(self, start: int, payload: Any, layers: tuple[int, int]) -> None:
        """LENT, REPLICA: write layers ``[l0, l1)`` of the region's blocks
        ``[start, start + n)`` from ``payload`` [l1-l0, 2, n, bs, kvh, hd]
        (a replica's partial last block written again, fuller). Raises
        ValueError (nothing written) when they are not the region's."""
        self._open("fill_blocks")
        n = payload.shape[2]
        if self.purpose not in (Purpose.LENT, Purpose.REPLICA) or not 0 <= start <= start + n <= len(self.block_ids):
            raise ValueError(f"fill_blocks: blocks [{start}, {start + n}) of a {self.purpose.value} "
                             f"region of {len(self.block_ids)}")
        if n:
            self.pool._storage().scatter(self.tier, self.block_ids[start:start + n], payload, layers=layers)

    def append(self, payload: Any) -> bool:
        """A replica grows: ``payload`` [L, 2, n, bs, kvh, hd] written into
        ``n`` fresh blocks of the region's tier, appended. False when the
        tier is short of memory, and then nothing changed."""
        self._open("append")
        if self.purpose is not Purpose.REPLICA:
            raise ValueError(f"append: a {self.purpose.value} region has a fixed size")
        n = payload.shape[2]
        ids = self.pool.alloc_mem(n, self.tier, reclaim=False) if n else []   # a copy never takes a copy's
        if ids is None:
            return False
        if ids:
            try:
                self.pool._storage().import_blocks(self.tier, ids, payload)
            except BaseException:
                self.pool.free_mem(ids, self.tier)
                raise
        self.block_ids.extend(ids)
        return True

    # ------------------------------------------------------------------ end
    def commit(self, tokens: Any = None) -> PrefixLock | None:
        """The KV is complete: PREFIX indexes it under ``self.tokens``
        (blocks cached meanwhile by someone else are duplicates: freed) and
        unlocks the prefix, returns None; PROMPT hands the blocks to the
        request and returns its lookup (the caller's to release); REPLICA
        indexes its first ``len(tokens) // block_size`` blocks as the KV of
        ``tokens``, frees the rest and returns a lock on the indexed prefix
        (``unlock`` it); LENT (the debtor returned the loan) frees its blocks,
        indexes nothing and returns None. Raises ValueError (nothing changed) when the region
        ended or a replica is shorter than ``tokens``."""
        self._open("commit")
        pool = self.pool
        if self.purpose is Purpose.PREFIX:
            pool._index_region(self)
            pool.unlock(self.prefix)
            self.state = RegionState.COMMITTED
            return None
        if self.purpose is Purpose.PROMPT:
            self.state = RegionState.COMMITTED
            return self.prefix
        if self.purpose is Purpose.LENT:
            ids, self.block_ids = self.block_ids, []
            self.state = RegionState.COMMITTED
            if ids:
                pool.free_mem(ids, self.tier)
            return None
        nfull = len(tokens) // pool.block_size
        if nfull > len(self.block_ids):
            raise ValueError(f"commit: {nfull} full blocks, the replica has {len(self.block_ids)}")
        ids, rest = self.block_ids[:nfull], self.block_ids[nfull:]
        self.block_ids = []
        self.state = RegionState.COMMITTED
        if rest:
            pool.free_mem(rest, self.tier)
        prefix = tokens[:nfull * pool.block_size]
        if ids:
            pool.insert(prefix, ids, self.tier)
        return pool.lock_prefix(prefix)

    def cancel(self) -> None:
        """Free the fresh blocks and give the prefix back (a prompt's as a
        lookup, ``release``): nothing was indexed. Raises ValueError when
        the region already ended."""
        self._open("cancel")
        ids, self.block_ids = self.block_ids, []
        self.state = RegionState.CANCELLED
        if ids:
            self.pool.free_mem(ids, self.tier)
        if self.purpose is Purpose.PROMPT:
            self.pool.release(self.prefix)
        elif self.prefix is not None:
            self.pool.unlock(self.prefix)

    def _open(self, verb: str) -> None:
        if self.state is not RegionState.RESERVED:
            raise ValueError(f"{verb}: the {self.purpose.value} region is {self.state.value}")

    def __repr__(self) -> str:
        return (f"Region({self.purpose.value}, {self.state.value}, have={self.have_blocks}, "
                f"blocks={len(self.block_ids)}, tier={self.tier})")
