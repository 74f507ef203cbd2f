"""Layer-wise KV streaming: gather by layer on the way out, scatter on the way in.

A prompt's KV leaves a prefill instance layer by layer: the model's layer
loop calls a ``LayerStreamer`` after each layer (``LlamaModel.forward``'s
``on_layer``), which copies that layer of each streamed request's blocks
into the request's staging buffer (one copy per run of consecutive block
ids) and tells the request's ``KVSink``. The sink transmits off the compute
path; the engine never waits for it.

Layouts: a source region is (block ids, layer range) of the sender's pool;
on the wire it is one contiguous [l1-l0, 2, n, bs, kvh, hd] buffer; the
destination region is the receiver's reservation (a ``Region``, ``MemPool.reserve_region``),
whose first ``skip_blocks`` blocks it already holds and are never sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KVSink(Protocol):
    """Where a streamed prefill's KV goes (kvd's ``LayerSender``). Called on the
    engine thread; no call may block."""

    skip_blocks: int            # leading prompt blocks the destination holds: not sent

    def open(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A staging view of ``shape`` [L, 2, n, bs, kvh, hd] for the ``n``
        blocks to send; the sink owns (and later releases) its buffer."""

    def layers_ready(self, l0: int, l1: int) -> None:
        """Layers ``[l0, l1)`` of the view are written and final."""


def stream_out(pool, block_ids: Sequence[int], layers: tuple[int, int], out: torch.Tensor) -> None:
    """Gather layers ``[l0, l1)`` of a running request's ``block_ids`` into
    ``out`` [l1-l0, 2, len(ids), bs, kvh, hd]: one copy per run of ids."""
    if block_ids:
        pool.gather_blocks(block_ids, out, layers)


def stream_in(pool, region, payload: torch.Tensor, layers: tuple[int, int], skip: int = 0) -> None:
    """Write layers ``[l0, l1)`` of ``payload`` [l1-l0, 2, skip + n, ...] into
    the fresh blocks of ``region`` (a ``Region``), dropping its
    first ``skip`` blocks: one copy per run of the region's ids."""
    region.fill(payload, layers, skip)


class LayerStreamer:
    """The per-step layer hook of a prefill batch with streamed requests.

    ``entries``: (the request's block ids to send, its sink). ``__call__(i)``
    runs after layer ``i`` wrote its KV: layer ``i`` of every entry goes to
    its staging view, then to its sink."""

    def __init__(self, pool, entries: list[tuple[list[int], KVSink]]) -> None:
        layout = pool.kv_layout()
        self.pool = pool
        self.entries = []
        for ids, sink in entries:
            view = sink.open((layout.num_layers, *layout.block_shape[1:2], len(ids),
                              *layout.block_shape[2:]), layout.dtype)
            self.entries.append((ids, view, sink))

    def __call__(self, layer: int) -> None:
        for ids, view, sink in self.entries:
            stream_out(self.pool, ids, (layer, layer + 1), view[layer:layer + 1])
            sink.layers_ready(layer, layer + 1)
