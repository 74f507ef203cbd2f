"""Keeps the global prompt trees in step with the nodes' caches.

The coordinator's side of the cache-event protocol (the node's side is
kvd/node/cache_shipper.py). Per registered node it remembers the next event
number it expects, or that it waits for a snapshot:

    Hello (any registration, a restart's included) -> forget the node's
        blocks; wait for a snapshot (the node sends one after every
        registration, so a coordinator restart resyncs too)
    CacheEvents(snapshot)  -> the node's blocks become the snapshot's; expect seq
    CacheEvents(seq == expected) -> apply; expect seq + n
    CacheEvents(other seq, or while waiting) -> CacheAck(resync): nothing applied
    node dead, gone, or refused -> forget its blocks (``gone``)

Every reply is a ``CacheAck`` or, for events that do not fit the tree (a
bad hash, a block stored twice, another block size), an ``Error`` with code
``invalid_events``: nothing changes, and the node answers either by
resyncing. Pure bookkeeping: no I/O, no torch.
"""

from __future__ import annotations

from kvd import protocol
from kvd.cache_events import unpack
from kvd.coordinator.prompt_tree import DEFAULT_ROLE, InvalidEvents, PromptTrees


class CacheSync:
    def __init__(self, trees: PromptTrees) -> None:
        self.trees = trees
        self._next: dict[str, int | None] = {}    # node -> next expected seq; None: wants a snapshot
        self.applied_events = 0
        self.snapshots = 0
        self.resyncs_asked = 0
        self.invalid = 0

    def registered(self, node: str, block_size: int, role: str = DEFAULT_ROLE) -> None:
        """``node`` (re)registered: its blocks are unknown until its snapshot.
        The first node's block size becomes the trees' while none is tracked."""
        self.gone(node)
        if not self._next and block_size != self.trees.block_size:
            self.trees.resize(block_size)
        self.trees.set_role(node, role)
        self._next[node] = None

    def gone(self, node: str) -> None:
        """``node`` died or left: it holds nothing any more."""
        self.trees.drop(node)
        self.trees.role_of.pop(node, None)
        self._next.pop(node, None)

    def next_seq(self, node: str) -> int | None:
        """The next event number expected from ``node`` (None: waiting for its snapshot)."""
        return self._next.get(node)

    def synced(self) -> dict[str, int | None]:
        return dict(self._next)

    def handle(self, msg: protocol.CacheEvents) -> protocol.Message:
        """Apply one CacheEvents message; the reply to send back."""
        node = msg.node
        if node not in self._next:
            self.resyncs_asked += 1
            return protocol.CacheAck(id=msg.id, node=node, resync=True, reason="unknown node: register")
        if msg.block_size != self.trees.block_size:
            return self._invalid(msg, f"block_size {msg.block_size}, the trees use {self.trees.block_size}")
        tree = self.trees.for_node(node)
        try:
            if msg.snapshot:
                tree.replace(node, unpack(msg))
                self.snapshots += 1
                self._next[node] = msg.seq
                return protocol.CacheAck(id=msg.id, node=node, next_seq=msg.seq)
            expected = self._next[node]
            if expected is None or msg.seq != expected:
                self.resyncs_asked += 1
                why = "waiting for a snapshot" if expected is None else f"seq {msg.seq}, expected {expected}"
                return protocol.CacheAck(id=msg.id, node=node, resync=True, reason=why)
            ops = unpack(msg)
            tree.apply(node, ops)
        except InvalidEvents as exc:
            return self._invalid(msg, str(exc))
        self._next[node] = msg.seq + len(ops)
        self.applied_events += len(ops)
        return protocol.CacheAck(id=msg.id, node=node, next_seq=msg.seq + len(ops))

    def _invalid(self, msg: protocol.CacheEvents, why: str) -> protocol.Error:
        self.invalid += 1
        return protocol.Error(id=msg.id, code="invalid_events", message=f"node {msg.node}: {why}")

    def stats(self) -> dict:
        return {"applied_events": self.applied_events, "snapshots": self.snapshots,
                "resyncs_asked": self.resyncs_asked, "invalid": self.invalid,
                "next_seq": self.synced()}
