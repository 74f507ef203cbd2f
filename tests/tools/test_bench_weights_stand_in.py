"""``tools.bench.engine.bench_engine.random_smollm2``: the stand-in for the bundled GGUF on hosts the file
cannot reach (benchmarks only). Its timings stand for the real model's only if it has the
same config, the same tensors in the same block formats and shapes, and so the same bytes
per decode step; its values must be finite."""

from __future__ import annotations

import torch

from engine.model.registry import resolve_model
from kernels.quant import QuantTensor
from tools.bench.engine.bench_engine import random_smollm2


def test_same_config_formats_shapes_and_bytes_as_the_bundled_model():
    real = resolve_model("smollm2").load_weights(quantized=True)
    fake = random_smollm2()
    assert fake.config.vocab_size == real.config.vocab_size
    for field in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "rope_theta", "tie_word_embeddings"):
        assert getattr(fake.config, field) == getattr(real.config, field), field
    assert fake.tensors.keys() == real.tensors.keys()
    for name, t in real.tensors.items():
        f = fake.tensors[name]
        assert type(f) is type(t) and tuple(f.shape) == tuple(t.shape), name
        if isinstance(t, QuantTensor):
            assert f.fmt == t.fmt and f.nbytes == t.nbytes, name


def test_values_are_finite_and_model_sized():
    fake = random_smollm2()
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
        w = fake.tensors[name].dequantize()
        assert torch.isfinite(w).all() and 0.0 < w.abs().max() <= 0.07, name
