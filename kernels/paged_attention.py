"""Attention over paged KV in the plan executor's arithmetic, for the torch path (csrc/paged_attention.cpp).

``PagedAttention.attend`` computes, for every query row of a step (a prefill's
chunk rows, a decode batch's rows, or both), causal attention over its
sequence's keys as they sit in the KV cache (on a sliding layer of window W,
the row at position p over keys max(0, p - W + 1)..p, as
``kernels.attention.window_mask``): the functions the plan executor's
decode step runs for a row (csrc/attention_rows.h), keys cut into chunks by
the row's position alone (fixed 128-key places, the first cut at the
window's start), each chunk's max, sum of exponentials and
weighted values combined in chunk order.

Contract, for rotated fp32 queries q [T, H, hd] and a layer's caches
[N, bs, KVH, hd] of fp32 or float16 (``kv_cache_dtype``), keys already written:

- **one arithmetic per token**: row r's output depends only on its query, its
  position and its sequence's cached keys and values up to it, bit for bit:
  not on how many rows the step has, which chunk of a prompt the row is in,
  whether the keys before it were prefilled or decoded, the thread count or
  the build; and it equals the plan executor's (kernels/plan_decode.py) for
  the same token. So a token prefilled and the same token decoded leave the
  same K/V in the next layer and the same logits;
- agrees with ``F.scaled_dot_product_attention`` to fp32 rounding;
- ``hd`` a multiple of 16 up to 256 and H a multiple of KVH (``attend``
  returns None for others: the caller then uses torch).

Builds follow kernels/quant_linear.py's variants (``host_variant``).
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native
from kernels.quant_linear import KernelBuild

LIBRARY = "paged_attention"


class PagedAttention(KernelBuild):
    """One loaded build of csrc/paged_attention.cpp. Construct with :meth:`load` or :meth:`create`."""

    LIBRARY = LIBRARY
    WHAT = "paged attention kernel"

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        native.require_variant(lib, "kvd_paged_attention_variant", LIBRARY, variant)
        self.variant = variant
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._attend = lib.kvd_paged_attention
        self._attend.restype = ctypes.c_int
        self._attend.argtypes = [ptr, i64, ptr, ptr, i32, i64, i32, ptr, ptr, ptr, ptr, i32, i64, i32, i32, i32,
                                 i32, ctypes.c_float, i64, ptr, i64, i32]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: torch.Tensor,
               tables: torch.Tensor, scale: float, out: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor | None:
        """Attention of every row of ``q`` (fp32 [T, H, hd], a row's heads contiguous: views into
        wider rows are read in place) over the caches (fp32 or float16 [N, bs, KVH, hd],
        contiguous). ``seqs``: int64 [S, 3], each sequence's (first row, rows, context length:
        the keys of its last row); its rows sit at the last positions of its context.
        ``tables``: int64 [S, max_blocks], each sequence's block table. ``window``: the layer's
        sliding window in keys (None: every key up to the row's). Returns ``out`` (fp32
        [T, H, hd], made when None), or None (nothing computed) for a shape the kernel does not
        take. Raises ValueError for arguments that contradict each other."""
        if q.dim() != 3 or q.dtype != torch.float32 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
            return None
        if k_cache.dtype not in (torch.float32, torch.float16) or v_cache.dtype != k_cache.dtype:
            return None
        T, H, hd = q.shape
        N, bs, kvh = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        if k_cache.shape[3] != hd or H % kvh or hd % 16 or hd > 256:
            return None
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the K and V caches must be contiguous")
        seqs, tables = seqs.contiguous(), tables.contiguous()
        if seqs.dtype != torch.int64 or tables.dtype != torch.int64 or seqs.dim() != 2 or seqs.shape[1] != 3 \
                or tables.dim() != 2 or tables.shape[0] != seqs.shape[0]:
            raise ValueError("seqs must be int64 [S, 3] and tables int64 [S, max_blocks]")
        qf = q if _rows_of_heads(q) else q.contiguous()
        if out is None:
            out = torch.empty(T, H, hd, dtype=torch.float32)
        elif out.shape != q.shape or out.dtype != torch.float32 or not _rows_of_heads(out):
            raise ValueError(f"out must be fp32 {list(q.shape)} with contiguous heads")
        starts, lens, ctxs = seqs[:, 0].contiguous(), seqs[:, 1].contiguous(), seqs[:, 2].contiguous()
        rc = self._attend(qf.data_ptr(), _row_stride(qf), k_cache.data_ptr(), v_cache.data_ptr(),
                          int(k_cache.dtype == torch.float16), N, seqs.shape[0], starts.data_ptr(), lens.data_ptr(),
                          ctxs.data_ptr(), tables.data_ptr(), tables.shape[1], T, H, kvh, hd, bs, scale,
                          window or 0, out.data_ptr(), _row_stride(out), torch.get_num_threads())
        if rc != 0:
            raise ValueError("a sequence's rows or context do not fit the step, or a block id is out of range")
        return out


def _rows_of_heads(t: torch.Tensor) -> bool:
    """Whether t [N, heads, hd]'s rows are each heads * hd contiguous floats (rows may be
    any stride apart, not overlapping)."""
    n, heads, hd = t.shape
    return t.stride(2) == 1 and t.stride(1) == hd and (n <= 1 or t.stride(0) >= heads * hd)


def _row_stride(t: torch.Tensor) -> int:
    """Floats between t's rows (a single row: its own length)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1] * t.shape[2]
