"""A ``LlamaModel``'s decode step on a one-call C++ kernel: the adapters.

The kernels know nothing of the model (kernels/plan_decode.py runs a plan of
ops it is given; kernels/fused_decode.py writes one layer out in C++). Here the
model is turned into what they take:

- ``plan_decoder``: an fp32 model (quantized, or float matrices in the rows
  layout) as a ``Plan``: its layer plan (llama.py's ``layer_steps``) as it is,
  each layer's weights by the steps' names, the embedding, final norm and LM
  head, each layer's RoPE tables and sliding window, the embedding scale. A plan
  with an op the executor lacks is declined by the executor; what an
  architecture changes outside the steps that the executor does not implement
  (``attention_features`` less ``PLAN_FEATURES``: softcaps) is declined here,
  by name.
- ``fused_decoder``: a bf16 float model as ``FusedWeights``, where its
  layer plan is the layer the fused kernel writes out (``fused_decode.LAYER``).

Each returns None (logged, and for the model's reasons said by
``plan_unsupported_reason`` / ``fused_unsupported_reason``) where the model
cannot run there; decode then stays on ``LlamaModel.forward``.
"""

from __future__ import annotations

import logging

import torch

from engine.model.config import LlamaConfig
from engine.model.llama import LlamaModel
from kernels import fused_decode, plan_decode
from kernels.decode_inputs import DecoderDims
from kernels.fused_decode import FusedDecoder, FusedWeights, LayerWeights
from kernels.plan_decode import Plan, PlanDecoder

log = logging.getLogger(__name__)


def decoder_dims(model: LlamaModel) -> DecoderDims:
    """``model``'s shape in the executors' terms."""
    cfg = model.config
    return DecoderDims(num_layers=cfg.num_layers, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                       heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       vocab=cfg.vocab_size, eps=cfg.rms_norm_eps, scale=model.scale)


def attention_features(config: LlamaConfig) -> dict[str, str]:
    """What ``config`` asks of a decode step beyond its layer plan's ops: each feature's
    config field and how a message names it. The fused kernel implements none of these;
    the plan executor those in PLAN_FEATURES."""
    features = {}
    if config.sliding_window is not None:
        features["sliding_window"] = f"sliding-window attention ({config.sliding_window} keys)"
    if config.rope_local_theta is not None and config.rope_local_theta != config.rope_theta:
        features["rope_local_theta"] = "a RoPE base per layer kind"
    if config.embed_scale != 1.0:
        features["embed_scale"] = "embedding scaling"
    if config.query_pre_attn_scalar is not None and config.query_pre_attn_scalar != config.head_dim:
        features["query_pre_attn_scalar"] = "query_pre_attn_scalar"
    if config.attn_logit_softcap is not None:
        features["attn_logit_softcap"] = "attention logit softcapping"
    if config.final_logit_softcap is not None:
        features["final_logit_softcap"] = "final logit softcapping"
    return features


# What the plan executor implements of attention_features: a layer's window and RoPE tables,
# the embedding scale and the attention scale are data in its plan (model_plan).
PLAN_FEATURES = frozenset({"sliding_window", "rope_local_theta", "embed_scale", "query_pre_attn_scalar"})


def _features_reason(model: LlamaModel, implemented: frozenset[str] = frozenset()) -> str | None:
    missing = [text for name, text in attention_features(model.config).items() if name not in implemented]
    return f"{model.config.architecture}: {', '.join(missing)}" if missing else None


# ------------------------------------------------------------------ the plan executor (fp32)
def float_unsupported_reason(config: LlamaConfig) -> str | None:
    """Why the plan executor could not run an fp32 float model of ``config`` here (its
    shapes, this CPU), or None: what ``build_model`` asks before keeping such a model's
    matrices in the rows layout, which only the executor wants."""
    return plan_decode.float_unsupported_reason(config.head_dim, {
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "q_size": config.q_size})


def model_plan(model: LlamaModel) -> Plan:
    """``model`` as the plan executor runs it (its layer plan, its weights in place)."""
    names = list(dict.fromkeys(s.weight for s in model.steps if s.weight))
    return Plan(dims=decoder_dims(model), steps=model.steps,
                layers=tuple({name: getattr(layer, name) for name in names} for layer in model.layers),
                embed=model.embed, head=model.lm_head, final_norm=model.norm, ropes=tuple(model.ropes),
                layer_rope=tuple(layer.rope for layer in model.layers),
                layer_window=tuple(layer.window for layer in model.layers), quantized=model.quantized,
                embed_scale=model.config.embed_scale)


def _plan_model_reason(model: LlamaModel) -> str | None:
    """Why ``model`` makes no plan the executor could take, or None (then the plan decides)."""
    if not model.quantized and not model.rows_layout:
        return ("float weights stored [in, out] for MKL's decode (the plan executor reads them [out, in]: "
                "LlamaModel(float_layout=\"rows\"))")
    if model.dtype != torch.float32:
        return f"dtype {model.dtype} (the plan executor computes in fp32)"
    if not (model.is_first and model.is_last):
        return "a pipeline stage (the plan executor runs whole models)"
    return _features_reason(model, PLAN_FEATURES)


def plan_unsupported_reason(model: LlamaModel) -> str | None:
    """Why the plan executor cannot run ``model``'s decode steps here, or None."""
    return _plan_model_reason(model) or plan_decode.unsupported_reason(model_plan(model))


def plan_decoder(model: LlamaModel, kv: torch.Tensor, block_size: int,
                 variant: str | None = None) -> PlanDecoder | None:
    """The plan executor for ``model`` over the KV tensor ``kv`` ([L, 2, N, bs, kvh, hd]),
    or None (logged) where it cannot run (``PlanDecoder.create``, ``variant`` likewise)."""
    reason = _plan_model_reason(model)
    if reason is not None:
        log.info("plan decode off: %s", reason)
        return None
    return PlanDecoder.create(model_plan(model), kv, block_size, variant)


# ------------------------------------------------------------------ the fused kernel (bf16)
def _fused_model_reason(model: LlamaModel) -> str | None:
    """Why ``model`` is not a decoder the fused kernel implements, or None."""
    if model.quantized:
        return "quantized weights (the fused step packs bf16 matrices; weights = \"native\" has its own kernel)"
    if model.dtype != torch.bfloat16:
        return f"dtype {model.dtype} (the fused decode step is bf16 only)"
    if not (model.is_first and model.is_last):
        return "a pipeline stage (the fused step runs whole models)"
    if tuple((s.op, s.src, s.dst, s.weight) for s in model.steps) != fused_decode.LAYER:
        return (f"{model.config.architecture}'s layer plan is not the layer the fused kernel implements "
                "(fused_decode.LAYER)")
    return _features_reason(model)


def fused_unsupported_reason(model: LlamaModel) -> str | None:
    """Why ``model`` cannot use the fused decode step here, or None if it can."""
    return _fused_model_reason(model) or fused_decode.unsupported_reason(decoder_dims(model))


def fused_decoder(model: LlamaModel, kv: torch.Tensor, block_size: int) -> FusedDecoder | None:
    """The fused bf16 decoder for ``model`` over the KV tensor ``kv`` ([L, 2, N, bs, kvh, hd]),
    or None (logged) where it cannot run (``FusedDecoder.create``)."""
    reason = _fused_model_reason(model)
    if reason is not None:
        log.info("fused decode off: %s", reason)
        return None
    weights = FusedWeights(
        dims=decoder_dims(model),
        layers=tuple(LayerWeights(input_norm=layer.input_norm, qkv=layer.qkv, o=layer.o, post_norm=layer.post_norm,
                                  gate_up=layer.gate_up, down=layer.down) for layer in model.layers),
        embed=model.embed, final_norm=model.norm, lm_head=model.lm_head, cos=model.cos, sin=model.sin)
    return FusedDecoder.create(weights, kv, block_size)
