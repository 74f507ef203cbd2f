"""Blocked causal prefill attention with an online softmax, in C++ (csrc/prefill_attention.cpp).

``PrefillAttention.attend(q, k, v, scale)`` is causal attention of a sequence's
new tokens (queries at positions ``S - T .. S - 1``) over its keys ``0 .. S - 1``:
the query heads of one KV head together (GQA), keys in blocks of 128 with a
running max and sum (flash attention's online softmax), so no ``[H, T, S]``
score matrix is ever made. Where torch's CPU SDPA takes its math path (it does
for ``enable_gqa``), that matrix and its softmax cost more than the matmuls at
1,024 tokens (tools/bench/engine/bench_prefill.py, docs/benchmarks.md).

Contract, for q fp32 [T, H, hd] and k, v fp32 [S, KVH, hd]:

- agrees with ``F.scaled_dot_product_attention`` (causal, GQA) to fp32
  rounding: dot products and sums run in another order, and ``exp`` is a
  polynomial within 2 ulp (tests/kernels/test_prefill_attention.py bounds the
  difference);
- **position invariant**: a token's output depends only on its query, its
  position and the keys and values up to it, bit for bit (up to the sign of a
  zero), not on T, on how the prompt was split (a cached prefix, chunks), on
  the other sequences of the step or on the thread count (the .cpp header says
  why);
- ``hd`` must be a multiple of 32 (``attend`` refuses others; the caller then
  uses torch).

Builds follow the quantized-weights kernel's variants (AVX-512, AVX2 + FMA,
portable for tests), chosen by ``kernels.quant_linear.host_variant``.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native
from kernels.quant_linear import KernelBuild

LIBRARY = "prefill_attention"


class PrefillAttention(KernelBuild):
    """One loaded build of csrc/prefill_attention.cpp. Construct with :meth:`load` or :meth:`create`."""

    LIBRARY = LIBRARY
    WHAT = "prefill attention kernel"

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        native.require_variant(lib, "kvd_attention_variant", LIBRARY, variant)
        self.variant = variant
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._attend = lib.kvd_prefill_attention
        self._attend.restype = ctypes.c_int
        self._attend.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i32, i32, i32, ctypes.c_float,
                                 i32]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
        """q [T, H, hd], k and v [S, KVH, hd] (S >= T; the queries are the last T
        positions) -> [T, H, hd] in q's dtype, computed in fp32. None (nothing
        computed) for a shape the kernel does not take.

        fp32 inputs whose token rows are strided views (a token's heads contiguous:
        q and k as views into the qkv projection's rows) are read in place; others are
        copied first. ``out``: an fp32 [T, H, hd] to write into, the same layout rule
        (e.g. rows of a batch's output); then it is what is returned."""
        if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
            return None
        T, H, hd = q.shape
        S, kvh = k.shape[0], k.shape[1]
        if k.shape[2] != hd or S < T or H % kvh or hd % 32:
            return None
        if out is not None and (out.shape != q.shape or out.dtype != torch.float32 or not _rows_of_heads(out)):
            raise ValueError(f"out must be fp32 {list(q.shape)} with contiguous heads, got {out.dtype} "
                             f"{list(out.shape)} strides {out.stride()}")
        qf, kf, vf = (t if t.dtype == torch.float32 and _rows_of_heads(t) else t.float().contiguous()
                      for t in (q, k, v))
        dst = out if out is not None else torch.empty(T, H, hd, dtype=torch.float32)
        rc = self._attend(qf.data_ptr(), _row_stride(qf), kf.data_ptr(), _row_stride(kf), vf.data_ptr(),
                          _row_stride(vf), dst.data_ptr(), _row_stride(dst), T, S, H, kvh, hd, scale,
                          torch.get_num_threads())
        if rc != 0:
            return None
        return dst if q.dtype == torch.float32 or out is not None else dst.to(q.dtype)


def _rows_of_heads(t: torch.Tensor) -> bool:
    """Whether t [N, heads, hd]'s rows are each heads * hd contiguous floats (rows may be
    any stride apart, not overlapping)."""
    n, heads, hd = t.shape
    return t.stride(2) == 1 and t.stride(1) == hd and (n <= 1 or t.stride(0) >= heads * hd)


def _row_stride(t: torch.Tensor) -> int:
    """Floats between t's rows (a single row: its own length)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1] * t.shape[2]
