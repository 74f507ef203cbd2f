"""Reusable staging buffers: the contiguous side of a buffered copy.

A buffer is flat CPU bytes; ``acquire`` hands out the smallest free buffer
that fits (or a new one) viewed with the requested shape and dtype, and
``release`` keeps it for the next transfer, up to ``keep_bytes`` in all
(the largest are dropped first). Thread-safe: the engine thread acquires
for a streamed prefill, the event loop releases once the peer acknowledged.
"""

from __future__ import annotations

import math
import threading

import torch

STAGING_KEEP_BYTES = 1 << 30    # staging memory kept for reuse between transfers


class StagingPool:
    def __init__(self, keep_bytes: int = STAGING_KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0          # buffers created (a warm pool stops counting)

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(buffer, a contiguous view of it with ``shape``/``dtype``). Give the
        buffer back with ``release`` once nothing reads the view any more."""
        need = math.prod(shape) * dtype.itemsize
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None:
            buf = torch.empty(max(need, 1), dtype=torch.uint8)
            self.allocated += 1
        return buf, buf[:need].view(dtype).view(shape)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: -b.numel())
            while sum(b.numel() for b in self._free) > self.keep_bytes:
                self._free.pop(0)   # drop the largest first


STAGING = StagingPool()     # the process's staging buffers (KV transfers, streamed prefills)
