"""A GGUF's architecture: its ``{arch}.*`` metadata as a ``LlamaConfig``, and its
tensor names as the decoder's.

kvd serves the architectures of ``config.ARCHITECTURES`` with one decoder; what
sets one apart is read here, from the metadata keys llama.cpp writes for it and
from which tensors the file has (biases on q/k/v, per-head q/k norms), the rest
being the architecture's fixed traits as llama.cpp builds it:

==========  ==================================================================
llama       Llama 2/3, Mistral, SmolLM: q/k rows permuted for interleaved RoPE
qwen2       biases on q, k, v
qwen3       RMSNorm over each q and k head
gemma3      q/k head norms, norms around attention and MLP, GeGLU, embeddings
            times sqrt(hidden); every 6th layer global, the others slide over
            ``gemma3.attention.sliding_window`` keys with RoPE base 10000
phi3        fused qkv and gate/up matrices (split here); a sliding window on
            every layer when the file names one
==========  ==================================================================

Norm weights come as llama.cpp's converter writes them (Gemma's ``1 + w``
already added), so every norm multiplies by its weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from engine.model.config import ARCHITECTURES, LlamaConfig
from kernels.quant import QuantTensor

# GGUF (llama.cpp) per-layer tensor name -> decoder (HF Llama) name suffix. The
# gemma3 norms around attention and MLP are post_attention_norm / post_feedforward_norm
# (HF's Llama name post_attention_layernorm is the norm before the MLP, GGUF's ffn_norm).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",          # phi3: split into q, k, v (split_fused)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",                   # phi3: gate and up, split (split_fused)
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_norm",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# the tensors that may carry a bias (qwen2's q, k, v)
BIASED = ("attn_q", "attn_k", "attn_v")
# gemma3's traits llama.cpp fixes rather than reads (llama-model.cpp, LLM_ARCH_GEMMA3)
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def hf_name(gguf_name: str, path: Path) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``. ValueError
    names a tensor the decoder has no place for."""
    base, _, suffix = gguf_name.rpartition(".")
    if base == "rope_freqs" or base.startswith("rope_factors"):
        # Llama-3.1's frequency factors, Phi-3's long-context ones: the decoder would
        # need them and GGUF does not carry the parameters to rebuild them.
        raise ValueError(f"{path}: {base} (RoPE frequency factors) is not supported")
    if suffix not in ("weight", "bias"):
        raise ValueError(f"{path}: unexpected tensor {gguf_name}")
    if base in GLOBAL_NAMES and suffix == "weight":
        return GLOBAL_NAMES[base] + ".weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        if suffix == "bias" and parts[2] not in BIASED:
            raise ValueError(f"{path}: unexpected tensor {gguf_name} (only q, k and v take biases)")
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"{path}: unexpected tensor {gguf_name}")


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], vocab_rows: int | None,
                     path: Path) -> LlamaConfig:
    """The decoder's config from a GGUF's metadata (``meta``: key -> value; the
    tokenizer's arrays may be left out) and tensor names. ``vocab_rows``: the
    tokenizer's token count, else the embedding's row count (the vocabulary size when
    no key says it). ValueError naming an unknown architecture, a missing key or bad values."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def field(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}")
        return default if value is None else value

    def required(key: str) -> Any:
        value = field(key)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    layers = int(required("block_count"))
    vocab = field("vocab_size", vocab_rows)
    if vocab is None:
        raise ValueError(f"{path}: cannot tell the vocabulary size")
    if arch == "llama":
        head_dim = field("attention.key_length") or field("rope.dimension_count") or hidden // heads
    else:
        head_dim = field("attention.key_length") or hidden // heads
        rope_dim = field("rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != int(head_dim):
            raise ValueError(f"{path}: {arch}.rope.dimension_count {rope_dim} is not the head size {head_dim} "
                             "(partial RoPE is not supported)")
    rope_scaling = None
    scaling_type = field("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = (("rope_type", str(scaling_type)), ("factor", float(required("rope.scaling.factor"))))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    gemma = arch == "gemma3"
    window = field("attention.sliding_window") if arch in ("gemma3", "phi3") else None
    query_scalar = None
    if gemma and layers == 62:       # Gemma 3 27B scales queries by hidden / heads (llama.cpp does too)
        query_scalar = hidden / heads
    try:
        return LlamaConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(required("feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(field("attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rope_theta=float(field("rope.freq_base", 10000.0)),
            rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-6 if arch != "llama" else 1e-5)),
            max_position_embeddings=int(field("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids if e is not None)),
            rope_scaling=rope_scaling,
            architecture=arch,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            sandwich_norms=gemma,
            activation="gelu_tanh" if gemma else "silu",
            embed_scale=math.sqrt(hidden) if gemma else 1.0,
            sliding_window=None if not window else int(window),
            global_layer_every=GEMMA3_GLOBAL_EVERY if gemma else None,
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if gemma else None,
            query_pre_attn_scalar=query_scalar,
            attn_logit_softcap=_positive(field("attn_logit_softcapping")),
            final_logit_softcap=_positive(field("final_logit_softcapping")),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: bad model metadata: {exc}") from exc


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def split_fused(tensors: dict[str, torch.Tensor | QuantTensor], config: LlamaConfig, path: Path) -> None:
    """Phi-3's fused matrices split into the decoder's, in place: ``qkv_proj`` [q + 2kv, D]
    into q, k, v; an ``up_proj`` of 2 * intermediate rows (gate and up, in that order) into
    gate and up. Whole rows move (a ``QuantTensor``'s rows of blocks too). ValueError when a
    fused matrix's rows disagree with the metadata."""
    q, kv, ffn = config.q_size, config.kv_size, config.intermediate_size
    for name in [n for n in tensors if n.endswith("self_attn.qkv_proj.weight")]:
        _split(tensors, name, {"q_proj": q, "k_proj": kv, "v_proj": kv}, path)
    for name in [n for n in tensors if n.endswith("mlp.up_proj.weight")]:
        if tensors[name].shape[0] == 2 * ffn and name.replace("up_proj", "gate_proj") not in tensors:
            _split(tensors, name, {"gate_proj": ffn, "up_proj": ffn}, path)


def _split(tensors: dict[str, torch.Tensor | QuantTensor], name: str, parts: dict[str, int], path: Path) -> None:
    fused = tensors.pop(name)
    if fused.shape[0] != sum(parts.values()):
        raise ValueError(f"{path}: tensor {name} has {fused.shape[0]} rows, the metadata gives "
                         f"{' + '.join(str(n) for n in parts.values())}")
    prefix = name.rsplit(".", 2)[0]                   # model.layers.i.self_attn / .mlp
    start = 0
    for part, rows in parts.items():
        if isinstance(fused, QuantTensor):
            piece = fused.take_rows(torch.arange(start, start + rows))
        else:
            piece = fused[start:start + rows].contiguous()
        tensors[f"{prefix}.{part}.weight"] = piece
        start += rows
