"""Radix tree over token blocks: the prompt index of MemPool (MemServe §4.2).

Pure Python (no torch, no I/O). Modelled on SGLang's radix cache, at block
granularity and with MemServe's two extensions: a cached block may live in any
tier ("device", "host", ...), and each block records which instance holds it,
so the same class serves as the coordinator's global prompt tree.

Only FULL blocks are indexed. A key is ``block_size`` tokens; a prompt of
``n`` tokens indexes its first ``n // block_size`` blocks and ignores the tail.

Edges are compressed (like SGLang): one node holds a run of consecutive blocks
of ONE tier, so a 4,096-token prompt inserted fresh is one node, and matching
it is one tuple comparison per node, not one dict lookup per block::

    root ─┬─ [b0 b1 b2]            node: key = tokens of its blocks
          │      ├─ [b3 b4]        (len(key) == len(refs) * block_size),
          │      └─ [b3' b4' b5']  refs = one BlockRef per block,
          └─ [c0]                  children keyed by their first block

A node is split when a match or an insert diverges inside it, and when
``relocate`` moves only part of it to another tier. On a split the EXISTING
node object keeps the deeper part (the suffix) and a new node takes the
prefix, so a handle held by a caller stays the deepest node of the path it
locked.

Locks follow SGLang: ``lock(handle)`` adds one to ``lock_ref`` on every node
from the handle to the root; a node with ``lock_ref > 0`` is never evicted,
deleted or chosen for swapping. ``last_access`` is a logical clock (one tick
per match/insert), so eviction order is deterministic.

Eviction removes blocks from the tails of unlocked leaves, least recently used
first, so a prefix always outlives its extensions. ``evict(n, tier)`` prefers
leaves of ``tier``; when only other-tier leaves hide the remaining ``tier``
blocks (e.g. a device block whose extension was swapped to host), those leaves
are removed too and returned, so the caller frees them in their own tier.
Hence ``evictable(tier)`` is exactly the number of unlocked ``tier`` blocks.

Events: every block stored or removed appends a ``BlockStored`` /
``BlockRemoved`` event (``block_hash(parent_hash, block_tokens)``, chained
from ``ROOT_HASH``; int-tuple hashes are the same in every process).
``take_events()`` drains them. The buffer is capped: the oldest are dropped
and counted in ``events_dropped``. Tier moves (``relocate``) emit nothing: the
global tree tracks which instance holds a block, not in which tier.
"""

from __future__ import annotations

import heapq
import itertools
from functools import partial
from operator import itemgetter
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union

ROOT_HASH = 0
"""Parent hash of a prompt's first block (an int, so hashes agree across processes)."""


def block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The hash of the block of ``tokens`` that follows the block hashed
    ``parent_hash`` (``ROOT_HASH`` for a prompt's first): the one rule that
    the nodes' radix trees and the coordinator's prompt trees share. A tuple
    of ints hashes the same in every process."""
    return hash((parent_hash, tokens))


class BlockRef(NamedTuple):
    """Where one cached block lives: ``(tier, block_id)`` on instance ``node_id``.

    Immutable and hashable like a frozen dataclass, but a NamedTuple: it is
    built and hashed in C, and ``insert`` of a 4,096-token prompt makes 256 of
    them (see tools/bench/engine/bench_radix.py).
    """

    tier: str
    block_id: int
    node_id: str


class BlockStored(NamedTuple):
    node_id: str                 # instance holding the block
    parent_hash: int             # ROOT_HASH for a prompt's first block
    block_hash: int
    tokens: tuple[int, ...]      # the block's block_size tokens
    ref: BlockRef


class BlockRemoved(NamedTuple):
    node_id: str
    block_hash: int


CacheEvent = Union[BlockStored, BlockRemoved]

_new_ref = partial(tuple.__new__, BlockRef)


def make_refs(tier: str, block_ids: Iterable[int], node_id: str) -> list[BlockRef]:
    """``[BlockRef(tier, i, node_id) for i in block_ids]``, built in C (hot in insert)."""
    return list(map(_new_ref, zip(itertools.repeat(tier), block_ids, itertools.repeat(node_id))))


_new_stored = partial(tuple.__new__, BlockStored)   # BlockStored from one 5-tuple, in C
_node_id_of = itemgetter(2)                          # BlockRef.node_id, in C


class _Node:
    __slots__ = ("key", "refs", "hashes", "tier", "children", "parent",
                 "lock_ref", "last_access", "serial")

    def __init__(self, key: tuple[int, ...], refs: list[BlockRef], hashes: list[int] | None,
                 tier: str, parent: _Node | None, last_access: int, serial: int) -> None:
        self.key = key                    # tokens of this node's blocks, back to back
        self.refs = refs                  # one per block, all of `tier`
        self.hashes = hashes              # chained block hashes (None: events disabled)
        self.tier = tier
        self.children: dict[tuple[int, ...], _Node] = {}   # first block -> child
        self.parent = parent              # None once removed (and for the root)
        self.lock_ref = 0
        self.last_access = last_access
        self.serial = serial              # creation order: deterministic tie-break


@dataclass(slots=True)
class MatchResult:
    """Longest cached prefix. ``last_node`` is an opaque handle for lock/unlock;
    it is only guaranteed valid until the tree is next mutated unless locked."""

    blocks: list[BlockRef]
    num_tokens: int
    last_node: _Node


class RadixTree:
    """Prompt index: full token blocks -> BlockRefs, with locks and LRU eviction.

    Not thread-safe: the engine core calls it from one thread.
    """

    def __init__(self, block_size: int = 16, node_id: str = "local", *,
                 enable_events: bool = True, max_events: int = 1 << 16) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.block_size = block_size
        self.node_id = node_id
        self.enable_events = enable_events
        self.max_events = max_events
        self._serial = itertools.count()
        self._clock = 0
        self._root = _Node((), [], [] if enable_events else None, "", None, 0, next(self._serial))
        self._where: dict[BlockRef, _Node] = {}      # every cached ref -> its node
        self._leaves: set[_Node] = set()             # non-root nodes without children
        self._cached: defaultdict[str, int] = defaultdict(int)     # tier -> cached blocks
        self._evictable: defaultdict[str, int] = defaultdict(int)  # tier -> unlocked cached
        self._events: deque[CacheEvent] = deque(maxlen=max_events)
        self.events_dropped = 0

    # ---------------------------------------------------------------- queries

    def num_cached(self, tier: str | None = None) -> int:
        """Cached blocks of ``tier`` (all tiers when None)."""
        if tier is None:
            return len(self._where)
        return self._cached.get(tier, 0)

    def evictable(self, tier: str = "device") -> int:
        """Blocks of ``tier`` that ``evict`` could free: exactly the unlocked ones."""
        return self._evictable.get(tier, 0)

    def holds(self, ref: BlockRef) -> bool:
        """Whether ``ref`` is indexed (is a cached block)."""
        return ref in self._where

    def holds_any(self, refs: Iterable[BlockRef]) -> bool:
        """Whether any of ``refs`` is indexed."""
        return not self._where.keys().isdisjoint(refs)

    def cached_refs(self) -> list[BlockRef]:
        return list(self._where)

    def is_locked(self, ref: BlockRef) -> bool:
        return self._where[ref].lock_ref > 0

    # ------------------------------------------------------------------ match

    def match(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``tokens`` in full blocks.

        Marks the path as accessed (LRU) and may split the last node so that
        the handle ends exactly at the match. Does not lock.
        """
        bs = self.block_size
        t = tokens if type(tokens) is tuple else tuple(tokens)
        end = len(t) - len(t) % bs
        self._clock += 1
        tick = self._clock
        node = self._root
        blocks: list[BlockRef] = []
        i = 0
        while i < end:
            child = node.children.get(t[i:i + bs])
            if child is None:
                break
            key = child.key
            child.last_access = tick
            if t[i:i + len(key)] == key:
                blocks.extend(child.refs)
                i += len(key)
                node = child
                continue
            k = self._common_blocks(t, i, end, key)
            node = self._split(child, k)
            blocks.extend(node.refs)
            i += k * bs
            break
        return MatchResult(blocks, i, node)

    def _common_blocks(self, t: tuple[int, ...], i: int, end: int, key: tuple[int, ...]) -> int:
        """Blocks of ``key`` matching ``t[i:end]``; the first is known to match."""
        bs = self.block_size
        k = 1
        limit = min(len(key), end - i)
        while (k + 1) * bs <= limit and t[i + k * bs:i + (k + 1) * bs] == key[k * bs:(k + 1) * bs]:
            k += 1
        return k

    # ----------------------------------------------------------------- insert

    def insert(self, tokens: Sequence[int], blocks: Sequence[BlockRef]) -> int:
        """Index the full blocks of ``tokens``; ``blocks[i]`` holds block ``i``.

        ``len(blocks)`` must equal ``len(tokens) // block_size``. Returns how
        many leading blocks were already cached: existing entries are never
        replaced, so the caller's copies of those are duplicates it must free
        (unless they ARE the cached blocks, see ``holds``). A new ref that is
        already indexed elsewhere raises ``ValueError`` and changes nothing.
        """
        bs = self.block_size
        t = tokens if type(tokens) is tuple else tuple(tokens)
        nb = len(t) // bs
        if len(blocks) != nb:
            raise ValueError(f"insert: {nb} full blocks of tokens but {len(blocks)} block refs")
        self._clock += 1
        tick = self._clock
        node = self._root
        i = 0                       # blocks matched so far
        split_child, split_k = None, 0
        while i < nb:
            child = node.children.get(t[i * bs:(i + 1) * bs])
            if child is None:
                break
            key = child.key
            child.last_access = tick
            if t[i * bs:i * bs + len(key)] == key:
                node = child
                i += len(child.refs)
                continue
            split_child, split_k = child, self._common_blocks(t, i * bs, nb * bs, key)
            i += split_k
            break
        present = i
        if present == nb:
            return present
        new = blocks[present:]
        if not self._where.keys().isdisjoint(new) or len(set(new)) != len(new):
            raise ValueError("insert: a block ref is already cached or repeated")
        if split_child is not None:
            node = self._split(split_child, split_k)
        self._attach(node, t, present, new, tick)
        return present

    def _attach(self, parent: _Node, t: tuple[int, ...], start: int,
                new: Sequence[BlockRef], tick: int) -> None:
        """Hang ``new`` (blocks ``start..``) under ``parent``: one node per tier run."""
        bs = self.block_size
        events = self.enable_events
        ph = (parent.hashes[-1] if parent.hashes else ROOT_HASH) if events else 0
        j = 0
        while j < len(new):
            tier = new[j].tier
            k = j + 1
            while k < len(new) and new[k].tier == tier:
                k += 1
            refs = list(new[j:k])
            a, b = (start + j) * bs, (start + k) * bs
            hashes = None
            if events:
                # Hot path (~half of a fresh insert): build the events with
                # C-level map/zip instead of one Python constructor call each.
                blks = [t[p:p + bs] for p in range(a, b, bs)]
                parents = [ph]
                hashes = []
                for blk in blks:
                    ph = block_hash(ph, blk)
                    hashes.append(ph)
                parents += hashes[:-1]
                self._emit(list(map(_new_stored, zip(
                    map(_node_id_of, refs), parents, hashes, blks, refs))))
            node = _Node(t[a:b], refs, hashes, tier, parent, tick, next(self._serial))
            if not parent.children:
                self._leaves.discard(parent)
            parent.children[t[a:a + bs]] = node
            self._where.update(dict.fromkeys(refs, node))
            self._cached[tier] += len(refs)
            self._evictable[tier] += len(refs)
            parent = node
            j = k
        self._leaves.add(parent)

    # ------------------------------------------------------------------ locks

    def lock(self, handle: _Node) -> None:
        """``lock_ref += 1`` from ``handle`` to the root; those blocks become unevictable."""
        self._check_alive(handle)
        node, root = handle, self._root
        while node is not root:
            if node.lock_ref == 0:
                self._evictable[node.tier] -= len(node.refs)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: _Node) -> None:
        """Undo one ``lock(handle)``; raises ``ValueError`` if not locked."""
        self._check_alive(handle)
        if handle is not self._root and handle.lock_ref <= 0:
            raise ValueError("unlock of a node that is not locked")
        node, root = handle, self._root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable[node.tier] += len(node.refs)
            node = node.parent

    def _check_alive(self, node: _Node) -> None:
        if node is not self._root and node.parent is None:
            raise ValueError("handle refers to a node that is no longer in the tree")

    def lock_refs(self, refs: Iterable[BlockRef]) -> list[_Node]:
        """Lock the path of every distinct node holding ``refs``; returns the
        handles to pass to ``unlock`` (once each). Raises KeyError if not cached."""
        handles = list(dict.fromkeys(self._where[r] for r in refs))
        for h in handles:
            self.lock(h)
        return handles

    # --------------------------------------------------------------- eviction

    def evict(self, num_blocks: int, tier: str = "device") -> list[BlockRef]:
        """Remove LRU unlocked blocks until ``num_blocks`` of ``tier`` are removed
        or none is left. Returns every removed ref (possibly some of other tiers,
        see the module docstring); the caller frees them in their tiers."""
        if num_blocks <= 0 or not self._evictable.get(tier):
            return []
        need = num_blocks
        primary: list[tuple[int, int, _Node]] = []
        other: list[tuple[int, int, _Node]] = []
        for leaf in self._leaves:
            if leaf.lock_ref == 0:
                (primary if leaf.tier == tier else other).append(
                    (leaf.last_access, leaf.serial, leaf))
        heapq.heapify(primary)
        heapq.heapify(other)
        removed: list[BlockRef] = []
        root = self._root
        while need > 0:
            if primary:
                leaf = heapq.heappop(primary)[2]
                take = min(need, len(leaf.refs))
                need -= take
            elif other:
                leaf = heapq.heappop(other)[2]
                if not self._hides_unlocked(leaf, tier):
                    continue
                take = len(leaf.refs)
            else:
                break
            parent = leaf.parent
            removed.extend(self._remove_tail(leaf, take))
            if leaf.parent is None and parent is not root and not parent.children \
                    and parent.lock_ref == 0:
                heapq.heappush(primary if parent.tier == tier else other,
                               (parent.last_access, parent.serial, parent))
        return removed

    def _hides_unlocked(self, leaf: _Node, tier: str) -> bool:
        """Whether an unlocked ``tier`` node sits above ``leaf``."""
        node = leaf.parent
        while node is not self._root:
            if node.lock_ref:
                return False
            if node.tier == tier:
                return True
            node = node.parent
        return False

    def _remove_tail(self, node: _Node, k: int) -> list[BlockRef]:
        """Remove the last ``k`` blocks of unlocked leaf ``node`` (all: the node)."""
        bs = self.block_size
        n = len(node.refs)
        gone = node.refs[n - k:]
        if self.enable_events and node.hashes is not None:
            self._emit([BlockRemoved(r.node_id, h)
                        for r, h in zip(reversed(gone), reversed(node.hashes[n - k:]))])
        for r in gone:
            del self._where[r]
        self._cached[node.tier] -= k
        self._evictable[node.tier] -= k
        if k == n:
            parent = node.parent
            del parent.children[node.key[:bs]]
            node.parent = None
            self._leaves.discard(node)
            if parent is not self._root and not parent.children:
                self._leaves.add(parent)
        else:
            node.key = node.key[:(n - k) * bs]
            del node.refs[n - k:]
            if node.hashes is not None:
                del node.hashes[n - k:]
        gone.reverse()           # deepest first
        return gone

    def delete(self, tokens: Sequence[int]) -> list[BlockRef]:
        """Remove the cached blocks that belong to ``tokens`` alone.

        Contract: walk the cached path of ``tokens``' full blocks. If it ends
        inside a node, or at a node with children, the blocks are shared with a
        longer prompt and nothing is removed. Otherwise remove that node and
        then each ancestor that is left childless, stopping at the first locked
        node or one with other children. Returns the removed refs, deepest
        first. Does not touch access order.
        """
        bs = self.block_size
        t = tokens if type(tokens) is tuple else tuple(tokens)
        end = len(t) - len(t) % bs
        node, i = self._root, 0
        while i < end:
            child = node.children.get(t[i:i + bs])
            if child is None or t[i:i + len(child.key)] != child.key:
                if child is not None:
                    return []          # ends inside a node: shared with a longer prompt
                break
            node = child
            i += len(child.key)
        removed: list[BlockRef] = []
        while node is not self._root and not node.children and node.lock_ref == 0:
            parent = node.parent
            removed.extend(self._remove_tail(node, len(node.refs)))
            node = parent
        return removed

    # -------------------------------------------------------------- swapping

    def swap_candidates(self, num_blocks: int, tier: str = "device") -> list[BlockRef]:
        """Up to ``num_blocks`` unlocked ``tier`` blocks in the order eviction
        would take them (LRU leaves first, deepest block first), so moving them
        to another tier keeps prefixes in the faster tier. Does not modify the
        tree. O(nodes)."""
        if num_blocks <= 0 or not self._evictable.get(tier):
            return []
        heap: list[tuple[int, int, _Node]] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.tier == tier and node.lock_ref == 0 and \
                    all(c.tier != tier for c in node.children.values()):
                heap.append((node.last_access, node.serial, node))
        heapq.heapify(heap)
        taken: set[_Node] = set()
        out: list[BlockRef] = []
        while heap and len(out) < num_blocks:
            node = heapq.heappop(heap)[2]
            k = min(num_blocks - len(out), len(node.refs))
            out.extend(reversed(node.refs[len(node.refs) - k:]))
            if k < len(node.refs):
                break
            taken.add(node)
            p = node.parent
            if p is not self._root and p.tier == tier and p.lock_ref == 0 and \
                    all(c.tier != tier or c in taken for c in p.children.values()):
                heapq.heappush(heap, (p.last_access, p.serial, p))
        return out

    def relocate(self, moves: Iterable[tuple[BlockRef, BlockRef]]) -> None:
        """Point cached blocks at new locations: ``(old, new)`` pairs.

        Used by swap_out/swap_in (tier change) and migration (other instance).
        Nodes left holding two tiers are split so every node has one tier.
        Raises ``ValueError`` (changing nothing) when an ``old`` is not cached
        or a ``new`` is already cached or repeated.
        """
        moves = [(o, n) for o, n in moves if o != n]
        where = self._where
        news = [n for _, n in moves]
        if any(o not in where for o, _ in moves):
            raise ValueError("relocate: block is not cached")
        if not where.keys().isdisjoint(news) or len(set(news)) != len(news) \
                or len({o for o, _ in moves}) != len(moves):
            raise ValueError("relocate: target already cached or repeated")
        by_node: dict[_Node, dict[BlockRef, BlockRef]] = {}
        for o, n in moves:
            by_node.setdefault(where[o], {})[o] = n
        for node, mapping in by_node.items():
            node.refs = [mapping.get(r, r) for r in node.refs]
            for o, n in mapping.items():
                del where[o]
                where[n] = node
                self._cached[o.tier] -= 1
                self._cached[n.tier] += 1
                if node.lock_ref == 0:
                    self._evictable[o.tier] -= 1
                    self._evictable[n.tier] += 1
            self._split_by_tier(node)

    def _split_by_tier(self, node: _Node) -> None:
        refs = node.refs
        while True:
            k = next((i for i in range(1, len(refs)) if refs[i].tier != refs[0].tier), 0)
            if not k:
                node.tier = refs[0].tier
                return
            prefix = self._split(node, k)
            prefix.tier = prefix.refs[0].tier
            refs = node.refs

    # ------------------------------------------------------------------ nodes

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node`` after its first ``k`` blocks; returns the new prefix
        node (``node`` keeps the suffix, its children and its identity)."""
        if k >= len(node.refs):
            return node
        cut = k * self.block_size
        bs = self.block_size
        parent = node.parent
        prefix = _Node(node.key[:cut], node.refs[:k],
                       node.hashes[:k] if node.hashes is not None else None,
                       node.tier, parent, node.last_access, next(self._serial))
        prefix.lock_ref = node.lock_ref
        parent.children[node.key[:bs]] = prefix
        node.key = node.key[cut:]
        node.refs = node.refs[k:]
        if node.hashes is not None:
            node.hashes = node.hashes[k:]
        node.parent = prefix
        prefix.children[node.key[:bs]] = node
        self._where.update(dict.fromkeys(prefix.refs, prefix))
        return prefix

    # ----------------------------------------------------------------- events

    def _emit(self, events: list[CacheEvent]) -> None:
        # The deque's maxlen drops the oldest; count what falls off.
        overflow = len(self._events) + len(events) - self.max_events
        if overflow > 0:
            self.events_dropped += overflow
        self._events.extend(events)

    def take_events(self) -> list[CacheEvent]:
        """Drain and return all buffered events, oldest first."""
        out = list(self._events)
        self._events.clear()
        return out

    def snapshot(self) -> list[BlockStored]:
        """A ``BlockStored`` for every cached block, parents before children:
        replayed from an empty tree, these events rebuild this tree's index
        (what a global prompt tree resyncs from). Needs events enabled. Does
        not modify the tree or its event buffer."""
        if not self.enable_events:
            raise ValueError("snapshot needs a tree with events enabled")
        bs = self.block_size
        out: list[BlockStored] = []
        stack = [(c, ROOT_HASH) for c in self._root.children.values()]
        while stack:
            node, ph = stack.pop()
            for j, (ref, h) in enumerate(zip(node.refs, node.hashes)):
                out.append(BlockStored(ref.node_id, ph, h, node.key[j * bs:(j + 1) * bs], ref))
                ph = h
            stack.extend((c, ph) for c in node.children.values())
        return out

    # -------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Assert every structural invariant (O(nodes + blocks); for tests/idle)."""
        bs = self.block_size
        root = self._root
        assert root.lock_ref == 0 and not root.refs and root.parent is None
        cached: dict[str, int] = {}
        evictable: dict[str, int] = {}
        seen: dict[BlockRef, _Node] = {}
        leaves: set[_Node] = set()
        stack: list[tuple[_Node, int]] = [(c, ROOT_HASH) for c in root.children.values()]
        for key, c in root.children.items():
            assert c.key[:bs] == key and c.parent is root
        while stack:
            node, ph = stack.pop()
            n = len(node.refs)
            assert n > 0 and len(node.key) == n * bs, "node key/refs length mismatch"
            assert all(r.tier == node.tier for r in node.refs), "mixed tiers in a node"
            assert node.lock_ref >= 0, "negative lock_ref"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), \
                "child locked more than its parent"
            if self.enable_events:
                assert node.hashes is not None and len(node.hashes) == n
                for j in range(n):
                    h = block_hash(ph, node.key[j * bs:(j + 1) * bs])
                    assert node.hashes[j] == h, "broken hash chain"
                    ph = h
            for r in node.refs:
                assert r not in seen, f"ref {r} cached twice"
                seen[r] = node
            cached[node.tier] = cached.get(node.tier, 0) + n
            if node.lock_ref == 0:
                evictable[node.tier] = evictable.get(node.tier, 0) + n
            if not node.children:
                leaves.add(node)
            for key, c in node.children.items():
                assert c.parent is node and c.key[:bs] == key, "bad child link"
                stack.append((c, ph))
        assert seen == self._where, "ref index out of sync"
        assert leaves == self._leaves, "leaf set out of sync"
        assert {k: v for k, v in self._cached.items() if v} == cached, "cached counters"
        assert {k: v for k, v in self._evictable.items() if v} == evictable, "evictable counters"
        assert len(self._events) <= self.max_events
