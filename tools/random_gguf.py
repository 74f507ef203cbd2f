"""A GGUF of the bundled model's family at another size, its blocks random: for
benchmarks on a model larger than the bundled one, which this machine cannot download.

    .venv/bin/python tools/random_gguf.py --shape smollm2-1.7b --out /tmp/smollm2-1.7b-random.gguf
        [--source FILE] [--metadata-only]

The file has the bundled SmolLM2's metadata (tokenizer, chat template, RoPE base)
with the shape of ``--shape`` (SmolLM2-360M's or SmolLM2-1.7B's published
configs), and its formats: Q4_1 layers, a Q8_0 tied embedding, fp32 norms. Q4_1
blocks get scale 2^-7 and minimum -2^-4, Q8_0 blocks scale 2^-11, their nibbles
and int8s uniform random bytes (``tools.bench.engine.bench_engine.random_blocks``, as
``random_smollm2``).
kvd and llama.cpp both load it; a decode step reads the same bytes and does the
same arithmetic as on real weights of that shape, so its speed is the real
model's (its tokens are gibberish). Nothing here is a quantization: the bytes are
written as they are.

``--source``: the GGUF whose metadata is copied (default the bundled file); only
its metadata is read. ``--metadata-only`` writes that metadata alone, no
tensors (a few MB): a ``--source`` to carry to a host that has no bundled file
and cannot take its 98 MB (a benchmark machine reached through a size-limited copy).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

# the published configs (config.json of HuggingFaceTB/SmolLM2-*); head_dim 64, vocab 49152
SHAPES = {
    "smollm2-135m": {"hidden": 576, "ffn": 1536, "layers": 30, "heads": 9, "kv_heads": 3},
    "smollm2-360m": {"hidden": 960, "ffn": 2560, "layers": 32, "heads": 15, "kv_heads": 5},
    "smollm2-1.7b": {"hidden": 2048, "ffn": 8192, "layers": 24, "heads": 32, "kv_heads": 32},
}
HEAD_DIM = 64
SHAPE_KEYS = {"llama.block_count": "layers", "llama.embedding_length": "hidden", "llama.feed_forward_length": "ffn",
              "llama.attention.head_count": "heads", "llama.attention.head_count_kv": "kv_heads"}


@functools.lru_cache(maxsize=4)
def _metadata(path: str, mtime_ns: int, size: int) -> dict[str, tuple[Any, Any, Any]]:
    """key -> (contents, type, array element type) of each metadata field of the GGUF at
    ``path``, in the file's order (parsing a tokenizer's fields takes seconds: kept per
    file version)."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {key: (field.contents(), field.types[0], field.types[-1]) for key, field in reader.fields.items()}


def write(shape: str, out: Path, seed: int = 0, source_path: Path | None = None,
          metadata_only: bool = False) -> None:
    """Writes the ``shape`` model to ``out`` (see the module docstring), its metadata
    from ``source_path`` (default the bundled GGUF); ``metadata_only``: no tensors."""
    import gguf

    from engine.model.registry import bundled_gguf_path
    from tools.bench.engine.bench_engine import random_blocks

    dims = SHAPES[shape]
    src = Path(source_path or bundled_gguf_path())
    st = src.stat()
    fields = _metadata(str(src), st.st_mtime_ns, st.st_size)
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, (value, vtype, subtype) in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue                                # the writer's own
        if key in SHAPE_KEYS:
            writer.add_uint32(key, dims[SHAPE_KEYS[key]])
        elif key in ("general.name", "general.size_label"):
            writer.add_string(key, f"{shape} (random blocks)")
        elif vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=subtype)
        else:
            writer.add_key_value(key, value, vtype)
    vocab = int(fields["llama.vocab_size"][0])
    if metadata_only:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return
    gen = torch.Generator().manual_seed(seed)
    hidden, ffn = dims["hidden"], dims["ffn"]
    q_dim, kv_dim = dims["heads"] * HEAD_DIM, dims["kv_heads"] * HEAD_DIM
    q41, q80 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", random_blocks(vocab, hidden, "Q8_0", gen).numpy(), raw_dtype=q80)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for n in range(dims["layers"]):
        for name, rows, cols in (("attn_q", q_dim, hidden), ("attn_k", kv_dim, hidden), ("attn_v", kv_dim, hidden),
                                 ("attn_output", hidden, q_dim), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                                 ("ffn_down", hidden, ffn)):
            writer.add_tensor(f"blk.{n}.{name}.weight", random_blocks(rows, cols, "Q4_1", gen).numpy(), raw_dtype=q41)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{n}.{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Random blocks of kernels/gguf_blocks.py's formats: the fp16 fields (d, and dmin / m)
# drawn around these values (x U[0.5, 1.5)), chosen so the largest weight is ~0.1;
# every other byte (quants, packed sub-block scales) uniform random: valid blocks.
BLOCK_SCALES = {
    "Q5_0": (6e-3,), "Q5_1": (3e-3, -5e-2), "IQ4_NL": (1e-3,), "Q2_K": (2e-3, 3e-3), "Q3_K": (8e-4,),
    "Q4_K": (1e-4, 1e-4), "Q5_K": (5e-5, 5e-5), "Q6_K": (2.5e-5,), "IQ4_XS": (2.5e-5,),
}


def random_type_blocks(fmt: str, rows: int, cols: int, gen: torch.Generator) -> np.ndarray:
    """uint8 ``[rows, row bytes]``: a ``[rows, cols]`` matrix of random valid ``fmt`` blocks,
    a kernels/gguf_blocks.py format or one of kernels/quant.py's (``random_blocks``'s)."""
    from kernels import gguf_blocks
    from tools.bench.engine.bench_engine import random_blocks

    if fmt not in gguf_blocks.BLOCKS:
        return random_blocks(rows, cols, fmt, gen).numpy()
    per, nbytes = gguf_blocks.BLOCKS[fmt]
    nb = rows * cols // per
    blocks = torch.randint(0, 256, (nb, nbytes), dtype=torch.uint8, generator=gen)
    for at, scale in zip(gguf_blocks.HALF_FIELDS[fmt], BLOCK_SCALES[fmt]):
        values = scale * (0.5 + torch.rand(nb, generator=gen))
        blocks[:, at:at + 2] = values.to(torch.float16).view(torch.uint8).view(nb, 2)
    return blocks.reshape(rows, -1).numpy()


def write_llama(path: Path, config: Any, fmt: str, seed: int = 0) -> None:
    """A llama GGUF of ``config`` (engine/model/config.py's LlamaConfig): every matrix
    random valid ``fmt`` blocks (``random_type_blocks``), norms ones, no tokenizer (tests
    use the tiny one); the row length of every matrix must be a whole number of blocks."""
    import gguf

    c = config
    gen = torch.Generator().manual_seed(seed)
    qtype = gguf.GGMLQuantizationType[fmt]
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", c.num_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_heads), ("attention.head_count_kv", c.num_kv_heads),
                       ("rope.dimension_count", c.head_dim), ("vocab_size", c.vocab_size)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", c.rope_theta)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)

    def matrix(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, random_type_blocks(fmt, rows, cols, gen), raw_dtype=qtype)

    matrix("token_embd.weight", c.vocab_size, c.hidden_size)
    writer.add_tensor("output_norm.weight", np.ones(c.hidden_size, dtype=np.float32))
    if not c.tie_word_embeddings:
        matrix("output.weight", c.vocab_size, c.hidden_size)
    for n in range(c.num_layers):
        for name, rows, cols in (("attn_q", c.q_size, c.hidden_size), ("attn_k", c.kv_size, c.hidden_size),
                                 ("attn_v", c.kv_size, c.hidden_size), ("attn_output", c.hidden_size, c.q_size),
                                 ("ffn_gate", c.intermediate_size, c.hidden_size),
                                 ("ffn_up", c.intermediate_size, c.hidden_size),
                                 ("ffn_down", c.hidden_size, c.intermediate_size)):
            matrix(f"blk.{n}.{name}.weight", rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{n}.{name}.weight", np.ones(c.hidden_size, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", type=Path, default=None, help="GGUF to copy the metadata of (default: bundled)")
    ap.add_argument("--metadata-only", action="store_true", help="write the metadata alone, no tensors")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    write(args.shape, args.out, args.seed, args.source, args.metadata_only)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
