"""A whole fp32 decode step in one C++ call: the executor of a layer plan.

kernels/csrc/plan_decode.cpp runs a decoder given to it as data (a ``Plan``):
the steps of one layer (an op, the activation slot it reads, the slot it
writes, the weight it uses), each layer's weights (``QuantLinear`` blocks, or
float matrices [out, in], fp32 or 16-bit widened in registers; norm vectors),
the embedding, the final norm and the LM head. Each decode step is then one
ctypes call: embed, every layer's steps, final norm, LM head. The executor
implements ops (``OPS``), not a model: a plan with an op it does not know is
declined (``unsupported_reason``). It knows nothing of where a plan comes
from: engine/model/decode_kernels.py turns the model's ``LAYER_STEPS`` into
one.

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

:meth:`PlanDecoder.create` returns None (and says why) for a plan with an op
the executor lacks, a matrix that is neither one block-quantized tensor nor a
float one, an unsupported shape, a CPU without a kernel build, or a failed
build.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import native
from kernels.decode_inputs import DecodeExecutor, DecoderDims, Launch, check_decode_inputs
from kernels.quant import X8, QuantTensor
from kernels.quant_linear import VARIANTS, QuantLinear, host_variant, library_flags, runs_here
from kernels.row_ops import DENSE_FORMATS   # PlanWeight.format of a float matrix (16-bit ones widened in registers)

log = logging.getLogger(__name__)

LIBRARY = "plan_decode"
OPS = {"rms_norm": 0, "linear": 1, "rope_attention": 2, "linear_add": 3, "silu_mul": 4,   # enum Op in the .cpp
       "add_bias": 5, "qk_norm": 6, "gelu_mul": 7, "add": 8}
GATES = ("silu_mul", "gelu_mul")              # ops whose output is half their input's width
MATRIX_OPS = ("linear", "linear_add")
KV_DTYPES = (torch.float32, torch.float16)    # the KV caches the executor reads (PlanModel.kv_half)
STREAM = "h"                                  # the residual stream's slot: embed writes it, the LM head reads it


class PlanStep(Protocol):
    """One step of a layer: ``dst = op(src, weight)`` over named activation slots."""

    op: str
    src: str
    dst: str
    weight: str | None


@dataclass(frozen=True)
class Plan:
    """A decoder as the executor runs it. ``steps`` run in order in every layer over
    named slots (``STREAM`` is the residual stream: each layer's input and output);
    ``layers[i]`` maps each step's weight name to layer i's matrix or norm vector (fp32
    [hidden]). ``quantized``: every matrix is one block-quantized tensor (a
    ``QuantLinear``), else each is a float matrix [out, in]. ``ropes``: RoPE tables
    (cos, signed sin: fp32 [max_positions, head_dim] each, rope_tables), layer i
    rotating with ``ropes[layer_rope[i]]``; ``layer_window[i]``: layer i's sliding
    window in keys (None: global); the embedding's rows are multiplied by
    ``embed_scale`` (fp32). The executor reads the tensors in place: they must
    outlive it (it keeps the plan)."""

    dims: DecoderDims
    steps: tuple[PlanStep, ...]
    layers: tuple[Mapping[str, object], ...]
    embed: object                       # [vocab, hidden] matrix
    head: object                        # [vocab, hidden] matrix (the LM head)
    final_norm: torch.Tensor            # fp32 [hidden]
    ropes: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    layer_rope: tuple[int, ...]         # [num_layers]: an index into ropes
    layer_window: tuple[int | None, ...]     # [num_layers]
    quantized: bool
    embed_scale: float = 1.0


class _Step(ctypes.Structure):
    _fields_ = [("op", ctypes.c_int32), ("src", ctypes.c_int32), ("dst", ctypes.c_int32),
                ("weight", ctypes.c_int32)]


class _Weight(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int32), ("parts", ctypes.c_int32), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("data", ctypes.c_void_p)]


FMT_PARTS = 32          # csrc/plan_decode.cpp: a _Weight whose data is an array of quantized parts


class _Model(ctypes.Structure):
    """Mirror of ``struct PlanModel`` in csrc/plan_decode.cpp."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "num_layers", "num_steps", "num_slots", "num_weights", "hidden", "heads", "kv_heads", "head_dim",
        "vocab", "block_size", "num_blocks", "max_positions", "kv_half")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("embed_scale", ctypes.c_float),
        ("steps", ctypes.POINTER(_Step)), ("slot_width", ctypes.POINTER(ctypes.c_int64)),
        ("weights", ctypes.POINTER(_Weight)), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("window", ctypes.c_void_p),
        ("embed", _Weight), ("head", _Weight), ("final_norm", ctypes.c_void_p)]


# PlanRemote.hook: (layer, phase) -> 0, or nonzero to fail the step
_HOOK = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)


class _Remote(ctypes.Structure):
    """Mirror of ``struct PlanRemote`` in csrc/plan_decode.cpp."""

    _fields_ = [("split", ctypes.c_void_p), ("chunks", ctypes.c_int64), ("q", ctypes.c_void_p),
                ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("m", ctypes.c_void_p), ("l", ctypes.c_void_p),
                ("o", ctypes.c_void_p), ("hook", _HOOK)]


@dataclass
class SplitStep:
    """What a decode step over sequences with KV in remote parts trades with the executor
    (:meth:`PlanDecoder.decode_split`; DistAttention, engine/dist_attention.py).

    ``split`` int64 [B]: sequence b's key chunks [0, split[b]) are local (its block table
    covers them), the rest remote (split[b] >= its chunk count: all local). At every layer the
    executor writes each row's rotated query into ``q`` [B, H, hd] and its new K and V into
    ``k``, ``v`` [B, KVH, hd] (fp32), then calls ``hook(layer, 0)``: start the remote parts;
    it computes the local chunks and calls ``hook(layer, 1)``: write the remote chunks'
    partials into ``gather`` (``Partials`` [B, C, H(, hd)], row b's chunk c at slot c). A
    hook that raises fails the step: ``decode_split`` raises that exception."""

    split: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gather: object              # kernels.dist_attention.Partials
    hook: Callable[[int, int], None]


def _single_block_tensor(m: object) -> bool:
    """One block-quantized tensor in the kernels' x8 layout (a QuantLinear with a kernel)."""
    return (isinstance(m, QuantLinear) and len(m.parts) == 1 and isinstance(m.parts[0], QuantTensor)
            and m.parts[0].layout == X8)


def _block_tensors(m: object) -> bool:
    """Block-quantized tensors in the x8 layout stacked by rows, of any formats (a _K_M file's
    q/k beside its v in another type), every one but the last a whole number of groups of 8."""
    return (isinstance(m, QuantLinear) and all(isinstance(p, QuantTensor) and p.layout == X8 for p in m.parts)
            and all(p.shape[0] % 8 == 0 for p in m.parts[:-1]))


def _dense_matrix(m: object) -> bool:
    """A float matrix [out, in] (fp32, bf16 or fp16) the executor reads as it is (dense_gemm.h)."""
    return (isinstance(m, torch.Tensor) and m.dtype in DENSE_FORMATS and m.dim() == 2 and m.is_contiguous()
            and m.shape[1] % 16 == 0)


def head_dim_reason(head_dim: int) -> str | None:
    """Why the executor's attention cannot take heads of ``head_dim``, or None."""
    if head_dim % 16 or head_dim > 256:
        return f"head_dim {head_dim} (needs a multiple of 16, at most 256)"
    return None


def float_unsupported_reason(head_dim: int, widths: Mapping[str, int]) -> str | None:
    """Why the executor could not run float matrices of these shapes here (``widths``:
    each matrix width by the name a message should give it; this CPU), or None."""
    if reason := head_dim_reason(head_dim):
        return reason
    odd = [name for name, n in widths.items() if n % 16]
    if odd:
        return f"{', '.join(odd)} not a multiple of 16 (the width of an fp32 matrix's rows)"
    if host_variant() is None:
        return "CPU lacks AVX2, FMA or F16C"
    return None


def unsupported_reason(plan: Plan) -> str | None:
    """Why the executor cannot run ``plan`` here, or None."""
    if reason := head_dim_reason(plan.dims.head_dim):
        return reason
    unknown = sorted({s.op for s in plan.steps} - set(OPS))
    if unknown:
        return f"the layer plan has ops the executor does not implement: {', '.join(unknown)}"
    matrix = _block_tensors if plan.quantized else _dense_matrix
    what = ("block-quantized tensors (with a kernel)" if plan.quantized else
            "a float matrix [out, in] (fp32, bf16 or fp16) whose width is a multiple of 16")
    for step in plan.steps:
        if step.op in MATRIX_OPS and not all(matrix(layer[step.weight]) for layer in plan.layers):
            return f"{step.weight} is not {what} in every layer"
    table = _single_block_tensor if plan.quantized else _dense_matrix
    if not (table(plan.embed) and table(plan.head)):
        return f"the embedding or the LM head is not {'one ' if plan.quantized else ''}{what}"
    if host_variant() is None:
        return "CPU lacks AVX2, FMA or F16C"
    return None


def _weight(t: object, keep: list) -> _Weight:
    """``t`` as the executor reads it; arrays it points into are appended to ``keep``
    (the caller holds them as long as the plan)."""
    if isinstance(t, QuantLinear) and len(t.parts) > 1:
        parts = (_Weight * len(t.parts))(*[_Weight(q.fmt.code, 0, q.shape[0], q.shape[1], q.data.data_ptr())
                                           for q in t.parts])
        keep.append(parts)
        return _Weight(FMT_PARTS, len(t.parts), t.out_features, t.in_features, ctypes.addressof(parts))
    if isinstance(t, QuantLinear):
        q = t.parts[0]
        return _Weight(q.fmt.code, 0, q.shape[0], q.shape[1], q.data.data_ptr())
    if t.dim() == 2:
        return _Weight(DENSE_FORMATS[t.dtype], 0, t.shape[0], t.shape[1], t.data_ptr())   # a float matrix [out, in]
    return _Weight(-1, 0, t.numel(), 1, t.data_ptr())             # an fp32 vector (a norm's weight)


class PlanDecoder(DecodeExecutor):
    """A plan plus the loaded executor. Construct with :meth:`create`. ``decode``/``staging``:
    DecodeExecutor's, on KV of ``kv_dtype``; the greedy tokens computed in the step (the LM
    head's threads, as it writes the logits)."""

    WHAT = "plan decoder"
    REFUSED = "empty batch, or a token id, position or block id out of range"
    NATIVE_ARGMAX = True

    # A step may run on fewer threads than torch's (DecodeStaging.run's ``threads``), inside an
    # OpenMP region of torch's size whose other threads idle: libgomp would otherwise end the
    # pool's surplus threads at each smaller step and start them again at the next torch op.
    SMALL_TEAMS = True

    def __init__(self, plan: Plan, lib: ctypes.CDLL, num_blocks: int, block_size: int,
                 variant: str, kv_dtype: torch.dtype = torch.float32) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"a KV cache of {kv_dtype} (the plan executor reads fp32 or fp16 KV)")
        native.require_variant(lib, "kvd_plan_variant", LIBRARY, variant)
        dims, steps = plan.dims, plan.steps
        self.variant = variant                      # the build in use (a key of quant_linear.VARIANTS)
        slots = [STREAM] + [s.dst for s in steps if s.dst != STREAM]
        slots = list(dict.fromkeys(slots))
        weights = list(dict.fromkeys(s.weight for s in steps if s.weight))
        width = {STREAM: dims.hidden}
        for s in steps:                             # each slot's width from the step that writes it
            w = plan.layers[0][s.weight] if s.weight else None
            rows = (w.shape[0] if isinstance(w, torch.Tensor) else w.out_features) if s.op in MATRIX_OPS else None
            width[s.dst] = (rows if rows is not None else width[s.src] // 2 if s.op in GATES
                            else dims.q_size if s.op == "rope_attention" else width[s.src])
        self._steps = (_Step * len(steps))(*[
            _Step(OPS[s.op], slots.index(s.src), slots.index(s.dst), weights.index(s.weight) if s.weight else -1)
            for s in steps])
        self._widths = (ctypes.c_int64 * len(slots))(*[width[s] for s in slots])
        self._parts: list = []                      # FMT_PARTS weights' arrays of parts
        self._weights = (_Weight * (len(plan.layers) * len(weights)))(*[
            _weight(layer[name], self._parts) for layer in plan.layers for name in weights])
        self.plan = plan                            # keeps every buffer the plan points into alive
        if len(plan.layer_rope) != dims.num_layers or len(plan.layer_window) != dims.num_layers:
            raise ValueError("the plan's layer_rope and layer_window must name every layer")
        self.ropes = [(c.contiguous(), s.contiguous()) for c, s in plan.ropes]
        positions = {c.shape[0] for c, _ in self.ropes}
        if len(positions) != 1 or any(c.shape != s.shape for c, s in self.ropes):
            raise ValueError("the plan's RoPE tables must have one shape")
        ptrs = ctypes.c_void_p * dims.num_layers
        self._cos = ptrs(*[self.ropes[i][0].data_ptr() for i in plan.layer_rope])
        self._sin = ptrs(*[self.ropes[i][1].data_ptr() for i in plan.layer_rope])
        self._window = (ctypes.c_int32 * dims.num_layers)(*[w or 0 for w in plan.layer_window])
        self.dims, self.num_blocks, self.block_size, self.kv_dtype = dims, num_blocks, block_size, kv_dtype
        self.desc = _Model(
            dims.num_layers, len(steps), len(slots), len(weights), dims.hidden, dims.heads,
            dims.kv_heads, dims.head_dim, dims.vocab, block_size, num_blocks, positions.pop(),
            int(kv_dtype == torch.float16), dims.eps, dims.scale, plan.embed_scale, self._steps, self._widths,
            self._weights, ctypes.addressof(self._cos), ctypes.addressof(self._sin), ctypes.addressof(self._window),
            _weight(plan.embed, self._parts),
            _weight(plan.head, self._parts),
            plan.final_norm.data_ptr())
        check = lib.kvd_plan_check
        check.restype, check.argtypes = ctypes.c_int, [ctypes.POINTER(_Model)]
        if check(ctypes.byref(self.desc)) != 0:
            raise ValueError("the plan executor refused the model's plan (a weight or width does not fit)")
        self._step = lib.kvd_plan_decode
        self._step.restype = ctypes.c_int
        self._step.argtypes = [ctypes.POINTER(_Model), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_int]
        self._split_step = lib.kvd_plan_decode_split
        self._split_step.restype = ctypes.c_int
        self._split_step.argtypes = [*self._step.argtypes, ctypes.POINTER(_Remote)]

    @classmethod
    def create(cls, plan: Plan, kv: torch.Tensor, block_size: int,
               variant: str | None = None) -> PlanDecoder | None:
        """The executor for ``plan`` over the KV tensor ``kv`` ([L, 2, N, bs, kvh, hd]),
        or None (logged) where it cannot run. ``variant`` (a key of
        ``quant_linear.VARIANTS``) picks a build other than the host's fastest, for
        benchmarks and tests; one this CPU cannot run gives None."""
        reason = unsupported_reason(plan)
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
            return cls(plan, lib, kv.shape[2], block_size, variant, kv.dtype)
        except (native.BuildError, OSError, ValueError) as exc:
            log.warning("plan decode executor unavailable, decoding with torch: %s", exc)
            return None

    def decode_split(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                     kv: torch.Tensor, step: SplitStep, threads: int = 0) -> tuple[torch.Tensor, list[int]]:
        """:meth:`decode` of a batch whose sequences may have KV in remote parts (``step``):
        (fp32 logits [B, V], each row's greedy token). ``block_tables`` need cover only each
        sequence's local chunks. The same bits as the unsplit step where the hook gives the
        unsplit kernel's partials (``PagedAttention.partials``). Raises ValueError on bad
        input (nothing written), or what the hook raised (the step's K/V writes then stand
        for positions it computes again)."""
        ids, positions, tables = check_decode_inputs(ids, positions, block_tables, kv, dims=self.dims,
                                                     num_blocks=self.num_blocks, block_size=self.block_size,
                                                     dtype=self.kv_dtype, what=self.WHAT)
        B, d = ids.shape[0], self.dims
        g = step.gather
        C = g.m.shape[1] if g.m.dim() == 3 else 0
        wants = {"split": (step.split, torch.int64, (B,)), "q": (step.q, torch.float32, (B, d.heads, d.head_dim)),
                 "k": (step.k, torch.float32, (B, d.kv_heads, d.head_dim)),
                 "v": (step.v, torch.float32, (B, d.kv_heads, d.head_dim)),
                 "gather m": (g.m, torch.float32, (B, C, d.heads)), "gather l": (g.l, torch.float32, (B, C, d.heads)),
                 "gather o": (g.o, torch.float32, (B, C, d.heads, d.head_dim))}
        for name, (t, dtype, shape) in wants.items():
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"split step: {name} must be contiguous {dtype} {list(shape)}")
        if C < 1:
            raise ValueError("split step: the gather has no slots")
        failure: list[BaseException] = []

        def hook(layer: int, phase: int) -> int:
            try:
                step.hook(layer, phase)
                return 0
            except BaseException as exc:  # noqa: BLE001 -- raised by decode_split, after the step
                failure.append(exc)
                return 1

        remote = _Remote(step.split.data_ptr(), C, step.q.data_ptr(), step.k.data_ptr(), step.v.data_ptr(),
                         g.m.data_ptr(), g.l.data_ptr(), g.o.data_ptr(), _HOOK(hook))
        logits = torch.empty(B, d.vocab, dtype=torch.float32)
        argmax = torch.empty(B, dtype=torch.int64)
        team = torch.get_num_threads()
        rc = self._split_step(ctypes.byref(self.desc), kv.data_ptr(), B, ids.data_ptr(), positions.data_ptr(),
                              tables.data_ptr(), tables.shape[1], logits.data_ptr(), argmax.data_ptr(),
                              threads or team, team, ctypes.byref(remote))
        if failure:
            raise failure[0]
        if rc != 0:
            raise ValueError(self.REFUSED + ", or a split that does not fit the gather")
        return logits, argmax.tolist()

    def _launcher(self, kv: torch.Tensor) -> Launch:
        """The step over ``kv`` (already checked) on addresses (argmax 0: none; threads 0: torch's count)."""
        step, desc, kv_ptr = self._step, ctypes.byref(self.desc), kv.data_ptr()

        def launch(B: int, ids: int, positions: int, tables: int, max_blocks: int, logits: int, argmax: int,
                   threads: int, _owners: tuple = (self, kv)) -> int:   # what the addresses point into stays alive
            team = torch.get_num_threads()          # the region's size whatever works in it (the .cpp)
            return step(desc, kv_ptr, B, ids, positions, tables, max_blocks, logits, argmax or None,
                        threads or team, team)
        return launch
