"""Memory for what a decode step streams, on transparent huge pages where the OS allows:
the model's packed weights (``WeightArena``) and the KV cache's CPU tiers
(``huge_page_zeros``).

A decode step streams every weight byte once (~96 MB for the bundled model), and
every key and value of its sequences (at 4,096 keys, 189 MB for the bundled
model). On 4 KiB pages that is a TLB miss every 4 KiB, and the hardware
prefetchers stop at each page boundary; on 2 MiB pages neither happens. What it
is worth is in docs/benchmarks-history.md (``tools/bench/engine/bench_decode_batch.py
--pages both``, with ``--scatter`` for the KV cache).

``WeightArena.take(n)`` hands out uint8 tensors from anonymous mappings of at
least ``CHUNK`` bytes, each aligned to 2 MiB and advised ``MADV_HUGEPAGE``
(Linux; with THP set to ``madvise`` or ``always``; elsewhere, or with THP
``never``, the same memory on ordinary pages). A mapping lives as long as any
tensor taken from it; the arena itself may be dropped once the model is built.
Untouched tails of a mapping are never faulted in, so they cost address space,
not memory.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
CHUNK = 32 << 20                    # bytes per mapping (a larger request gets its own)
ALIGN = 64                          # every tensor starts on a cache line


class WeightArena:
    """A bump allocator over 2 MiB-aligned, huge-page-advised anonymous mappings."""

    def __init__(self) -> None:
        self._chunk: mmap.mmap | None = None
        self._base = 0                  # offset of the 2 MiB-aligned start in _chunk
        self._used = 0
        self._size = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 tensor of ``nbytes`` (zeroed, 64-byte aligned); raises
        ``OSError`` when the OS refuses the mapping."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._size:
            self._new_chunk(max(nbytes, CHUNK))
            start = 0
        self._used = start + nbytes
        return torch.frombuffer(self._chunk, dtype=torch.uint8, count=nbytes, offset=self._base + start)

    def _new_chunk(self, size: int) -> None:
        size = -(-size // HUGE_PAGE) * HUGE_PAGE
        # private: a shared anonymous mapping is shmem, which THP leaves alone by default
        chunk = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # room to align to 2 MiB
        address = _address(chunk)
        base = -address % HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                chunk.madvise(mmap.MADV_HUGEPAGE, base, size)
            except OSError:                                 # THP off in this kernel: ordinary pages
                pass
        self._chunk, self._base, self._used, self._size = chunk, base, 0, size


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` and ``dtype`` in its own 2 MiB-aligned,
    huge-page-advised mapping (the OS zeroes pages on first touch, so untouched
    parts cost no memory); raises ``OSError`` when the OS refuses the mapping."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return WeightArena().take(nbytes).view(dtype).view(shape)


def _address(chunk: mmap.mmap) -> int:
    """The virtual address where ``chunk`` starts."""
    return torch.frombuffer(chunk, dtype=torch.uint8, count=1).data_ptr()
