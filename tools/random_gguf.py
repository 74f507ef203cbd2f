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

``--arch``: a small random model of that architecture instead
(``write_architecture``: llama, qwen2, qwen3, gemma3 or phi3, its tensors
``--tensor-type`` F32 or Q8_0, the norms and biases F32), for the architecture
tests against transformers::

    .venv/bin/python tools/random_gguf.py --arch gemma3 --tensor-type Q8_0 --out /tmp/gemma3-tiny.gguf

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
# drawn around these values (x U[0.5, 1.5)), chosen so the largest weight is ~0.1 and,
# where there is a min, the mean weight about 0 (dmin = d * mean q); every other byte
# (quants, packed sub-block scales) uniform random: valid blocks.
BLOCK_SCALES = {
    "Q5_0": (6e-3,), "Q5_1": (3e-3, -4.65e-2), "IQ4_NL": (1e-3,), "Q2_K": (2e-3, 3e-3), "Q3_K": (8e-4,),
    "Q4_K": (1e-4, 7.5e-4), "Q5_K": (5e-5, 7.75e-4), "Q6_K": (2.5e-5,), "IQ4_XS": (2.5e-5,),
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


def write_llama(path: Path, config: Any, fmt: str, seed: int = 0, types: dict[str, str] | None = None) -> None:
    """A llama GGUF of ``config`` (engine/model/config.py's LlamaConfig): every matrix
    random valid ``fmt`` blocks (``random_type_blocks``), or ``types[kind]``'s for a kind
    (``attn_v``, ``ffn_down``, ``token_embd``, ...: a _K_M file's mix), norms ones, no
    tokenizer (tests use the tiny one); every matrix's row length a whole number of blocks."""
    import gguf

    c = config
    gen = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", c.num_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_heads), ("attention.head_count_kv", c.num_kv_heads),
                       ("rope.dimension_count", c.head_dim), ("vocab_size", c.vocab_size)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", c.rope_theta)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)

    def matrix(name: str, rows: int, cols: int) -> None:
        kind = name.split(".")[-2]
        t = (types or {}).get(kind, fmt)
        writer.add_tensor(name, random_type_blocks(t, rows, cols, gen), raw_dtype=gguf.GGMLQuantizationType[t])

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


# the small shape of write_architecture: 7 layers, so a gemma3 has a global layer (the 6th)
ARCH_SHAPE = {"hidden": 64, "ffn": 128, "layers": 7, "heads": 4, "kv_heads": 2, "head_dim": 16}
ARCH_SLIDING_WINDOW = 8          # a gemma3's window: shorter than the tests' prompts
MATRIX_TYPES = ("F32", "Q8_0")


def write_architecture(arch: str, out: Path, tensor_type: str = "F32", seed: int = 0,
                       source_path: Path | None = None, sliding_window: int = ARCH_SLIDING_WINDOW) -> None:
    """A small random ``arch`` model (``ARCH_SHAPE``) at ``out``: the ``{arch}.*`` keys
    llama.cpp writes for it, the tokenizer of ``source_path`` (default the bundled GGUF;
    its vocabulary sizes the embedding), matrices of ``tensor_type`` (normal, std 0.05,
    quantized by gguf-py), norms near 1 and biases F32, with the tensors the architecture
    has (``ARCH_TENSORS``). Deterministic per ``(arch, tensor_type, seed)``."""
    import gguf

    from engine.model.registry import bundled_gguf_path

    if tensor_type not in MATRIX_TYPES:
        raise ValueError(f"tensor type {tensor_type!r}: use one of {', '.join(MATRIX_TYPES)}")
    src = Path(source_path or bundled_gguf_path())
    st = src.stat()
    fields = _metadata(str(src), st.st_mtime_ns, st.st_size)
    d = ARCH_SHAPE
    hidden, ffn, hd = d["hidden"], d["ffn"], d["head_dim"]
    q_dim, kv_dim = d["heads"] * hd, d["kv_heads"] * hd
    vocab = len(fields["tokenizer.ggml.tokens"][0])
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"random {arch}")
    for key, (value, vtype, subtype) in fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, value, vtype, sub_type=subtype if vtype == gguf.GGUFValueType.ARRAY else None)
    for key, value in (("context_length", 2048), ("embedding_length", hidden), ("block_count", d["layers"]),
                       ("feed_forward_length", ffn), ("attention.head_count", d["heads"]),
                       ("attention.head_count_kv", d["kv_heads"]), ("attention.key_length", hd),
                       ("attention.value_length", hd), ("vocab_size", vocab)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6 if arch in ("gemma3", "qwen3") else 10000.0)
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window", sliding_window)
    gen = torch.Generator().manual_seed(seed)

    def matrix(name: str, rows: int, cols: int) -> None:
        w = torch.empty(rows, cols).normal_(0.0, 0.05, generator=gen).numpy()
        if tensor_type == "F32":
            writer.add_tensor(name, w)
        else:
            qtype = gguf.GGMLQuantizationType[tensor_type]
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, mean: float) -> None:
        writer.add_tensor(name, (mean + 0.1 * torch.randn(n, generator=gen)).numpy())

    matrix("token_embd.weight", vocab, hidden)
    vector("output_norm.weight", hidden, 1.0)
    if arch in ("qwen2", "phi3"):                # separate LM heads (the others tie it)
        matrix("output.weight", vocab, hidden)
    for n in range(d["layers"]):
        p = f"blk.{n}."
        shapes = {"attn_q": q_dim, "attn_k": kv_dim, "attn_v": kv_dim}
        if arch == "phi3":
            matrix(p + "attn_qkv.weight", q_dim + 2 * kv_dim, hidden)
        else:
            for name, rows in shapes.items():
                matrix(p + name + ".weight", rows, hidden)
        if arch == "qwen2":
            for name, rows in shapes.items():
                vector(p + name + ".bias", rows, 0.0)
        if arch in ("qwen3", "gemma3"):
            vector(p + "attn_q_norm.weight", hd, 1.0)
            vector(p + "attn_k_norm.weight", hd, 1.0)
        matrix(p + "attn_output.weight", hidden, q_dim)
        vector(p + "attn_norm.weight", hidden, 1.0)
        vector(p + "ffn_norm.weight", hidden, 1.0)
        if arch == "gemma3":
            vector(p + "post_attention_norm.weight", hidden, 1.0)
            vector(p + "post_ffw_norm.weight", hidden, 1.0)
        if arch == "phi3":
            matrix(p + "ffn_up.weight", 2 * ffn, hidden)          # gate and up, fused
        else:
            matrix(p + "ffn_gate.weight", ffn, hidden)
            matrix(p + "ffn_up.weight", ffn, hidden)
        matrix(p + "ffn_down.weight", hidden, ffn)
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
    ap.add_argument("--arch", choices=("llama", "qwen2", "qwen3", "gemma3", "phi3"), default=None,
                    help="a small random model of this architecture instead of --shape")
    ap.add_argument("--tensor-type", choices=MATRIX_TYPES, default="F32", help="its matrices' type (with --arch)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    if args.arch:
        write_architecture(args.arch, args.out, args.tensor_type, args.seed, args.source)
    else:
        write(args.shape, args.out, args.seed, args.source, args.metadata_only)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
