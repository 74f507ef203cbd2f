"""Disaggregated prefill between node processes, on the KV-movement layer
(``kvmove.py``): the prefill leg's ``LayerSender``; the decode node
receives into a PROMPT region of its KV inbox (``inbox.py``).

One request, two legs (docs/cluster.md, "Disaggregated prefill")::

    coordinator ── DecodeLeg(prefill_node=P) ──▶ decode node D
                                                        reserve_region(PROMPT), inbox.open_prompt
                ◀── Accepted(kv grant) ──────────────   (KVReceiver: pending)
    coordinator ── PrefillLeg(kv_to_node=D, grant) ──▶ prefill node P
                                                        engine prefill; after each layer the
                                                        LayerStreamer stages it and the LayerSender
                                                        sends it (event loop, off the compute path)
                                      D ◀── KVData(layers [l0, l1)) ───  ... one per layer (or a few)
                                      D ─── KVAck ─────────────────▶
    coordinator ◀── TokenChunk(0) ──   P samples token 0
                                      D ◀── KVCommit(done, token 0) ──  after every ack
                                        D: engine.add_prefilled; decodes from token 1
    coordinator ◀── TokenChunk(1..) ── D

``LayerSender`` (prefill side, a ``KVSender``) is the ``engine.stream.KVSink``
of one request: ``pending → sending → done | finished | failed |
timed_out``. A ``KVReceiver`` (decode side) holds the region:
``pending → receiving → done | finished | failed | timed_out | cancelled``. Each has one deadline (the
request's transfer deadline, ``[cluster].kv_transfer_timeout`` from the
region), and every state but ``done`` cancels the region
(on the decode side) at once; ``done`` hands it to the engine.

Only the node the coordinator named as the prefill leg may fill a
region: with authentication, a KVData or KVCommit from any other key is
refused (``no_grant``) and changes nothing; the first accepted message binds
the link, later ones must come over the same one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from kvd.node.kvmove import KVSender, TransferState

log = logging.getLogger("kvd.disagg")

# Layers of one request go out as soon as this many bytes are staged (or the
# last layer is): a layer of a short prompt is a few KiB, and a message costs
# a round of Python on both sides; a long prompt's layers go one by one.
MIN_MESSAGE_BYTES = 256 << 10


# ─── prefill side ────────────────────────────────────────────────────────────


class LayerSender(KVSender):
    """The prefill leg's KV stream to one decode node's reservation: a
    ``KVSender`` that is also the request's ``engine.stream.KVSink``.

    Engine thread: ``open`` (a staging view for the blocks to send) and
    ``layers_ready`` (hands the layer range to the event loop, never
    blocks). Event loop: each staged range of at least ``MIN_MESSAGE_BYTES``
    (or the last layer) is sent as one KVData without waiting for the acks
    of the previous ones (``by_request``: every layer in one KVData once the
    prefill's last layer is staged, ``[cluster].kv_stream = "request"``);
    ``commit`` waits for every ack, then sends the KVCommit."""

    def __init__(self, *, have_blocks: int, loop: asyncio.AbstractEventLoop, by_request: bool = False,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.skip_blocks = have_blocks
        self.loop = loop
        self.by_request = by_request              # hold every layer until the prefill ends (a baseline)
        self._view: torch.Tensor | None = None
        self._next = 0                            # first layer not yet sent

    # engine thread ---------------------------------------------------------
    def open(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if shape[2] != len(self.block_ids):
            raise ValueError(f"prefill leg: {shape[2]} blocks to send, the grant has {len(self.block_ids)}")
        self._view = self.stage(shape, dtype)
        return self._view

    def layers_ready(self, l0: int, l1: int) -> None:
        self.loop.call_soon_threadsafe(self._staged, l1)

    # event loop ------------------------------------------------------------
    def _staged(self, upto: int) -> None:
        if self.state is not TransferState.SENDING or not self.block_ids or self._view is None:
            return
        per_layer = self._view[0].numel() * self._view.element_size()
        if upto < self.num_layers and (self.by_request or (upto - self._next) * per_layer < MIN_MESSAGE_BYTES):
            return
        l0, self._next = self._next, upto
        self.send(l0, upto, (self._view[l0:upto],))

    @property
    def staged(self) -> torch.Tensor | None:
        """The staged KV of every block sent, once the last layer was staged."""
        return self._view if self._next == self.num_layers else None

    async def commit(self, status: str, first_token: int = -1, cached_tokens: int = 0,
                     reason: str = "", replica_to: str = "", keep_staging: bool = False) -> TransferState:
        if status == "done" and self.block_ids and self._next < self.num_layers:
            status, reason = "failed", f"only {self._next} of {self.num_layers} layers were staged"
        return await super().commit(status, first_token, cached_tokens, reason, replica_to, keep_staging)
