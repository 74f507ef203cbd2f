"""MemServe distributed transfer (§4.3) of a cached prefix between two node
processes, on the KV-movement layer (``kvmove.py``: a ``KVSender`` here; on the other
side a PREFIX region of that node's KV inbox, ``inbox.py``, each with its
states and one deadline).

MemServe's transfer with insert (allocation, transmission, insertion)
across a transport. The allocation step
always comes first (so nothing the receiver has is sent, and the receiver
takes KV only into blocks it granted), then layer chunks stream, DéjàVu
§4.1 style::

    KVSender: pending
    match + lock             ── KVTransferRequest ──▶  reserve_region(PREFIX): its prefix locked,
    gather chunk 0 (overlaps ◀──── KVAllocReply ────   blocks for the rest, bound to the asking link
      the round trip)                                   (KVReceiver: pending)
    KVSender: sending
    for each chunk c:        ─── KVData(c) ─────────▶  the KVReceiver of this transfer id,
      send c, gather c+1          [l1-l0, 2, n, ...]    from this very link? else
      (no wait for acks)                                Error(no_grant), nothing changes;
                                                        fill chunk c (receiving)
                             ◀────── KVAck(c) ──────   the last one commits: done
    drain (every ack, by the deadline): done | failed | timed_out; unlock

Regions (receiver): a KVData is taken only into a region this node reserved
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
host (tools/bench/transfer/bench_kv_transfer.py), and each message costs a round of Python
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
  dominate: docs/benchmarks.md, design measurements).
- **staged**: gathered (a copy per run) into the sender's staging buffers
  (``KVSender.stage``: reused, no page faults per transfer; given back only
  when every frame from them was answered), and the prefix is unlocked once
  gathered.

The receiver copies each frame into its blocks, one copy per overlap of a
frame with a run of its block ids. KV memory is reached only through MemPool's
verbs (``lock_prefix``/``unlock``, ``kv_layout``, ``gather``/``pieces`` on the
sender; ``reserve_region``, then the region's ``fill``/``fill_pieces`` and
``commit``/``cancel`` on the receiver), each inside ``EngineDriver.call``
(inline when the engine is idle); the receiver serialises chunk imports
there, so the reaper (``KVInbox.expire``) never races an import. A region
that never sees all its data is cancelled at its deadline (``timed_out``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from engine.memory.kv_cache import block_runs
from engine.memory.mempool import KVLayout, PrefixLock
from kvd import protocol
from kvd.node.engine_driver import EngineDriver
from kvd.node.kvmove import KVSender, TransferState, new_transfer_id, reply_reason
from transports import Connection

log = logging.getLogger("kvd.transfer")

CHUNK_BYTES = 8 << 20           # streamed chunk size target (whole layers, <= num_layers chunks)
WHOLE_MAX_BYTES = 32 << 20      # payloads up to this go as ONE KVData after the allocation
ZERO_COPY_MIN_BYTES = 64 << 10  # a pool slice this big is sent as is (pyzmq copies smaller frames)
MAX_PIECE_FRAMES = 128          # pieces frames in one KVData message (the protocol allows 256)
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


# ─── sender ──────────────────────────────────────────────────────────────────


async def send_prefix(driver: EngineDriver, conn: Connection, token_ids: list[int], *,
                      src_node: str, dst_node: str, timeout: float = 30.0,
                      chunk_bytes: int | None = None) -> dict[str, Any]:
    """Sender half: move the cached KV of ``token_ids``' full blocks to the
    node behind ``conn`` and insert it into that node's radix tree, as one
    ``KVSender`` whose deadline is ``timeout`` seconds from now.

    Returns {"transferred", "state", "transfer_id", "blocks", "sent_blocks",
    "new_blocks", "bytes", "sends", "chunks", "inserted_tokens", "zero_copy",
    "seconds", "reason"}: ``state`` the sender's final state, ``sent_blocks``
    travelled, ``new_blocks`` the receiver did not have, ``zero_copy``: the
    frames were views of the pool (no gather). Raises TimeoutError past the
    deadline and TransportError on a transport failure; the sender's lock
    on the prefix is released in every case.
    """
    t0 = time.perf_counter()
    whole_max = WHOLE_MAX_BYTES if chunk_bytes is None else 0   # an explicit chunk size is kept
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    result: dict[str, Any] = {"transferred": False, "blocks": 0, "sent_blocks": 0, "new_blocks": 0,
                              "bytes": 0, "sends": 0, "chunks": 0, "inserted_tokens": 0, "reason": "",
                              "zero_copy": False}

    m, layout, zc_tier, chunk_bytes = await driver.call(
        lambda engine: _lock_for_send(engine, token_ids, chunk_bytes, whole_max))
    sender = KVSender(transfer_id=new_transfer_id(), conn=conn, num_layers=layout.num_layers,
                      deadline=time.time() + timeout)
    result.update(blocks=len(m.blocks), transfer_id=sender.transfer_id)
    clean = False                    # every frame sent was answered (or none was sent)
    try:
        if not m.blocks:
            clean = True
            result["reason"] = "no cached prefix for these tokens"
            sender.end(TransferState.FAILED, result["reason"])
            return result
        req = protocol.KVTransferRequest(
            id=sender.transfer_id, deadline=sender.deadline, transfer_id=sender.transfer_id, src_node=src_node,
            dst_node=dst_node, token_ids=tuple(token_ids[:len(m.blocks) * layout.block_shape[2]]),
            num_blocks=len(m.blocks), num_layers=layout.num_layers, dtype=protocol.dtype_name(layout.dtype))
        try:
            async with asyncio.timeout(sender.seconds_left()):
                if zc_tier is not None:
                    await _send_pieces(driver, sender, m, req, layout, chunk_bytes, zc_tier, result)
                else:
                    await _send_staged(driver, sender, m, req, layout, chunk_bytes, result)
        except TimeoutError:
            sender.end(TransferState.TIMED_OUT, "past the transfer deadline")
            raise
        clean = True
        return result
    finally:
        # (a staged stream unlocks with its last gather: the data is in staging)
        if not m.released and (clean or not result["zero_copy"]):
            await driver.call(lambda engine: _unlock(engine, m))
        elif not m.released:
            # Frames that alias the pool may still sit in the transport's
            # queue: keep the blocks from being reused until the deadline has
            # passed, after which the receiver refuses the message on arrival.
            _unlock_after(driver, m, sender.deadline)
        await sender.close()         # staging back to the pool unless a send was cut in flight
        result.update(state=sender.state.value, seconds=time.perf_counter() - t0)


def _lock_for_send(engine, token_ids: list[int], chunk_bytes: int, whole_max: int):
    """Match and lock ``token_ids``' cached prefix; pick the chunk size and the frame
    layout (pool pieces or staged). Engine thread. Returns (lock, layout, zero-copy
    tier or None, chunk bytes)."""
    layout = engine.pool.kv_layout()
    m = engine.pool.lock_prefix(token_ids)
    payload = len(m.blocks) * layout.bytes_per_block
    chunk = max(chunk_bytes, payload) if payload <= whole_max else chunk_bytes
    per_message = max(l1 - l0 for l0, l1 in _layer_chunks(layout.num_layers, payload, chunk))
    zc_tier = _zero_copy_tier(layout, m.blocks, per_message) if m.blocks else None
    return m, layout, zc_tier, chunk


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


def _granted(sender: KVSender, alloc: Any, m: PrefixLock, result: dict[str, Any]) -> list[Any] | None:
    """The sender's blocks to send after the allocation reply (the receiver
    has the first ``have_blocks``), or None when it refused (``failed``)."""
    if not isinstance(alloc, protocol.KVAllocReply) or not alloc.ok:
        result["reason"] = reply_reason(alloc)
        sender.end(TransferState.FAILED, result["reason"])
        return None
    sender.start(alloc.block_ids)
    refs = m.blocks[alloc.have_blocks:]
    result["new_blocks"] = len(refs)
    return refs


async def _finish(sender: KVSender, sent_blocks: int, result: dict[str, Any]) -> None:
    """Every chunk's ack (``done``), or the first refusal's reason."""
    result["sent_blocks"] = sent_blocks
    try:
        acks = await sender.drain()
    except RuntimeError as exc:
        result["reason"] = str(exc)
        return
    result.update(transferred=sender.state is TransferState.DONE,
                  inserted_tokens=max(a.inserted_tokens for a in acks))


async def _send_pieces(driver: EngineDriver, sender: KVSender, m: PrefixLock, req: protocol.KVTransferRequest,
                       layout: KVLayout, chunk_bytes: int, tier: str, result: dict[str, Any]) -> None:
    """Allocation round trip (``req``), then layer chunks whose frames are
    views of the sender's pool (pieces layout: no gather, no staging), sent
    without waiting for acks. The prefix stays locked until the caller
    unlocks it, after every ack. Raises TransportError."""
    num_layers = req.num_layers
    result.update(sends=1, zero_copy=True)
    refs = _granted(sender, await protocol.call(sender.conn, req), m, result)
    if refs is None:
        return
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
    chunks = (_layer_chunks(num_layers, len(refs) * layout.bytes_per_block, chunk_bytes,
                            max_layers=MAX_PIECE_FRAMES // per_layer) if refs else [(0, num_layers)])
    for l0, l1 in chunks:
        sender.send(l0, l1, tuple(views[l0 * per_layer:l1 * per_layer]), tuple(lengths))
        result["sends"] += 1
        result["chunks"] += 1
        result["bytes"] += len(refs) * layout.bytes_per_block * (l1 - l0) // num_layers
    await _finish(sender, len(refs), result)


async def _send_staged(driver: EngineDriver, sender: KVSender, m: PrefixLock, req: protocol.KVTransferRequest,
                       layout: KVLayout, chunk_bytes: int, result: dict[str, Any]) -> None:
    """Allocation round trip (``req``), then layer chunks gathered into the
    sender's staging buffer and sent without waiting for acks (the gather
    of chunk c+1 overlaps the wire time of chunk c). Returns once every
    chunk was answered (or the allocation refused); raises TransportError."""
    num_layers = req.num_layers
    alloc_call = asyncio.ensure_future(protocol.call(sender.conn, req))
    result["sends"] += 1
    chunks = _layer_chunks(num_layers, len(m.blocks) * layout.bytes_per_block, chunk_bytes)
    L, two, bs, kvh, hd = layout.block_shape
    view: Any = None

    def gather(refs, l0, l1, fresh=False, unlock=False):
        """Engine thread: (optionally a fresh staging view,) gather layers
        [l0, l1) into it, (optionally) unlock the prefix: the data to send is
        in staging, so the sender's blocks need no lock while it travels."""
        def run(engine):
            nonlocal view
            try:
                if fresh:
                    view = sender.stage((L, two, len(refs), bs, kvh, hd), layout.dtype)
                if refs and l1 > l0:
                    engine.pool.gather(refs, view[l0:l1], (l0, l1))
            finally:
                if unlock:
                    _unlock(engine, m)
        return run

    # speculative: gather chunk 0 of every block while the allocation round trip runs
    try:
        await driver.call(gather(m.blocks, *chunks[0], fresh=True))
    except BaseException:
        await asyncio.gather(alloc_call, return_exceptions=True)
        raise
    refs = _granted(sender, await alloc_call, m, result)
    if refs is None:
        return
    if len(refs) < len(m.blocks):     # the receiver has a prefix: send only the rest
        chunks = _layer_chunks(num_layers, len(refs) * layout.bytes_per_block, chunk_bytes) if refs else [(0, num_layers)]
        await driver.call(gather(refs, *chunks[0], fresh=True, unlock=len(chunks) == 1))
    unlocking = None
    if len(chunks) == 1 and not m.released:   # nothing left to gather: unlock while chunk 0 travels
        unlocking = asyncio.ensure_future(driver.call(gather(refs, 0, 0, unlock=True)))
    try:
        for c, (l0, l1) in enumerate(chunks):
            if c:
                await driver.call(gather(refs, l0, l1, unlock=c == len(chunks) - 1))
            sender.send(l0, l1, (view[l0:l1],) if refs else ())
            result["sends"] += 1
            result["chunks"] += 1
            result["bytes"] += view[l0:l1].nbytes if refs else 0
    finally:
        if unlocking is not None:
            await asyncio.gather(unlocking, return_exceptions=True)
    await _finish(sender, len(refs), result)
