"""Random sampling of logits rows in C++ (kernels/csrc/sample_rows.cpp), rows across threads.

``RowSampler.sample`` computes ``engine.sampling``'s definition of a random
draw (temperature, top-k, top-p, inverse CDF over the kept tokens in index
order) for many rows in one call, without sorting the vocabulary: the tokens
near the row's maximum are counted into bins of 1/8 nat of weight and only
the bins the filters end in are sorted. Through torch a top-p row needs a
full ``torch.sort`` of the vocabulary; tools/bench/kernels/bench_sampling.py measures
both ways (docs/benchmarks.md, Kernels).

Contract, per row:

- the token ``engine.sampling`` defines, with weights ``e^((l - max) / T)``
  from simd.h's exp (within 2 ulp of e^x) and sums in double: top-p's
  preceding weight is summed bin by bin (each in index order) up to the bin
  the nucleus ends in, then token by token. The torch fallback (torch's exp, a
  sorted cumsum) agrees except where a boundary or a draw falls within
  rounding;
- **row invariant, bit for bit**: a row's token depends on its logits,
  parameters and uniform number alone, not on the other rows or the thread
  count; the same token on every build (AVX-512, AVX2, portable);
- ``UNSAMPLED`` (-1) for a row without a finite weight (a NaN or +inf logit,
  or every logit -inf), as the fallback answers: the caller fails that row's
  request alone.

Builds follow kernels/quant_linear.py's variants (``host_variant``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kernels import native
from kernels.quant_linear import KernelBuild

LIBRARY = "sample_rows"
UNSAMPLED = -1          # a row without a finite weight: no token


class RowSampler(KernelBuild):
    """One loaded build of csrc/sample_rows.cpp. Construct with :meth:`load` or :meth:`create`."""

    LIBRARY = LIBRARY
    WHAT = "sampling kernel"

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        native.require_variant(lib, "kvd_sample_rows_variant", LIBRARY, variant)
        self.variant = variant
        i64, p64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
        self._sample = lib.kvd_sample_rows
        self._sample.restype = None
        self._sample.argtypes = [ctypes.c_void_p, i64, i64, p64, i64, ctypes.POINTER(ctypes.c_double), p64, p64,
                                 ctypes.c_int]

    def sample(self, logits: torch.Tensor, rows: Sequence[int], temperature: Sequence[float],
               top_k: Sequence[int], top_p: Sequence[float], uniform: Sequence[float],
               num_threads: int | None = None) -> list[int]:
        """One token for each ``rows[r]`` of ``logits`` (fp32 [B, V], unit column stride),
        drawn with ``temperature[r]`` (> 0 as a float32: the kernel divides by that), ``top_k[r]``
        (an int64; <= 0 or >= V: off), ``top_p[r]`` (in (0, 1]; 1: off) and ``uniform[r]`` in
        [0, 1). Threads: torch's by default. ValueError for arguments that do not fit;
        ``UNSAMPLED`` for a row without a finite weight."""
        n = len(rows)
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError(f"sample: logits must be fp32 [B, V] with unit column stride, got "
                             f"{logits.dtype} {list(logits.shape)} strides {logits.stride()}")
        b, v = logits.shape
        if v < 1 or any(len(a) != n for a in (temperature, top_k, top_p, uniform)):
            raise ValueError(f"sample: {n} rows, {len(temperature)} temperatures, {len(top_k)} top_k, "
                             f"{len(top_p)} top_p, {len(uniform)} uniforms over a vocabulary of {v}")
        if n == 0:
            return []
        if not (all(0 <= r < b for r in rows) and all(ctypes.c_float(t).value > 0 for t in temperature)
                and all(-2**63 <= k < 2**63 for k in top_k)
                and all(0 < p <= 1 for p in top_p) and all(0 <= u < 1 for u in uniform)):
            raise ValueError("sample: a row index outside the logits, a temperature <= 0 (as a float32), a "
                             "top_k outside int64, a top_p outside (0, 1] or a uniform number outside [0, 1)")
        params = (ctypes.c_double * (3 * n))()           # temperature, top_p, u per row
        params[0::3], params[1::3], params[2::3] = temperature, top_p, uniform
        out = (ctypes.c_int64 * n)()
        self._sample(logits.data_ptr(), logits.stride(0), v, (ctypes.c_int64 * n)(*rows), n, params,
                     (ctypes.c_int64 * n)(*top_k), out, torch.get_num_threads() if num_threads is None else num_threads)
        return list(out)                                # -1 (UNSAMPLED) where a row has no finite weight
