"""A decoder layer's row-local ops in C++ for many rows at once (a prefill's tokens).

``LlamaModel.forward`` runs ``LAYER_STEPS`` op by op; for fp32 activations it
hands the row-local ones to a ``RowOps`` (kernels/csrc/row_ops.cpp): RMSNorm,
SwiGLU's ``silu(gate) * up``, GeGLU's ``gelu(gate) * up`` and RoPE, each one C++ call over every row
instead of two to six torch ops. These are the very functions the decode-plan
executor runs per row (kernels/csrc/row_ops.h), so a token's norm, SwiGLU and
RoPE get the same bits in a prefill as in a plan decode step.

Contract, for fp32 inputs:

- ``rms_norm``: HF LlamaRMSNorm, the mean of squares in a fixed order (not
  torch's: equal to ``engine.model.llama.rms_norm`` to fp32 rounding);
- ``silu_mul``: ``silu(x[:, :I]) * x[:, I:]`` with its own exp (to fp32
  rounding of torch's);
- ``gelu_mul``: ``gelu(x[:, :I]) * x[:, I:]``, GELU's tanh approximation as
  ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))`` with the same exp (to fp32
  rounding of ``F.gelu(approximate="tanh")``);
- ``rope``: ``apply_rope`` bit for bit (the same three roundings);
- **batch invariant, bit for bit**: row m of a result depends on row m of
  the input alone, not on the row count or the thread count; the same bits
  on every build (AVX-512, AVX2, portable).

Builds follow kernels/quant_linear.py's variants (``host_variant``).
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native
from kernels.quant_linear import KernelBuild

LIBRARY = "row_ops"
# A float matrix's element type by dtype, as the C++ names it (dense_gemm.h's FMT_F32, FMT_BF16,
# FMT_F16): kvd_dense_matmul's fmt and the plan executor's PlanWeight.format
DENSE_FORMATS = {torch.float32: 16, torch.bfloat16: 17, torch.float16: 18}


def _rows(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """x as fp32 [M, width] with unit column stride (a view where it already is one)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{what}: expects fp32 [M, {width}], got {x.dtype} {list(x.shape)}")
    return x if x.stride(1) == 1 and (x.shape[0] <= 1 or x.stride(0) >= width) else x.contiguous()


class RowOps(KernelBuild):
    """One loaded build of csrc/row_ops.cpp. Construct with :meth:`load` or :meth:`create`."""

    LIBRARY = LIBRARY
    WHAT = "row ops kernel"

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        native.require_variant(lib, "kvd_row_ops_variant", LIBRARY, variant)
        self.variant = variant
        ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._norm = lib.kvd_rms_norm_rows
        self._norm.restype = None
        self._norm.argtypes = [ptr, i64, ptr, i64, i64, f32, ptr, i32]
        self._silu = lib.kvd_silu_mul_rows
        self._silu.restype = None
        self._silu.argtypes = [ptr, i64, i64, ptr, i32]
        self._gelu = lib.kvd_gelu_mul_rows
        self._gelu.restype = None
        self._gelu.argtypes = [ptr, i64, i64, ptr, i32]
        self._rope = lib.kvd_rope_rows
        self._rope.restype = None
        self._rope.argtypes = [ptr, i64, i64, i64, i32, ptr, ptr, ptr, i32]
        self._dense = lib.kvd_dense_matmul
        self._dense.restype = None
        self._dense.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x fp32 [M, D], weight fp32 [D] -> fp32 [M, D]."""
        d = x.shape[-1]
        x = _rows(x, d, "rms_norm")
        if weight.dtype != torch.float32 or weight.shape != (d,) or not weight.is_contiguous():
            raise ValueError(f"rms_norm: weight must be fp32 [{d}], contiguous")
        out = torch.empty(x.shape[0], d, dtype=torch.float32)
        self._norm(x.data_ptr(), x.stride(0) if x.shape[0] > 1 else d, weight.data_ptr(), x.shape[0], d, eps,
                   out.data_ptr(), torch.get_num_threads())
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [M, 2I] (gate, then up) -> fp32 [M, I]: silu(gate) * up."""
        return self._gated(self._silu, x, "silu_mul")

    def gelu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [M, 2I] (gate, then up) -> fp32 [M, I]: gelu(gate) * up (tanh approximation)."""
        return self._gated(self._gelu, x, "gelu_mul")

    @staticmethod
    def _gated(fn, x: torch.Tensor, what: str) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] % 2:
            raise ValueError(f"{what}: expects [M, 2I], got {list(x.shape)}")
        x = _rows(x, x.shape[1], what).contiguous()
        i = x.shape[1] // 2
        out = torch.empty(x.shape[0], i, dtype=torch.float32)
        fn(x.data_ptr(), x.shape[0], i, out.data_ptr(), torch.get_num_threads())
        return out

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
             signed_sin: torch.Tensor) -> torch.Tensor:
        """The first ``heads`` heads of each row of x (fp32 [T, >= heads * head_dim]) rotated:
        fp32 [T, heads, head_dim]; cos, signed_sin fp32 [T, head_dim] (rope_tables' rows
        at the tokens' positions)."""
        if x.dim() != 2 or x.shape[1] < heads * head_dim or head_dim % 2:
            raise ValueError(f"rope: x {list(x.shape)} does not hold {heads} heads of {head_dim}")
        t = x.shape[0]
        x = _rows(x, x.shape[1], "rope")
        for name, table in (("cos", cos), ("signed_sin", signed_sin)):
            if table.dtype != torch.float32 or table.shape != (t, head_dim) or not table.is_contiguous():
                raise ValueError(f"rope: {name} must be fp32 [{t}, {head_dim}], contiguous")
        out = torch.empty(t, heads, head_dim, dtype=torch.float32)
        self._rope(x.data_ptr(), x.stride(0) if t > 1 else x.shape[1], t, heads, head_dim, cos.data_ptr(),
                   signed_sin.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x fp32 [M, K] @ w.T for a float matrix w [N, K] (fp32, bf16 or fp16, row-major, K a
        multiple of 16) -> fp32 [M, N]: the plan executor's dense matmul (dense_gemm.h; a
        16-bit w widened in registers), so each row gets a decode step's bits."""
        n, k = w.shape
        x = _rows(x, k, "linear")
        if w.dtype not in DENSE_FORMATS or not w.is_contiguous() or k % 16:
            raise ValueError(f"linear: w must be a contiguous fp32/bf16/fp16 [N, K] with K % 16 == 0, got "
                             f"{w.dtype} {list(w.shape)}")
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        self._dense(DENSE_FORMATS[w.dtype], w.data_ptr(), n, k, x.data_ptr(), x.stride(0) if x.shape[0] > 1 else k,
                    x.shape[0], out.data_ptr(), n, torch.get_num_threads())
        return out
