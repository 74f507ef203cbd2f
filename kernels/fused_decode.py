"""Fused bf16 decode step: every layer and the LM head in one C++ call.

On a CPU, single-stream decode of a small model is bound by reading the
weights once per token. The torch path pays ~900 op dispatches per step and
oneDNN's bf16 gemv streams weights at about half the memory bandwidth
(docs/benchmarks-history.md); this kernel (kernels/csrc/fused_decode.cpp) streams
pre-packed weight tiles with ``_mm512_dpbf16_ps`` on all torch threads and
runs norms, RoPE, the KV write, paged attention and SwiGLU in between.

Contract of :meth:`FusedDecoder.decode` (same as ``LlamaModel.forward`` +
``compute_logits`` for a decode batch):

- one new token per sequence; writes its K/V into ``kv`` at the slot
  ``block_tables[b, pos // bs] * bs + pos % bs`` of every layer and reads
  the sequence's keys ``0..pos`` through its block table;
- returns fp32 logits [B, V] holding bf16-rounded values, like the torch path;
- **batch invariant, bit for bit**: row b depends only on sequence b's
  token, position, block table and cached K/V — not on B, the other rows or
  the thread count (fixed per-column reduction order, see the .cpp header);
- deterministic; keeps no per-request state; allocates no KV memory.

It agrees with the torch path to bf16 rounding (sums inside matmuls and
attention run in another order), not bit for bit. Prefill stays on the torch
path. The kernel writes one layer out in C++ (``LAYER``) and knows nothing of
the model it serves: engine/model/decode_kernels.py hands it a model whose
layer plan is that one, as ``FusedWeights``. :meth:`FusedDecoder.create`
returns None (and says why) where the kernel cannot run: a CPU without
AVX512-BF16, an unsupported shape, or a failed build.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native
from kernels.decode_inputs import DecodeExecutor, DecoderDims, Launch

log = logging.getLogger(__name__)

LIBRARY = "fused_decode"
TILE = 32                      # output columns per packed tile (TILE in the .cpp)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
PHASES = ("setup", "norm", "qkv", "rope_kv", "attention", "o_proj", "post_norm", "gate_up", "down",
          "lm_head")                 # enum PH_* in the .cpp
# The layer kvd_decode_step writes out in C++ (csrc/fused_decode.cpp), as the steps
# (op, src, dst, weight) of a layer plan (kernels/plan_decode.PlanStep): a model whose
# layer is another is not given to this kernel, until the kernel is taught the change.
LAYER = (
    ("rms_norm", "h", "a", "input_norm"),
    ("linear", "a", "qkv", "qkv"),
    ("rope_attention", "qkv", "o", None),
    ("linear_add", "o", "h", "o"),
    ("rms_norm", "h", "m", "post_norm"),
    ("linear", "m", "gu", "gate_up"),
    ("silu_mul", "gu", "act", None),
    ("linear_add", "act", "h", "down"),
)
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def cpu_unsupported_reason() -> str | None:
    """Why this CPU cannot run the kernel, or None if it can."""
    missing = [f for f in REQUIRED_FLAGS if f not in native.cpu_flags()]
    return f"CPU lacks {', '.join(missing)}" if missing else None


@dataclass(frozen=True)
class LayerWeights:
    """One layer's bf16 weights, the matrices [out, in] (``LAYER``'s weight names)."""

    input_norm: torch.Tensor      # [D]
    qkv: torch.Tensor             # [q + 2*kv, D]
    o: torch.Tensor               # [D, q]
    post_norm: torch.Tensor       # [D]
    gate_up: torch.Tensor         # [2*I, D]
    down: torch.Tensor            # [D, I]


@dataclass(frozen=True)
class FusedWeights:
    """A bf16 decoder of ``LAYER``s as the kernel packs it."""

    dims: DecoderDims
    layers: tuple[LayerWeights, ...]
    embed: torch.Tensor           # [V, D]
    final_norm: torch.Tensor      # [D]
    lm_head: torch.Tensor         # [V, D]
    cos: torch.Tensor             # RoPE tables [max_positions, head_dim]
    sin: torch.Tensor


def unsupported_reason(dims: DecoderDims) -> str | None:
    """Why a decoder of ``dims`` cannot use the fused decode step here, or None if it can."""
    if dims.head_dim % 16 or dims.head_dim > 256:
        return f"head_dim {dims.head_dim} (needs a multiple of 16, at most 256)"
    return cpu_unsupported_reason()


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """[N, K] (out, in) -> [ceil(N/32), ceil(K/2), 32, 2], zero-padded (see the .cpp header)."""
    n, k = w.shape
    np_, kp = -(-n // TILE) * TILE, -(-k // 2) * 2
    w = F.pad(w, (0, kp - k, 0, np_ - n))
    return w.view(np_ // TILE, TILE, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def interleave_gate_up(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """[2I, D] -> [2*Ip, D] with Ip = I rounded up to 16: rows gate[16t:16t+16] then
    up[16t:16t+16] for each t, so one 32-column tile yields silu(gate) * up directly."""
    ip = -(-inter // 16) * 16
    gate = F.pad(gate_up[:inter], (0, 0, 0, ip - inter)).view(ip // 16, 16, -1)
    up = F.pad(gate_up[inter:], (0, 0, 0, ip - inter)).view(ip // 16, 16, -1)
    return torch.stack((gate, up), dim=1).reshape(2 * ip, -1)


class _KvdModel(ctypes.Structure):
    """Mirror of ``struct KvdModel`` in csrc/fused_decode.cpp."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "num_layers", "hidden", "inter", "heads", "kv_heads", "head_dim", "vocab",
        "block_size", "num_blocks", "max_positions")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("embed", ctypes.c_void_p), ("norms", ctypes.c_void_p), ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p), ("packed", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
        ("head_offset", ctypes.c_int64)]


def _huge_page_buffer(numel: int) -> torch.Tensor:
    """An uninitialised bf16 buffer on 2 MiB boundaries, advised to use huge pages
    (fewer TLB misses while streaming ~270 MB per token). Advice only: ignored
    where transparent huge pages are off."""
    pad = HUGE_PAGE // 2
    raw = torch.empty(numel + pad, dtype=torch.bfloat16)
    start = (-raw.data_ptr() % HUGE_PAGE) // 2
    buf = raw[start:start + numel]
    length = numel * 2 // HUGE_PAGE * HUGE_PAGE
    if length:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(length), MADV_HUGEPAGE)
    return buf


class FusedDecoder(DecodeExecutor):
    """Packed weights of one bf16 decoder plus the loaded kernel. Construct with :meth:`create`.
    ``decode``/``staging``: DecodeExecutor's, on bf16 KV; the greedy tokens from numpy's
    argmax over the logits."""

    WHAT = "fused decoder"
    kv_dtype = torch.bfloat16

    # Every step on torch's whole team: the kernel's OpenMP barriers take the whole region, and a
    # smaller region would make libgomp end and restart the pool's surplus threads (see PlanDecoder).
    SMALL_TEAMS = False

    def __init__(self, weights: FusedWeights, lib: ctypes.CDLL, num_blocks: int, block_size: int) -> None:
        dims = weights.dims
        mats: list[torch.Tensor] = []
        for layer in weights.layers:                    # bf16 matrices are [out, in]
            mats += [pack_tiles(layer.qkv), pack_tiles(layer.o),
                     pack_tiles(interleave_gate_up(layer.gate_up, dims.intermediate)),
                     pack_tiles(F.pad(layer.down, (0, -(-dims.intermediate // 16) * 16 - dims.intermediate)))]
        mats.append(pack_tiles(weights.lm_head))
        # one buffer in the order a step reads it: the prefetchers see one long stream
        self.packed = _huge_page_buffer(sum(m.numel() for m in mats))
        starts, at = [], 0
        for m in mats:
            self.packed[at:at + m.numel()].copy_(m.flatten())
            starts.append(at)
            at += m.numel()
        self.offsets = torch.tensor(starts[:-1], dtype=torch.int64)        # [L*4]
        self.norms = torch.stack([n for layer in weights.layers for n in (layer.input_norm, layer.post_norm)]
                                 + [weights.final_norm]).contiguous()      # [2L+1, D]
        self.embed, self.cos, self.sin = weights.embed, weights.cos.contiguous(), weights.sin.contiguous()
        self.dims, self.num_blocks, self.block_size = dims, num_blocks, block_size
        # When set (float64 [len(PHASES)]), every decode adds each phase's
        # seconds to it (tools/bench/engine/bench_engine.py's profile); None costs nothing.
        self.phase_seconds: torch.Tensor | None = None
        self.desc = _KvdModel(
            dims.num_layers, dims.hidden, dims.intermediate, dims.heads, dims.kv_heads,
            dims.head_dim, dims.vocab, block_size, num_blocks, self.cos.shape[0],
            dims.eps, dims.scale, self.embed.data_ptr(), self.norms.data_ptr(),
            self.cos.data_ptr(), self.sin.data_ptr(), self.packed.data_ptr(), self.offsets.data_ptr(),
            starts[-1])
        self._step = lib.kvd_decode_step
        self._step.restype = ctypes.c_int
        self._step.argtypes = [ctypes.POINTER(_KvdModel), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_void_p]

    @classmethod
    def create(cls, weights: FusedWeights, kv: torch.Tensor, block_size: int) -> FusedDecoder | None:
        """The fused decoder for ``weights`` over the KV tensor ``kv``
        ([L, 2, N, bs, kvh, hd]), or None (logged) where it cannot run."""
        reason = unsupported_reason(weights.dims)
        if reason is None:
            try:
                lib = native.load(LIBRARY, native.AVX512_BF16_FLAGS)
            except (native.BuildError, OSError) as exc:
                log.warning("fused decode kernel unavailable, decoding with torch: %s", exc)
                return None
            return cls(weights, lib, kv.shape[2], block_size)
        log.info("fused decode off: %s", reason)
        return None

    def _launcher(self, kv: torch.Tensor) -> Launch:
        """The step over ``kv`` (already checked) on addresses; no greedy tokens (argmax ignored)."""
        step, desc, kv_ptr = self._step, ctypes.byref(self.desc), kv.data_ptr()

        def launch(B: int, ids: int, positions: int, tables: int, max_blocks: int, logits: int, argmax: int,
                   threads: int, _owners: tuple = (self, kv)) -> int:   # what the addresses point into stays alive
            return step(desc, kv_ptr, B, ids, positions, tables, max_blocks, logits, torch.get_num_threads(),
                        self._phase_seconds_ptr())          # threads: ignored (SMALL_TEAMS)
        return launch

    def _phase_seconds_ptr(self) -> int | None:
        """phase_seconds' address for the step, or None (off). Raises ValueError for a bad buffer."""
        prof = self.phase_seconds
        if prof is None:
            return None
        if prof.dtype != torch.float64 or prof.shape != (len(PHASES),):
            raise ValueError(f"phase_seconds must be float64 [{len(PHASES)}]")
        return prof.data_ptr()
