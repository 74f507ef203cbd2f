"""A whole fp32 decode step in one C++ call, run from llama.py's layer plan.

``LlamaModel.forward`` runs ``engine.model.llama.LAYER_STEPS`` op by op in
torch: about 1,700 torch ops per SmolLM2 decode step, whose dispatch costs more
than reading the quantized weights (docs/architecture.md). ``PlanDecoder``
hands the same steps, the layers' weights (``QuantLinear`` blocks, or an fp32
model's float matrices in ``float_layout = "rows"``, fp32 or kept in their
checkpoint's bf16 or fp16 and widened in registers; norm vectors), the
embedding and the LM head to kernels/csrc/plan_decode.cpp once,
and each decode step is then one ctypes call: embed, every layer's steps,
final norm, LM head. The C++ side implements ops, not a Llama: a plan with an
op it does not know is declined here (``unsupported_reason``) and decode stays
on ``forward``.

Contract of :meth:`PlanDecoder.decode` (as ``LlamaModel.forward`` +
``compute_logits`` for a decode batch, like ``kernels.fused_decode``):

- one new token per sequence; writes its K/V into ``kv`` at the slot
  ``block_tables[b, pos // bs] * bs + pos % bs`` of every layer and reads the
  sequence's keys ``0..pos`` through its block table. ``kv`` is fp32, or fp16
  (``kv_cache_dtype = "float16"``): then K/V are stored as
  ``kernels.attention.store_kv`` stores them (clamped to the largest half,
  rounded to nearest even), and attention reads them widened, exactly;
- returns fp32 logits [B, V];
- **batch invariant, bit for bit**: row b depends only on sequence b's token,
  position, block table and cached K/V, not on B, the other rows or the
  thread count (the matmuls' fixed orders, row-local ops elsewhere);
- agrees with ``forward`` to fp32 rounding (norm and attention sums run in
  another order; quantized matmuls are the same kernel, bit for bit, and a
  float model's run in kernels/csrc/dense_gemm.h's order, not MKL's);
- deterministic; keeps no per-request state; allocates no KV memory.

:meth:`PlanDecoder.create` returns None (and says why) for a model that does
not compute in fp32, a float model whose matrices are not in the rows layout, a
pipeline stage, a matrix that is neither one block-quantized tensor nor a float
one, an unsupported shape, a CPU without a kernel build, or a failed build.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from engine.model.config import LlamaConfig
from engine.model.llama import LAYER_STEPS, LlamaModel
from kernels import native
from kernels.decode_inputs import DecodeStaging, check_decode_inputs, check_decode_kv
from kernels.quant import X8, QuantTensor
from kernels.quant_linear import VARIANTS, QuantLinear, host_variant, library_flags, runs_here
from kernels.row_ops import DENSE_FORMATS   # PlanWeight.format of a float matrix (16-bit ones widened in registers)

log = logging.getLogger(__name__)

LIBRARY = "plan_decode"
OPS = {"rms_norm": 0, "linear": 1, "rope_attention": 2, "linear_add": 3, "silu_mul": 4}   # enum Op in the .cpp
_MATRIX_OPS = ("linear", "linear_add")
KV_DTYPES = (torch.float32, torch.float16)    # the KV caches the executor reads (PlanModel.kv_half)


class _Step(ctypes.Structure):
    _fields_ = [("op", ctypes.c_int32), ("src", ctypes.c_int32), ("dst", ctypes.c_int32),
                ("weight", ctypes.c_int32)]


class _Weight(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int32), ("unused", ctypes.c_int32), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("data", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    """Mirror of ``struct PlanModel`` in csrc/plan_decode.cpp."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "num_layers", "num_steps", "num_slots", "num_weights", "hidden", "heads", "kv_heads", "head_dim",
        "vocab", "block_size", "num_blocks", "max_positions", "kv_half")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("steps", ctypes.POINTER(_Step)), ("slot_width", ctypes.POINTER(ctypes.c_int64)),
        ("weights", ctypes.POINTER(_Weight)), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("embed", _Weight), ("head", _Weight), ("final_norm", ctypes.c_void_p)]


def _single_block_tensor(m: object) -> bool:
    """One block-quantized tensor in the kernels' x8 layout (a QuantLinear with a kernel)."""
    return (isinstance(m, QuantLinear) and len(m.parts) == 1 and isinstance(m.parts[0], QuantTensor)
            and m.parts[0].layout == X8)


def _dense_matrix(m: object) -> bool:
    """A float matrix [out, in] (fp32, bf16 or fp16) the executor reads as it is (dense_gemm.h)."""
    return (isinstance(m, torch.Tensor) and m.dtype in DENSE_FORMATS and m.dim() == 2 and m.is_contiguous()
            and m.shape[1] % 16 == 0)


def _head_dim_reason(config: LlamaConfig) -> str | None:
    if config.head_dim % 16 or config.head_dim > 256:
        return f"head_dim {config.head_dim} (needs a multiple of 16, at most 256)"
    return None


def float_unsupported_reason(config: LlamaConfig) -> str | None:
    """Why the plan executor could not run an fp32 float model of ``config`` here (its
    shapes, this CPU), or None: what ``build_model`` asks before keeping such a model's
    matrices in the rows layout, which only the executor wants."""
    if reason := _head_dim_reason(config):
        return reason
    widths = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
              "q_size": config.q_size}
    odd = [name for name, n in widths.items() if n % 16]
    if odd:
        return f"{', '.join(odd)} not a multiple of 16 (the width of an fp32 matrix's rows)"
    if host_variant() is None:
        return "CPU lacks AVX2, FMA or F16C"
    return None


def unsupported_reason(model: LlamaModel) -> str | None:
    """Why the plan executor cannot run ``model``'s decode steps here, or None."""
    if not model.quantized and not model.rows_layout:
        return ("float weights stored [in, out] for MKL's decode (the plan executor reads them [out, in]: "
                "LlamaModel(float_layout=\"rows\"))")
    if model.dtype != torch.float32:
        return f"dtype {model.dtype} (the plan executor computes in fp32)"
    if not (model.is_first and model.is_last):
        return "a pipeline stage (the plan executor runs whole models)"
    if reason := _head_dim_reason(model.config):
        return reason
    unknown = sorted({s.op for s in LAYER_STEPS} - set(OPS))
    if unknown:
        return f"LAYER_STEPS has ops the executor does not implement: {', '.join(unknown)}"
    matrix = _single_block_tensor if model.quantized else _dense_matrix
    what = ("one block-quantized tensor (with a kernel)" if model.quantized else
            "a float matrix [out, in] (fp32, bf16 or fp16) whose width is a multiple of 16")
    for step in LAYER_STEPS:
        if step.op in _MATRIX_OPS and not all(matrix(getattr(layer, step.weight)) for layer in model.layers):
            return f"{step.weight} is not {what} in every layer"
    if not (matrix(model.embed) and matrix(model.lm_head)):
        return f"the embedding or the LM head is not {what}"
    if host_variant() is None:
        return "CPU lacks AVX2, FMA or F16C"
    return None


def _weight(t: object) -> _Weight:
    if isinstance(t, QuantLinear):
        q = t.parts[0]
        return _Weight(q.fmt.code, 0, q.shape[0], q.shape[1], q.data.data_ptr())
    if t.dim() == 2:
        return _Weight(DENSE_FORMATS[t.dtype], 0, t.shape[0], t.shape[1], t.data_ptr())   # a float matrix [out, in]
    return _Weight(-1, 0, t.numel(), 1, t.data_ptr())             # an fp32 vector (a norm's weight)


class PlanDecoder:
    """The plan of one fp32 model plus the loaded executor. Construct with :meth:`create`."""

    # A step may run on fewer threads than torch's (DecodeStaging.run's ``threads``), inside an
    # OpenMP region of torch's size whose other threads idle: libgomp would otherwise end the
    # pool's surplus threads at each smaller step and start them again at the next torch op.
    SMALL_TEAMS = True

    def __init__(self, model: LlamaModel, lib: ctypes.CDLL, num_blocks: int, block_size: int,
                 variant: str, kv_dtype: torch.dtype = torch.float32) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"a KV cache of {kv_dtype} (the plan executor reads fp32 or fp16 KV)")
        native.require_variant(lib, "kvd_plan_variant", LIBRARY, variant)
        cfg = model.config
        self.variant = variant                      # the build in use (a key of quant_linear.VARIANTS)
        slots = ["h"] + [s.dst for s in LAYER_STEPS if s.dst != "h"]
        slots = list(dict.fromkeys(slots))
        weights = list(dict.fromkeys(s.weight for s in LAYER_STEPS if s.weight))
        width = {"h": cfg.hidden_size}
        for s in LAYER_STEPS:                       # each slot's width from the step that writes it
            w = getattr(model.layers[0], s.weight) if s.weight else None
            rows = (w.shape[0] if isinstance(w, torch.Tensor) else w.out_features) if s.op in _MATRIX_OPS else None
            width[s.dst] = (rows if rows is not None else width[s.src] // 2 if s.op == "silu_mul"
                            else cfg.q_size if s.op == "rope_attention" else width[s.src])
        self._steps = (_Step * len(LAYER_STEPS))(*[
            _Step(OPS[s.op], slots.index(s.src), slots.index(s.dst), weights.index(s.weight) if s.weight else -1)
            for s in LAYER_STEPS])
        self._widths = (ctypes.c_int64 * len(slots))(*[width[s] for s in slots])
        self._weights = (_Weight * (len(model.layers) * len(weights)))(*[
            _weight(getattr(layer, name)) for layer in model.layers for name in weights])
        self.model = model                          # keeps every buffer the plan points into alive
        self.cos, self.sin = model.cos.contiguous(), model.sin.contiguous()
        self.config, self.num_blocks, self.block_size, self.kv_dtype = cfg, num_blocks, block_size, kv_dtype
        self.desc = _Model(
            cfg.num_layers, len(LAYER_STEPS), len(slots), len(weights), cfg.hidden_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, block_size, num_blocks, self.cos.shape[0],
            int(kv_dtype == torch.float16), cfg.rms_norm_eps, model.scale, self._steps, self._widths,
            self._weights, self.cos.data_ptr(), self.sin.data_ptr(), _weight(model.embed), _weight(model.lm_head),
            model.norm.data_ptr())
        check = lib.kvd_plan_check
        check.restype, check.argtypes = ctypes.c_int, [ctypes.POINTER(_Model)]
        if check(ctypes.byref(self.desc)) != 0:
            raise ValueError("the plan executor refused the model's plan (a weight or width does not fit)")
        self._step = lib.kvd_plan_decode
        self._step.restype = ctypes.c_int
        self._step.argtypes = [ctypes.POINTER(_Model), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_int]

    @classmethod
    def create(cls, model: LlamaModel, kv: torch.Tensor, block_size: int,
               variant: str | None = None) -> PlanDecoder | None:
        """The executor for ``model`` over the KV tensor ``kv`` ([L, 2, N, bs, kvh, hd]),
        or None (logged) where it cannot run. ``variant`` (a key of
        ``quant_linear.VARIANTS``) picks a build other than the host's fastest, for
        benchmarks and tests; one this CPU cannot run gives None."""
        reason = unsupported_reason(model)
        if reason is None and variant is not None and variant not in VARIANTS:
            reason = f"unknown kernel variant {variant!r}"
        if reason is None and variant is not None and not runs_here(variant):
            reason = f"this CPU cannot run the {variant} build"
        if reason is not None:
            log.info("plan decode off: %s", reason)
            return None
        variant = variant or host_variant()
        try:
            lib = native.load(LIBRARY, library_flags(LIBRARY, variant))
            return cls(model, lib, kv.shape[2], block_size, variant, kv.dtype)
        except (native.BuildError, OSError, ValueError) as exc:
            log.warning("plan decode executor unavailable, decoding with torch: %s", exc)
            return None

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               kv: torch.Tensor) -> torch.Tensor:
        """ids, positions [B] int64; block_tables [B, M] int64 covering every
        position; kv [L, 2, N, bs, kvh, hd] of the executor's KV dtype (mutated: the new K/V).
        Returns fp32 logits [B, V]. Raises ValueError on bad input (nothing written)."""
        B = ids.shape[0]
        cfg = self.config
        ids, positions, tables = check_decode_inputs(ids, positions, block_tables, kv, config=cfg,
                                                     num_blocks=self.num_blocks, block_size=self.block_size,
                                                     dtype=self.kv_dtype, what="plan decoder")
        logits = torch.empty(B, cfg.vocab_size, dtype=torch.float32)
        rc = self._step(ctypes.byref(self.desc), kv.data_ptr(), B, ids.data_ptr(), positions.data_ptr(),
                        tables.data_ptr(), tables.shape[1], logits.data_ptr(), None, torch.get_num_threads(),
                        torch.get_num_threads())
        if rc != 0:
            raise ValueError("empty batch, or a token id, position or block id out of range")
        return logits

    def staging(self, kv: torch.Tensor) -> DecodeStaging:
        """Reusable buffers for steps over ``kv`` (checked here, once), the greedy
        tokens computed in the step (the LM head's threads, as it writes the logits).
        Raises ValueError when ``kv`` does not match the model."""
        check_decode_kv(kv, config=self.config, num_blocks=self.num_blocks, block_size=self.block_size,
                        dtype=self.kv_dtype, what="plan decoder")
        step, desc, kv_ptr = self._step, ctypes.byref(self.desc), kv.data_ptr()

        def launch(B: int, ids: int, positions: int, tables: int, max_blocks: int, logits: int, argmax: int,
                   threads: int, _owners: tuple = (self, kv)) -> int:   # what the addresses point into stays alive
            team = torch.get_num_threads()          # the region's size whatever works in it (the .cpp)
            return step(desc, kv_ptr, B, ids, positions, tables, max_blocks, logits, argmax or None,
                        threads or team, team)
        return DecodeStaging(self.config.vocab_size, launch, native_argmax=True, what="plan decoder")
