"""Log-probability summaries of logits rows in C++ (kernels/csrc/logprob_rows.cpp), rows across threads.

``LogprobKernel.summarize`` answers, for each asked row of fp32 logits
[B, V], the row's log-sum-exp (in double) and its ``k`` largest logits as
log probabilities (``logit - lse``, rounded to float32) with their token ids,
in two passes over the row and without writing a [B, V] ``log_softmax``:
what a step's ``logprobs`` / ``top_logprobs`` need (engine/logprobs.py).

Contract, per row:

- ``lse`` within a few float32 ulps of ``torch.logsumexp`` of the row (the
  exponentials are simd.h's, within 2 ulp; the sum runs in double), so each
  logprob is within 1e-5 of ``torch.log_softmax``'s;
- the top list is ``torch.topk``'s set, largest first, ties broken by the
  smaller token id;
- **row invariant, bit for bit**: a row's answer depends on its logits alone,
  not on the other rows or the thread count; the same bits on every build
  (AVX-512, AVX2);
- a row holding a NaN or +inf, with every logit -inf, or with fewer than
  ``k`` logits above -inf is reported as not summarized (None): the caller
  answers it with torch.

Builds follow kernels/quant_linear.py's variants (``host_variant``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels import native
from kernels.quant_linear import KernelBuild

LIBRARY = "logprob_rows"


class RowSummary(NamedTuple):
    """One row's log-sum-exp and its top ``k`` (token id, logprob), largest first."""

    lse: float
    top: tuple[tuple[int, float], ...]


class LogprobKernel(KernelBuild):
    """One loaded build of csrc/logprob_rows.cpp. Construct with :meth:`load` or :meth:`create`."""

    LIBRARY = LIBRARY
    WHAT = "logprob kernel"

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        native.require_variant(lib, "kvd_logprob_rows_variant", LIBRARY, variant)
        self.variant = variant
        lib.kvd_logprob_rows_max_top.restype = ctypes.c_int
        self.max_top = int(lib.kvd_logprob_rows_max_top())
        i64, p64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
        self._summarize = lib.kvd_logprob_rows
        self._summarize.restype = None
        self._summarize.argtypes = [ctypes.c_void_p, i64, i64, p64, i64, ctypes.c_int,
                                    ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_float), p64,
                                    ctypes.POINTER(ctypes.c_uint8), ctypes.c_int]

    def summarize(self, logits: torch.Tensor, rows: Sequence[int], k: int,
                  num_threads: int | None = None) -> list[RowSummary | None]:
        """``RowSummary`` of each ``rows[r]`` of ``logits`` (fp32 [B, V], unit column
        stride) with its ``k`` (0 <= k <= ``max_top``) largest logits; None for a row
        the kernel does not summarize (the module docstring's bad rows). Threads:
        torch's by default. ValueError for arguments that do not fit."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError(f"summarize: logits must be fp32 [B, V] with unit column stride, got "
                             f"{logits.dtype} {list(logits.shape)} strides {logits.stride()}")
        b, v = logits.shape
        if not 0 <= k <= min(self.max_top, v) or not all(0 <= r < b for r in rows):
            raise ValueError(f"summarize: k = {k} outside [0, {min(self.max_top, v)}] or a row outside [0, {b})")
        n = len(rows)
        if n == 0:
            return []
        lse = (ctypes.c_double * n)()
        top_v = (ctypes.c_float * max(1, n * k))()
        top_i = (ctypes.c_int64 * max(1, n * k))()
        ok = (ctypes.c_uint8 * n)()
        self._summarize(logits.data_ptr(), logits.stride(0), v, (ctypes.c_int64 * n)(*rows), n, k, lse, top_v,
                        top_i, ok, torch.get_num_threads() if num_threads is None else num_threads)
        ids, values = list(top_i), list(top_v)
        return [RowSummary(lse[r], tuple(zip(ids[r * k:(r + 1) * k], values[r * k:(r + 1) * k]))) if ok[r] else None
                for r in range(n)]
