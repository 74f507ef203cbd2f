"""The KV-movement layer: one transfer of KV between two node processes, as
an object on each side.

A transfer moves layers of KV from blocks of the sender's pool into blocks
the receiver set aside for it (a MemPool ``Region``: PREFIX for a cached
prefix, PROMPT for a prompt another node computes), kept by the node's KV
inbox (``inbox.py``). Two senders build on it: the prefix transfer
(``transfer.py``, MemServe §4.3) and disaggregated prefill (``disagg.py``)::

    KVSender (sender's event loop)             KVReceiver (receiver's table)
    ─────────────────────────────              ─────────────────────────────
    pending   (waiting for the grant)          pending    (blocks set aside)
    sending   send(l0, l1, frames) ── KVData ─▶ receiving  import_fn: layers [l0, l1)
              (no wait for acks)  ◀── KVAck ──             into the region's blocks
    drain():  every ack, by the deadline
    commit() (disagg) ─────────── KVCommit ──▶ done | finished | failed
                          or the last layer's ack ends it (on_complete: prefix)
    done | finished | failed | timed_out       done | finished | failed | timed_out | cancelled

Each side has ONE deadline: the sender's is wall clock (it travels on every
message, so the receiver refuses a late one on arrival); the receiver's is
monotonic (its region's: the inbox's reaper, or ``wait``). A final state is
reached once; later transitions are ignored. The inbox cancels the region
unless the state is ``done``, which commits it: into the radix tree (prefix)
or to the engine (prompt).

Frames are one packed tensor [l1-l0, 2, n, bs, kvh, hd] (usually a view of a
staging buffer, ``stage``) or pool pieces (``KVData.pieces``). A staging
buffer goes back to ``engine.stream.STAGING`` only when every message that
read it was answered: a send cancelled in flight may still sit, zero-copy,
in the transport's queue, so its buffer is dropped instead of reused.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.stream import STAGING, stream_in
from kvd import protocol
from kvd.transfer_state import FINAL, TransferState
from transports import Connection, TransportError

# transfer ids: unique per sender process (random prefix) and per transfer
# (counter); a receiver keys its open transfers by them
_ID_PREFIX = f"kv-{os.urandom(6).hex()}-"
_ID_SEQ = itertools.count(1)


def new_transfer_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_SEQ)}"


def reply_reason(reply: Any) -> str:
    return getattr(reply, "reason", None) or getattr(reply, "message", None) or repr(reply)


def import_layers(pool: Any, region: Any, l0: int, l1: int, msg: protocol.KVData, skip: int = 0) -> None:
    """Write layers [l0, l1) of a KVData's KV into ``region``'s fresh blocks
    (a ``Region``: ``block_ids`` of ``tier``), dropping its
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
        region.fill_pieces([t.data for t in msg.tensors], msg.pieces, (l0, l1), skip)
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


# ─── sender ──────────────────────────────────────────────────────────────────


class KVSender:
    """The sending side of one transfer (event loop).

    ``start(block_ids)`` once the receiver's blocks are known (``sending``);
    ``send`` puts one KVData on the wire without waiting for the acks of the
    ones before; ``drain`` waits for every ack (the transfer is ``done``
    when the receiver ends it on its last layer); ``commit`` ends it with a
    KVCommit instead. ``close`` (always, in a ``finally``) cancels what is
    still in flight and gives the staging buffers back."""

    def __init__(self, *, transfer_id: str, conn: Connection, num_layers: int, deadline: float,
                 request_id: str = "", block_ids: tuple[int, ...] | None = None) -> None:
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.conn = conn
        self.num_layers = num_layers
        self.deadline = deadline                  # wall clock, as on the wire
        self.state = TransferState.PENDING
        self.reason = ""
        self.block_ids: tuple[int, ...] = ()
        self.bytes = 0                            # acknowledged KV bytes
        self.messages = 0                         # KVData sent
        self._sends: list[asyncio.Task] = []
        self._staging: list[torch.Tensor] = []
        self._cut = False                         # a send was cancelled in flight
        if block_ids is not None:
            self.start(block_ids)

    def start(self, block_ids: tuple[int, ...]) -> None:
        """The receiver's blocks for the KV to send: from here on, ``sending``."""
        self.block_ids = tuple(block_ids)
        self.state = TransferState.SENDING

    def stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A staging view [L, 2, n, bs, kvh, hd] that this transfer owns until
        ``close`` (any thread)."""
        buf, view = STAGING.acquire(shape, dtype)
        self._staging.append(buf)
        return view

    def release_staging(self, reusable: bool = True) -> None:
        """Give the staging buffers back to ``STAGING``; drop them instead
        when a send of this transfer was cut in flight or not ``reusable``
        (a send outside this transfer may still read them)."""
        staging, self._staging = self._staging, []
        if reusable and not self._cut:
            for buf in staging:
                STAGING.release(buf)

    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.time())

    def send(self, l0: int, l1: int, tensors: tuple[Any, ...] = (), pieces: tuple[int, ...] = ()) -> None:
        """One KVData of layers [l0, l1) (``tensors``: one packed frame, or
        pool pieces); its ack is awaited by ``drain``."""
        seq = len(self._sends)
        data = protocol.KVData(id=f"{self.transfer_id}.{seq}", deadline=self.deadline,
                               transfer_id=self.transfer_id, seq=seq, layer_start=l0, layer_end=l1,
                               block_ids=self.block_ids, last=l1 == self.num_layers, pieces=pieces,
                               tensors=tensors)
        self.messages += 1
        self._sends.append(asyncio.get_running_loop().create_task(
            self._send(data), name=f"kv {self.transfer_id} {l0}"))

    async def _send(self, data: protocol.KVData) -> protocol.KVAck:
        ack = await protocol.call(self.conn, data)
        if not (isinstance(ack, protocol.KVAck) and ack.ok):
            raise RuntimeError(f"refused layers [{data.layer_start}, {data.layer_end}): {reply_reason(ack)}")
        self.bytes += sum(t.nbytes for t in data.tensors)
        return ack

    async def drain(self) -> list[protocol.KVAck]:
        """Wait, by the deadline, until every KVData sent so far is answered;
        ``done`` when an ack says the receiver completed (the prefix
        transfer's last layer). Raises TimeoutError (``timed_out``), and the
        first RuntimeError (a refusal) or TransportError (``failed``) once
        every other send has been answered too (so no frame is in flight)."""
        try:
            async with asyncio.timeout(self.seconds_left()):
                results = await asyncio.gather(*self._sends, return_exceptions=True)
        except TimeoutError:
            self.end(TransferState.TIMED_OUT, "past the transfer deadline")
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.end(TransferState.FAILED, str(errors[0]))
            raise errors[0]
        if any(a.inserted_tokens for a in results):
            self.end(TransferState.DONE)
        return results

    async def commit(self, status: str, first_token: int = -1, cached_tokens: int = 0,
                     reason: str = "", replica_to: str = "", keep_staging: bool = False) -> TransferState:
        """End the transfer with a KVCommit: ``done`` after every layer's ack;
        ``finished`` or ``failed`` at once. Returns the final state; never
        raises (a transport failure is ``failed``). ``keep_staging``: the
        staging buffers outlive it (the caller ends with ``release_staging``)."""
        try:
            if status == "done":
                if self.block_ids and not self._sends:
                    raise RuntimeError("no layer was sent")
                await self.drain()
            reply = await protocol.call(self.conn, protocol.KVCommit(
                id=f"{self.transfer_id}.commit", deadline=self.deadline, transfer_id=self.transfer_id,
                request_id=self.request_id, status=status, first_token=first_token,
                cached_tokens=cached_tokens, reason=reason, replica_to=replica_to))
            if not (isinstance(reply, protocol.KVAck) and reply.ok):
                raise RuntimeError(f"the receiver refused the commit: {reply_reason(reply)}")
            self.end(TransferState.DONE if status == "done" else TransferState(status), reason)
        except TimeoutError:
            self.end(TransferState.TIMED_OUT, "past the transfer deadline")
        except (TransportError, RuntimeError) as exc:
            self.end(TransferState.FAILED, str(exc))
            if status == "done":      # tell the receiver at once rather than let it time out
                await self._fail_quietly(self.reason)
        finally:
            await self.close(release=not keep_staging)
        return self.state

    async def _fail_quietly(self, reason: str) -> None:
        try:
            await protocol.call(self.conn, protocol.KVCommit(
                id=f"{self.transfer_id}.abort", deadline=self.deadline, transfer_id=self.transfer_id,
                request_id=self.request_id, status="failed", reason=reason))
        except TransportError:
            pass

    def end(self, state: TransferState, reason: str = "") -> None:
        if self.state not in FINAL:
            self.state, self.reason = state, reason

    async def close(self, release: bool = True) -> None:
        """Cancel sends still in flight and wait for them; give the staging
        buffers back (``release_staging``) unless not ``release``."""
        for task in self._sends:
            if not task.done():
                task.cancel()
                self._cut = True
        await asyncio.gather(*self._sends, return_exceptions=True)
        self._sends.clear()
        if self.state not in FINAL:
            self.end(TransferState.FAILED, "closed before it ended")
        if release:
            self.release_staging()


# ─── receiver ────────────────────────────────────────────────────────────────


class KVReceiver:
    """The receiving side of one transfer: ``region`` (a MemPool ``Region``,
    whose purpose and deadline it has) waiting for layers from
    ``sender_node``; the node's KV inbox (inbox.py) keeps them.

    ``import_fn(msg)`` is the engine-thread half of a KVData; it checks the
    state there, so no import lands after the transfer ended. With
    ``on_complete`` (engine thread, returns the tokens it made available)
    the last layer ends the transfer ``done``; without it a KVCommit does
    (the owner calls ``end``). ``end`` may be called from any thread."""

    def __init__(self, *, transfer_id: str, region: Any, num_layers: int,
                 sender_node: str | None, link: bytes | None = None, request_id: str = "",
                 on_complete: Callable[[Any], int] | None = None) -> None:
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.region = region
        self.num_layers = num_layers
        self.sender_node = sender_node            # the identity allowed to fill the region
        self.link = link                          # the transport peer bound to it (first message)
        self.on_complete = on_complete
        self.state = TransferState.PENDING
        self.reason = ""
        self.first_token = -1
        self.cached_tokens = 0
        self.replica_to = ""                      # disagg: where the prefill node sent the prompt's replica
        self.layers_done: set[int] = set()
        self.bytes = 0
        self._lock = threading.Lock()
        self._outcome: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def refusal(self, peer: bytes, identity: str | None, authenticated: bool) -> str | None:
        """Why a message from (peer, identity) may not touch this transfer;
        None binds the link (first message) or matches it."""
        if self.state in FINAL:
            return f"transfer {self.transfer_id} is {self.state.value}"
        if authenticated and identity != self.sender_node:
            return f"{identity!r} is not this transfer's sender"
        if self.link is not None and peer != self.link:
            return "another link is filling this transfer"
        self.link = peer
        return None

    def import_fn(self, msg: protocol.KVData) -> Callable[[Any], protocol.KVAck]:
        """The engine-thread half of one KVData: its layers into the region.
        Raises ValueError (TypeError, IndexError) on a message that does not
        fit; the caller ends the transfer ``failed``."""
        def run(engine: Any) -> protocol.KVAck:
            if self.state in FINAL:
                return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                      reason=f"transfer is {self.state.value}")
            ids = self.region.block_ids
            layers = range(msg.layer_start, msg.layer_end) if ids else range(self.num_layers)
            if (list(msg.block_ids) != list(ids) or bool(msg.tensors) != bool(ids)
                    or msg.layer_end > self.num_layers or not layers or self.layers_done.intersection(layers)):
                raise ValueError(f"KVData does not match the transfer (blocks or layers "
                                 f"[{msg.layer_start}, {msg.layer_end}))")
            if ids:
                import_layers(engine.pool, self.region, msg.layer_start, msg.layer_end, msg)
            if self.state is TransferState.PENDING:
                self.state = TransferState.RECEIVING
            self.layers_done.update(layers)
            self.bytes += sum(t.nbytes for t in msg.tensors)
            if not (self.complete and self.on_complete is not None):
                return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=True)
            inserted = self.on_complete(engine)
            self.end(TransferState.DONE)
            return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=True, inserted_tokens=inserted,
                                  have_blocks=self.region.have_blocks)
        return run

    @property
    def complete(self) -> bool:
        return not self.region.block_ids or len(self.layers_done) == self.num_layers

    @property
    def purpose(self) -> Any:
        return self.region.purpose

    @property
    def deadline(self) -> float:
        """Monotonic: the region's."""
        return self.region.deadline

    @property
    def expired(self) -> bool:
        return self.region.expired()

    def end(self, state: TransferState, reason: str = "") -> bool:
        """Move to a final state, once (any thread); False when it had one."""
        with self._lock:
            if self.state in FINAL:
                return False
            self.state, self.reason = state, reason
            fut, loop = self._outcome, self._loop
        if fut is not None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(state))
        return True

    async def wait(self) -> TransferState:
        """The final state; ``timed_out`` at the deadline (event loop)."""
        with self._lock:
            if self.state in FINAL:
                return self.state
            if self._outcome is None:
                self._loop = asyncio.get_running_loop()
                self._outcome = self._loop.create_future()
        try:
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                return await asyncio.shield(self._outcome)
        except TimeoutError:
            self.end(TransferState.TIMED_OUT, "no KV from the sender before the deadline")
            return self.state
