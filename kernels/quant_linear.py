"""Linear layers over GGUF block-quantized weights, computed without a dequantized copy.

``QuantLinear(x)`` is ``x @ W.T`` for a ``W`` kept in its GGUF blocks
(kernels/quant.py). With a ``QuantKernel`` it runs the C++ kernel
(kernels/csrc/quant_matmul.cpp): each row of x quantized per 32-block to 16
bits, an exact integer dot per block of weights, one fixed fp32 chain per
output; OpenMP threads over groups of 8 output rows. Without one it is the
torch reference: dequantize, then an fp32 matmul (tests and the fallback of a
host without a kernel).

Contract of the kernel path, for ``x`` [M, K] -> ``y`` [M, N]:

- the weights it multiplies by are exactly ``W.dequantize()`` (gguf-py's
  values, the ``weights = "dequantize"`` path's); x is rounded to
  ``amax / 32767`` of its 32-block (half that at most per element: finer than
  bf16 for every element within 2^7 of its block's largest);
- **batch invariant, bit for bit**: row m of y depends only on row m of x —
  not on M, the other rows or the thread count — because every output is an
  exact integer dot per block then one fixed fp32 sequence (see the .cpp
  header) run by one thread, whichever path the batch size picks (one row in
  registers, or groups of W widened once for a chunk of rows); so a prompt's
  tokens get the same bits in a prefill of any length as one at a time, and a
  sequence the same logits alone as in a decode batch;
- the same bits on every build (AVX2, AVX-512, AVX-512 VNNI, AMX, portable);
- against the exact product of x and the dequantized weights it is within
  the bound tests/kernels/test_quant_linear.py states (x's rounding plus the
  fp32 chain's).

Builds are chosen at start-up from /proc/cpuinfo (``host_variant``): AMX (where
Linux grants this process the tile state), then AVX-512 VNNI, then AVX-512, else
AVX2 + FMA + F16C; each is compiled once by
kernels/native.py (``make install``). A CPU with none gets no kernel: the
engine then serves dequantized weights (engine/engine.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable
from typing import Self

import torch
import torch.nn.functional as F

from kernels import native
from kernels.quant import X8, QuantTensor
from kernels.weight_arena import WeightArena

log = logging.getLogger(__name__)

LIBRARY = "quant_matmul"
_COMMON = ("-ffp-contract=off",)        # the source spells out every fma; let the compiler add none
_PRESSURE = ("-fschedule-insns", "-fsched-pressure")      # native.GCC_ONLY_FLAGS
# variant -> (CPU flags it needs, compiler flags); preferred first
_VNNI = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c", *_COMMON)
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # 16 rows of x or more (prefill, batched decode) on the AMX tile unit: int8 tile dots that
    # give the same integers (quant_gemm.h, the tile path); fewer as avx512vnni
    "avx512amx": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c", "amx_tile", "amx_int8"),
                  (*_VNNI, "-mamx-tile", "-mamx-int8")),
    # vpdpwssd in place of pmaddwd + add: the same integers
    "avx512vnni": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"),
                   _VNNI),
    "avx512": (("avx512f", "avx512bw", "fma", "f16c"), ("-mavx512f", "-mavx512bw", "-mfma", "-mf16c", *_COMMON)),
    # GCC's pre-allocation scheduler, register pressure in mind: with 16 vector registers its
    # default order spills the one-row matmul's accumulators every block (quant_gemm.h); decode
    # steps and prefills measured faster with it on Zen 3 (docs/benchmarks.md, design measurements)
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", *_PRESSURE, *_COMMON)),
    # scalar integers and fmaf: the arithmetic's definition, far too slow to serve (tests only)
    "portable": ((), _COMMON),
    # the avx2 build with the AMX tile path, its tile instructions emulated in scalar code
    # (csrc/amx_tiles.h): tests the tile path's layout on any host; far too slow to serve
    "amxemu": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", "-DKVD_AMX_EMULATE", *_PRESSURE, *_COMMON)),
}
SERVING_VARIANTS = ("avx512amx", "avx512vnni", "avx512", "avx2")
# The pressure-aware scheduler for these builds' many-row GEMM (this library) alone: on a
# Cascade Lake Xeon it made a prefill's matmuls faster and a decode step (plan_decode's
# one-row path) slower (docs/benchmarks.md, design measurements)
_GEMM_ONLY: dict[str, tuple[str, ...]] = {"avx512vnni": _PRESSURE, "avx512": _PRESSURE}


def library_flags(library: str, variant: str) -> tuple[str, ...]:
    """The compiler flags of ``library``'s (a kernels/csrc name) ``variant`` build:
    ``VARIANTS[variant]``'s, plus any this library alone takes."""
    return VARIANTS[variant][1] + (_GEMM_ONLY.get(variant, ()) if library == LIBRARY else ())


def runs_here(variant: str, flags: Iterable[str] | None = None) -> bool:
    """Whether this CPU (``flags`` default: /proc/cpuinfo's) runs ``variant``'s build."""
    return set(VARIANTS[variant][0]) <= set(native.cpu_flags() if flags is None else flags)


# Caps the build host_variant picks at the named one (a SERVING_VARIANTS key), as torch's
# ATEN_CPU_CAPABILITY caps its kernels: to compare builds on one CPU, or to step around one.
CAPABILITY_ENV = "KVD_CPU_CAPABILITY"


def host_variant(flags: Iterable[str] | None = None) -> str | None:
    """The fastest serving build this CPU runs (``flags`` default: /proc/cpuinfo's), or None.
    ``$KVD_CPU_CAPABILITY`` (read only for the host's own flags) caps it: the fastest build
    that is no faster than the one it names; an unknown name is logged and ignored."""
    have = set(native.cpu_flags() if flags is None else flags)
    order = SERVING_VARIANTS
    cap = os.environ.get(CAPABILITY_ENV, "") if flags is None else ""
    if cap in SERVING_VARIANTS:
        order = SERVING_VARIANTS[SERVING_VARIANTS.index(cap):]
    elif cap:
        log.warning("%s=%s ignored: not one of %s", CAPABILITY_ENV, cap, ", ".join(SERVING_VARIANTS))
    return next((v for v in order if runs_here(v, have)), None)


class KernelBuild:
    """A library of kernels/csrc built once per variant (``VARIANTS``): a subclass names its
    ``LIBRARY`` and what it is (``WHAT``, for the log) and is constructed from a loaded
    library and the variant it was built as."""

    LIBRARY: str
    WHAT: str

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        raise NotImplementedError

    @classmethod
    def load(cls, variant: str) -> Self:
        """Build (if needed) and load ``variant``. Raises BuildError or OSError."""
        return cls(native.load(cls.LIBRARY, library_flags(cls.LIBRARY, variant)), variant)

    @classmethod
    def create(cls) -> Self | None:
        """This host's serving build (``host_variant``), or None (logged) when the CPU has
        no variant or the build fails."""
        variant = host_variant()
        if variant is None:
            log.info("no %s for this CPU (needs AVX2, FMA and F16C)", cls.WHAT)
            return None
        try:
            return cls.load(variant)
        except (native.BuildError, OSError) as exc:
            log.warning("%s (%s) unavailable: %s", cls.WHAT, variant, exc)
            return None


class QuantKernel(KernelBuild):
    """One loaded build of csrc/quant_matmul.cpp. Construct with :meth:`load` or :meth:`create`."""

    LIBRARY = LIBRARY
    WHAT = "quantized-weights kernel"

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        native.require_variant(lib, "kvd_quant_variant", LIBRARY, variant)
        self.variant = variant
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._matmul = lib.kvd_quant_matmul
        self._matmul.restype = ctypes.c_int
        self._matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int]
        self._rows = lib.kvd_quant_rows
        self._rows.restype = ctypes.c_int
        self._rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]

    def matmul_into(self, w: QuantTensor, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[:, :N] = x @ w.T: w in the x8 layout (``QuantTensor.pack``); x fp32 [M, K] with
        unit column stride; y fp32 [M, >= N], unit column stride (a column slice of a
        wider output is fine)."""
        n, k = w.shape
        m = x.shape[0]
        if w.layout != X8:
            raise ValueError(f"quant matmul needs W in the x8 layout, got {w!r}")
        if (x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1
                or (m > 1 and x.stride(0) < k) or y.dtype != torch.float32 or y.dim() != 2
                or y.shape[0] != m or y.shape[1] < n or y.stride(1) != 1 or (m > 1 and y.stride(0) < n)):
            raise ValueError(f"quant matmul: x {x.dtype} {list(x.shape)} / y {list(y.shape)} do not fit "
                             f"W {list(w.shape)}")
        rc = self._matmul(w.fmt.code, w.data.data_ptr(), n, k, x.data_ptr(), m, x.stride(0) if m > 1 else k,
                          y.data_ptr(), y.stride(0) if m > 1 else n, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"quant matmul refused W {w!r}")

    def rows(self, w: QuantTensor, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [T, K]: rows ``ids`` (int64 [T]) of ``w`` (x8 layout) dequantized.
        ValueError for an id outside [0, rows)."""
        ids = ids.contiguous()
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError("ids must be int64 [T]")
        if w.layout != X8:
            raise ValueError(f"quant rows needs W in the x8 layout, got {w!r}")
        out = torch.empty(ids.shape[0], w.shape[1], dtype=torch.float32)
        if self._rows(w.fmt.code, w.data.data_ptr(), w.shape[0], w.shape[1], ids.data_ptr(), ids.shape[0],
                      out.data_ptr()) != 0:
            raise ValueError(f"token id out of range [0, {w.shape[0]})")
        return out


class QuantLinear:
    """``y = x @ W.T`` for a ``W`` made of row blocks (``parts``, stacked in order):
    each a ``QuantTensor``, or a float tensor ``[rows, K]`` for a part the file
    stores unquantized. Parts of one format are merged into one (one kernel call).

    ``x``: [M, K] of any float dtype; the result has x's dtype (computed in fp32,
    rounded once at the end, where a bf16 ``F.linear`` rounds). ``kernel``
    None: the torch reference (dequantize, fp32 matmul: slow, not batch
    invariant), used by tests and where no kernel loads. With a kernel the
    quantized parts are held in the kernel's x8 layout (``QuantTensor.pack``: the
    same bytes reordered, no copy kept in the file's layout), in memory taken
    from ``arena`` when one is given (kernels/weight_arena.py: huge pages).
    """

    def __init__(self, parts: list[QuantTensor | torch.Tensor], kernel: QuantKernel | None,
                 arena: WeightArena | None = None) -> None:
        merged: list[QuantTensor | torch.Tensor] = []
        for p in parts:
            last = merged[-1] if merged else None
            if (isinstance(p, QuantTensor) and isinstance(last, QuantTensor) and last.fmt == p.fmt
                    and last.shape[1] == p.shape[1]):
                merged[-1] = QuantTensor.cat_rows([last, p])
            elif isinstance(p, QuantTensor):
                merged.append(p)
            else:
                merged.append(p.to(torch.float32).contiguous())
        if kernel is not None:
            merged = [p.pack(arena) if isinstance(p, QuantTensor) else p for p in merged]
        widths = {p.shape[1] for p in merged}
        if len(widths) != 1:
            raise ValueError(f"QuantLinear parts disagree on the input width: {sorted(widths)}")
        self.parts = merged
        self.kernel = kernel
        self.in_features = widths.pop()
        self.out_features = sum(p.shape[0] for p in merged)
        # the hot path (one quantized part and a kernel): the call's constant arguments, bound once
        single = merged[0] if len(merged) == 1 and isinstance(merged[0], QuantTensor) else None
        self._fast = None if kernel is None or single is None else (
            kernel._matmul, single.fmt.code, single.data.data_ptr(), single.shape[0], single.shape[1])

    def __repr__(self) -> str:
        return f"QuantLinear({self.parts}, kernel={self.kernel and self.kernel.variant})"

    @property
    def nbytes(self) -> int:
        """Bytes of weights one call reads."""
        return sum(p.nbytes if isinstance(p, QuantTensor) else p.numel() * p.element_size() for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self(x.float()).to(x.dtype)
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"QuantLinear expects [M, {self.in_features}], got {list(x.shape)}")
        m = x.shape[0]
        if x.stride(1) != 1 or (m > 1 and x.stride(0) < self.in_features):    # e.g. an expanded row
            x = x.contiguous()
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        if self._fast is not None:
            # called ~4 times a layer a token, so no more checks than the ones above
            # (matmul_into's are implied by them)
            fn, code, w, n, k = self._fast
            if fn(code, w, n, k, x.data_ptr(), m, x.stride(0) if m > 1 else k, y.data_ptr(), n,
                  torch.get_num_threads()) != 0:
                raise ValueError(f"quant matmul refused {self!r}")
            return y
        kernel = self.kernel
        at = 0
        for p in self.parts:
            n = p.shape[0]
            if not isinstance(p, QuantTensor):
                y[:, at:at + n] = x @ p.t()
            elif kernel is not None:
                kernel.matmul_into(p, x, y[:, at:at + n])
            else:
                y[:, at:at + n] = x @ p.dequantize().t()
            at += n
        return y

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as fp32 [T, K] (W read as an embedding table); exact."""
        if len(self.parts) != 1:
            raise ValueError("an embedding table is one tensor")
        w = self.parts[0]
        if not isinstance(w, QuantTensor):
            return F.embedding(ids, w)
        if self.kernel is not None:
            return self.kernel.rows(w, ids)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0]):
            raise ValueError(f"token id out of range [0, {w.shape[0]})")
        return w.dequantize_rows(ids)
