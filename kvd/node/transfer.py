"""MemServe distributed transfer (§4.3) between two node processes.

``MemPool.transfer_with_insert`` moves KV between two pools of one process;
here the same three steps cross a transport. MemServe's allocation step
always comes first (so nothing the receiver has is sent, and the receiver
takes KV only into blocks it granted), then layer chunks stream, DéjàVu
§4.1 style::

    match + lock             ── KVTransferRequest ──▶  match + lock, alloc_mem(the rest):
    gather chunk 0 (overlaps ◀──── KVAllocReply ────   a grant, bound to the asking link
      the round trip)                                   (block ids, have_blocks)
    for each chunk c:        ─── KVData(c) ─────────▶  the grant of this transfer id, for
      send c, gather c+1          [l1-l0, 2, n, ...]    this very link? else Error(no_grant),
      (no wait for acks)                                nothing changes; import chunk c (a
                                                        copy per run of block ids)
                             ◀────── KVAck(c) ──────   the last one inserts into the tree
    all acked: unlock

Grants (receiver): a KVData is taken only into an allocation this node made
for a KVTransferRequest *from the same link* (its transport peer id and its
authenticated identity, kvd/trust.py); anything else is refused before it
touches the grant, the pool or the tree. There is no path that allocates on
a KVData's arrival: a one-shot KVData carrying its token ids (one round trip
for payloads <= 32 MiB) let any sender that reached the port write KV into
the prefix cache, which then served other users' prompts from it.

At most ``num_layers`` KVData per transfer (chunks of >= ``CHUNK_BYTES``,
whole layers), never one per block: sends = 1 + chunks. A payload up to
``WHOLE_MAX_BYTES`` goes as ONE chunk of every layer: splitting it to
overlap the receiver's import with the wire measured no better on a 2-core
host (tools/bench_kv_transfer.py), and each message costs a round of Python
on both sides.

Frames come one of two ways (``KVData.pieces``):

- **pool pieces, no gather** (``_zero_copy_tier``): when the blocks sit in a
  few runs of consecutive ids, each (layer, K|V, run) is a contiguous slice
  of the layer-major pool, sent as its own frame (zero-copy in zmq). The
  prefix stays locked until every chunk is acked; if the transfer fails
  before that, the unlock waits until the messages' deadline has passed
  (the receiver refuses them on arrival after it), so the transport never
  reads a block that was reused. Slices under ``ZERO_COPY_MIN_BYTES`` are
  not worth a frame each (pyzmq copies them anyway, and per-frame costs
  dominate: 1 MiB as 32 frames of 32 KiB measured half as fast).
- **staged**: gathered (a copy per run) into reusable staging buffers
  (engine.stream's ``STAGING``: no fresh allocation, no page faults per transfer); a
  staging buffer is reused only after every chunk from it was acknowledged
  (zmq sends it zero-copy), and the prefix is unlocked once gathered.

The receiver copies each frame into its blocks, one copy per overlap of a
frame with a run of its block ids. KV memory is reached only through MemPool's
verbs (``lock_prefix``/``unlock``, ``kv_layout``, ``gather``/``pieces`` on the
sender; ``grant``, ``import_kv``/``import_pieces``, ``insert_granted``/``abandon``
on the receiver), each inside ``EngineDriver.call`` (inline when the engine is idle); the
receiver serialises chunk imports there, so the reaper (``expire``) never
races an import. A receiver's allocation that never sees all its data is
released at its deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from engine.memory.kv_cache import block_runs
from engine.memory.mempool import Grant, KVLayout, PrefixLock
from engine.stream import STAGING as _STAGING
from engine.stream import stream_in
from kvd import protocol
from kvd.node.engine_driver import EngineDriver
from transports import Connection

log = logging.getLogger("kvd.transfer")

CHUNK_BYTES = 8 << 20           # streamed chunk size target (whole layers, <= num_layers chunks)
WHOLE_MAX_BYTES = 32 << 20      # payloads up to this go as ONE KVData after the allocation
ZERO_COPY_MIN_BYTES = 64 << 10  # a pool slice this big is sent as is (pyzmq copies smaller frames)
MAX_PIECE_FRAMES = 128          # pieces frames in one KVData message (the protocol allows 256)

# transfer ids: unique per sender process (random prefix) and per transfer
# (counter); a receiver keys its pending allocations by them
_ID_PREFIX = f"x-{os.urandom(6).hex()}-"
_ID_SEQ = itertools.count(1)


def _zero_copy_tier(layout: KVLayout, refs: list[Any], layers_per_message: int) -> str | None:
    """The tier to send ``refs`` from without a gather (pieces layout), or
    None: they must sit in one CPU tier, in few runs of consecutive ids
    (<= MAX_PIECE_FRAMES frames in a message of ``layers_per_message``
    layers), each run's slice of a layer's K or V >= ZERO_COPY_MIN_BYTES
    (smaller ones cost more per frame than the gather they save)."""
    slice_bytes = layout.slice_bytes
    if len(refs) * slice_bytes < ZERO_COPY_MIN_BYTES:
        return None                   # not even one run could make a frame worth sending
    tiers = {r.tier for r in refs}
    if len(tiers) != 1:
        return None
    tier = tiers.pop()
    if tier not in layout.cpu_tiers:
        return None
    runs = block_runs([r.block_id for r in refs])
    if 2 * layers_per_message * len(runs) > MAX_PIECE_FRAMES:
        return None
    return tier if min(n for _, _, n in runs) * slice_bytes >= ZERO_COPY_MIN_BYTES else None


def _piece_tensors(layout: KVLayout, lengths: list[int], views: list[memoryview]) -> tuple[Any, ...]:
    """``MemPool.pieces`` byte views as wire tensors (no torch op per piece)."""
    dtype, (bs, kvh, hd) = protocol.dtype_name(layout.dtype), layout.block_shape[2:]
    shapes = [(n, bs, kvh, hd) for n in lengths]
    R = len(lengths)
    return tuple(protocol.RawTensor(dtype, shapes[i % R], v) for i, v in enumerate(views))


def _layer_chunks(num_layers: int, nbytes: int, chunk_bytes: int,
                  max_layers: int | None = None) -> list[tuple[int, int]]:
    """Split [0, num_layers) into <= num_layers contiguous ranges of
    ~chunk_bytes, each of at most ``max_layers`` layers."""
    n = max(1, min(num_layers, -(-nbytes // max(chunk_bytes, 1))))
    if max_layers is not None:
        n = max(n, -(-num_layers // max(1, max_layers)))
    bounds = [round(i * num_layers / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def import_layers(pool: Any, region: Any, l0: int, l1: int, msg: protocol.KVData, skip: int = 0) -> None:
    """Write layers [l0, l1) of a KVData's KV into ``region``'s fresh blocks
    (a Grant or a Reservation: ``block_ids`` of ``tier``), dropping its
    first ``skip`` blocks (the receiver had them): one copy per overlap of a
    received frame with a run of the region's ids, read from the frames in
    place (engine thread). Raises ValueError on frames that do not fit."""
    layout, ids = pool.kv_layout(), region.block_ids
    if msg.pieces:
        dtype, (bs, kvh, hd) = protocol.dtype_name(layout.dtype), layout.block_shape[2:]
        R = len(msg.pieces)
        for i, t in enumerate(msg.tensors):
            if t.dtype != dtype or t.shape != (msg.pieces[i % R], bs, kvh, hd):
                raise ValueError(f"piece {i} is {t.dtype}{list(t.shape)}, want "
                                 f"{dtype}[{msg.pieces[i % R]}, {bs}, {kvh}, {hd}]")
        pool.import_pieces(region, [t.data for t in msg.tensors], msg.pieces, (l0, l1), skip)
        return
    if len(msg.tensors) != 1:
        raise ValueError(f"packed KVData carries one frame, got {len(msg.tensors)}")
    payload = msg.tensors[0].to_torch()
    L, two, bs, kvh, hd = layout.block_shape
    if payload.dtype != layout.dtype:
        raise ValueError(f"dtype {payload.dtype} != cache dtype {layout.dtype}")
    if tuple(payload.shape) != (l1 - l0, two, skip + len(ids), bs, kvh, hd):
        raise ValueError(f"shape {tuple(payload.shape)} does not match "
                         f"[{l1 - l0}, 2, {skip + len(ids)}, {bs}, {kvh}, {hd}]")
    stream_in(pool, region, payload, (l0, l1), skip)


# ─── receiver ────────────────────────────────────────────────────────────────


@dataclass
class _Pending:
    """A receiver-side allocation awaiting its KVData (engine-thread state)."""

    grant: Grant           # MemPool's: the blocks, and the lock on what this node had
    expires: float
    num_layers: int = 0
    layers_done: set[int] = field(default_factory=set)
    sender: Any = None     # the link the grant is bound to: (peer id, identity)


class TransferReceiver:
    """Receiver half: a grant (allocation) on KVTransferRequest, bound to the
    link that asked; import per KVData chunk of that grant, from that link
    only; insertion on the last.

    ``sender``, in every call: who the message came from, as an opaque
    hashable (the node daemon passes (transport peer id, authenticated
    identity)); a KVData whose sender is not its grant's is refused with
    Error("no_grant") and changes nothing (counted in ``refused``)."""

    def __init__(self, driver: EngineDriver, tier: str = "device") -> None:
        self.driver = driver
        self.tier = tier
        self._pending: dict[str, _Pending] = {}
        self.received_bytes = 0
        self.completed = 0
        self.failed = 0
        self.refused = 0           # KVData for no grant of this sender (forged, late or stray)

    @staticmethod
    def _layout_error(engine: Any, num_layers: int, dtype: str) -> str | None:
        layout = engine.pool.kv_layout()
        if num_layers != layout.num_layers or dtype != protocol.dtype_name(layout.dtype):
            return "layout mismatch (layers or dtype)"
        return None

    async def on_request(self, msg: protocol.KVTransferRequest, timeout: float,
                         sender: Any) -> protocol.KVAllocReply:
        """Step 1: allocate (a grant to ``sender``, released at ``timeout``
        seconds unless its data completes) and answer the block ids."""
        if msg.transfer_id in self._pending:
            return self._duplicate(msg)
        return await self.driver.call(self._allocate_fn(msg, timeout, sender))

    def try_request(self, msg: protocol.KVTransferRequest, timeout: float,
                    sender: Any) -> protocol.KVAllocReply | None:
        """``on_request`` at once, without a task, when the engine is idle (the
        reply); None when it is busy: then await ``on_request``."""
        if msg.transfer_id in self._pending:
            return self._duplicate(msg)
        done, reply = self.driver.try_call(self._allocate_fn(msg, timeout, sender))
        return reply if done else None

    @staticmethod
    def _duplicate(msg: protocol.KVTransferRequest) -> protocol.KVAllocReply:
        return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                     reason="duplicate transfer id")

    def _allocate_fn(self, msg: protocol.KVTransferRequest, timeout: float, sender: Any) -> Any:
        def allocate(engine) -> protocol.KVAllocReply:
            pool = engine.pool
            bs = pool.block_size
            tokens = tuple(msg.token_ids[:msg.num_blocks * bs])
            if len(tokens) != msg.num_blocks * bs:
                return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                             reason="token_ids shorter than num_blocks")
            if reason := self._layout_error(engine, msg.num_layers, msg.dtype):
                return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False, reason=reason)
            grant = pool.grant(tokens, msg.num_blocks, self.tier)
            if grant is None:
                return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                             reason="out of KV blocks")
            self._pending[msg.transfer_id] = _Pending(grant, time.monotonic() + timeout,
                                                      msg.num_layers, sender=sender)
            return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=True,
                                         block_ids=tuple(grant.block_ids), have_blocks=grant.have_blocks)
        return allocate

    async def on_data(self, msg: protocol.KVData, sender: Any) -> protocol.KVAck | protocol.Error:
        return await self.driver.call(lambda engine: self._import_chunk(engine, msg, sender))

    def try_data(self, msg: protocol.KVData, sender: Any) -> protocol.KVAck | protocol.Error | None:
        """``on_data`` at once, without a task, when the engine is idle (the
        ack); None when it is busy: then await ``on_data``."""
        done, ack = self.driver.try_call(lambda engine: self._import_chunk(engine, msg, sender))
        return ack if done else None

    def _ack(self, msg: protocol.KVData, ok: bool, **kw: Any) -> protocol.KVAck:
        return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=ok, **kw)

    def _finish(self, engine: Any, p: _Pending) -> int:
        """Insert the transferred tokens, free duplicates, unlock (engine thread)."""
        inserted = engine.pool.insert_granted(p.grant)
        self.completed += 1
        return inserted

    def _abandon(self, engine: Any, p: _Pending) -> None:
        engine.pool.abandon(p.grant)
        self.failed += 1

    def _import_chunk(self, engine: Any, msg: protocol.KVData,
                      sender: Any) -> protocol.KVAck | protocol.Error:
        """One chunk of layers of a granted transfer; the last one inserts.
        A KVData that is not for a grant of this sender changes nothing."""
        p = self._pending.get(msg.transfer_id)
        if p is None or p.sender != sender:
            self.refused += 1
            return protocol.Error(id=msg.id, code="no_grant",
                                  message=f"transfer {msg.transfer_id!r}: no KV allocation of this node "
                                          "for this sender (unknown, expired, or granted to another link)")
        try:
            ids = p.grant.block_ids
            if list(msg.block_ids) != ids or bool(msg.tensors) != bool(ids):
                raise ValueError("KVData does not match the allocation")
            layers = range(msg.layer_start, msg.layer_end) if ids else range(p.num_layers)
            if msg.layer_end > p.num_layers or not layers or p.layers_done.intersection(layers):
                raise ValueError(f"bad or repeated layer range [{msg.layer_start}, {msg.layer_end})")
            if ids:
                import_layers(engine.pool, p.grant, msg.layer_start, msg.layer_end, msg)
        except (TypeError, ValueError, IndexError) as exc:
            del self._pending[msg.transfer_id]
            self._abandon(engine, p)
            return self._ack(msg, False, reason=str(exc))
        p.layers_done.update(layers)
        self.received_bytes += sum(t.nbytes for t in msg.tensors)
        if len(p.layers_done) < p.num_layers:
            return self._ack(msg, True)
        del self._pending[msg.transfer_id]
        return self._ack(msg, True, inserted_tokens=self._finish(engine, p), have_blocks=p.grant.have_blocks)

    async def expire(self) -> int:
        """Release allocations whose data never came. Returns how many."""
        def reap(engine) -> int:
            now = time.monotonic()
            dead = [tid for tid, p in self._pending.items() if p.expires < now]
            for tid in dead:
                self._abandon(engine, self._pending.pop(tid))
            return len(dead)
        if not self._pending:
            return 0
        return await self.driver.call(reap)


# ─── sender ──────────────────────────────────────────────────────────────────


def reply_reason(reply: Any) -> str:
    return getattr(reply, "reason", None) or getattr(reply, "message", None) or repr(reply)


async def send_prefix(driver: EngineDriver, conn: Connection, token_ids: list[int], *,
                      src_node: str, dst_node: str, timeout: float = 30.0,
                      chunk_bytes: int | None = None) -> dict[str, Any]:
    """Sender half: move the cached KV of ``token_ids``' full blocks to the
    node behind ``conn`` and insert it into that node's radix tree.

    Returns {"transferred", "blocks", "sent_blocks", "new_blocks", "bytes",
    "sends", "chunks", "inserted_tokens", "zero_copy", "seconds", "reason"}:
    ``sent_blocks`` travelled, ``new_blocks`` the receiver did not have,
    ``zero_copy``: the frames were views of the pool (no gather). Raises TransportError
    on a transport failure; the sender's lock on the prefix is released in
    every case.
    """
    t0 = time.perf_counter()
    whole_max = WHOLE_MAX_BYTES if chunk_bytes is None else 0   # an explicit chunk size is kept
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    transfer_id = f"{_ID_PREFIX}{next(_ID_SEQ)}"
    result: dict[str, Any] = {"transferred": False, "blocks": 0, "sent_blocks": 0, "new_blocks": 0,
                              "bytes": 0, "sends": 0, "chunks": 0, "inserted_tokens": 0, "reason": "",
                              "zero_copy": False}
    staging: list[Any] = []          # buffers to give back once every frame from them is acked

    def lock_prefix(engine):
        """Match + lock; pick the chunk size and the frame layout (pool pieces or staged)."""
        layout = engine.pool.kv_layout()
        L = layout.num_layers
        m = engine.pool.lock_prefix(token_ids)
        payload = len(m.blocks) * layout.bytes_per_block
        chunk = max(chunk_bytes, payload) if payload <= whole_max else chunk_bytes
        per_message = max(l1 - l0 for l0, l1 in _layer_chunks(L, payload, chunk))
        zc_tier = _zero_copy_tier(layout, m.blocks, per_message) if m.blocks else None
        return (m, L, protocol.dtype_name(layout.dtype), layout.block_shape[2], layout.bytes_per_block,
                zc_tier, chunk)

    m, num_layers, dtype, bs, block_bytes, zc_tier, chunk_bytes = await driver.call(lock_prefix)
    result["blocks"] = len(m.blocks)
    deadline = time.time() + timeout
    tokens = tuple(token_ids[:len(m.blocks) * bs])
    clean = False                    # every frame sent was acknowledged (or none was sent)
    try:
        if not m.blocks:
            clean = True
            result["reason"] = "no cached prefix for these tokens"
            return result
        req = protocol.KVTransferRequest(
            id=transfer_id, deadline=deadline, transfer_id=transfer_id, src_node=src_node,
            dst_node=dst_node, token_ids=tokens, num_blocks=len(m.blocks), num_layers=num_layers,
            dtype=dtype)
        if zc_tier is not None:
            await _stream_pieces(driver, conn, m, req, block_bytes, chunk_bytes, zc_tier, result)
        else:
            await _stream(driver, conn, m, req, block_bytes, chunk_bytes, staging, result)
        clean = True
        return result
    finally:
        # (a staged stream unlocks with its last gather: the data is in staging)
        if not m.released and (clean or not result.get("zero_copy")):
            await driver.call(lambda engine: _unlock(engine, m))
        elif not m.released:
            # Frames that alias the pool may still sit in the transport's
            # queue: keep the blocks from being reused until the deadline has
            # passed, after which the receiver refuses the message on arrival.
            _unlock_after(driver, m, deadline)
        for buf in staging:
            if clean:
                _STAGING.release(buf)
        result["seconds"] = time.perf_counter() - t0


_LATE_UNLOCKS: set[asyncio.Task] = set()


def _unlock(engine: Any, lock: PrefixLock) -> None:
    """Engine thread: release the sender's lock on its prefix, once."""
    if not lock.released:
        engine.pool.unlock(lock)


def _unlock_after(driver: EngineDriver, lock: PrefixLock, deadline: float) -> None:
    """Unlock ``lock`` once wall-clock ``deadline`` (+1 s) has passed."""
    async def later() -> None:
        await asyncio.sleep(max(0.0, deadline - time.time()) + 1.0)
        try:
            await driver.call(lambda engine: _unlock(engine, lock))
        except Exception:  # noqa: BLE001 -- the engine stopped: nothing left to protect
            log.debug("late unlock skipped", exc_info=True)
    task = asyncio.get_running_loop().create_task(later())
    _LATE_UNLOCKS.add(task)
    task.add_done_callback(_LATE_UNLOCKS.discard)


async def _stream_pieces(driver: EngineDriver, conn: Connection, m: Any,
                         req: protocol.KVTransferRequest, block_bytes: int, chunk_bytes: int,
                         tier: str, result: dict[str, Any]) -> None:
    """Allocation round trip (``req``), then layer chunks whose frames are
    views of the sender's pool (pieces layout: no gather, no staging), sent
    without waiting for acks. The prefix stays locked until the caller
    unlocks it, after every ack. Raises TransportError."""
    transfer_id, deadline, num_layers = req.transfer_id, req.deadline, req.num_layers
    result.update(sends=1, zero_copy=True)
    alloc = await protocol.call(conn, req)
    if not isinstance(alloc, protocol.KVAllocReply) or not alloc.ok:
        result["reason"] = reply_reason(alloc)
        return
    refs = m.blocks[alloc.have_blocks:]
    result["new_blocks"] = len(refs)
    lengths: list[int] = []
    views: list[Any] = []
    if refs:
        def pieces(engine):
            runs, views = engine.pool.pieces(tier, [r.block_id for r in refs], (0, num_layers))
            return runs, _piece_tensors(engine.pool.kv_layout(), runs, views)
        lengths, views = await driver.call(pieces)
    per_layer = 2 * len(lengths)
    # fewer blocks than planned (the receiver had some) may mean fewer, wider
    # chunks: keep each message within MAX_PIECE_FRAMES (a suffix of the
    # blocks has no more runs than all of them, so one layer always fits)
    chunks = (_layer_chunks(num_layers, len(refs) * block_bytes, chunk_bytes,
                            max_layers=MAX_PIECE_FRAMES // per_layer) if refs else [(0, num_layers)])
    sends: list[asyncio.Future] = []
    try:
        for c, (l0, l1) in enumerate(chunks):
            data = protocol.KVData(id=f"{transfer_id}.{c}", deadline=deadline, transfer_id=transfer_id,
                                   seq=c, layer_start=l0, layer_end=l1, block_ids=alloc.block_ids,
                                   last=c == len(chunks) - 1, pieces=tuple(lengths),
                                   tensors=tuple(views[l0 * per_layer:l1 * per_layer]))
            sends.append(asyncio.ensure_future(protocol.call(conn, data)))
            result["sends"] += 1
            result["chunks"] += 1
            result["bytes"] += len(refs) * block_bytes * (l1 - l0) // num_layers
        acks = await asyncio.gather(*sends)
    finally:
        await _settle(sends)
    _record_acks(acks, len(refs), result)


async def _settle(sends: list[asyncio.Future]) -> None:
    """Cancel the chunk sends still in flight (after a failure) and wait for all."""
    for s in sends:
        if not s.done():
            s.cancel()
    if sends:
        await asyncio.gather(*sends, return_exceptions=True)


def _record_acks(acks: list[Any], sent_blocks: int, result: dict[str, Any]) -> None:
    """The outcome of a streamed transfer: every chunk's ack ok, or the first
    reason. ``None`` entries (an unlock that rode along with the sends) are not acks."""
    acks = [a for a in acks if a is not None]
    result["sent_blocks"] = sent_blocks
    bad = [a for a in acks if not (isinstance(a, protocol.KVAck) and a.ok)]
    if bad:
        result["reason"] = reply_reason(bad[0])
        return
    result.update(transferred=True, inserted_tokens=max(a.inserted_tokens for a in acks))


async def _stream(driver: EngineDriver, conn: Connection, m: Any, req: protocol.KVTransferRequest,
                  block_bytes: int, chunk_bytes: int, staging: list[Any], result: dict[str, Any]) -> None:
    """Allocation round trip (``req``), then layer chunks sent without waiting
    for acks (the gather of chunk c+1 overlaps the wire time of chunk c).
    Returns once every chunk was acked (or the first failure); raises
    TransportError."""
    transfer_id, deadline, num_layers = req.transfer_id, req.deadline, req.num_layers
    alloc_call = asyncio.ensure_future(protocol.call(conn, req))
    result["sends"] += 1
    n = len(m.blocks)
    chunks = _layer_chunks(num_layers, n * block_bytes, chunk_bytes)

    def gather(refs, l0, l1, new_staging=False, unlock=False):
        """Engine thread: (optionally a fresh staging view,) gather layers
        [l0, l1) into it, (optionally) unlock the prefix: the data to send is
        in staging, so the sender's blocks need no lock while it travels."""
        def run(engine):
            nonlocal view
            try:
                if new_staging:
                    layout = engine.pool.kv_layout()
                    L, two, bs, kvh, hd = layout.block_shape
                    buf, view = _STAGING.acquire((L, two, len(refs), bs, kvh, hd), layout.dtype)
                    staging.append(buf)
                if refs and l1 > l0:
                    engine.pool.gather(refs, view[l0:l1], (l0, l1))
            finally:
                if unlock:
                    _unlock(engine, m)
        return run

    # speculative: gather chunk 0 of every block while the allocation round trip runs
    view: Any = None
    try:
        await driver.call(gather(m.blocks, *chunks[0], new_staging=True))
    except BaseException:
        await asyncio.gather(alloc_call, return_exceptions=True)
        raise
    alloc = await alloc_call
    if not isinstance(alloc, protocol.KVAllocReply) or not alloc.ok:
        result["reason"] = reply_reason(alloc)
        return
    have = alloc.have_blocks
    refs = m.blocks[have:]
    result["new_blocks"] = len(refs)
    if have:                          # the receiver has a prefix: send only the rest
        chunks = _layer_chunks(num_layers, len(refs) * block_bytes, chunk_bytes) if refs else [(0, num_layers)]
        await driver.call(gather(refs, *chunks[0], new_staging=True, unlock=len(chunks) == 1))
    sends: list[asyncio.Future] = []
    if len(chunks) == 1 and not m.released:   # nothing left to gather: unlock while chunk 0 travels
        sends.append(asyncio.ensure_future(driver.call(gather(refs, 0, 0, unlock=True))))
    try:
        for c, (l0, l1) in enumerate(chunks):
            if c:
                await driver.call(gather(refs, l0, l1, unlock=c == len(chunks) - 1))
            data = protocol.KVData(id=f"{transfer_id}.{c}", deadline=deadline, transfer_id=transfer_id,
                                   seq=c, layer_start=l0, layer_end=l1, block_ids=alloc.block_ids,
                                   last=c == len(chunks) - 1,
                                   tensors=(view[l0:l1],) if refs else ())
            sends.append(asyncio.ensure_future(protocol.call(conn, data)))
            result["sends"] += 1
            result["chunks"] += 1
            result["bytes"] += data.tensors[0].nbytes if refs else 0
        acks = await asyncio.gather(*sends)
    finally:
        await _settle(sends)
    _record_acks(acks, len(refs), result)
