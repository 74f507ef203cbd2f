"""Allowed-token bitmasks applied to logits rows in C++ (kernels/csrc/token_masks.cpp), rows across threads.

``MaskKernel.apply`` sets to -inf every logit that a row's bitmask does not
allow, in place, for many rows in one call: what a step's structured-output
rows need before sampling (engine/structured/masks.py). Through numpy the
same work unpacks the bits into a [R, V] byte array and writes through it,
several times the cost of the step's masks themselves.

Contract, per row (the bitmask layout is llguidance's: ``ceil(V / 32)``
int32 words, bit ``i`` of word ``j`` allows token ``32 j + i``):

- an allowed token's logit is unchanged, bit for bit; every other token of
  the row, ids past the bitmask's words included, becomes -inf;
- the answer says whether any token below V is allowed;
- rows are independent: the result does not depend on the other rows or the
  thread count.

Builds follow kernels/quant_linear.py's variants (``host_variant``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from kernels import native
from kernels.quant_linear import KernelBuild

LIBRARY = "token_masks"


class MaskKernel(KernelBuild):
    """One loaded build of csrc/token_masks.cpp. Construct with :meth:`load` or :meth:`create`."""

    LIBRARY = LIBRARY
    WHAT = "token mask kernel"

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        native.require_variant(lib, "kvd_token_masks_variant", LIBRARY, variant)
        self.variant = variant
        i64 = ctypes.c_int64
        self._apply = lib.kvd_token_masks
        self._apply.restype = None
        self._apply.argtypes = [ctypes.c_void_p, i64, i64, ctypes.POINTER(i64), i64, ctypes.c_void_p, i64,
                                ctypes.POINTER(ctypes.c_uint8), ctypes.c_int]

    def apply(self, logits: torch.Tensor, rows: Sequence[int], bitmask: np.ndarray,
              num_threads: int | None = None) -> list[bool]:
        """Mask ``rows[r]`` of ``logits`` (fp32 [B, V], unit column stride) by
        ``bitmask[r]`` (C-contiguous int32 [len(rows), W]), in place; whether each
        row has an allowed token left. Threads: torch's by default. ValueError for
        arguments that do not fit."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError(f"apply: logits must be fp32 [B, V] with unit column stride, got "
                             f"{logits.dtype} {list(logits.shape)} strides {logits.stride()}")
        n = len(rows)
        if (bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != n
                or not bitmask.flags["C_CONTIGUOUS"]):
            raise ValueError(f"apply: the bitmask must be C-contiguous int32 [{n}, W], got {bitmask.dtype} "
                             f"{list(bitmask.shape)}")
        b, v = logits.shape
        if not all(0 <= r < b for r in rows):
            raise ValueError(f"apply: a row outside [0, {b})")
        if n == 0:
            return []
        allowed = (ctypes.c_uint8 * n)()
        self._apply(logits.data_ptr(), logits.stride(0), v, (ctypes.c_int64 * n)(*rows), n, bitmask.ctypes.data,
                    bitmask.shape[1], allowed, torch.get_num_threads() if num_threads is None else num_threads)
        return [bool(a) for a in allowed]
