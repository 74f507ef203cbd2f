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
``gather``/``pieces``, ``grant``/``import_kv``/``import_pieces``/
``insert_granted``/``abandon``, ``hold_kv``/``commit_hold``/``drop_hold``,
``write_blocks`` -- never ``tree``, ``pools`` or the storage itself
(tests/kvd/test_kv_door.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.memory.blocks import BlockPool
from engine.memory.radix import BlockRef, BlockStored, CacheEvent, RadixTree, make_refs

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


@dataclass
class Grant:
    """Blocks allocated to receive a transfer (``MemPool.grant``): ``lock``
    holds the prefix the pool already had (``len(lock.blocks)`` blocks, not
    sent), ``block_ids`` of ``tier`` take the rest, in token order."""

    tokens: tuple[int, ...]
    lock: PrefixLock
    block_ids: list[int]
    tier: str

    @property
    def have_blocks(self) -> int:
        return len(self.lock.blocks)


@dataclass
class Hold:
    """Private KV blocks (``MemPool.hold_kv``): ``block_ids`` of ``tier``, in
    token order, request-owned, in no index; end with ``commit_hold`` or
    ``drop_hold``."""

    tier: str
    block_ids: list[int] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class Reservation:
    """Device blocks reserved for a request whose prompt KV another instance
    computes (disaggregated prefill, ``MemPool.reserve``): ``prefix`` is this
    pool's cached prefix of the prompt, locked as a request's lookup
    (``match``), its blocks on device at ``prefix_ids``; ``block_ids`` take
    the rest of the prompt, blocks ``[have_blocks, ceil(len(tokens)/bs))``,
    the last one possibly partial. The KV arrives through ``import_kv``; the
    engine then runs the request from these blocks (``LLMEngine.add_prefilled``),
    or ``cancel`` returns them."""

    tokens: tuple[int, ...]
    prefix: PrefixLock
    prefix_ids: list[int]
    block_ids: list[int]
    tier: str = "device"

    @property
    def have_blocks(self) -> int:
        return len(self.prefix_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prefix_ids + self.block_ids


@dataclass(frozen=True)
class KVLayout:
    """What a peer must agree on and a sender sizes its messages by."""

    num_layers: int
    dtype: object                       # torch dtype
    block_shape: tuple[int, ...]        # [L, 2, bs, kvh, hd]
    bytes_per_block: int
    slice_bytes: int                    # one layer's K (or V) of one block
    cpu_tiers: tuple[str, ...]          # tiers whose blocks can be sent as views (pieces)


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

    def _pool(self, tier: str) -> BlockPool:
        try:
            return self.pools[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}") from None

    def _ref(self, tier: str, block_id: int) -> BlockRef:
        return BlockRef(tier, block_id, self.node_id)

    # ------------------------------------------------------------ memory blocks

    def alloc_mem(self, n: int, tier: str = "device") -> list[int] | None:
        """Allocate ``n`` blocks of ``tier`` for a request.

        When the pool is short, evicts unlocked cached blocks (LRU) first.
        Returns None when even eviction cannot cover ``n``; then nothing
        changed (no partial allocation, nothing evicted).
        """
        pool = self._pool(tier)
        short = n - pool.num_free
        if short > 0:
            if self.tree.evictable(tier) < short:
                return None
            self._free_refs(self.tree.evict(short, tier))
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

    def delete(self, tokens: Sequence[int]) -> int:
        """Drop the cached blocks that only this prompt uses (see
        ``RadixTree.delete``); returns the number of blocks freed."""
        refs = self.tree.delete(tokens)
        self._free_refs(refs)
        return len(refs)

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
        blocks of its lookup ``prefix`` (``match``, ``reserve`` or
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

    def available(self, tier: str = "device") -> int:
        """Blocks of ``tier`` that ``alloc_mem`` could hand out now: the free
        ones and the unlocked cached ones (evictable). A peek: nothing changes."""
        return self._pool(tier).num_free + self.tree.evictable(tier)

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

    # ------------------------------------------------------------------ transfer

    def transfer(self, dst: MemPool, block_ids: Sequence[int], tier: str = "device",
                 dst_ids: Sequence[int] | None = None,
                 dst_tier: str | None = None) -> list[int] | None:
        """Copy blocks to another instance's pool (MemServe §4.3).

        1. allocation: the receiver allocates ``len(block_ids)`` blocks of
           ``dst_tier`` (default: ``tier``) unless ``dst_ids`` is given;
        2. transmission: one ``export_blocks`` payload, one ``import_blocks``.
        The blocks stay owned by the sender; the receiver's blocks are
        request-owned there. Returns the receiver's ids, None when the
        receiver is short (nothing changed).
        """
        dst_tier = dst_tier or tier
        block_ids = list(block_ids)
        src_pool = self._pool(tier)
        if not src_pool.all_used(block_ids):
            raise ValueError("transfer: source blocks are not allocated")
        if (self.storage is None) != (dst.storage is None):
            raise ValueError("transfer: both pools need a storage, or neither")
        if dst_ids is None:
            ids = dst.alloc_mem(len(block_ids), dst_tier)
            if ids is None:
                return None
        else:
            ids = list(dst_ids)
            if len(ids) != len(block_ids):
                raise ValueError("transfer: dst_ids and block_ids differ in length")
            if not dst._pool(dst_tier).all_used(ids):
                raise ValueError("transfer: dst_ids are not allocated at the receiver")
        if self.storage is not None and block_ids:
            payload = self.storage.export_blocks(tier, block_ids)
            dst.storage.import_blocks(dst_tier, ids, payload)  # type: ignore[union-attr]
        return ids

    def transfer_with_insert(self, dst: MemPool, tokens: Sequence[int],
                             block_ids: Sequence[int], tier: str = "device",
                             dst_tier: str | None = None) -> int | None:
        """Transfer the full blocks of ``tokens`` and insert them into the
        receiver's index (allocation, transmission, insertion).

        Blocks the receiver already caches are not sent. Returns the number of
        blocks newly cached at the receiver, or None when it is short of
        memory (nothing changed). The sender's blocks are untouched.
        """
        dst_tier = dst_tier or tier
        bs = self.block_size
        if dst.block_size != bs:
            raise ValueError("transfer_with_insert: block sizes differ")
        nfull = len(tokens) // bs
        if len(block_ids) < nfull:
            raise ValueError(f"transfer_with_insert: {nfull} full blocks, {len(block_ids)} ids")
        tokens = tokens[:nfull * bs]
        # Lock what the receiver already has, so its allocation cannot evict it
        # (tree-level: this is not a lookup to count in the receiver's stats).
        m = dst.tree.match(tokens)
        dst.tree.lock(m.last_node)
        try:
            have = len(m.blocks)
            sent = self.transfer(dst, block_ids[have:nfull], tier, dst_tier=dst_tier)
            if sent is None:
                return None
            # The receiver's own refs for the prefix it had (any tier), then the
            # new blocks; insert never replaces, so nothing already there moves.
            refs = m.blocks + [dst._ref(dst_tier, i) for i in sent]
            present = dst.tree.insert(tokens, refs)
            dups = [r.block_id for r in refs[have:present]]   # none while single-threaded
            if dups:
                dst.pools[dst_tier].free(dups)
            return nfull - present
        finally:
            dst.tree.unlock(m.last_node)

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

    def grant(self, tokens: Sequence[int], num_blocks: int, tier: str = "device") -> Grant | None:
        """Receive side of a transfer of the ``num_blocks`` full blocks of
        ``tokens``: lock the prefix this pool already caches and allocate
        blocks of ``tier`` for the rest. None when short of memory (nothing
        changed). End it with ``insert_granted`` once its KV is written
        (``import_kv``), or ``abandon`` it."""
        tokens = tuple(tokens[:num_blocks * self.block_size])
        if len(tokens) != num_blocks * self.block_size:
            raise ValueError(f"grant: {len(tokens)} tokens for {num_blocks} blocks")
        lock = self.lock_prefix(tokens)
        have = len(lock.blocks)
        ids = self.alloc_mem(num_blocks - have, tier) if have < num_blocks else []
        if ids is None:
            self.unlock(lock)
            return None
        return Grant(tokens, lock, ids, tier)

    def insert_granted(self, grant: Grant) -> int:
        """Index a grant's blocks under its tokens (blocks cached meanwhile
        by someone else are duplicates: freed), unlock. Returns its tokens."""
        refs = grant.lock.blocks + make_refs(grant.tier, grant.block_ids, self.node_id)
        present = self.tree.insert(grant.tokens, refs)
        dups = [r.block_id for r in refs[len(grant.lock.blocks):present]]
        if dups:
            self._pool(grant.tier).free(dups)
        self.unlock(grant.lock)
        return len(grant.tokens)

    def abandon(self, grant: Grant) -> None:
        """Free a grant's blocks and unlock its prefix: nothing was indexed."""
        self.free_mem(grant.block_ids, grant.tier)
        self.unlock(grant.lock)

    def hold_kv(self, hold: Hold | None, payload: object, tier: str = "host") -> Hold | None:
        """Keep KV private: a replica of a request another instance runs
        (DejaVu §4.2.3). ``payload`` [L, 2, n, bs, kvh, hd] is written into
        ``n`` fresh blocks of ``tier`` appended to ``hold`` (a new one when
        None). Held blocks are request-owned: in no index, so no lookup
        ever matches them and no eviction takes them, until ``commit_hold``
        indexes them or ``drop_hold`` frees them. Returns the hold; None
        when ``tier`` is short of memory, and then nothing changed."""
        if hold is not None and hold.tier != tier:
            raise ValueError(f"hold_kv: a hold of {hold.tier} blocks cannot grow in {tier}")
        n = payload.shape[2]
        ids = self.alloc_mem(n, tier) if n else []
        if ids is None:
            return None
        if ids:
            try:
                self._storage().import_blocks(tier, ids, payload)
            except BaseException:
                self.free_mem(ids, tier)
                raise
        hold = hold if hold is not None else Hold(tier)
        hold.block_ids.extend(ids)
        return hold

    def commit_hold(self, hold: Hold, tokens: Sequence[int]) -> PrefixLock:
        """Index a hold as the KV of ``tokens``, as a request's own KV is at
        its end (``insert``): its first ``len(tokens) // block_size`` blocks
        hold those tokens' full blocks; blocks past them are freed; blocks
        the index already has are duplicates, freed. The hold is empty
        afterwards. Returns a lock on the indexed prefix (``unlock`` it).
        Raises ValueError when the hold is shorter than ``tokens``."""
        nfull = len(tokens) // self.block_size
        if nfull > len(hold.block_ids):
            raise ValueError(f"commit_hold: {nfull} full blocks, the hold has {len(hold.block_ids)}")
        ids, rest = hold.block_ids[:nfull], hold.block_ids[nfull:]
        hold.block_ids = []
        if rest:
            self.free_mem(rest, hold.tier)
        prefix = tokens[:nfull * self.block_size]
        if ids:
            self.insert(prefix, ids, hold.tier)
        return self.lock_prefix(prefix)

    def drop_hold(self, hold: Hold) -> None:
        """Free a hold's blocks (nothing of it was indexed)."""
        ids, hold.block_ids = hold.block_ids, []
        if ids:
            self.free_mem(ids, hold.tier)

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` this pool caches (full
        blocks, any tier). A peek: nothing is locked or counted."""
        return self.tree.match(tokens).num_tokens

    def reserve(self, tokens: Sequence[int]) -> Reservation | None:
        """Reserve device blocks for every token of a prompt whose KV another
        instance computes: the cached prefix of ``tokens[:-1]`` (as
        ``match`` finds it: counted as a lookup, host blocks swapped in) plus
        fresh blocks for the rest. None when device memory is short (nothing
        changed). End it with ``LLMEngine.add_prefilled`` or ``cancel``."""
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
        return Reservation(tuple(tokens), hit, prefix_ids, fresh)

    def cancel(self, res: Reservation) -> None:
        """Return a reservation that will not run: its fresh blocks are freed
        and its prefix released (raises ValueError when done twice)."""
        self.free_mem(res.block_ids, res.tier)
        res.block_ids = []
        self.release(res.prefix)

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

    def pieces(self, tier: str, ids: Sequence[int], layers: tuple[int, int]) -> tuple[list[int], list]:
        """Byte views (no copy) of layers ``[l0, l1)`` of blocks ``ids`` of a
        CPU tier, one per (layer, K|V, run): ``KVCache.pieces``. They alias
        the pool: the blocks must stay locked while the views are read."""
        return self._storage().pieces(tier, ids, layers)

    def import_kv(self, grant: Grant | Reservation, payload: object, layers: tuple[int, int],
                  skip: int = 0) -> None:
        """Write layers ``[l0, l1)`` of a granted transfer (or a reservation's
        KV) into its fresh blocks:
        ``payload`` [l1-l0, 2, skip + n, bs, kvh, hd] (its first ``skip``
        blocks dropped), one copy per run of the grant's ids."""
        if grant.block_ids:
            self._storage().scatter(grant.tier, grant.block_ids, payload[:, :, skip:], layers=layers)

    def import_pieces(self, grant: Grant, pieces: Sequence[object], lengths: Sequence[int],
                      layers: tuple[int, int], skip: int = 0) -> None:
        """``import_kv`` for KV that arrives as pieces (``KVCache.scatter_pieces``)."""
        self._storage().scatter_pieces(grant.tier, grant.block_ids, pieces, lengths, layers, skip)

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
