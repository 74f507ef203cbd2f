"""MemServe distributed transfer (§4.3) between two node processes.

``MemPool.transfer_with_insert`` moves KV between two pools of one process;
here the same three steps cross a transport::

    sender (engine thread)          wire                     receiver (engine thread)
    match + lock the prefix   ── KVTransferRequest ──▶  match + lock what it has,
                                                        alloc_mem(the rest)
                              ◀──── KVAllocReply ────   (block ids, have_blocks)
    export_blocks(rest), unlock ──── KVData ────────▶  import_blocks, insert into the
                              (ONE frame [L,2,n,bs,kvh,hd])   radix tree, unlock
                              ◀────── KVAck ─────────   (inserted tokens)

One request transfer is exactly two sends from the sender (the request and
ONE KVData frame holding every layer), never one per block. Every MemPool
touch runs on the owning node's engine thread (``EngineDriver.call``). A
receiver's allocation that never sees its data is released at its deadline.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.memory.radix import make_refs
from kvd import protocol
from kvd.node.engine_driver import EngineDriver
from transports import Connection

log = logging.getLogger("kvd.transfer")


@dataclass
class _Pending:
    """A receiver-side allocation awaiting its KVData (engine-thread state)."""

    tokens: tuple[int, ...]
    have_refs: list[Any]
    block_ids: list[int]
    handle: Any            # radix node locked for the duration
    tier: str
    expires: float


class TransferReceiver:
    """Receiver half: allocation on KVTransferRequest, insertion on KVData."""

    def __init__(self, driver: EngineDriver, tier: str = "device") -> None:
        self.driver = driver
        self.tier = tier
        self._pending: dict[str, _Pending] = {}
        self.received_bytes = 0
        self.completed = 0
        self.failed = 0

    async def on_request(self, msg: protocol.KVTransferRequest, timeout: float) -> protocol.KVAllocReply:
        def allocate(engine) -> protocol.KVAllocReply:
            pool = engine.pool
            bs = pool.block_size
            tokens = tuple(msg.token_ids[:msg.num_blocks * bs])
            if len(tokens) != msg.num_blocks * bs:
                return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                             reason="token_ids shorter than num_blocks")
            if msg.num_layers != engine.kv.num_layers or msg.dtype != str(engine.kv.dtype).removeprefix("torch."):
                return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                             reason="layout mismatch (layers or dtype)")
            m = pool.tree.match(tokens)
            pool.tree.lock(m.last_node)
            have = len(m.blocks)
            ids = pool.alloc_mem(msg.num_blocks - have, self.tier) if have < msg.num_blocks else []
            if ids is None:
                pool.tree.unlock(m.last_node)
                return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                             reason="out of KV blocks")
            self._pending[msg.transfer_id] = _Pending(tokens, list(m.blocks), ids, m.last_node,
                                                      self.tier, time.monotonic() + timeout)
            return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=True,
                                         block_ids=tuple(ids), have_blocks=have)
        if msg.transfer_id in self._pending:
            return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                         reason="duplicate transfer id")
        return await self.driver.call(allocate)

    async def on_data(self, msg: protocol.KVData) -> protocol.KVAck:
        def insert(engine) -> protocol.KVAck:
            p = self._pending.pop(msg.transfer_id, None)
            if p is None:
                return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                      reason="unknown or expired transfer")
            pool = engine.pool
            try:
                if list(msg.block_ids) != p.block_ids or len(msg.tensors) != (1 if p.block_ids else 0):
                    raise ValueError("KVData does not match the allocation")
                if p.block_ids:
                    engine.kv.import_blocks(p.tier, p.block_ids, msg.tensors[0].to_torch())
            except (TypeError, ValueError) as exc:
                pool.free_mem(p.block_ids, p.tier)
                pool.tree.unlock(p.handle)
                self.failed += 1
                return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=False, reason=str(exc))
            refs = p.have_refs + make_refs(p.tier, p.block_ids, pool.node_id)
            present = pool.tree.insert(p.tokens, refs)
            dups = [r.block_id for r in refs[len(p.have_refs):present]]
            if dups:
                pool.pools[p.tier].free(dups)
            pool.tree.unlock(p.handle)
            self.completed += 1
            self.received_bytes += sum(t.nbytes for t in msg.tensors)
            return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=True,
                                  inserted_tokens=len(p.tokens))
        return await self.driver.call(insert)

    async def expire(self) -> int:
        """Release allocations whose data never came. Returns how many."""
        def reap(engine) -> int:
            now = time.monotonic()
            dead = [tid for tid, p in self._pending.items() if p.expires < now]
            for tid in dead:
                p = self._pending.pop(tid)
                engine.pool.free_mem(p.block_ids, p.tier)
                engine.pool.tree.unlock(p.handle)
            self.failed += len(dead)
            return len(dead)
        if not self._pending:
            return 0
        return await self.driver.call(reap)


async def send_prefix(driver: EngineDriver, conn: Connection, token_ids: list[int], *,
                      src_node: str, dst_node: str, timeout: float = 30.0) -> dict[str, Any]:
    """Sender half: move the cached KV of ``token_ids``' full blocks to the
    node behind ``conn`` and insert it into that node's radix tree.

    Returns {"transferred", "blocks", "sent_blocks", "bytes", "sends", "inserted_tokens",
    "seconds", "reason"}. Raises TransportError on a transport failure; the
    sender's lock on the prefix is released in every case.
    """
    t0 = time.perf_counter()
    transfer_id = f"x-{uuid.uuid4().hex[:16]}"

    def lock_prefix(engine):
        m = engine.pool.tree.match(token_ids)
        engine.pool.tree.lock(m.last_node)
        return m, engine.kv.num_layers, str(engine.kv.dtype).removeprefix("torch."), engine.pool.block_size

    m, num_layers, dtype, bs = await driver.call(lock_prefix)
    result: dict[str, Any] = {"transferred": False, "blocks": len(m.blocks), "sent_blocks": 0, "bytes": 0,
                              "sends": 0, "inserted_tokens": 0, "reason": ""}
    locked = True
    try:
        if not m.blocks:
            result["reason"] = "no cached prefix for these tokens"
            return result
        deadline = time.time() + timeout
        req = protocol.KVTransferRequest(
            id=transfer_id, deadline=deadline, transfer_id=transfer_id, src_node=src_node,
            dst_node=dst_node, token_ids=tuple(token_ids[:len(m.blocks) * bs]),
            num_blocks=len(m.blocks), num_layers=num_layers, dtype=dtype)
        alloc = await protocol.call(conn, req)
        result["sends"] += 1
        if not isinstance(alloc, protocol.KVAllocReply) or not alloc.ok:
            result["reason"] = getattr(alloc, "reason", None) or getattr(alloc, "message", repr(alloc))
            return result
        refs = m.blocks[alloc.have_blocks:]

        def export(engine):
            # [L, 2, n, bs, kvh, hd], one tensor per tier run (normally one)
            parts, tiers = [], []
            for r in refs:
                if not tiers or tiers[-1][0] != r.tier:
                    tiers.append((r.tier, []))
                tiers[-1][1].append(r.block_id)
            for tier, ids in tiers:
                parts.append(engine.kv.export_blocks(tier, ids))
            engine.pool.tree.unlock(m.last_node)
            if not parts:
                return None
            import torch
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

        payload = await driver.call(export)
        locked = False
        data = protocol.KVData(id=transfer_id, deadline=deadline, transfer_id=transfer_id,
                               layer_start=0, layer_end=num_layers, block_ids=alloc.block_ids,
                               last=True, tensors=() if payload is None else (payload,))
        ack = await protocol.call(conn, data)
        result["sends"] += 1
        result["sent_blocks"] = len(refs)
        result["bytes"] = 0 if payload is None else payload.numel() * payload.element_size()
        if isinstance(ack, protocol.KVAck) and ack.ok:
            result.update(transferred=True, inserted_tokens=ack.inserted_tokens)
        else:
            result["reason"] = getattr(ack, "reason", None) or getattr(ack, "message", repr(ack))
        return result
    finally:
        if locked:
            await driver.call(lambda engine: engine.pool.tree.unlock(m.last_node))
        result["seconds"] = time.perf_counter() - t0
