"""MemPool cache events on the wire: ``CacheEvents`` frames <-> events.

The node packs its radix tree's ``BlockStored`` / ``BlockRemoved`` events
(engine/memory/radix.py) into the two int64 frames of a ``CacheEvents``
message (kvd/protocol.py has the layout); the coordinator unpacks them into
``prompt_tree.Op``s. Pure Python (``array``/``memoryview``, no torch): the
coordinator runs it. Hashes are Python's int-tuple hashes, signed 64-bit, the
same in every process; the frames are in the host's byte order, as every kvd
tensor frame is.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from engine.memory.radix import BlockStored, CacheEvent
from kvd import protocol
from kvd.coordinator.prompt_tree import REMOVED, STORED, Op


def pack(node: str, seq: int, block_size: int, events: Sequence[CacheEvent], *,
         snapshot: bool = False, msg_id: str = "", deadline: float | None = None) -> protocol.CacheEvents:
    """A ``CacheEvents`` message carrying ``events`` (oldest first) numbered from ``seq``."""
    ops = array("q")
    tokens = array("q")
    for ev in events:
        if type(ev) is BlockStored:
            ops.extend((STORED, ev.parent_hash, ev.block_hash))
            tokens.extend(ev.tokens)
        else:
            ops.extend((REMOVED, 0, ev.block_hash))
    n, m = len(ops) // 3, len(tokens) // block_size
    return protocol.CacheEvents(
        id=msg_id, deadline=deadline, node=node, seq=seq, block_size=block_size, snapshot=snapshot,
        tensors=(protocol.RawTensor("int64", (n, 3), memoryview(ops).cast("B")),
                 protocol.RawTensor("int64", (m, block_size), memoryview(tokens).cast("B"))))


def unpack(msg: protocol.CacheEvents) -> list[Op]:
    """The ops of a (validated) ``CacheEvents`` message, in order."""
    bs = msg.block_size
    flat = msg.tensors[0].data.cast("q").tolist()
    toks = msg.tensors[1].data.cast("q").tolist()
    out: list[Op] = []
    new_op = tuple.__new__             # Op(...) without its Python-level __new__: thousands per snapshot
    row = 0
    for i in range(0, len(flat), 3):
        kind, parent, h = flat[i], flat[i + 1], flat[i + 2]
        if kind == STORED:
            out.append(new_op(Op, (STORED, parent, h, tuple(toks[row:row + bs]))))
            row += bs
        else:
            out.append(new_op(Op, (REMOVED, 0, h, ())))
    return out
