"""DéjàVuLib for kvd (DéjàVu §4.1): moving KV between a pool's blocks and
contiguous buffers, by layer, with few large copies.

- ``staging``: reusable contiguous CPU buffers (``StagingPool``), so a stream
  neither allocates nor page-faults per transfer.
- ``layers``: ``stream_out`` (gather layers of a non-contiguous block region
  into a staging buffer, one copy per run of consecutive block ids, never one
  per block) and ``stream_in`` (the inverse, into a destination region of
  another layout: the source's leading blocks the destination already holds
  are skipped), and ``LayerStreamer``, the hook a prefill step calls after
  each layer so that a prompt's KV leaves while the next layer computes.
- ``KVSink``: what a layer streamer hands layers to (kvd's ``LayerSender``
  sends them to a decode node).

Every copy goes through MemPool's verbs (``gather_blocks``, ``Region.fill``):
this package never holds a KV tensor of its own beyond the staging buffers.
"""

from engine.stream.layers import KVSink, LayerStreamer, stream_in, stream_out
from engine.stream.staging import STAGING, StagingPool

__all__ = ["KVSink", "LayerStreamer", "STAGING", "StagingPool", "stream_in", "stream_out"]
