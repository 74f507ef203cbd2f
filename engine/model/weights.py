"""Model weights: load a Llama from GGUF or a Hugging Face safetensors directory.

Both loaders return the same thing, ``LoadedWeights``: a ``LlamaConfig`` and a
dict of float32 contiguous tensors under Hugging Face Llama names, shaped as in
HF (a Linear weight is ``[out_features, in_features]``). ``load_gguf(path,
quantized=True)`` keeps Q4_0, Q4_1 and Q8_0 matrices in their GGUF blocks
instead (``kernels.quant.QuantTensor``, same logical shape, no fp32 copy)::

    model.embed_tokens.weight                         [V, D]
    model.layers.{i}.input_layernorm.weight           [D]
    model.layers.{i}.self_attn.q_proj.weight          [H*hd, D]
    model.layers.{i}.self_attn.{k,v}_proj.weight      [KV*hd, D]
    model.layers.{i}.self_attn.o_proj.weight          [D, H*hd]
    model.layers.{i}.post_attention_layernorm.weight  [D]
    model.layers.{i}.mlp.{gate,up}_proj.weight        [F, D]
    model.layers.{i}.mlp.down_proj.weight             [D, F]
    model.norm.weight                                 [D]
    lm_head.weight                                    [V, D]   (untied only)

The decoder uses HF's rotate_half RoPE. llama.cpp's converter permutes the
rows of q/k for its interleaved RoPE; ``load_gguf`` undoes that exactly as
transformers' GGUF loader does (``_reverse_permute_weights``).

No pickle anywhere: safetensors and GGUF only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model import gguf_arch
from engine.model.config import LlamaConfig
from engine.model.gguf_meta import TYPE_NAMES, check_tensor_table, read_header
from engine.model.gguf_tensors import GGUFTensor, map_tensors
from kernels import gguf_blocks, kquant_repack
from kernels.quant import GGUF_FORMATS, QuantTensor


# GGUF tensor types we load (gguf_meta.TYPE_NAMES; others are refused by name, before
# anything is read): gguf-py dequantizes F32 ... Q4_1, kernels/gguf_blocks.py the rest
# (each checked bit for bit against gguf-py).
SUPPORTED_GGUF_TYPES = tuple(TYPE_NAMES.values())
# Of those, the block formats load_gguf(quantized=True) keeps as they are, and the ones it
# repacks into kvd's blocks (kernels/kquant_repack.py: every weight kept).
NATIVE_GGUF_TYPES = GGUF_FORMATS
REPACKED_GGUF_TYPES = tuple(kquant_repack.TARGET)

# Tensors some HF checkpoints carry that the decoder recomputes.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedWeights:
    """A config plus its tensors (HF names, float32, contiguous, CPU; or
    ``QuantTensor`` for a block-quantized matrix loaded with ``quantized=True``;
    or bf16 / fp16 as stored, from ``load_hf_dir(keep_16bit=True)``).

    ``source`` says where they came from ("gguf:/path", "hf:/dir", "tiny:0").
    The dict is not copied by consumers; treat it as read-only.
    """

    config: LlamaConfig
    tensors: dict[str, torch.Tensor | QuantTensor]
    source: str

    @property
    def is_quantized(self) -> bool:
        return any(isinstance(t, QuantTensor) for t in self.tensors.values())

    def dequantized(self) -> LoadedWeights:
        """The same weights with every ``QuantTensor`` dequantized to float32
        (bit for bit what ``load_gguf(path)`` gives); self when none is quantized."""
        if not self.is_quantized:
            return self
        return LoadedWeights(self.config, {n: t.dequantize() if isinstance(t, QuantTensor) else t
                                           for n, t in self.tensors.items()}, self.source)


# --------------------------------------------------------------------- shapes
def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama of ``config`` needs, name -> shape (insertion order = layer order)."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (q, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
        if config.qkv_bias:
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        if config.sandwich_norms:
            shapes[p + "post_attention_norm.weight"] = (d,)
            shapes[p + "post_feedforward_norm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def validate(config: LlamaConfig, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``ValueError`` naming every missing or unexpected tensor and the first bad shape."""
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in tensors]
    unexpected = [n for n in tensors if n not in expected]
    if missing:
        raise ValueError(f"{source}: missing tensors: {_short_list(missing)}")
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors (not a plain Llama?): {_short_list(unexpected)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                             f"expected {shape} from the config")


def _short_list(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ----------------------------------------------------------------------- GGUF
def load_gguf(path: str | Path, quantized: bool = False) -> LoadedWeights:
    """Read a GGUF file of an architecture kvd serves, dequantize every tensor to float32
    — or, with ``quantized``, keep Q4_0 / Q4_1 / Q8_0 matrices as ``QuantTensor``
    (their bytes copied out of the file as they are; a llama's q/k rows un-permuted;
    fused matrices split: engine/model/gguf_arch.py), and repack the K-quant, Q5 and
    IQ4 ones into kvd's blocks (kernels/kquant_repack.py; a converted type is logged
    once with its cost).

    Config comes from the ``{arch}.*`` metadata keys (gguf_arch.config_from_gguf);
    embeddings are tied when the file has no ``output.weight``. Raises ``ValueError`` for a missing
    file, another architecture, an unsupported tensor type (named), a tensor
    whose bytes do not fit its shape (a truncated file), missing tensors or
    shapes that disagree with the metadata.
    """
    import gguf  # local: only this loader needs it

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    source = f"gguf:{path}"
    meta, infos = read_header(path)       # ValueError naming the file for a malformed header
    check_tensor_table(path, infos)
    file_tensors = map_tensors(path, infos)
    config = _gguf_config(meta, file_tensors, path)

    tensors: dict[str, torch.Tensor] = {}
    for tensor in file_tensors:
        name = gguf_arch.hf_name(tensor.name, path)
        if name is None:
            continue
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)     # a supported type: check_tensor_table
        if quantized and qtype.name in NATIVE_GGUF_TYPES and len(tensor.shape) == 2:
            weight = _gguf_blocks(tensor, qtype.name, path)
        elif quantized and qtype.name in REPACKED_GGUF_TYPES and len(tensor.shape) == 2:
            weight = kquant_repack.repack(qtype.name, _gguf_decoded(tensor, qtype.name, path))
        elif qtype.name == "Q8_0" and len(tensor.shape) == 2:
            # gguf-py's values bit for bit, ~8x faster (a 262,144-row embedding); for
            # Q4_0 / Q4_1 gguf-py's own numpy is the faster of the two
            weight = _gguf_blocks(tensor, qtype.name, path).dequantize()
        elif qtype.name in gguf_blocks.BLOCKS:
            weight = _gguf_decoded(tensor, qtype.name, path).dequantize()
            weight = weight.view(*reversed([int(n) for n in tensor.shape]))
        else:
            # dequantize returns the logical shape in numpy order: [out, in] for a Linear.
            array = gguf.quants.dequantize(tensor.data, qtype)
            # Copy: F32/F16 come back as views of the read-only memory map.
            weight = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
        if config.architecture == "llama" and name.endswith("self_attn.q_proj.weight"):
            weight = reverse_permute_qk(weight, config.num_heads)
        elif config.architecture == "llama" and name.endswith("self_attn.k_proj.weight"):
            weight = reverse_permute_qk(weight, config.num_kv_heads)
        tensors[name] = weight if isinstance(weight, QuantTensor) else weight.contiguous()

    gguf_arch.split_fused(tensors, config, path)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    validate(config, tensors, source)
    return LoadedWeights(config=config, tensors=tensors, source=source)


def _gguf_blocks(tensor: Any, fmt: str, path: Path) -> QuantTensor:
    """A GGUF block-quantized matrix as a ``QuantTensor``: its bytes, copied (the
    reader's are views of a read-only memory map). ValueError when they do not fit."""
    cols, rows = (int(n) for n in tensor.shape)           # GGUF lists ne0 (the row length) first
    data = np.asarray(tensor.data)
    try:
        return QuantTensor(fmt, (rows, cols), torch.from_numpy(np.array(data, dtype=np.uint8, order="C",
                                                                         copy=True)))
    except ValueError as exc:
        raise ValueError(f"{path}: tensor {tensor.name}: {exc}") from None


def _gguf_decoded(tensor: Any, fmt: str, path: Path) -> gguf_blocks.SubBlocks:
    """A tensor of a kernels/gguf_blocks.py format, decoded as [rows, cols] (a vector as
    one row); ValueError naming the tensor when its bytes do not fit."""
    cols = int(tensor.shape[0])                           # GGUF lists ne0 (the row length) first
    rows = int(np.prod([int(n) for n in tensor.shape[1:]], dtype=np.int64))
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, order="C", copy=True).reshape(rows, -1))
    try:
        sub = gguf_blocks.decode(fmt, data, cols)
    except ValueError as exc:
        raise ValueError(f"{path}: tensor {tensor.name}: {exc}") from None
    return sub


def reverse_permute_qk(weight: torch.Tensor | QuantTensor, n_heads: int) -> torch.Tensor | QuantTensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> HF rotate_half).

    llama.cpp wrote ``w.reshape(n, 2, hd/2, D).swapaxes(1, 2)``; per head, rows
    ``[x0 y0 x1 y1 ...]`` go back to ``[x0 x1 ... y0 y1 ...]``.
    weight: [n_heads * hd, D] -> same shape. A ``QuantTensor``'s rows (whole
    rows of blocks) move the same way.
    """
    if isinstance(weight, QuantTensor):
        order = reverse_permute_qk(torch.arange(weight.shape[0]).unsqueeze(1), n_heads).squeeze(1)
        return weight.take_rows(order)
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return (weight.reshape(n_heads, half, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _gguf_config(meta: dict[str, Any], file_tensors: list[GGUFTensor], path: Path) -> LlamaConfig:
    """``gguf_arch.config_from_gguf`` over a file's metadata (of the tokenizer's
    arrays only the vocabulary's length)."""
    model_meta = {key: value for key, value in meta.items()
                  if not key.startswith("tokenizer.") or key.endswith("_token_id")}
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = next((t for t in file_tensors if t.name == "token_embd.weight"), None)
    vocab_rows = len(tokens) if tokens is not None else (int(embed.shape[1]) if embed is not None else None)
    return gguf_arch.config_from_gguf(model_meta, {t.name for t in file_tensors}, vocab_rows, path)


# ----------------------------------------------------------- Hugging Face dir
def load_hf_dir(path: str | Path, keep_16bit: bool = False) -> LoadedWeights:
    """Read ``config.json`` + ``*.safetensors`` (single file or sharded with an index).

    Tensors of any float dtype are converted to float32, but bf16 and fp16 ones
    stay as they are with ``keep_16bit`` (LlamaModel keeps such matrices for an
    fp32 model whose decode steps run on the plan executor). A checkpoint that
    ties embeddings but still stores ``lm_head.weight`` has it dropped.
    Raises ``ValueError`` for a missing directory/config/weights, a non-Llama
    ``model_type``, missing/unexpected tensors or bad shapes.
    """
    from safetensors import safe_open

    path = Path(path)
    source = f"hf:{path}"
    if not path.is_dir():
        raise ValueError(f"Hugging Face model directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: no config.json")
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text(encoding="utf-8")) if generation_file.is_file() else {}
    config = config_from_hf(raw, generation, source)

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ValueError(f"{path}: shard {file.name} listed in the index is missing")
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_HF_SUFFIXES):
                    continue
                t = f.get_tensor(name)
                keep = keep_16bit and t.dtype in (torch.bfloat16, torch.float16)
                tensors[name] = (t if keep else t.to(torch.float32)).contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    validate(config, tensors, source)
    return LoadedWeights(config=config, tensors=tensors, source=source)


def config_from_hf(raw: dict[str, Any], generation: dict[str, Any] | None = None,
                   source: str = "config.json") -> LlamaConfig:
    """Map an HF ``config.json`` dict (and optional generation config) onto ``LlamaConfig``.

    Follows HF's defaults: ``num_key_value_heads`` = heads, ``head_dim`` =
    hidden / heads, ``tie_word_embeddings`` = False. ``rope_theta`` may sit at
    the top level (transformers 4) or in ``rope_parameters`` (transformers 5).
    """
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise ValueError(f"{source}: model_type {model_type!r} is not supported (need 'llama')")
    generation = generation or {}
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_parameters = raw.get("rope_parameters") or {}
        rope = raw.get("rope_scaling") or rope_parameters
        rope_theta = raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type not in (None, "default"):
            rope_scaling = tuple(sorted((k, v) for k, v in {**rope, "rope_type": rope_type}.items()
                                        if k not in ("rope_theta", "type") and isinstance(v, (int, float, str))))
        eos: list[int] = []
        for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
            eos += [value] if isinstance(value, int) else list(value or [])
        bos = raw.get("bos_token_id", generation.get("bos_token_id"))
        return LlamaConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
            rope_scaling=rope_scaling,
        )
    except KeyError as exc:
        raise ValueError(f"{source}: config key {exc.args[0]} is missing") from exc
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: bad config: {exc}") from exc


def config_to_hf(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` dict transformers' ``LlamaConfig`` reads back to the same model."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        out["eos_token_id"] = (config.eos_token_ids[0] if len(config.eos_token_ids) == 1
                               else list(config.eos_token_ids))
    if config.rope_scaling is not None:
        out["rope_scaling"] = dict(config.rope_scaling)
    return out


def save_hf_dir(weights: LoadedWeights, path: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``path`` (created if needed):
    bf16 and fp16 tensors as they are, any other as float32.

    ``load_hf_dir(path)`` gives back equal config and tensors (``keep_16bit=True``:
    of the same dtypes too). Validates first,
    so a bad ``LoadedWeights`` never reaches disk. Returns ``path``.
    """
    from safetensors.torch import save_file

    validate(weights.config, weights.tensors, weights.source)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(weights.config), indent=2) + "\n",
                                      encoding="utf-8")
    tensors = {name: (t if t.dtype in (torch.bfloat16, torch.float16) else t.to(torch.float32)).detach().contiguous()
               for name, t in weights.tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# ------------------------------------------------------------------ random init
def random_weights(config: LlamaConfig, seed: int = 0, std: float = 0.02) -> LoadedWeights:
    """Random Llama weights, deterministic per ``(config, seed)``.

    Linears and embeddings ~ N(0, std); norms are ones. Draws in
    ``expected_shapes`` order from one seeded ``torch.Generator``, so the same
    seed gives bit-identical tensors on every machine (CPU generator).
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    return LoadedWeights(config=config, tensors=tensors, source=f"random:seed={seed}")
