"""The global prompt trees stay EXACT: after random workloads on real MemPools
(inserts, lookups, evictions under memory pressure, flushes, swaps between
tiers, event-buffer overflows), lost messages and replies, node
deaths and restarts and coordinator restarts, the coordinator's trees equal
the union of the nodes' own trees.

The real pieces talk: each node's ``CacheOutbox`` and ``_drain`` (the node
side), the wire (``protocol.encode``/``decode``), ``CacheSync`` and
``PromptTrees`` (the coordinator side). Only the transport is a function
call, which may drop a message or its answer.
"""

import collections
import random
from types import SimpleNamespace

import pytest

from engine.memory.mempool import MemPool
from kvd import protocol
from kvd.coordinator.cache_sync import CacheSync
from kvd.coordinator.prompt_tree import PromptTrees
from kvd.node.cache_shipper import CacheOutbox, _drain

BS = 4
NODES = ("n1", "n2", "n3")


def wire(msg: protocol.Message) -> protocol.Message:
    header, frames = protocol.encode(msg)
    out = protocol.decode(header, [bytes(f) for f in frames])
    assert not isinstance(out, protocol.ProtocolError), out
    return out


class Node:
    """A node's cache and its shipping state; ``restart`` is a new process."""

    def __init__(self, name: str, rng: random.Random, max_events: int) -> None:
        self.name, self.rng, self.max_events = name, rng, max_events
        self.registration = 0
        self.restart()

    def restart(self) -> None:
        self.pool = MemPool(device_blocks=24, host_blocks=8, block_size=BS, node_id=self.name,
                            max_events=self.max_events)
        self.engine = SimpleNamespace(pool=self.pool)
        self.outbox = CacheOutbox(self.name, BS)

    def own(self) -> dict:
        return {b.block_hash: (b.parent_hash, b.tokens) for b in self.pool.cache_snapshot()}

    def work(self, prompts: list[list[int]]) -> None:
        """One random MemPool operation, as the engine would do it."""
        pool, rng = self.pool, self.rng
        op = rng.random()
        tokens = rng.choice(prompts)[:rng.randrange(BS, 8 * BS)]
        if op < 0.45:                       # a request: hit, compute the rest, retire into the cache
            hit = pool.match(tokens)
            n = len(tokens) // BS - len(hit.blocks)
            ids = pool.alloc_mem(n) if n > 0 else []
            if ids is not None:
                host = [r for r in hit.blocks if r.tier == "host"]
                new = pool.swap_in(host) if host else []
                if new is not None:
                    dev = iter(new)
                    cached = [r.block_id if r.tier == "device" else next(dev) for r in hit.blocks]
                    pool.insert(tokens, cached + ids)
                else:
                    pool.free_mem(ids)
            pool.release(hit)
        elif op < 0.6:
            pool.swap_out(rng.randrange(1, 6))
        elif op < 0.7:                      # memory pressure: allocation evicts cached blocks
            ids = pool.alloc_mem(rng.randrange(1, 20))
            if ids is not None:
                pool.free_mem(ids)
        elif op < 0.85:
            pool.flush()
        else:
            hit = pool.match(tokens)
            pool.release(hit)


def ship(node: Node, sync_box: list, rng: random.Random, loss: float,
         shipped: collections.Counter | None = None) -> None:
    """One shipping round of ``node`` over a lossy call to the coordinator."""
    box = node.outbox
    box.registered(node.registration)
    for _ in range(2):
        snapshot = box.need_snapshot
        events, dropped = _drain(snapshot)(node.engine)
        msg = box.message(events, dropped, snapshot)
        if msg is not None or not box.need_snapshot:
            break
    if msg is None:
        return
    if rng.random() < loss:                 # the request is lost
        box.on_failure()
        return
    reply = wire(sync_box[0].handle(wire(msg)))
    if rng.random() < loss:                 # applied, but the answer is lost
        box.on_failure()
        return
    if box.on_reply(msg, reply) and shipped is not None:
        shipped["snapshots" if msg.snapshot else "events"] += 1


def settle(nodes: dict, sync_box: list, rng: random.Random) -> None:
    """Ship until every node is in sync (no loss), then compare."""
    for _ in range(4):
        for node in nodes.values():
            ship(node, sync_box, rng, loss=0.0)
    sync = sync_box[0]
    trees = sync.trees
    union: dict = {}
    for name, node in nodes.items():
        own = node.own()
        assert not node.outbox.need_snapshot
        assert sync.next_seq(name) == node.outbox.seq
        assert trees.for_node(name).held(name) == own, f"{name}: the global tree differs from its own"
        union.update(own)
    tree = trees.of_role("mixed")
    tree.check_integrity()
    assert tree.num_blocks() == len(union)
    for name in nodes:
        node = nodes[name]
        node.pool.check_integrity()


def register(nodes: dict, sync_box: list, name: str) -> None:
    nodes[name].registration += 1
    sync_box[0].registered(name, BS)


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_the_global_tree_exact(seed):
    rng = random.Random(seed)
    # a few shared "system prompts", each continued many ways, so nodes share blocks
    heads = [[rng.randrange(50) for _ in range(3 * BS)] for _ in range(3)]
    prompts = [h + [rng.randrange(50) for _ in range(5 * BS)] for h in heads for _ in range(6)]
    max_events = 8 if seed % 3 == 0 else 1 << 16   # 8: the event buffer overflows
    nodes = {n: Node(n, rng, max_events) for n in NODES}
    sync_box = [CacheSync(PromptTrees(BS))]
    for n in NODES:
        register(nodes, sync_box, n)
    late: set[str] = set()                          # registered with a coordinator that is gone
    shipped: collections.Counter = collections.Counter()
    for step in range(400):
        r = rng.random()
        name = rng.choice(NODES)
        if r < 0.7:
            nodes[name].work(prompts)
        elif r < 0.93:
            ship(nodes[name], sync_box, rng, loss=0.15, shipped=shipped)
        elif r < 0.96:                              # the node dies; its process comes back
            sync_box[0].gone(name)
            nodes[name].restart()
            register(nodes, sync_box, name)
        elif r < 0.98:                              # a node registers again (same process)
            register(nodes, sync_box, name)
        else:                                       # the coordinator restarts; the nodes notice later
            sync_box[0] = CacheSync(PromptTrees(BS))
            late.update(NODES)
        if late and rng.random() < 0.1:             # a node's heartbeat got "unknown": it registers
            register(nodes, sync_box, late.pop())
        if step % 50 == 49:
            while late:
                register(nodes, sync_box, late.pop())
            settle(nodes, sync_box, rng)
    while late:
        register(nodes, sync_box, late.pop())
    settle(nodes, sync_box, rng)
    assert shipped["events"] > 0 and shipped["snapshots"] > len(NODES)


def test_a_gap_or_an_unknown_node_asks_for_a_snapshot_and_applies_nothing():
    rng = random.Random(1)
    nodes = {"n1": Node("n1", rng, 1 << 16)}
    sync_box = [CacheSync(PromptTrees(BS))]
    register(nodes, sync_box, "n1")
    settle(nodes, sync_box, rng)
    pool = nodes["n1"].pool
    ids = pool.alloc_mem(2)
    pool.insert(list(range(2 * BS)), ids)
    events, dropped = _drain(False)(nodes["n1"].engine)
    msg = nodes["n1"].outbox.message(events, dropped, False)
    sync = sync_box[0]
    gap = wire(protocol.CacheEvents(node="n1", seq=msg.seq + 1, block_size=BS, tensors=msg.tensors))
    reply = sync.handle(gap)
    assert isinstance(reply, protocol.CacheAck) and reply.resync and "expected" in reply.reason
    assert sync.trees.for_node("n1").held("n1") == {}
    reply = sync.handle(wire(protocol.CacheEvents(node="n9", seq=0, block_size=BS, tensors=msg.tensors)))
    assert reply.resync
    bad = sync.handle(wire(protocol.CacheEvents(node="n1", seq=msg.seq, block_size=BS + 4,
                                                tensors=(msg.tensors[0], protocol.RawTensor(
                                                    "int64", (2, BS + 4), memoryview(bytes(16 * (BS + 4))))))))
    assert isinstance(bad, protocol.Error) and bad.code == "invalid_events"
    assert sync.trees.for_node("n1").held("n1") == {} and sync.next_seq("n1") == msg.seq
    assert isinstance(sync.handle(wire(msg)), protocol.CacheAck)
    assert sync.trees.for_node("n1").held("n1") == nodes["n1"].own()
