"""Disaggregated prefill between node processes: the two transfer objects.

One request, two legs (docs/cluster.md, "Disaggregated prefill")::

    coordinator ── GenerateRequest(prefill_node=P) ──▶ decode node D
                                                        reserve blocks for the prompt
                ◀── Accepted(kv grant) ──────────────   (KVReceiver: pending)
    coordinator ── GenerateRequest(kv_to_node=D, grant) ──▶ prefill node P
                                                        engine prefill; after each layer the
                                                        LayerStreamer stages it and the KVSender
                                                        sends it (event loop, off the compute path)
                                      D ◀── KVData(layers [l0, l1)) ───  ... one per layer (or a few)
                                      D ─── KVAck ─────────────────▶
    coordinator ◀── TokenChunk(0) ──   P samples token 0
                                      D ◀── KVCommit(done, token 0) ──  after every ack
                                        D: engine.add_prefilled; decodes from token 1
    coordinator ◀── TokenChunk(1..) ── D

``KVSender`` (prefill side) is the ``engine.stream.KVSink`` of one request:
``pending → sending → done | finished | failed | timed_out``. ``KVReceiver``
(decode side) holds the reservation: ``pending → receiving → done |
finished | failed | timed_out | cancelled``. Each has one deadline (the
request's transfer deadline, ``[cluster].kv_transfer_timeout`` from the
reservation), and every state but ``done`` returns the reservation's blocks
(on the decode side) at once; ``done`` hands them to the engine.

Only the node the coordinator named as the prefill leg may fill a
reservation: with authentication, a KVData or KVCommit from any other key is
refused (``no_grant``) and changes nothing; the first accepted message binds
the link, later ones must come over the same one.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import time
from typing import Any

import torch

from engine.memory.mempool import Reservation
from engine.stream import STAGING
from kvd import protocol
from kvd.node.engine_driver import EngineDriver
from kvd.node.transfer import import_layers, reply_reason
from transports import Connection, TransportError

log = logging.getLogger("kvd.disagg")

# Layers of one request go out as soon as this many bytes are staged (or the
# last layer is): a layer of a short prompt is a few KiB, and a message costs
# a round of Python on both sides; a long prompt's layers go one by one.
MIN_MESSAGE_BYTES = 256 << 10

_ID_PREFIX = f"pd-{os.urandom(6).hex()}-"
_ID_SEQ = itertools.count(1)


def new_transfer_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_SEQ)}"


class TransferState(str, enum.Enum):
    PENDING = "pending"
    SENDING = "sending"
    RECEIVING = "receiving"
    DONE = "done"
    FINISHED = "finished"          # token 0 ended the request on the prefill node
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"        # the request was aborted


FINAL = frozenset((TransferState.DONE, TransferState.FINISHED, TransferState.FAILED,
                   TransferState.TIMED_OUT, TransferState.CANCELLED))


# ─── prefill side ────────────────────────────────────────────────────────────


class KVSender:
    """The prefill leg's KV stream to one decode node's reservation.

    Engine thread: ``open`` (a staging buffer for the blocks to send) and
    ``layers_ready`` (hands the layer range to the event loop, never
    blocks). Event loop: each staged range of at least ``MIN_MESSAGE_BYTES``
    (or the last layer) is sent as one KVData without waiting for the acks
    of the previous ones (``by_request``: every layer in one KVData once the
    prefill's last layer is staged, ``[cluster].kv_stream = "request"``);
    ``commit`` waits for every ack, then sends the
    KVCommit. The staging buffer is released once nothing is in flight."""

    def __init__(self, *, transfer_id: str, request_id: str, conn: Connection,
                 block_ids: tuple[int, ...], have_blocks: int, num_layers: int, deadline: float,
                 loop: asyncio.AbstractEventLoop, by_request: bool = False) -> None:
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.conn = conn
        self.block_ids = block_ids
        self.skip_blocks = have_blocks
        self.num_layers = num_layers
        self.deadline = deadline                  # wall clock, as on the wire
        self.loop = loop
        self.by_request = by_request              # hold every layer until the prefill ends (a baseline)
        self.state = TransferState.PENDING
        self.reason = ""
        self.bytes = 0
        self.messages = 0
        self._buf: torch.Tensor | None = None
        self._view: torch.Tensor | None = None
        self._next = 0                            # first layer not yet sent
        self._ready = 0                           # layers staged so far
        self._sends: list[asyncio.Task] = []

    # engine thread ---------------------------------------------------------
    def open(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if shape[2] != len(self.block_ids):
            raise ValueError(f"prefill leg: {shape[2]} blocks to send, the grant has {len(self.block_ids)}")
        self._buf, self._view = STAGING.acquire(shape, dtype)
        self.state = TransferState.SENDING
        return self._view

    def layers_ready(self, l0: int, l1: int) -> None:
        self.loop.call_soon_threadsafe(self._staged, l1)

    # event loop ------------------------------------------------------------
    def _staged(self, upto: int) -> None:
        self._ready = upto
        if self.state is not TransferState.SENDING or not self.block_ids:
            return
        per_layer = self._view[0].numel() * self._view.element_size()
        if upto < self.num_layers and (self.by_request or (upto - self._next) * per_layer < MIN_MESSAGE_BYTES):
            return
        l0, self._next = self._next, upto
        self._sends.append(self.loop.create_task(self._send(l0, upto), name=f"kv {self.transfer_id} {l0}"))

    async def _send(self, l0: int, l1: int) -> None:
        data = protocol.KVData(id=f"{self.transfer_id}.{l0}", deadline=self.deadline,
                               transfer_id=self.transfer_id, seq=l0, layer_start=l0, layer_end=l1,
                               block_ids=self.block_ids, last=l1 == self.num_layers,
                               tensors=(self._view[l0:l1],))
        self.messages += 1
        ack = await protocol.call(self.conn, data)
        if not (isinstance(ack, protocol.KVAck) and ack.ok):
            raise RuntimeError(f"decode node refused layers [{l0}, {l1}): {reply_reason(ack)}")
        self.bytes += data.tensors[0].nbytes

    async def commit(self, status: str, first_token: int = -1, cached_tokens: int = 0,
                     reason: str = "") -> TransferState:
        """End the transfer: wait for every layer's ack (``done`` only), then
        tell the decode node. Returns the final state; never raises."""
        try:
            if status == "done":
                if self.block_ids and self._next < self.num_layers:
                    raise RuntimeError(f"only {self._next} of {self.num_layers} layers were staged")
                async with asyncio.timeout(max(0.0, self.deadline - time.time())):
                    await asyncio.gather(*self._sends)
            reply = await protocol.call(self.conn, protocol.KVCommit(
                id=f"{self.transfer_id}.commit", deadline=self.deadline, transfer_id=self.transfer_id,
                request_id=self.request_id, status=status, first_token=first_token,
                cached_tokens=cached_tokens, reason=reason))
            if not (isinstance(reply, protocol.KVAck) and reply.ok):
                raise RuntimeError(f"decode node refused the commit: {reply_reason(reply)}")
            self.state = TransferState.DONE if status == "done" else TransferState(status)
            self.reason = reason
        except TimeoutError:
            self.state, self.reason = TransferState.TIMED_OUT, "past the transfer deadline"
        except (TransportError, RuntimeError) as exc:
            self.state, self.reason = TransferState.FAILED, str(exc)
            if status == "done":      # tell the decode node at once rather than let it time out
                await self._fail_quietly(self.reason)
        finally:
            await self._settle()
        return self.state

    async def _fail_quietly(self, reason: str) -> None:
        try:
            await protocol.call(self.conn, protocol.KVCommit(
                id=f"{self.transfer_id}.abort", deadline=self.deadline, transfer_id=self.transfer_id,
                request_id=self.request_id, status="failed", reason=reason))
        except TransportError:
            pass

    async def _settle(self) -> None:
        """Cancel sends still in flight, wait for them, give the buffer back."""
        for task in self._sends:
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)
        self._sends.clear()
        if self._buf is not None:
            STAGING.release(self._buf)
            self._buf = self._view = None


# ─── decode side ─────────────────────────────────────────────────────────────


class KVReceiver:
    """The decode leg's reservation, waiting for a prefill node's KV.

    ``outcome`` resolves with the final state (event loop). Imports run on
    the engine thread (``import_fn``); they check the state there, so no
    import lands after the reservation was cancelled."""

    def __init__(self, *, transfer_id: str, request_id: str, reservation: Reservation,
                 prefill_node: str, num_layers: int, deadline: float) -> None:
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.reservation = reservation
        self.prefill_node = prefill_node
        self.num_layers = num_layers
        self.deadline = deadline                  # monotonic
        self.state = TransferState.PENDING
        self.reason = ""
        self.first_token = -1
        self.cached_tokens = 0
        self.layers_done: set[int] = set()
        self.bytes = 0
        self.link: bytes | None = None            # the transport peer of the first accepted message
        self.outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    def refusal(self, peer: bytes, identity: str | None, authenticated: bool) -> str | None:
        """Why a message from (peer, identity) may not touch this
        reservation; None binds the link (first message) or matches it."""
        if self.state in FINAL:
            return f"transfer {self.transfer_id} is {self.state.value}"
        if authenticated and identity != self.prefill_node:
            return f"{identity!r} is not this request's prefill node"
        if self.link is not None and peer != self.link:
            return "another link is filling this reservation"
        self.link = peer
        return None

    def import_fn(self, msg: protocol.KVData):
        """The engine-thread half of one KVData: its layers into the reservation."""
        def run(engine: Any) -> protocol.KVAck:
            if self.state in FINAL:
                return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=False,
                                      reason=f"transfer is {self.state.value}")
            layers = range(msg.layer_start, msg.layer_end)
            if (list(msg.block_ids) != self.reservation.block_ids or msg.layer_end > self.num_layers
                    or not layers or self.layers_done.intersection(layers)):
                raise ValueError(f"KVData does not match the reservation (blocks or layers "
                                 f"[{msg.layer_start}, {msg.layer_end}))")
            import_layers(engine.pool, self.reservation, msg.layer_start, msg.layer_end, msg)
            self.layers_done.update(layers)
            self.bytes += sum(t.nbytes for t in msg.tensors)
            return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=True)
        return run

    @property
    def complete(self) -> bool:
        return not self.reservation.block_ids or len(self.layers_done) == self.num_layers

    def end(self, state: TransferState, reason: str = "") -> None:
        """Move to a final state (once; later calls are ignored)."""
        if self.state in FINAL:
            return
        self.state, self.reason = state, reason
        if not self.outcome.done():
            self.outcome.set_result(state)

    async def wait(self) -> TransferState:
        """The final state; ``timed_out`` at the deadline."""
        try:
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                return await asyncio.shield(self.outcome)
        except TimeoutError:
            self.end(TransferState.TIMED_OUT, "no KV from the prefill node before the deadline")
            return self.state


class DecodeSide:
    """A node's open KVReceivers, by transfer id, and how it answers the
    prefill nodes' KVData and KVCommit for them."""

    def __init__(self, driver: EngineDriver, authenticated: bool) -> None:
        self.driver = driver
        self.authenticated = authenticated
        self.receivers: dict[str, KVReceiver] = {}
        self.counts = {"remote": 0, "local": 0, "failed": 0, "timed_out": 0, "refused": 0}

    def owns(self, transfer_id: str) -> bool:
        return transfer_id in self.receivers

    def _refuse(self, msg: protocol.Message, why: str) -> protocol.Error:
        self.counts["refused"] += 1
        return protocol.Error(id=msg.id, code="no_grant", message=why)

    async def on_data(self, msg: protocol.KVData, peer: bytes, identity: str | None) -> protocol.Message:
        rx = self.receivers[msg.transfer_id]
        if why := rx.refusal(peer, identity, self.authenticated):
            return self._refuse(msg, why)
        if rx.state is TransferState.PENDING:
            rx.state = TransferState.RECEIVING
        try:
            return await self.driver.call(rx.import_fn(msg))
        except (TypeError, ValueError, IndexError) as exc:
            rx.end(TransferState.FAILED, f"bad KV from the prefill node: {exc}")
            return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=False, reason=str(exc))

    def on_commit(self, msg: protocol.KVCommit, peer: bytes, identity: str | None) -> protocol.Message:
        rx = self.receivers[msg.transfer_id]
        if msg.request_id != rx.request_id:
            return self._refuse(msg, "the commit names another request")
        if why := rx.refusal(peer, identity, self.authenticated):
            return self._refuse(msg, why)
        if msg.status == "done" and not rx.complete:
            rx.end(TransferState.FAILED, f"commit after {len(rx.layers_done)} of {rx.num_layers} layers")
            return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=False, reason=rx.reason)
        rx.first_token, rx.cached_tokens = msg.first_token, msg.cached_tokens
        rx.end(TransferState(msg.status), msg.reason)
        return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=True)

    async def release(self, rx: KVReceiver, handed_to_engine: bool) -> None:
        """Forget ``rx``; unless the engine took its reservation, return the
        blocks (engine thread). Counts its outcome."""
        self.receivers.pop(rx.transfer_id, None)
        key = {TransferState.DONE: "remote", TransferState.TIMED_OUT: "timed_out",
               TransferState.FINISHED: "remote"}.get(rx.state, "failed")
        self.counts[key] += 1
        if not handed_to_engine:
            await self.driver.call(lambda engine: engine.pool.cancel(rx.reservation))

    def stats(self) -> dict[str, Any]:
        """Outcome counts, and each open reservation: request, transfer id,
        prefill node, state, layers landed."""
        return {**self.counts, "open": [
            {"request_id": rx.request_id, "transfer_id": tid, "prefill_node": rx.prefill_node,
             "state": rx.state.value, "layers": len(rx.layers_done), "blocks": len(rx.reservation.block_ids)}
            for tid, rx in self.receivers.items()]}
