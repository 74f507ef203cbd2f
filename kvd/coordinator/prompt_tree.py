"""Global prompt trees (MemServe §6): which kvd nodes cache which prompt blocks.

Pure Python (no torch, no I/O). One ``GlobalPromptTree`` per node role
(``PromptTrees``, keyed by the node's ``Role`` from its Hello: mixed, prefill
or decode, so a prefill node's cache is scored apart from a decode's). The
tree is fed by the nodes' own MemPool cache events (engine/memory/radix.py:
``BlockStored`` / ``BlockRemoved``, chained block hashes from ``ROOT_HASH``)
and is EXACT: after the events of every node are applied in order, the set
of (block hash, parent hash, tokens, holders) equals the union of the nodes'
own radix trees. Nothing is inferred from routing decisions; those are kept
apart as *pending* prefixes with a TTL (below) and never enter the tree.

Layout: one ``_Block`` per distinct block hash, linked to its parent::

    ROOT ─┬─ h1 {n1,n2} ── h2 {n1,n2} ─┬─ h3 {n1}
          │                             └─ h3' {n2}
          └─ g1 {n3}

and per node the blocks it holds, each with how many of its children the node
holds (a node's holdings are prefix-closed, as in its own tree: a block is
stored after its parent and removed after its children). A block that no node
holds is gone.

Validation: ``apply`` checks a whole batch against the current state first
(token count, the hash really is ``block_hash(parent, tokens)``, the parent is
held, a removed block is held and has no held children, no double store) and
changes nothing when any op is invalid (``InvalidEvents``). A real hash
collision (two different blocks, one hash) is reported the same way.

Pending prefixes: between a routing decision and the stored events that
confirm it (the node indexes a prompt's blocks when its prefill ends), the router
records the prompt's block hashes as pending on the chosen node for
``ttl`` seconds, so a burst sharing a new prefix lands on one node. A stored
event for (node, hash) confirms (drops) the pending entry; ``match`` counts
unexpired pending blocks like held ones.

Not thread-safe: the coordinator's event loop owns it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from engine.memory.radix import ROOT_HASH, block_hash
from kvd.cluster_config import Role

STORED, REMOVED = 1, 0
DEFAULT_ROLE = Role.MIXED.value
_NOBODY: frozenset[str] = frozenset()


class InvalidEvents(ValueError):
    """A batch of events (or a snapshot) that does not fit the tree; nothing changed."""


class Op(NamedTuple):
    """One cache event on the coordinator's side: ``kind`` STORED (with
    ``parent`` and ``tokens``) or REMOVED (``parent`` 0, ``tokens`` ()).
    A NamedTuple: a snapshot makes thousands (tools/bench/cluster/bench_prompt_tree.py)."""

    kind: int
    parent: int
    block_hash: int
    tokens: tuple[int, ...] = ()


class _Block:
    __slots__ = ("block_hash", "parent", "tokens", "holders", "children")

    def __init__(self, block_hash: int, parent: int, tokens: tuple[int, ...]) -> None:
        self.block_hash = block_hash
        self.parent = parent                  # parent block hash (ROOT_HASH at depth 0)
        self.tokens = tokens
        self.holders: set[str] = set()
        self.children: set[int] = set()       # child block hashes


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``, as the nodes' radix trees compute them."""
    out: list[int] = []
    ph = ROOT_HASH
    t = tokens if type(tokens) is tuple else tuple(tokens)
    for p in range(0, len(t) - block_size + 1, block_size):
        ph = block_hash(ph, t[p:p + block_size])
        out.append(ph)
    return out


class GlobalPromptTree:
    """Blocks cached anywhere in one role's nodes, with their holders; see the module docstring."""

    def __init__(self, block_size: int, pending_ttl: float = 30.0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if pending_ttl < 0:
            raise ValueError("pending_ttl must be >= 0")
        self.block_size = block_size
        self.pending_ttl = pending_ttl
        self._blocks: dict[int, _Block] = {}
        self._held: dict[str, dict[int, int]] = {}      # node -> {hash: held children}
        self._pending: dict[int, dict[str, float]] = {}  # hash -> {node: expiry}
        self._pending_q: deque[tuple[float, str, tuple[int, ...]]] = deque()
        self._expired_at = -math.inf    # every pending entry left expires after this

    # ----------------------------------------------------------------- queries

    def nodes(self) -> list[str]:
        return sorted(self._held)

    def num_blocks(self, node: str | None = None) -> int:
        """Blocks held by ``node`` (distinct blocks of the tree when None)."""
        if node is None:
            return len(self._blocks)
        return len(self._held.get(node, ()))

    def held(self, node: str) -> dict[int, tuple[int, tuple[int, ...]]]:
        """``{hash: (parent hash, tokens)}`` of the blocks ``node`` holds (a copy)."""
        blocks = self._blocks
        return {h: (blocks[h].parent, blocks[h].tokens) for h in self._held.get(node, ())}

    def match(self, tokens: Sequence[int], now: float | None = None) -> dict[str, int]:
        """Per node, how many leading full blocks of ``tokens`` it holds or has
        pending (unexpired). Nodes with none are absent. Does not modify the tree.

        The walk keeps the set of nodes still matching (``alive``) and writes a
        node's count once, when it drops out or the prompt ends: set
        operations in C, not a Python loop over every holder of every block
        (a system prompt cached on a thousand nodes)."""
        now = time.monotonic() if now is None else now
        bs = self.block_size
        t = tokens if type(tokens) is tuple else tuple(tokens)
        blocks, pending, fresh = self._blocks, self._pending, self._expired_at
        out: dict[str, int] = {}
        alive: set[str] | frozenset[str] | None = None      # never mutated: may be a block's holders
        depth = 0
        ph = ROOT_HASH
        for i, p in enumerate(range(0, len(t) - bs + 1, bs)):
            blk = t[p:p + bs]
            ph = block_hash(ph, blk)
            b = blocks.get(ph)
            here = b.holders if b is not None and b.tokens == blk else _NOBODY
            pend = pending.get(ph)
            if pend:
                # after expire(now) every entry is live: a union in C, not a test per node
                here = here.union(pend.keys() if now <= fresh else (n for n, exp in pend.items() if exp > now))
            left = here if alive is None else alive & here
            if alive is not None and len(left) < len(alive):
                out.update(dict.fromkeys(alive - left, i))
            alive = left
            if not alive:
                break
            depth = i + 1
        if alive:
            out.update(dict.fromkeys(alive, depth))
        return out

    # ------------------------------------------------------------------ events

    def apply(self, node: str, ops: Sequence[Op]) -> None:
        """Apply ``node``'s events in order; raises ``InvalidEvents`` (and
        changes nothing) when any of them does not fit."""
        self._validate(self._held.get(node, {}), ops)
        self._apply_valid(node, ops)

    def _apply_valid(self, node: str, ops: Sequence[Op]) -> None:
        held = self._held.setdefault(node, {})
        for op in ops:
            if op.kind == STORED:
                self._store(node, held, op)
            else:
                self._remove(node, held, op.block_hash)
        if not held:
            del self._held[node]

    def replace(self, node: str, ops: Sequence[Op]) -> None:
        """Resync: ``node``'s holdings become exactly the blocks stored by
        ``ops`` (a snapshot: STORED ops, parents first). Raises
        ``InvalidEvents`` and changes nothing when it is not one."""
        if any(op.kind != STORED for op in ops):
            raise InvalidEvents("a snapshot holds stored blocks only")
        self._validate({}, ops)
        self.drop(node, keep_pending=True)
        if ops:
            self._apply_valid(node, ops)

    def drop(self, node: str, keep_pending: bool = False) -> None:
        """Forget everything ``node`` holds (it died, or a snapshot follows)
        and, unless ``keep_pending``, its pending prefixes."""
        held = self._held.pop(node, None)
        for h in held or ():
            b = self._blocks[h]
            b.holders.discard(node)
            if not b.holders:
                self._delete(b)
        if not keep_pending:
            for pend in self._pending.values():
                pend.pop(node, None)

    def _validate(self, held: dict[int, int], ops: Iterable[Op]) -> None:
        """Check ``ops`` against a node's holdings ``held`` without changing anything."""
        bs = self.block_size
        present: dict[int, bool] = {}          # overlay: hash -> held after the ops so far
        kids: dict[int, int] = {}              # overlay: hash -> held children
        known: dict[int, tuple[int, tuple[int, ...]]] = {}   # blocks stored by this batch

        def holds(h: int) -> bool:
            return present.get(h, h in held)

        def children(h: int) -> int:
            return kids.get(h, held.get(h, 0))

        for i, op in enumerate(ops):
            h = op.block_hash
            if op.kind == STORED:
                if len(op.tokens) != bs:
                    raise InvalidEvents(f"op {i}: {len(op.tokens)} tokens, blocks have {bs}")
                if block_hash(op.parent, op.tokens) != h:
                    raise InvalidEvents(f"op {i}: the hash is not block_hash(parent, tokens)")
                if holds(h):
                    raise InvalidEvents(f"op {i}: block stored twice")
                if op.parent != ROOT_HASH and not holds(op.parent):
                    raise InvalidEvents(f"op {i}: parent block not held")
                b = self._blocks.get(h)
                if b is not None and (b.parent, b.tokens) != (op.parent, op.tokens):
                    raise InvalidEvents(f"op {i}: hash collision with a different block")
                present[h] = True
                kids[h] = 0
                known[h] = (op.parent, op.tokens)
                if op.parent != ROOT_HASH:
                    kids[op.parent] = children(op.parent) + 1
            elif op.kind == REMOVED:
                if not holds(h):
                    raise InvalidEvents(f"op {i}: removal of a block not held")
                if children(h):
                    raise InvalidEvents(f"op {i}: removal of a block whose children are held")
                present[h] = False
                parent = known[h][0] if h in known else self._blocks[h].parent
                if parent != ROOT_HASH:
                    kids[parent] = children(parent) - 1
            else:
                raise InvalidEvents(f"op {i}: unknown kind {op.kind}")

    def _store(self, node: str, held: dict[int, int], op: Op) -> None:
        h = op.block_hash
        b = self._blocks.get(h)
        if b is None:
            b = self._blocks[h] = _Block(h, op.parent, op.tokens)
            if op.parent != ROOT_HASH:
                self._blocks[op.parent].children.add(h)
        b.holders.add(node)
        held[h] = 0
        if op.parent != ROOT_HASH:
            held[op.parent] += 1
        pend = self._pending.get(h)
        if pend is not None:
            pend.pop(node, None)               # confirmed
            if not pend:
                del self._pending[h]

    def _remove(self, node: str, held: dict[int, int], h: int) -> None:
        b = self._blocks[h]
        del held[h]
        if b.parent != ROOT_HASH:
            held[b.parent] -= 1
        b.holders.discard(node)
        if not b.holders:
            self._delete(b)

    def _delete(self, b: _Block) -> None:
        del self._blocks[b.block_hash]
        parent = self._blocks.get(b.parent)
        if parent is not None:
            parent.children.discard(b.block_hash)

    # ----------------------------------------------------------------- pending

    def add_pending(self, node: str, hashes: Sequence[int], now: float | None = None) -> None:
        """Count the blocks ``hashes`` (a prompt's chain) as pending on ``node``
        for ``pending_ttl`` seconds, or until stored events confirm them."""
        if not hashes or self.pending_ttl <= 0:
            return
        now = time.monotonic() if now is None else now
        self.expire(now)
        expiry = now + self.pending_ttl
        if expiry <= self._expired_at:                 # a clock that went back: test each entry again
            self._expired_at = -math.inf
        for h in hashes:
            self._pending.setdefault(h, {})[node] = expiry
        self._pending_q.append((expiry, node, tuple(hashes)))

    def expire(self, now: float | None = None) -> None:
        """Drop pending entries whose TTL passed (the queue is in expiry order)."""
        now = time.monotonic() if now is None else now
        self._expired_at = max(self._expired_at, now)
        q = self._pending_q
        while q and q[0][0] <= now:
            expiry, node, hashes = q.popleft()
            for h in hashes:
                pend = self._pending.get(h)
                if pend is not None and pend.get(node) == expiry:
                    del pend[node]
                    if not pend:
                        del self._pending[h]

    def num_pending(self) -> int:
        """(hash, node) pending entries, expired ones not yet dropped included."""
        return sum(len(p) for p in self._pending.values())

    # --------------------------------------------------------------- reporting

    def shared_prefixes(self, node: str, top: int = 3) -> list[dict]:
        """The ``top`` longest prefixes ``node`` holds that are shared: held by
        another node too, or extended by more than one cached block (a branch
        point, e.g. a system prompt two conversations continue). Hashes only:
        no token of any prompt is shown."""
        held = self._held.get(node, {})
        blocks = self._blocks
        out = []
        for h in held:
            b = blocks[h]
            if len(b.holders) < 2 and len(b.children) < 2:
                continue
            if len(b.children) < 2 and any(c in held and blocks[c].holders == b.holders
                                           for c in b.children):
                continue                       # the same sharing continues one block deeper
            out.append((self._depth(h), h, b))
        out.sort(key=lambda x: (-x[0], x[1]))
        return [{"blocks": d, "tokens": d * self.block_size, "hash": f"{h & (2**64 - 1):016x}",
                 "nodes": sorted(b.holders), "branches": len(b.children)} for d, h, b in out[:top]]

    def _depth(self, h: int) -> int:
        d = 0
        while h != ROOT_HASH:
            h = self._blocks[h].parent
            d += 1
        return d

    def describe(self, top: int = 3) -> dict:
        """Per node: cached blocks and tokens, and its longest shared prefixes."""
        bs = self.block_size
        return {"block_size": bs, "blocks": len(self._blocks), "pending": self.num_pending(),
                "nodes": {n: {"blocks": len(held), "tokens": len(held) * bs,
                              "shared_prefixes": self.shared_prefixes(n, top)}
                          for n, held in sorted(self._held.items())}}

    def check_integrity(self) -> None:
        """Assert the structure's invariants (tests; O(blocks))."""
        for h, b in self._blocks.items():
            assert b.holders, "a block nobody holds"
            assert b.parent == ROOT_HASH or h in self._blocks[b.parent].children
            for c in b.children:
                assert self._blocks[c].parent == h
        for node, held in self._held.items():
            assert held, "an empty holdings table"
            for h, kids in held.items():
                b = self._blocks[h]
                assert node in b.holders
                assert b.parent == ROOT_HASH or b.parent in held, "holdings not prefix-closed"
                assert kids == sum(1 for c in b.children if c in held), "child counts"
        assert sum(len(b.holders) for b in self._blocks.values()) == sum(map(len, self._held.values()))


class PromptTrees:
    """One ``GlobalPromptTree`` per node role, created on first use; each node
    belongs to one role (``role_of``)."""

    def __init__(self, block_size: int = 16, pending_ttl: float = 30.0) -> None:
        self.block_size = block_size
        self.pending_ttl = pending_ttl
        self.trees: dict[str, GlobalPromptTree] = {}
        self.role_of: dict[str, str] = {}

    def resize(self, block_size: int) -> None:
        """Use ``block_size`` from now on; only while no node is tracked."""
        if any(t.nodes() for t in self.trees.values()):
            raise ValueError("resize of prompt trees that hold blocks")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.trees.clear()

    def of_role(self, role: str = DEFAULT_ROLE) -> GlobalPromptTree:
        t = self.trees.get(role)
        if t is None:
            t = self.trees[role] = GlobalPromptTree(self.block_size, self.pending_ttl)
        return t

    def for_node(self, node: str) -> GlobalPromptTree:
        return self.of_role(self.role_of.get(node, DEFAULT_ROLE))

    def set_role(self, node: str, role: str) -> None:
        """``node`` serves ``role`` from now on (its blocks in another role's tree are dropped)."""
        old = self.role_of.get(node)
        if old is not None and old != role:
            self.of_role(old).drop(node)
        self.role_of[node] = role

    def drop(self, node: str) -> None:
        """``node`` is gone: it holds nothing in any tree."""
        for t in self.trees.values():
            t.drop(node)

    def describe(self) -> dict:
        return {role: t.describe() for role, t in sorted(self.trees.items())}
