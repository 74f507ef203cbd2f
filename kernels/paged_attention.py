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

DistAttention (Infinite-LLM §4.2, kernels/dist_attention.py): ``partials``
computes, for the rows of a step, the per-chunk results (max, sum of
exponentials, weighted values) of the key chunks one part of a sequence's KV
holds, without combining them; ``combine`` combines a row's chunks, gathered
from every part in chunk order, into its output. Parts cut at 128-key chunk
boundaries leave every chunk's results the unsplit kernel's bits, so
``combine`` over all parts returns ``attend``'s output bit for bit: one
arithmetic per token holds with the KV in any number of parts.

Builds follow kernels/quant_linear.py's variants (``host_variant``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels import native
from kernels.dist_attention import Partials
from kernels.quant_linear import KernelBuild

LIBRARY = "paged_attention"


@dataclass(frozen=True)
class PartLayout:
    """``PagedAttention.partials``' rows and parts, checked once (``part_layout``) and kept
    as the kernel reads them: the columns of ``seqs`` and ``chunks``, contiguous int64, and
    ``tables``. For a caller that runs the same layout at every layer of a step
    (``partials_in``): a lent part's creditor. The tensors are the layout's own; the caller
    does not change them."""

    rows: int                   # T: the rows of every q it takes
    sequences: int              # S
    starts: torch.Tensor        # [S] each sequence's first row
    lens: torch.Tensor          # [S] its rows
    ctxs: torch.Tensor          # [S] its context
    lo: torch.Tensor            # [S] its part's chunks [lo, hi)
    hi: torch.Tensor
    tables: torch.Tensor        # [S, max_blocks]
    slots: int                  # C


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
        self._partials = lib.kvd_paged_attention_partials
        self._partials.restype = ctypes.c_int
        self._partials.argtypes = [ptr, i64, ptr, ptr, i32, i64, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i64, i32,
                                   i32, i32, i32, ctypes.c_float, i64, i64, ptr, ptr, ptr, i32]
        self._combine = lib.kvd_attention_combine
        self._combine.restype = ctypes.c_int
        self._combine.argtypes = [ptr, ptr, ptr, i64, i32, ptr, ptr, ptr, ptr, i64, i32, i32, i64, ptr, i64, i32]

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
        if not _takes(q, k_cache, v_cache):
            return None
        T, H, hd = q.shape
        N, bs, kvh = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        _check_window(window)
        seqs, tables = _check_rows(seqs, tables, k_cache, v_cache)
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


    def partials(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: torch.Tensor,
                 tables: torch.Tensor, chunks: torch.Tensor, scale: float, slots: int,
                 window: int | None = None, threads: int = 0, out: Partials | None = None) -> Partials | None:
        """The micro-attention of one part of each sequence's KV: for every row of ``q``, the
        results of its key chunks in its sequence's part, uncombined. ``chunks``: int64 [S, 2],
        each sequence's part as chunks [lo, hi) of ``KEY_CHUNK`` keys (its keys
        [lo * KEY_CHUNK, hi * KEY_CHUNK), the last part cut at the context); ``tables`` need
        hold only the blocks of those keys. ``slots``: C, at least every part's hi - lo. Other
        arguments as :meth:`attend`'s. Returns ``Partials`` ([T, C, ...], a row's chunk c at
        slot c - lo; slots it does not attend to m = -inf, l = 0, o = 0), or None for a shape
        the kernel does not take. Raises ValueError for arguments that contradict each other.
        ``threads``: the team's size (0: torch's count). ``out``: where to write them (contiguous
        fp32 m, l [T, C, H] and o [T, C, H, hd], every element written: a reply's buffer, say),
        made when None. Safe to call from any thread (reads the caches, writes only what it
        returns)."""
        if not _takes(q, k_cache, v_cache):
            return None
        _check_window(window)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the K and V caches must be contiguous")
        return self.partials_in(self.part_layout(q.shape[0], seqs, tables, chunks, slots), q, k_cache, v_cache, scale,
                                window, threads, out)

    @staticmethod
    def part_layout(rows: int, seqs: torch.Tensor, tables: torch.Tensor, chunks: torch.Tensor,
                    slots: int) -> PartLayout:
        """``partials``' ``seqs``, ``tables``, ``chunks`` and ``slots`` for a step of ``rows``
        query rows, checked and laid out once. Raises ValueError as ``partials``."""
        if seqs.dtype != torch.int64 or tables.dtype != torch.int64 or seqs.dim() != 2 or seqs.shape[1] != 3 \
                or tables.dim() != 2 or tables.shape[0] != seqs.shape[0]:
            raise ValueError("seqs must be int64 [S, 3] and tables int64 [S, max_blocks]")
        if chunks.dtype != torch.int64 or chunks.shape != (seqs.shape[0], 2):
            raise ValueError("chunks must be int64 [S, 2]")
        seqs, chunks = seqs.contiguous(), chunks.contiguous()
        return PartLayout(rows, seqs.shape[0], seqs[:, 0].contiguous(), seqs[:, 1].contiguous(),
                          seqs[:, 2].contiguous(), chunks[:, 0].contiguous(), chunks[:, 1].contiguous(),
                          tables.contiguous(), slots)

    @property
    def partials_address(self) -> int:
        """The address of this build's ``kvd_paged_attention_partials`` (csrc/paged_attention.cpp),
        for a native caller (csrc/ring_lane.cpp) that keeps this object alive meanwhile."""
        return ctypes.cast(self._partials, ctypes.c_void_p).value

    def partials_in(self, layout: PartLayout, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    scale: float, window: int | None = None, threads: int = 0,
                    out: Partials | None = None) -> Partials | None:
        """``partials`` over a ``part_layout``: the same contract, the layout's checks not
        made again (q's rows must be its ``rows``)."""
        if not _takes(q, k_cache, v_cache):
            return None
        T, H, hd = q.shape
        slots = layout.slots
        _check_window(window)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the K and V caches must be contiguous")
        if T != layout.rows:
            raise ValueError(f"{T} query rows, the layout has {layout.rows}")
        qf = q if _rows_of_heads(q) else q.contiguous()
        if out is None:
            out = Partials(torch.empty(T, slots, H), torch.empty(T, slots, H), torch.empty(T, slots, H, hd))
        elif (out.m.shape != (T, slots, H) or out.l.shape != (T, slots, H) or out.o.shape != (T, slots, H, hd)
              or not (out.m.dtype == out.l.dtype == out.o.dtype == torch.float32)
              or not (out.m.is_contiguous() and out.l.is_contiguous() and out.o.is_contiguous())):
            raise ValueError(f"out must be contiguous fp32 m, l {[T, slots, H]} and o {[T, slots, H, hd]}")
        tables = layout.tables
        rc = self._partials(qf.data_ptr(), _row_stride(qf), k_cache.data_ptr(), v_cache.data_ptr(),
                            int(k_cache.dtype == torch.float16), k_cache.shape[0], layout.sequences,
                            layout.starts.data_ptr(), layout.lens.data_ptr(), layout.ctxs.data_ptr(),
                            layout.lo.data_ptr(), layout.hi.data_ptr(), tables.data_ptr(),
                            tables.shape[1], T, H, k_cache.shape[2], hd, k_cache.shape[1], scale, window or 0, slots,
                            out.m.data_ptr(), out.l.data_ptr(), out.o.data_ptr(), threads or torch.get_num_threads())
        if rc != 0:
            raise ValueError("a part is empty or wider than the slots, a sequence's rows do not fit the step, "
                             "or a block id of the part is out of range")
        return out

    def combine(self, parts: Partials, seqs: torch.Tensor, chunk_lo: torch.Tensor,
                window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's attention from its chunks' results gathered from every part (``parts``:
        [T, C, ...], a row of sequence s holding chunk c at slot c - chunk_lo[s]), combined in
        chunk order: :meth:`attend`'s output, bit for bit, when the slots hold every chunk the
        row attends to. ``seqs`` and ``window`` as :meth:`attend`'s; ``chunk_lo`` int64 [S].
        Returns ``out`` (fp32 [T, H, hd], made when None). Raises ValueError for a row whose
        chunks fall outside its slots, or shapes that do not match."""
        T, C, H, hd = parts.o.shape
        _check_window(window)
        if parts.m.shape != (T, C, H) or parts.l.shape != (T, C, H) or not all(
                t.dtype == torch.float32 and t.is_contiguous() for t in (parts.m, parts.l, parts.o)):
            raise ValueError("partials must be contiguous fp32 m, l [T, C, H] and o [T, C, H, hd]")
        seqs, chunk_lo = seqs.contiguous(), chunk_lo.contiguous()
        if seqs.dtype != torch.int64 or seqs.dim() != 2 or seqs.shape[1] != 3 or chunk_lo.dtype != torch.int64 \
                or chunk_lo.shape != (seqs.shape[0],):
            raise ValueError("seqs must be int64 [S, 3] and chunk_lo int64 [S]")
        if out is None:
            out = torch.empty(T, H, hd, dtype=torch.float32)
        elif out.shape != (T, H, hd) or out.dtype != torch.float32 or not _rows_of_heads(out):
            raise ValueError(f"out must be fp32 {[T, H, hd]} with contiguous heads")
        starts, lens, ctxs = seqs[:, 0].contiguous(), seqs[:, 1].contiguous(), seqs[:, 2].contiguous()
        rc = self._combine(parts.m.data_ptr(), parts.l.data_ptr(), parts.o.data_ptr(), C, seqs.shape[0],
                           starts.data_ptr(), lens.data_ptr(), ctxs.data_ptr(), chunk_lo.data_ptr(), T, H, hd,
                           window or 0, out.data_ptr(), _row_stride(out), torch.get_num_threads())
        if rc != 0:
            raise ValueError("a row's chunks fall outside its slots, or its sequence does not fit the step")
        return out


def _takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes (``attend``'s None cases)."""
    if q.dim() != 3 or q.dtype != torch.float32 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        return False
    if k_cache.dtype not in (torch.float32, torch.float16) or v_cache.dtype != k_cache.dtype:
        return False
    H, hd, kvh = q.shape[1], q.shape[2], k_cache.shape[2]
    return k_cache.shape[3] == hd and H % kvh == 0 and hd % 16 == 0 and hd <= 256


def _check_window(window: int | None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")


def _check_rows(seqs: torch.Tensor, tables: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs, tables made contiguous, after the checks ``attend`` makes of them and the caches."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K and V caches must be contiguous")
    seqs, tables = seqs.contiguous(), tables.contiguous()
    if seqs.dtype != torch.int64 or tables.dtype != torch.int64 or seqs.dim() != 2 or seqs.shape[1] != 3 \
            or tables.dim() != 2 or tables.shape[0] != seqs.shape[0]:
        raise ValueError("seqs must be int64 [S, 3] and tables int64 [S, max_blocks]")
    return seqs, tables


def _rows_of_heads(t: torch.Tensor) -> bool:
    """Whether t [N, heads, hd]'s rows are each heads * hd contiguous floats (rows may be
    any stride apart, not overlapping)."""
    n, heads, hd = t.shape
    return t.stride(2) == 1 and t.stride(1) == hd and (n <= 1 or t.stride(0) >= heads * hd)


def _row_stride(t: torch.Tensor) -> int:
    """Floats between t's rows (a single row: its own length)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1] * t.shape[2]
