"""GGUF files of the K-quant, Q5 and IQ4 types (tools/random_gguf.py: random valid
blocks), loaded end to end: the fp32 loader against gguf-py, the native loader, the engine."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from engine.model.config import tiny_config
from engine.model.weights import load_gguf, reverse_permute_qk
from kernels import gguf_blocks
from tools.random_gguf import write_llama

FORMATS = tuple(gguf_blocks.BLOCKS)


def kquant_config(**overrides):
    """Every row length a multiple of 256 (the K-quants' super-block)."""
    base = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=64, bos_token_id=1, eos_token_ids=(2,), rms_norm_eps=2.0 ** -17)
    return tiny_config(**{**base, **overrides})


@pytest.fixture(scope="module", params=FORMATS)
def kquant_gguf(request, tmp_path_factory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("kq") / f"{request.param}.gguf"
    write_llama(path, kquant_config(), request.param, seed=7)
    return request.param, path


def test_the_fp32_loader_gives_gguf_py_values(kquant_gguf):
    fmt, path = kquant_gguf
    loaded = load_gguf(path)
    cfg = loaded.config
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, name, heads in (("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", cfg.num_heads),
                                   ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight",
                                    cfg.num_kv_heads),
                                   ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
                                   ("token_embd.weight", "model.embed_tokens.weight", None)):
        t = by_name[gguf_name]
        assert gguf.GGMLQuantizationType(t.tensor_type).name == fmt
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        if heads:
            want = reverse_permute_qk(want, heads)
        assert torch.equal(loaded.tensors[name], want), name
