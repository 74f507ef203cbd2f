"""A Llama-family decoder over paged KV (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings).

Weights are plain tensors, not ``nn.Module`` parameters: the hot path is a
straight line of matmuls (q/k/v fused into one matmul, gate/up into
another) because on a CPU single-stream decode is bound by weight bandwidth and
every extra op is Python overhead paid 30 times per token.

A model instance may hold a contiguous range of layers ``[start, end)`` (a
pipeline stage): the first stage embeds tokens, the last applies the final norm
and the LM head; a middle stage maps hidden states to hidden states.

Weights given as ``QuantTensor`` (a GGUF's Q4_0 / Q4_1 / Q8_0 blocks,
``weights = "native"``) stay in their blocks: every matrix of such a model is
a ``QuantLinear`` (kernels/quant_linear.py), the kernel this same layer loop
calls where a float model calls a matmul, and the embedding table is read
through it too (its rows dequantized on lookup; a tied LM head is the same
object).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.config import LlamaConfig
from kernels import native
from kernels.attention import AttentionBatch, decode_attention, prefill_attention, store_kv, write_kv
from kernels.paged_attention import PagedAttention
from kernels.quant import QuantTensor
from kernels.quant_linear import QuantKernel, QuantLinear
from kernels.row_ops import RowOps
from kernels.weight_arena import WeightArena

if TYPE_CHECKING:
    from engine.dist_attention import DistStep

Matrix = torch.Tensor | QuantLinear


@dataclass(frozen=True)
class Step:
    """One step of a decoder layer: ``dst = op(src, weight)``. ``src`` and ``dst``
    name the layer's activations (``h`` is the residual stream, the layer's input
    and output); ``weight`` names a field of ``_Layer``."""

    op: str
    src: str
    dst: str
    weight: str | None = None


# The decoder layer, the one definition of what a layer computes: ``layer_steps(config)``
# (Llama's is LAYER_STEPS; an architecture adds or swaps steps, as data).
# LlamaModel.forward runs these steps with torch ops, for every kind of step;
# kernels/plan_decode.py runs the same steps for a decode step in one C++ call
# (fp32 models, handed over by engine/model/decode_kernels.py) and declines a plan
# with an op it does not implement, so a change to the model is made here, in
# forward's op for it, and, for the fast decode path, in the executor's op. The
# fused bf16 kernel (kernels/fused_decode.py) writes this layer out in C++ and is
# not given a model whose layer is another.
LAYER_STEPS = (
    Step("rms_norm", "h", "a", "input_norm"),
    Step("linear", "a", "qkv", "qkv"),             # [T, q + 2kv]
    Step("rope_attention", "qkv", "o"),            # RoPE on q, k; k, v into the cache; attention: [T, q]
    Step("linear_add", "o", "h", "o"),             # h = h + o Wo
    Step("rms_norm", "h", "m", "post_norm"),
    Step("linear", "m", "gu", "gate_up"),          # [T, 2I]
    Step("silu_mul", "gu", "act"),                 # silu(gate) * up: [T, I]
    Step("linear_add", "act", "h", "down"),        # h = h + act Wdown
)


def layer_steps(config: LlamaConfig) -> tuple[Step, ...]:
    """The layer plan of ``config``'s architecture: LAYER_STEPS with

    - ``add_bias`` after the qkv matmul (``qkv_bias``: qwen2);
    - ``qk_norm`` (RMSNorm of each q and k head) before RoPE (``qk_norm``: qwen3, gemma3);
    - ``sandwich_norms`` (gemma3): the attention and MLP outputs normed
      (``post_attn_norm``, ``post_ffw_norm``) before ``add`` puts them on the residual;
    - ``gelu_mul`` for ``silu_mul`` (``activation = "gelu_tanh"``: gemma3).
    """
    steps = [LAYER_STEPS[0], LAYER_STEPS[1]]
    if config.qkv_bias:
        steps.append(Step("add_bias", "qkv", "qkv", "qkv_bias"))
    if config.qk_norm:
        steps.append(Step("qk_norm", "qkv", "qkv", "qk_norm"))
    steps.append(LAYER_STEPS[2])
    if config.sandwich_norms:
        steps += [Step("linear", "o", "ao", "o"), Step("rms_norm", "ao", "ao", "post_attn_norm"),
                  Step("add", "ao", "h")]
    else:
        steps.append(LAYER_STEPS[3])
    steps += [LAYER_STEPS[4], LAYER_STEPS[5]]
    gate = "gelu_mul" if config.activation == "gelu_tanh" else "silu_mul"
    steps.append(Step(gate, "gu", "act"))
    if config.sandwich_norms:
        steps += [Step("linear", "act", "f", "down"), Step("rms_norm", "f", "f", "post_ffw_norm"),
                  Step("add", "f", "h")]
    else:
        steps.append(LAYER_STEPS[7])
    return tuple(steps)


@dataclass
class _Layer:
    # matrices are stored [out, in] (F.linear) or [in, out] (matmul), or are a
    # QuantLinear (quantized weights), see LlamaModel
    input_norm: torch.Tensor      # [D]
    qkv: Matrix                   # [q + 2*kv, D]
    o: Matrix                     # [D, q]
    post_norm: torch.Tensor       # [D]
    gate_up: Matrix               # [2*I, D]
    down: Matrix                  # [D, I]
    window: int | None = None     # sliding window (LlamaConfig.layer_window), None: global
    rope: int = 0                 # index of the layer's RoPE tables in LlamaModel.ropes
    qkv_bias: torch.Tensor | None = None         # [q + 2*kv] (qkv_bias)
    qk_norm: torch.Tensor | None = None          # [2 * hd]: q's, then k's (qk_norm)
    post_attn_norm: torch.Tensor | None = None   # [D] (sandwich_norms)
    post_ffw_norm: torch.Tensor | None = None    # [D] (sandwich_norms)


def _matmul_in_out(x: torch.Tensor, w_in_out: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w_in_out)


# Rows of x up to which an fp32 model's 16-bit matrices multiply on the executor's dense
# kernel rather than widened for MKL (LlamaModel._linear_rows): from 57 rows MKL over the
# widened matrix was measured level or faster (docs/benchmarks.md, design measurements). fp32
# matrices always take MKL: its rows agree whatever their count (a prefix computed in a short
# chunk on one node and in a long one on another: the same K/V), the dense kernel's would not
# agree with them.
DENSE_PREFILL_ROWS = 56


def _quant_linear(x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
    return w(x)


def _nbytes(t: Matrix) -> int:
    return t.nbytes if isinstance(t, QuantLinear) else t.numel() * t.element_size()


@functools.cache
def linear_row_multiple() -> int:
    """The multiple of rows bf16 inputs are padded to (_linear_batch_invariant): 4 on a
    CPU that emulates bf16 with AVX-512 (no AVX512-BF16 or AMX-BF16), else 1."""
    return 4 if "avx512f" in native.cpu_flags() and not native.cpu_has_native_bf16() else 1


# Rows of every bf16 linear call on a CPU with AMX-BF16 (_linear_batch_invariant).
AMX_ROWS = 32


@functools.cache
def linear_row_block() -> int:
    """Rows of each bf16 linear call on a CPU with AMX-BF16 (``AMX_ROWS``), 0 elsewhere:
    there oneDNN picks its kernel by the row count (at K = 1536, SmolLM2's down
    projection, its AMX gemm from 37 rows up and another below, which sums in another
    order), so every call gets the same count."""
    return AMX_ROWS if "amx_bf16" in native.cpu_flags() else 0


def _linear_batch_invariant(x: torch.Tensor, w_out_in: torch.Tensor) -> torch.Tensor:
    """``F.linear`` whose rows do not depend on how many rows there are.

    oneDNN's bf16 gemv (one row) reduces a long K (the MLP's down projection,
    K = 1536 for SmolLM2) in another order than its gemm, whose rows agree with
    each other whatever the count from two rows up on the AVX2 and AVX512-BF16
    CPUs measured; on a CPU that emulates bf16 with AVX-512 (Cascade Lake)
    the gemm rounds the rows past the last multiple of 4 in yet another order,
    and on an AMX CPU the kernel changes with the row count. A request would
    then round differently alone, in a batch, or recomputed after a
    preemption, and greedy tokens could diverge. Rows are padded with zeros to
    two at least and to a multiple of ``linear_row_multiple()``: one row as two
    costs about the same as one; one as four costs more on the emulating CPU,
    where bf16 runs only when asked for (dtype "auto" picks fp32; docs/benchmarks.md,
    design measurements). On an AMX CPU every call has ``linear_row_block()`` rows
    (padded with zeros; a longer input in calls of that many)."""
    m = x.shape[0]
    if block := linear_row_block():
        if m % block:
            x = torch.cat((x, x.new_zeros(-m % block, x.shape[1])))
        if x.shape[0] == block:
            return F.linear(x, w_out_in)[:m]
        return torch.cat([F.linear(c, w_out_in) for c in x.split(block)])[:m]
    rows = max(m, 2)
    pad = rows - m + -rows % linear_row_multiple()
    if pad == 0:
        return F.linear(x, w_out_in)
    return F.linear(torch.cat((x, x.new_zeros(pad, x.shape[1]))), w_out_in)[:m]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale.

    Spelled out rather than ``F.rms_norm``: on a decode-sized row the fused CPU op's
    parallel-region overhead costs more than these ops (docs/benchmarks.md, design
    measurements)."""
    xf = x if x.dtype == torch.float32 else x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf if x.dtype == torch.float32 else xf.to(x.dtype))


def rope_tables(config: LlamaConfig, dtype: torch.dtype,
                theta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: [max_positions, head_dim] in the half-rotation (rotate_half)
    layout; the first half of sin is negated so rotate_half is a plain swap of halves.
    ``theta``: the RoPE base (default ``config.rope_theta``, the only one scaled by
    ``rope_scaling``; a sliding layer's own base is not, as in transformers)."""
    hd = config.head_dim
    base = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if config.rope_scaling and theta is None:
        inv_freq = _scale_inv_freq(inv_freq, dict(config.rope_scaling))
    pos = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)                    # [P, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)               # [P, hd]
    sin = emb.sin()
    sin[:, : hd // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv_freq / float(s["factor"])
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling {s!r}")
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= old / low) & (wavelen >= old / high)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos/signed_sin: [T, 1, hd] (see rope_tables)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


class LlamaModel:
    """Layers ``[start, end)`` of a Llama decoder; inference only.

    Weight layout is chosen per dtype by measurement (docs/benchmarks.md, design
    measurements): for fp32, MKL runs ``x @ W[in, out]`` on all cores even for one
    token while ``F.linear`` (``W[out, in]``) falls to a single-threaded gemv (slower
    decode); for bf16, oneDNN is the other way round (slower transposed).
    ``float_layout = "rows"`` keeps every float matrix ``[out, in]`` whatever the
    dtype (``rows_layout``): the layout the plan executor reads (kernels/plan_decode.py),
    for an fp32 model whose decode steps it runs, torch then running only prefills
    (``F.linear``, as fast as the transposed layout from a few rows up). There an fp32
    model keeps bf16 / fp16 matrices (the embedding and LM head included) in their
    dtype (``matrix_dtype``), widened exactly where used: in registers by the executor (a
    decode step has its fp32 copy's bits) and by ``_linear_rows`` for a prefill.

    ``tensors`` holding any ``QuantTensor`` make a quantized model
    (``quantized``): its matrices are ``QuantLinear`` objects over
    ``quant_kernel`` (None: their torch reference, for tests), fp32 inside
    whatever ``dtype`` the rest of the model runs in.

    ``attention_kernel``: attention over the paged KV cache in the plan executor's
    arithmetic (kernels/paged_attention.py), for fp32 activations, prefill and decode
    rows alike: a token's attention has the same bits whichever way it is computed;
    "auto" loads this host's build for an fp32 model (None where there is none), None
    runs torch's SDPA (so does a softcapped layer).

    ``batch_invariant``: an fp32 model's float matrices multiply a prefill's rows on
    the plan executor's dense kernel (``RowOps.linear``) at every row count, not MKL's,
    so a prefilled token has a decoded one's bits (quantized matrices always do: one
    kernel for both). False: MKL from DENSE_PREFILL_ROWS + 1 rows up (faster prefills).

    ``row_ops``: RMSNorm, SwiGLU and RoPE over all rows in one C++ call each
    (kernels/row_ops.py), for fp32 activations; "auto" loads this host's build
    for an fp32 model (None where there is none), None runs the torch ops below.

    Contract of :meth:`forward`: it writes the new tokens' K/V into ``kv`` at
    the slots named by ``batch`` and returns hidden states. It does not allocate
    KV memory and keeps no per-request state.
    """

    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor | QuantTensor],
                 dtype: torch.dtype = torch.float32,
                 layer_range: tuple[int, int] | None = None,
                 quant_kernel: QuantKernel | None = None,
                 attention_kernel: PagedAttention | None | str = "auto",
                 row_ops: RowOps | None | str = "auto", float_layout: str = "auto",
                 batch_invariant: bool = False) -> None:
        """Pick the weight layout (quantized, transposed fp32, rows) and load every
        layer's weights in it. Raises ValueError for a missing tensor or a bad range.
        Over 60 lines on purpose: the layout choices and the two loaders that follow
        from them (``w``, ``mat``) read as one decision; split, each part would take
        all of them as arguments."""
        if float_layout not in ("auto", "rows"):
            raise ValueError(f"float_layout {float_layout!r}: use 'auto' or 'rows'")
        self.config = config
        self.dtype = dtype
        start, end = layer_range or (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer_range {layer_range} outside 0..{config.num_layers}")
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == config.num_layers
        self.scale = config.attention_scale
        self.steps = layer_steps(config)
        if attention_kernel == "auto":
            attention_kernel = PagedAttention.create() if dtype == torch.float32 else None
        self.attention_kernel = attention_kernel
        self.batch_invariant = batch_invariant
        if row_ops == "auto":
            row_ops = RowOps.create() if dtype == torch.float32 else None
        self.row_ops = row_ops

        self.quantized = any(isinstance(t, QuantTensor) for t in tensors.values())
        self.quant_kernel = quant_kernel if self.quantized else None
        transposed = dtype == torch.float32 and not self.quantized and float_layout == "auto"
        self.rows_layout = not self.quantized and not transposed      # float matrices [out, in]
        # an fp32 model in the rows layout keeps bf16 / fp16 matrices as they came (widened
        # exactly where used: the plan executor in registers, torch's prefill per call)
        keep_16bit = dtype == torch.float32 and self.rows_layout
        self._linear = (_quant_linear if self.quantized else _matmul_in_out if transposed else
                        self._linear_rows if dtype == torch.float32 else _linear_batch_invariant)

        def w(name: str, matrix: bool = False) -> torch.Tensor | QuantTensor:
            if name not in tensors:
                raise ValueError(f"missing tensor {name}")
            t = tensors[name]
            if isinstance(t, QuantTensor):
                return t
            if matrix and keep_16bit and t.dtype in (torch.bfloat16, torch.float16):
                return t.contiguous()
            return t.to(dtype).contiguous()

        # the kernels' packed weights, on huge pages: one stream of ~100 MB a decode step
        arena = WeightArena()

        def mat(*names: str) -> Matrix:    # rows of these [out, in] weights -> what _linear takes
            parts = [w(n, matrix=True) for n in names]
            if self.quantized:
                return QuantLinear(parts, quant_kernel, arena)
            if len({p.dtype for p in parts}) > 1:          # 16-bit parts of two dtypes: fp32
                parts = [p.to(dtype) for p in parts]
            t = torch.cat(parts) if len(parts) > 1 else parts[0]
            return t.t().contiguous() if transposed else t.contiguous()

        embed = w("model.embed_tokens.weight", matrix=True) if self.is_first else None
        # a quantized table is read through its QuantLinear (rows dequantized on lookup)
        self.embed = QuantLinear([embed], quant_kernel, arena) if isinstance(embed, QuantTensor) else embed
        # one pair of RoPE tables per base: the global layers', and the sliding layers' own
        thetas = list(dict.fromkeys(config.layer_rope_theta(i) for i in range(start, end)))
        self.ropes = [rope_tables(config, dtype, None if t == config.rope_theta else t) for t in thetas]
        self.layers: list[_Layer] = []
        for i in range(start, end):
            p = f"model.layers.{i}."
            extra = {}
            if config.qkv_bias:
                extra["qkv_bias"] = torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            if config.qk_norm:
                extra["qk_norm"] = torch.cat([w(p + "self_attn.q_norm.weight"), w(p + "self_attn.k_norm.weight")])
            if config.sandwich_norms:
                extra["post_attn_norm"] = w(p + "post_attention_norm.weight")
                extra["post_ffw_norm"] = w(p + "post_feedforward_norm.weight")
            self.layers.append(_Layer(
                window=config.layer_window(i), rope=thetas.index(config.layer_rope_theta(i)), **extra,
                input_norm=w(p + "input_layernorm.weight"),
                qkv=mat(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                o=mat(p + "self_attn.o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=mat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=mat(p + "mlp.down_proj.weight"),
            ))
        if self.is_last:
            self.norm = w("model.norm.weight")
            head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            tied_here = config.tie_word_embeddings and self.embed is not None
            if tied_here and isinstance(self.embed, QuantLinear):
                self.lm_head = self.embed                   # one table, read both ways
            elif tied_here and not self.quantized:
                # shares the embedding unless transposed (then a [D, V] copy)
                self.lm_head = self.embed.t().contiguous() if transposed else self.embed
            else:
                self.lm_head = mat(head)
        # the global layers' tables (the fused bf16 kernel's): ropes' own where a layer here has them
        glob = config.rope_theta
        self.cos, self.sin = self.ropes[thetas.index(glob)] if glob in thetas else rope_tables(config, dtype)

    def _linear_rows(self, x: torch.Tensor, w_out_in: torch.Tensor) -> torch.Tensor:
        """fp32 x @ a float matrix [out, in]: ``F.linear``, a 16-bit matrix widened first
        (exactly: its fp32 copy's product); up to DENSE_PREFILL_ROWS rows of x over a 16-bit
        matrix, the plan executor's dense matmul instead (``RowOps.linear``: widened in
        registers, a decode step's bits), where widening a whole matrix in memory for a few
        rows cost more than the product; with ``batch_invariant``, that kernel at every row
        count and for fp32 matrices too."""
        if self.row_ops is not None and (self.batch_invariant or (w_out_in.dtype != x.dtype
                                                                   and x.shape[0] <= DENSE_PREFILL_ROWS)):
            return self.row_ops.linear(x, w_out_in)
        if w_out_in.dtype == x.dtype:
            return F.linear(x, w_out_in)
        return F.linear(x, w_out_in.to(x.dtype))

    @property
    def matrix_dtype(self) -> torch.dtype | None:
        """The float matrices' dtype (``dtype``, or a 16-bit checkpoint's kept as it is);
        None for a quantized model."""
        if self.quantized:
            return None
        return self.layers[0].qkv.dtype if self.layers else self.dtype

    @property
    def num_local_layers(self) -> int:
        return self.end - self.start

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights a single-token decode step must read (the bandwidth bound)."""
        n = sum(_nbytes(t) for layer in self.layers for t in vars(layer).values()
                if isinstance(t, (torch.Tensor, QuantLinear)))
        if self.is_last:
            n += _nbytes(self.lm_head) + _nbytes(self.norm)
        return n

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: torch.Tensor, on_layer: Callable[[int], None] | None = None,
                dist: DistStep | None = None) -> torch.Tensor:
        """x: token ids [T] (first stage) or hidden [T, D]; positions [T];
        kv: [local_layers, 2, N, bs, kvh, hd]. Returns hidden [T, D] (final-normed on the last stage).
        ``on_layer(i)`` runs after local layer ``i`` wrote its K/V (a layer-wise
        KV stream, engine/stream/layers.py); it must not block. ``dist``: the step's
        DistAttention (engine/dist_attention.py) where a sequence has KV in remote parts:
        every layer's attention goes through it (the paged kernel's bits)."""
        cfg, lin = self.config, self._linear
        if not self.is_first:
            h = x.to(self.dtype)                                                  # [T, D]
        elif isinstance(self.embed, QuantLinear):
            h = self.embed.embed(x).to(self.dtype)
        else:
            h = F.embedding(x, self.embed).to(self.dtype)                 # a 16-bit table's rows widened
        if self.is_first and cfg.embed_scale != 1.0:
            h = h * torch.tensor(cfg.embed_scale, dtype=h.dtype)          # rounded to h's dtype, as HF's Gemma
        rows = self.row_ops if h.dtype == torch.float32 else None
        ropes = [(cos[positions], sin[positions]) for cos, sin in self.ropes]      # [T, hd] per base
        eps = cfg.rms_norm_eps
        for i, layer in enumerate(self.layers):
            acts = {"h": h}
            for step in self.steps:
                x = acts[step.src]
                w = getattr(layer, step.weight) if step.weight else None
                op = step.op
                if op == "rms_norm":
                    y = rows.rms_norm(x, w, eps) if rows else rms_norm(x, w, eps)
                elif op == "linear":
                    y = lin(x, w)
                elif op == "linear_add":       # dst + x Wᵀ, summed into the product's fresh tensor
                    y = lin(x, w)
                    y += acts[step.dst]
                elif op == "silu_mul" and rows:
                    y = rows.silu_mul(x)
                elif op == "silu_mul":
                    gate, up = x.chunk(2, dim=-1)
                    y = F.silu(gate) * up
                elif op == "gelu_mul" and rows:
                    y = rows.gelu_mul(x)
                elif op == "gelu_mul":
                    gate, up = x.chunk(2, dim=-1)
                    y = F.gelu(gate, approximate="tanh") * up
                elif op == "add_bias":
                    y = x + w
                elif op == "qk_norm":
                    y = self._qk_norm(x, w, rows)
                elif op == "add":
                    y = acts[step.dst] + x
                elif op == "rope_attention":
                    cos, sin = ropes[layer.rope]
                    y = self._rope_attention(x, cos, sin, positions, batch, kv[i], rows, layer.window,
                                             (i, dist) if dist is not None else None)
                else:
                    raise ValueError(f"LAYER_STEPS: unknown op {op!r}")
                acts[step.dst] = y
            h = acts["h"]
            if on_layer is not None:
                on_layer(i)
        if self.is_last:
            h = rows.rms_norm(h, self.norm, eps) if rows else rms_norm(h, self.norm, eps)
        return h

    def _qk_norm(self, qkv: torch.Tensor, w: torch.Tensor, rows: RowOps | None) -> torch.Tensor:
        """qkv [T, q + 2kv] with each q head normed by ``w[:hd]`` and each k head by
        ``w[hd:]`` (RMSNorm over head_dim); v as it is. ``rows``: the row ops (the plan
        executor's norm, bit for bit), or None (torch's)."""
        cfg = self.config
        T, q_size, kv_size, hd = qkv.shape[0], cfg.q_size, cfg.kv_size, cfg.head_dim
        eps = cfg.rms_norm_eps

        def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:    # x [T, n * hd]
            heads = x.reshape(-1, hd)
            return (rows.rms_norm(heads, weight.contiguous(), eps) if rows else rms_norm(heads, weight, eps)).reshape(T, -1)

        return torch.cat((norm(qkv[:, :q_size], w[:hd]), norm(qkv[:, q_size:q_size + kv_size], w[hd:]),
                          qkv[:, q_size + kv_size:]), dim=1)

    def _rope_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        batch: AttentionBatch, kv_layer: torch.Tensor, rows: RowOps | None,
                        window: int | None, dist: tuple[int, DistStep] | None = None) -> torch.Tensor:
        """qkv [T, q + 2kv] -> attention output [T, q]; writes the new K/V into
        ``kv_layer`` ([2, N, bs, kvh, hd]). cos, sin: [T, hd] at the tokens' positions
        [T]; ``rows``: forward's row ops for these activations, or None (torch's RoPE);
        ``window``: the layer's sliding window (keys outside it are masked), or None;
        ``dist``: (layer index, the step's DistAttention): K/V written and attended
        through it, local and remote parts (raises ValueError where the paged kernel
        does not serve this model)."""
        cfg = self.config
        T, q_size, kv_size, hd = qkv.shape[0], cfg.q_size, cfg.kv_size, cfg.head_dim
        # RoPE on q and k heads together: [T, H + kvh, hd]
        if rows is not None:
            qk = rows.rope(qkv, cfg.num_heads + cfg.num_kv_heads, hd, cos, sin)
        else:
            qk = apply_rope(qkv[:, :q_size + kv_size].view(T, cfg.num_heads + cfg.num_kv_heads, hd),
                            cos.unsqueeze(1), sin.unsqueeze(1))
        q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        v = qkv[:, q_size + kv_size:].view(T, cfg.num_kv_heads, hd)
        k_cache, v_cache = kv_layer[0], kv_layer[1]       # [N, bs, kvh, hd]
        if dist is not None:
            if self.attention_kernel is None or q.dtype != torch.float32 or cfg.attn_logit_softcap is not None:
                raise ValueError("KV in remote parts needs the paged attention kernel (fp32, no softcap)")
            return dist[1].attend(dist[0], q, k, v, k_cache, v_cache, self.scale, window).reshape(T, q_size)
        # a 16-bit cache of an fp32 model (kv_cache_dtype): this step attends to the K/V as
        # the cache holds them, as every later step and a chunked or cached prefill does
        k, v = store_kv(k, k_cache.dtype), store_kv(v, k_cache.dtype)     # themselves when dtypes match
        write_kv(k_cache, v_cache, k, v, batch)
        if self.attention_kernel is not None and q.dtype == torch.float32 and cfg.attn_logit_softcap is None:
            o = self.attention_kernel.attend(q, k_cache, v_cache, *batch.paged_rows(positions), self.scale,
                                             window=window)
            if o is not None:
                return o.reshape(T, q_size)
        k, v = k.to(q.dtype), v.to(q.dtype)
        if batch.is_prefill:
            o = prefill_attention(q, k, v, k_cache, v_cache, batch, self.scale, window=window,
                                  softcap=cfg.attn_logit_softcap)
        else:
            o = decode_attention(q, k_cache, v_cache, batch, self.scale, window=window,
                                 positions=positions, softcap=cfg.attn_logit_softcap)
        return o.reshape(T, q_size)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, D] (final-normed) -> logits [n, V] in fp32."""
        logits = self._linear(hidden, self.lm_head).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
