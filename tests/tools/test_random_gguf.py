"""``tools/random_gguf.py``: a GGUF of the bundled model's family at another published size,
random blocks. kvd must load it as that shape, in the bundled file's formats, with the
bundled tokenizer's metadata, so that a benchmark on it reads the bytes such a model reads."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.model.registry import bundled_gguf_path
from engine.model.weights import load_gguf
from kernels.quant import QuantTensor
from tools.random_gguf import HEAD_DIM, SHAPES, write


@pytest.fixture(scope="module")
def bundled_fields():
    """The bundled GGUF's metadata, parsed once (its tokenizer's fields take seconds)."""
    return gguf.GGUFReader(str(bundled_gguf_path())).fields


def test_the_written_file_loads_as_the_shape_in_the_bundled_formats(tmp_path, bundled_fields):
    path = tmp_path / "smollm2-135m.gguf"
    write("smollm2-135m", path, seed=1)
    w = load_gguf(path, quantized=True)
    dims, cfg = SHAPES["smollm2-135m"], w.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim) == (dims["hidden"], dims["ffn"], dims["layers"], dims["heads"], dims["kv_heads"], HEAD_DIM)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    embed, down = w.tensors["model.embed_tokens.weight"], w.tensors["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(embed, QuantTensor) and embed.fmt.name == "Q8_0"
    assert isinstance(down, QuantTensor) and down.fmt.name == "Q4_1"
    assert tuple(down.shape) == (dims["hidden"], dims["ffn"])
    for t in (embed, down):
        values = t.dequantize()
        assert torch.isfinite(values).all() and 0.0 < values.abs().max() <= 0.07
    written = gguf.GGUFReader(str(path))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert written.fields[key].contents() == bundled_fields[key].contents(), key


def test_metadata_carried_in_a_tensorless_file_makes_the_same_model(tmp_path, bundled_fields):
    """``--metadata-only`` then ``--source``: the route to a host without the bundled file
    gives byte for byte the file written from the bundled one."""
    meta, via, direct = tmp_path / "meta.gguf", tmp_path / "via.gguf", tmp_path / "direct.gguf"
    write("smollm2-135m", meta, metadata_only=True)
    header = gguf.GGUFReader(str(meta))
    assert len(header.tensors) == 0 and meta.stat().st_size < 4 << 20
    assert header.fields["tokenizer.ggml.tokens"].contents() == bundled_fields["tokenizer.ggml.tokens"].contents()
    write("smollm2-135m", via, seed=2, source_path=meta)
    write("smollm2-135m", direct, seed=2)
    assert via.read_bytes() == direct.read_bytes()
