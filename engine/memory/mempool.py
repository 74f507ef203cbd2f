"""MemPool: MemServe's memory pool API (§4.1, Table 1) for one instance.

Pure Python bookkeeping over two block pools ("device", "host") and a radix
prompt index; the bytes live in a ``KVStorage`` (engine/memory/kv_cache.py)
that MemPool only ever asks to copy, export or import whole batches of blocks
(one call per batch, never one per block). ``storage`` may be None for pure
bookkeeping.

Every block of a tier is in exactly one of three states::

    free  ── alloc_mem ──▶  request-owned  ── insert ──▶  cached (in the index)
      ▲                         │                            │
      └──────── free_mem ───────┘◀── (duplicates) ───────────┤
      ▲                                                      │
      └──────────── evict / delete (unlocked only) ──────────┘

Request-owned is tracked implicitly: allocated by the pool but not indexed.
``match`` locks the hit so eviction cannot take it while a request reads it;
the caller ``release``s the hit exactly once. A request that started from a
hit may pass the very same (cached) block ids back to ``insert``: those are
recognised and neither duplicated nor freed.

Shortages return ``None`` and change nothing; misuse (double free, freeing a
cached block, releasing twice) raises.

MemPool is the only door to KV memory: code outside engine/ (the node's
transfers, its admin commands, the benchmarks) uses the verbs of the "KV
movement" section -- ``flush``, ``lock_prefix``/``unlock``, ``kv_layout``,
``gather``/``pieces``, ``reserve_region`` (a ``Region``: ``fill``/
``append``, then ``commit`` or ``cancel``), ``write_blocks`` -- never
``tree``, ``pools`` or ``storage`` (tests/kvd/test_kv_door.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.memory.blocks import BlockPool
from engine.memory.radix import BlockRef, BlockStored, CacheEvent, RadixTree, make_refs
from engine.memory.region import Purpose, Region

TIERS = ("device", "host")


class KVStorage(Protocol):
    """Where the KV bytes live; block ids are per-tier indices."""

    def copy_blocks(self, src_tier: str, src_ids: Sequence[int],
                    dst_tier: str, dst_ids: Sequence[int]) -> None: ...

    def export_blocks(self, tier: str, ids: Sequence[int]) -> object: ...

    def import_blocks(self, tier: str, ids: Sequence[int], payload: object) -> None: ...


class PrefixLock:
    """A cached prefix locked against eviction: ``blocks`` (BlockRefs, any
    tier) cover ``num_tokens`` tokens. From ``MemPool.match`` (a lookup, for a
    request; give it back with ``release``) or ``MemPool.lock_prefix`` (for a
    transfer; give it back with ``unlock``), exactly once either way."""

    __slots__ = ("num_tokens", "blocks", "_handle", "_released")

    def __init__(self, num_tokens: int, blocks: list[BlockRef], handle: object) -> None:
        self.num_tokens = num_tokens
        self.blocks = blocks
        self._handle = handle
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def __repr__(self) -> str:
        return f"PrefixLock(num_tokens={self.num_tokens}, blocks={len(self.blocks)})"


@dataclass(frozen=True)
class KVLayout:
    """What a peer must agree on and a sender sizes its messages by."""

    num_layers: int
    dtype: object                       # torch dtype
    block_shape: tuple[int, ...]        # [L, 2, bs, kvh, hd]
    bytes_per_block: int
    slice_bytes: int                    # one layer's K (or V) of one block
    cpu_tiers: tuple[str, ...]          # tiers whose blocks can be sent as views (pieces)


class Reclaimer(Protocol):
    """Who holds blocks of this pool that this instance's own work comes
    before (a pair's redundant copies, kvd/node/replica_store.py): asked by
    ``alloc_mem`` once evicting the cache is not enough, before it fails
    (and the scheduler preempts or refuses). Runs on the pool's thread."""

    def reclaimable(self, tier: str) -> int:
        """Blocks of ``tier`` it would give up now. A peek."""

    def reclaim(self, tier: str, n: int) -> int:
        """Give up at least ``n`` blocks of ``tier`` (freed into the pool)
        if it can; returns how many it freed."""


class MemPool:
    """Block memory, prefix index and transfers of one inference instance."""

    def __init__(self, device_blocks: int, host_blocks: int, block_size: int = 16,
                 node_id: str = "local", storage: KVStorage | None = None,
                 enable_events: bool = True, max_events: int = 1 << 16) -> None:
        self.block_size = block_size
        self.node_id = node_id
        self.storage = storage
        self.pools = {"device": BlockPool("device", device_blocks),
                      "host": BlockPool("host", host_blocks)}
        self.tree = RadixTree(block_size, node_id, enable_events=enable_events,
                              max_events=max_events)
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.live_hits = 0
        self.reclaimer: Reclaimer | None = None   # redundant copies given up for this instance's work

    def _pool(self, tier: str) -> BlockPool:
        try:
            return self.pools[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}") from None

    def _ref(self, tier: str, block_id: int) -> BlockRef:
        return BlockRef(tier, block_id, self.node_id)

    # ------------------------------------------------------------ memory blocks

    def alloc_mem(self, n: int, tier: str = "device", reclaim: bool = True) -> list[int] | None:
        """Allocate ``n`` blocks of ``tier`` for a request.

        When the pool is short, evicts unlocked cached blocks (LRU) first;
        when that is not enough, gives up redundant copies (the
        ``reclaimer``'s, least recently useful first; not with ``reclaim``
        False: a copy's own growth) rather than fail. Returns None when
        even both cannot cover ``n``; then nothing changed (no partial
        allocation, nothing evicted or given up).
        """
        pool = self._pool(tier)
        short = n - pool.num_free
        if short > 0:
            evictable = self.tree.evictable(tier)
            spare = self.reclaimer.reclaimable(tier) if reclaim and self.reclaimer is not None else 0
            if evictable + spare < short:
                return None
            if evictable:
                self._free_refs(self.tree.evict(min(short, evictable), tier))
                short -= min(short, evictable)
            if short > 0:
                self.reclaimer.reclaim(tier, short)
        return pool.allocate(n)

    def free_mem(self, ids: Sequence[int], tier: str = "device") -> None:
        """Free request-owned blocks. Raises ValueError on a double free, a
        foreign id or a block that is cached (the index owns those)."""
        if self.tree.holds_any(make_refs(tier, ids, self.node_id)):
            cached = [i for i in ids if self.tree.holds(self._ref(tier, i))]
            raise ValueError(f"free_mem of cached {tier} blocks {cached[:8]}")
        self._pool(tier).free(ids)

    def _free_refs(self, refs: Sequence[BlockRef]) -> None:
        """Return blocks removed from the index to their pools."""
        by_tier: dict[str, list[int]] = {}
        for r in refs:
            by_tier.setdefault(r.tier, []).append(r.block_id)
        for tier, ids in by_tier.items():
            self.pools[tier].free(ids)

    # -------------------------------------------------------------------- index

    def insert(self, tokens: Sequence[int], block_ids: Sequence[int],
               tier: str = "device") -> int:
        """Retire a request's KV into the historical cache.

        ``block_ids[i]`` holds tokens ``[i*bs, (i+1)*bs)``. Only the
        ``len(tokens) // block_size`` FULL blocks are inserted; any further
        ids in ``block_ids`` (the partial tail) stay request-owned and the
        caller frees them itself. Leading blocks already cached are
        duplicates: insert frees them, except ids that are the cached blocks
        themselves (a request that started from a hit). After insert the full
        blocks belong to the cache. Returns the number of newly cached blocks.
        """
        nfull = len(tokens) // self.block_size
        if not nfull <= len(block_ids) <= -(-len(tokens) // self.block_size):
            raise ValueError(f"insert: {len(tokens)} tokens need {nfull} full blocks "
                             f"(+1 partial at most), got {len(block_ids)} ids")
        pool = self._pool(tier)
        refs = make_refs(tier, block_ids[:nfull], self.node_id)
        if not pool.all_used(block_ids[:nfull]):
            raise ValueError("insert: block ids are not allocated")
        present = self.tree.insert(tokens[:nfull * self.block_size], refs)
        holds = self.tree.holds
        dups = [r.block_id for r in refs[:present] if not holds(r)]   # not the cached ones
        if dups:
            pool.free(dups)
        return nfull - present

    def match(self, tokens: Sequence[int]) -> PrefixLock:
        """Longest cached prefix of ``tokens`` (full blocks), LOCKED for the
        caller until ``release(hit)``. Blocks may be in the host tier: the
        engine calls ``swap_in`` for those. A miss is a hit of 0 tokens (it
        must be released too, for symmetry)."""
        m = self.tree.match(tokens)
        self.tree.lock(m.last_node)
        self.hit_tokens += m.num_tokens
        self.miss_tokens += len(tokens) - m.num_tokens
        self.live_hits += 1
        return PrefixLock(m.num_tokens, m.blocks, m.last_node)

    def cache_running(self, tokens: Sequence[int], block_ids: Sequence[int],
                      held: PrefixLock) -> PrefixLock | None:
        """Index a RUNNING request's full blocks of computed ``tokens`` now,
        not when it finishes, so that requests arriving meanwhile hit them
        (SGLang's ``cache_unfinished_req``; vLLM caches a block once full).

        ``block_ids`` is the request's device block table, ``held`` its
        lookup (``match``), whose blocks are the table's first ones. Only when
        the index holds nothing of ``tokens`` beyond ``held``: then every block
        indexed is the request's own and its table stays valid. On success the
        request's lookup becomes the returned lock, covering all those full
        blocks (``held`` is given back; the live-lookup count is unchanged),
        and the caller must not free them: they belong to the cache.

        Returns None and changes nothing when there is nothing new to index
        or another request indexed part of these tokens first (this request's
        copies then stay private and are offered again, as duplicates, by
        ``insert`` when it finishes).
        """
        bs = self.block_size
        have = len(held.blocks)
        nfull = min(len(tokens) // bs, len(block_ids))
        if held.released or nfull <= have:
            return None
        prefix = tokens[:nfull * bs]
        if self.tree.match(prefix).num_tokens != have * bs:
            return None
        self.insert(prefix, block_ids[:nfull])
        m = self.tree.match(prefix)
        self.tree.lock(m.last_node)
        self.unlock(held)
        return PrefixLock(m.num_tokens, list(m.blocks), m.last_node)

    def release(self, hit: PrefixLock) -> None:
        """Unlock a ``match``; raises ValueError when released twice."""
        self.unlock(hit)
        self.live_hits -= 1

    def shorten(self, hit: PrefixLock, tokens: Sequence[int], num_blocks: int) -> PrefixLock:
        """Replace a live ``match`` of ``tokens`` by a hit of its first
        ``num_blocks`` blocks: the caller recomputes the rest (the caching
        cost model chose not to swap them in). ``hit`` is released and the
        result is released in its place, once. The kept blocks are locked
        before ``hit`` lets go, so they are never evictable in between; the
        dropped tokens count as misses, not hits. Call it before swapping any
        of ``hit`` in (``swap_in`` leaves ``hit.blocks`` stale). Raises
        ValueError (nothing changed) when ``hit`` is released, ``num_blocks``
        is not within it, or ``tokens`` are not what it matched."""
        if hit.released or not 0 <= num_blocks <= len(hit.blocks):
            raise ValueError(f"shorten: {hit!r} (released: {hit.released}) to {num_blocks} blocks")
        bs = self.block_size
        if len(tokens) < hit.num_tokens or self.tree.match(tokens[:hit.num_tokens]).blocks != hit.blocks:
            raise ValueError("shorten: tokens are not the ones the hit matched")
        m = self.tree.match(tokens[:num_blocks * bs])
        self.tree.lock(m.last_node)
        self.unlock(hit)
        dropped = hit.num_tokens - m.num_tokens
        self.hit_tokens -= dropped
        self.miss_tokens += dropped
        return PrefixLock(m.num_tokens, m.blocks, m.last_node)

    # ------------------------------------------------------------------ swapping

    def _copy(self, src_tier: str, src: list[int], dst_tier: str, dst: list[int]) -> None:
        if self.storage is not None and src:
            self.storage.copy_blocks(src_tier, src, dst_tier, dst)

    def swap_out(self, num_blocks: int) -> int:
        """Move up to ``num_blocks`` LRU unlocked cached blocks from device to
        host (MemServe ``swap_out``), evicting host LRU blocks to make room.
        One copy call for the batch. Returns the number of blocks moved."""
        host = self.pools["host"]
        want = min(num_blocks, self.tree.evictable("device"))
        if want <= 0 or host.num_blocks == 0:
            return 0
        if host.num_free < want:
            self._free_refs(self.tree.evict(want - host.num_free, "host"))
        want = min(want, host.num_free, self.tree.evictable("device"))
        refs = self.tree.swap_candidates(want, "device")
        if not refs:
            return 0
        dev_ids = [r.block_id for r in refs]
        host_ids = host.allocate(len(refs))
        assert host_ids is not None
        self._copy("device", dev_ids, "host", host_ids)
        self.tree.relocate([(r, self._ref("host", h)) for r, h in zip(refs, host_ids)])
        self.pools["device"].free(dev_ids)
        return len(refs)

    def swap_in(self, refs: Sequence[BlockRef]) -> list[int] | None:
        """Bring cached host blocks back to device (one copy call), updating the
        index; returns their new device ids in order, or None when device
        memory is short (nothing changed). Refs are typically the host part of
        a live PrefixLock, whose ``blocks`` are NOT updated: use the result."""
        refs = list(refs)
        bad = [r for r in refs if r.tier != "host" or r.node_id != self.node_id
               or not self.tree.holds(r)]
        if bad:
            raise ValueError(f"swap_in: not cached local host blocks: {bad[:4]}")
        if not refs:
            return []
        # Pin the blocks: allocating device memory may evict other-tier leaves.
        handles = self.tree.lock_refs(refs)
        try:
            dev_ids = self.alloc_mem(len(refs), "device")
            if dev_ids is None:
                return None
            host_ids = [r.block_id for r in refs]
            self._copy("host", host_ids, "device", dev_ids)
            self.tree.relocate([(r, self._ref("device", d)) for r, d in zip(refs, dev_ids)])
            self.pools["host"].free(host_ids)
            return dev_ids
        finally:
            for h in handles:
                self.tree.unlock(h)

    def swap_out_private(self, device_ids: Sequence[int]) -> list[int] | None:
        """Preemption: copy request-owned device blocks to fresh host blocks
        (one copy call) and free the device ones. None if host is short."""
        return self._move_private(device_ids, "device", "host")

    def swap_in_private(self, host_ids: Sequence[int]) -> list[int] | None:
        """Inverse of ``swap_out_private`` (and of ``swap_out_request``). None if device is short."""
        return self._move_private(host_ids, "host", "device")

    def swap_out_request(self, device_ids: Sequence[int], prefix: PrefixLock | None) -> list[int] | None:
        """Preemption by swap: copy a request's whole device block table
        ``device_ids`` to fresh host blocks (one copy call) and give back every
        device block the request holds, so that a swapped request pins no
        device memory. The first ``len(prefix.blocks)`` ids are the cached
        blocks of its lookup ``prefix`` (``match``, a prompt's ``reserve_region`` or
        ``cache_running``): they are copied, stay in the index, and the lookup
        is released (they become evictable unless another lock holds them);
        the rest are request-owned and freed. ``prefix`` None: all are
        request-owned (``swap_out_private``).

        Returns the host ids in table order, request-owned host blocks that
        ``swap_in_private`` brings back as private device blocks; None when the
        host tier is short, and then nothing changed (``prefix`` still holds).
        Raises ValueError when the table does not match that description."""
        ids = list(device_ids)
        n = len(prefix.blocks) if prefix is not None else 0
        if prefix is not None and prefix.released or n > len(ids):
            raise ValueError(f"swap_out_request: {prefix!r} is not a live lookup of a {len(ids)}-block table")
        cached = make_refs("device", ids[:n], self.node_id)
        if not all(map(self.tree.holds, cached)):
            raise ValueError(f"swap_out_request: the table's first {n} blocks are not its cached prefix")
        private = ids[n:]
        device = self.pools["device"]
        if not device.all_used(private) or self.tree.holds_any(make_refs("device", private, self.node_id)):
            raise ValueError(f"swap_out_request: not request-owned device blocks: {private[:8]}")
        host_ids = self.alloc_mem(len(ids), "host")
        if host_ids is None:
            return None
        self._copy("device", ids, "host", host_ids)
        device.free(private)
        if prefix is not None:
            self.release(prefix)
        return host_ids

    def available(self, tier: str = "device", reclaim: bool = True) -> int:
        """Blocks of ``tier`` that ``alloc_mem(n, tier, reclaim)`` could hand
        out now: the free ones, the unlocked cached ones (evictable) and,
        with ``reclaim``, those of redundant copies (the ``reclaimer``'s).
        A peek: nothing changes."""
        spare = self.reclaimer.reclaimable(tier) if reclaim and self.reclaimer is not None else 0
        return self._pool(tier).num_free + self.tree.evictable(tier) + spare

    def free_blocks(self, tier: str = "device") -> int:
        """Blocks of ``tier`` in no one's hands (not evictable cached ones). A peek."""
        return self._pool(tier).num_free

    def lendable(self, tier: str = "device") -> int:
        """Blocks of ``tier`` a loan may take (``reserve_region(LENT)``): the
        free ones and the unlocked cached ones (evicted LRU first, as for
        ``alloc_mem``); never locked (a running request's, pinned) ones,
        nor redundant copies. A peek: nothing changes."""
        return self.available(tier, reclaim=False)

    def capacity(self, tier: str = "device") -> int:
        """All blocks of ``tier``."""
        return self._pool(tier).num_blocks

    def _move_private(self, ids: Sequence[int], src: str, dst: str) -> list[int] | None:
        ids = list(ids)
        pool = self.pools[src]
        if not pool.all_used(ids) or self.tree.holds_any(make_refs(src, ids, self.node_id)):
            raise ValueError(f"not request-owned {src} blocks: {ids[:8]}...")
        new = self.alloc_mem(len(ids), dst)
        if new is None:
            return None
        self._copy(src, ids, dst, new)
        pool.free(ids)
        return new

    # ------------------------------------------------- KV movement (kvd's door)
    # What a transfer needs, as verbs: kvd/ never reaches the radix tree, the
    # block pools or the KV tensors (tests/kvd/test_kv_door.py keeps it so).

    def flush(self) -> dict[str, int]:
        """Evict every unlocked cached block of every tier; returns the blocks
        freed per tier. Locked prefixes (running requests, transfers) stay."""
        freed = dict.fromkeys(self.pools, 0)
        for tier in self.pools:
            refs = self.tree.evict(self.tree.evictable(tier), tier)
            self._free_refs(refs)       # evicting a tier may take blocks of another tier below it
            for ref in refs:
                freed[ref.tier] += 1
        return freed

    def lock_prefix(self, tokens: Sequence[int]) -> PrefixLock:
        """The longest cached prefix of ``tokens`` (full blocks, any tier),
        locked against eviction until ``unlock``: for the length of a
        transfer. Unlike ``match`` it is not a lookup for the hit-rate
        statistics. A miss is a lock of no blocks (unlock it too)."""
        m = self.tree.match(tokens)
        self.tree.lock(m.last_node)
        return PrefixLock(m.num_tokens, list(m.blocks), m.last_node)

    def unlock(self, lock: PrefixLock) -> None:
        """Release a ``lock_prefix`` (or a grant's) lock; raises ValueError
        when released twice."""
        if lock.released:
            raise ValueError("PrefixLock released twice")
        self.tree.unlock(lock._handle)
        lock._released = True

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` this pool caches (full
        blocks, any tier). A peek: nothing is locked or counted."""
        return self.tree.match(tokens).num_tokens

    def reserve_region(self, tokens: Sequence[int], num_blocks: int = 0, tier: str = "device",
                       purpose: Purpose = Purpose.PREFIX, deadline: float | None = None) -> Region | None:
        """Set blocks aside for KV another instance sends (engine/memory/region.py):

        - ``PREFIX``: the ``num_blocks`` full blocks of ``tokens``: the prefix
          this pool caches is locked (not a lookup for the statistics),
          blocks of ``tier`` are allocated for the rest;
        - ``PROMPT``: every token of a prompt whose KV another instance
          computes: the cached prefix of ``tokens[:-1]`` as ``match`` finds
          it (counted as a lookup, host blocks swapped in), fresh device
          blocks for the rest (``num_blocks`` and ``tier`` unused);
        - ``REPLICA``: private blocks of ``tier`` that ``Region.append``
          adds: none yet, in no index, so no lookup matches them and no
          eviction takes them (``tokens`` and ``num_blocks`` unused);
        - ``LENT``: ``num_blocks`` private blocks of ``tier`` for another
          node's KV (``tokens`` unused), taken like a request's
          (``alloc_mem``): free blocks, then unlocked cached ones evicted
          LRU first; never locked ones, nor redundant copies (``lendable``).

        ``deadline`` (monotonic) rides on the region for its holder. None
        when short of memory (nothing changed). End it with ``commit`` or
        ``cancel``."""
        if purpose is Purpose.REPLICA:
            self._pool(tier)
            return Region(self, purpose, (), tier, [], deadline=deadline)
        if purpose is Purpose.PROMPT:
            return self._reserve_prompt(tuple(tokens), deadline)
        if purpose is Purpose.LENT:
            ids = self.alloc_mem(num_blocks, tier, reclaim=False) if 0 < num_blocks else None
            return None if ids is None else Region(self, purpose, (), tier, ids, deadline=deadline)
        tokens = tuple(tokens[:num_blocks * self.block_size])
        if len(tokens) != num_blocks * self.block_size:
            raise ValueError(f"reserve_region: {len(tokens)} tokens for {num_blocks} blocks")
        lock = self.lock_prefix(tokens)
        have = len(lock.blocks)
        ids = self.alloc_mem(num_blocks - have, tier) if have < num_blocks else []
        if ids is None:
            self.unlock(lock)
            return None
        return Region(self, purpose, tokens, tier, ids, prefix=lock, deadline=deadline)

    def _reserve_prompt(self, tokens: tuple[int, ...], deadline: float | None) -> Region | None:
        bs = self.block_size
        hit = self.lock_prefix(tokens[:-1])
        host = [r for r in hit.blocks if r.tier != "device"]
        moved = iter(())
        if host:
            new_ids = self.swap_in(host)
            if new_ids is None:
                self.unlock(hit)
                return None
            moved = iter(new_ids)
        prefix_ids = [r.block_id if r.tier == "device" else next(moved) for r in hit.blocks]
        fresh = self.alloc_mem(-(-len(tokens) // bs) - len(prefix_ids))
        if fresh is None:
            self.unlock(hit)
            return None
        self.hit_tokens += hit.num_tokens                 # from here on it is a request's lookup
        self.miss_tokens += len(tokens) - 1 - hit.num_tokens
        self.live_hits += 1
        return Region(self, Purpose.PROMPT, tokens, "device", fresh, prefix=hit, prefix_ids=prefix_ids,
                      deadline=deadline)

    def _index_region(self, region: Region) -> None:
        """Index a PREFIX region's blocks under its tokens: its prefix's refs
        (any tier), then its fresh blocks; blocks cached meanwhile by someone
        else are duplicates, freed (``Region.commit``)."""
        have = region.have_blocks
        refs = region.prefix.blocks + make_refs(region.tier, region.block_ids, self.node_id)
        present = self.tree.insert(region.tokens, refs)
        dups = [r.block_id for r in refs[have:present]]
        if dups:
            self._pool(region.tier).free(dups)

    def gather_blocks(self, ids: Sequence[int], out: object, layers: tuple[int, int],
                      tier: str = "device") -> None:
        """``gather`` of a running request's own blocks (ids of ``tier``, which
        the request holds: no lock needed while it runs)."""
        self._storage().gather(tier, ids, out, layers=layers)

    def kv_layout(self) -> KVLayout:
        """The KV storage's shape, for a peer to check and a sender to size."""
        kv = self._storage()
        return KVLayout(kv.num_layers, kv.dtype, tuple(kv.block_shape), kv.bytes_per_block, kv.slice_bytes,
                        tuple(t for t in self.pools if kv.tier(t).device.type == "cpu"))

    def gather(self, refs: Sequence[BlockRef], out: object, layers: tuple[int, int]) -> None:
        """Copy layers ``[l0, l1)`` of the blocks ``refs`` (a locked prefix's,
        any tiers) into ``out`` [l1-l0, 2, len(refs), bs, kvh, hd]: one copy
        per run of consecutive ids of one tier, never one per block."""
        kv = self._storage()
        l0, l1 = layers
        pos = 0
        while pos < len(refs):
            end = pos
            while end < len(refs) and refs[end].tier == refs[pos].tier:
                end += 1
            kv.gather(refs[pos].tier, [r.block_id for r in refs[pos:end]], out[:, :, pos:end], layers=(l0, l1))
            pos = end

    def layer_caches(self, layer: int, tier: str = "device") -> tuple[object, object]:
        """One layer's K and V caches of ``tier`` ([N, bs, kvh, hd] views, no copy), for a
        kernel that reads or writes blocks the caller holds (a running request's, a loan's:
        engine/dist_attention.py's lender). They alias the pool: the caller touches only
        its own blocks, from any thread."""
        kv = self._storage().layer(layer, tier)
        return kv[0], kv[1]

    def pieces(self, tier: str, ids: Sequence[int], layers: tuple[int, int]) -> tuple[list[int], list]:
        """Byte views (no copy) of layers ``[l0, l1)`` of blocks ``ids`` of a
        CPU tier, one per (layer, K|V, run): ``KVCache.pieces``. They alias
        the pool: the blocks must stay locked while the views are read."""
        return self._storage().pieces(tier, ids, layers)

    def write_blocks(self, ids: Sequence[int], payload: object, tier: str = "device") -> None:
        """Overwrite whole blocks ``ids`` of ``tier`` with ``payload`` [L, 2, n, bs, kvh, hd]
        (allocated ids: a benchmark's or a test's synthetic KV)."""
        self._storage().import_blocks(tier, ids, payload)

    def _storage(self):
        if self.storage is None:
            raise ValueError("this MemPool has no KV storage")
        return self.storage

    # ----------------------------------------------------------------- reporting

    def take_events(self) -> list[CacheEvent]:
        """Drain the index's stored/removed events, oldest first."""
        return self.tree.take_events()

    def events_dropped(self) -> int:
        """Events lost to the full event buffer since start (a reader that saw
        this grow must resync from ``cache_snapshot``)."""
        return self.tree.events_dropped

    def cache_snapshot(self) -> list[BlockStored]:
        """Every cached block as a ``BlockStored`` event, parents first (see
        ``RadixTree.snapshot``); nothing changes."""
        return self.tree.snapshot()

    def stats(self) -> dict:
        out: dict = {"block_size": self.block_size, "node_id": self.node_id,
                     "hit_tokens": self.hit_tokens, "miss_tokens": self.miss_tokens,
                     "live_hits": self.live_hits,
                     "events_dropped": self.tree.events_dropped}
        for tier, pool in self.pools.items():
            cached = self.tree.num_cached(tier)
            out[tier] = {"total": pool.num_blocks, "free": pool.num_free,
                         "used": pool.num_used, "cached": cached,
                         "request_owned": pool.num_used - cached,
                         "evictable": self.tree.evictable(tier)}
        return out

    def check_integrity(self) -> None:
        """Assert: per tier free + request-owned + cached == total, no block is
        both free and cached, every cached ref is local and allocated, lock
        refs >= 0 (checked by the tree)."""
        self.tree.check_integrity()
        cached: dict[str, set[int]] = {t: set() for t in self.pools}
        for r in self.tree.cached_refs():
            assert r.node_id == self.node_id, f"foreign ref {r} in a local index"
            assert r.tier in cached, f"unknown tier in {r}"
            cached[r.tier].add(r.block_id)
        for tier, pool in self.pools.items():
            pool.check_integrity()
            used = pool.used_ids()
            assert cached[tier] <= used, f"{tier}: cached blocks that are free"
            owned = len(used) - len(cached[tier])
            assert pool.num_free + owned + len(cached[tier]) == pool.num_blocks
        assert self.live_hits >= 0
