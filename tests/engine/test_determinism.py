"""One arithmetic per token (engine/exactness.py): a token's K/V and logits are the same
bits whether it was prefilled -- whole, in chunks of 1, 7, 64 or 256 -- or decoded on the
plan executor or the torch path, alone or in a batch of 3, 16 or 64, with one thread or
every one, for every weight format the engine serves natively, over an fp32 or a float16
KV cache.

Each case prefills one random 300-token sequence whole (the reference: its K/V in every
layer and the logits of every position) and computes the same tokens another way. Any
difference in any bit fails. The tiny models have the K-quants' shapes (rows of 256) and
two layers; ``smollm2`` is the bundled model as served (Q4_1 layers, Q8_0 embedding);
``gemma3`` a random 7-layer Gemma 3 in Q8_0 (sliding layers of 8 keys with their own RoPE
base beside a global one, sandwich norms, GeGLU, an embedding scale). The packaged Gemma 3
270M Q4_K_M file (skipped where its package is missing) has a test of its own, shorter:
18 layers and a 262,144-token vocabulary make every case slow.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from engine.exactness import same_bits
from engine.model.decode_kernels import plan_decoder
from engine.model.llama import LlamaModel
from engine.model.registry import resolve_model
from engine.model.weights import load_gguf, random_weights
from kernels.attention import AttentionBatch, PrefillSeq, decode_key_mask
from kernels.quant_linear import QuantKernel
from tools.random_gguf import write_architecture, write_llama

from .test_kquant_weights import kquant_config

BS, L = 16, 300
QUANTIZED = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    k = QuantKernel.create()
    assert k is not None, "no quantized-weights kernel on this host"
    return k


def make_model(name: str, kernel: QuantKernel, tmp_path_factory) -> LlamaModel:
    """``name``'s model as the engine builds it: a quantized format's blocks on the kernel;
    a float format's matrices (16-bit ones kept) in the executor's layout, prefilled on
    its kernel (batch_invariant); smollm2 as served."""
    if name in ("smollm2", "gemma3-270m"):
        try:
            w = resolve_model(name).load_weights(quantized=True)
        except FileNotFoundError as exc:
            pytest.skip(str(exc))
        return LlamaModel(w.config, w.tensors, quant_kernel=kernel)
    if name == "gemma3":
        path = tmp_path_factory.mktemp("determinism") / "gemma3.gguf"
        write_architecture("gemma3", path, "Q8_0", seed=7)
        w = load_gguf(path, quantized=True)
        return LlamaModel(w.config, w.tensors, quant_kernel=kernel)
    config = kquant_config(num_layers=2, max_position_embeddings=512)
    if name in FLOATS:
        w = random_weights(config, seed=3, std=0.06)
        tensors = {n: t.to(FLOATS[name]) if t.dim() == 2 else t for n, t in w.tensors.items()}
        return LlamaModel(config, tensors, float_layout="rows", batch_invariant=True)
    path = tmp_path_factory.mktemp("determinism") / f"{name}.gguf"
    write_llama(path, config, name, seed=11)
    w = load_gguf(path, quantized=True)
    return LlamaModel(w.config, w.tensors, quant_kernel=kernel)


class Sequence:
    """One random sequence of L tokens of ``model`` in scattered blocks of a cache with room
    for other sequences; ``others``' first blocks hold random decoding neighbours."""

    def __init__(self, model: LlamaModel, kv_dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.model = model
        c = model.config
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, c.vocab_size, (L,), generator=g)
        self.blocks = L // BS + 1 + 3 * 64                    # room for 63 neighbours of < 40 tokens
        perm = torch.randperm(self.blocks, generator=g)
        self.table = perm[:L // BS + 1]
        self.spare = perm[L // BS + 1:]                       # the neighbours' blocks
        self.kv_dtype = kv_dtype
        self.decoder = plan_decoder(model, self.empty(), BS)
        assert self.decoder is not None, "the plan executor did not build here"
        ref_kv = self.empty()
        self.ref_logits = self.prefill(ref_kv, 0, L)
        self.ref_kv = self.kv_of(ref_kv)

    def empty(self) -> torch.Tensor:
        c = self.model.config
        return torch.zeros(c.num_layers, 2, self.blocks, BS, c.num_kv_heads, c.head_dim, dtype=self.kv_dtype)

    def prefill(self, kv: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """Prefill tokens [start, start + n) after the cached [0, start): every row's logits [n, V]."""
        seq = PrefillSeq(0, n, start + n, self.table[:-(-(start + n) // BS)])
        slots = torch.tensor([self.table[p // BS] * BS + p % BS for p in range(start, start + n)])
        batch = AttentionBatch(slots=slots, is_prefill=True, prefill=[seq])
        hidden = self.model.forward(self.ids[start:start + n], torch.arange(start, start + n), batch, kv)
        return self.model.compute_logits(hidden)

    def kv_of(self, kv: torch.Tensor, upto: int = L) -> torch.Tensor:
        """The K/V of positions [0, upto) in every layer: [layers, 2, upto, kvh, hd]."""
        slots = torch.tensor([self.table[p // BS] * BS + p % BS for p in range(upto)])
        return kv.flatten(2, 3)[:, :, slots].clone()

    def neighbours(self, kv: torch.Tensor, count: int, seed: int) -> list[tuple[int, int, torch.Tensor]]:
        """``count`` other sequences of random lengths prefilled into the spare blocks of
        ``kv``: each one's (next id, position, block table)."""
        g = torch.Generator().manual_seed(seed)
        out, at = [], 0
        for _ in range(count):
            n = int(torch.randint(1, 40, (), generator=g))
            table = self.spare[at:at + n // BS + 1]
            at += n // BS + 1
            ids = torch.randint(0, self.model.config.vocab_size, (n + 1,), generator=g)
            slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
            batch = AttentionBatch(slots=slots, is_prefill=True, prefill=[PrefillSeq(0, n, n, table)])
            self.model.forward(ids[:n], torch.arange(n), batch, kv)
            out.append((int(ids[n]), n, table))
        return out

    def decode(self, kv: torch.Tensor, p: int, others: list[tuple[int, int, torch.Tensor]] = (), row: int = 0,
               torch_path: bool = False) -> torch.Tensor:
        """Decode token p (its K/V into ``kv``) as row ``row`` of a batch with ``others``: its logits [V]."""
        rows = list(others)
        rows.insert(row, (int(self.ids[p]), p, self.table))
        width = max(len(t) for _, _, t in rows)
        ids = torch.tensor([i for i, _, _ in rows])
        positions = torch.tensor([q for _, q, _ in rows])
        tables = torch.stack([torch.cat((t, t.new_zeros(width - len(t)))) for _, _, t in rows])
        if not torch_path:
            return self.decoder.decode(ids, positions, tables, kv)[row]
        slots = torch.stack([tables[b, q // BS] * BS + q % BS for b, q in enumerate(positions.tolist())])
        batch = AttentionBatch(slots=slots, is_prefill=False, block_tables=tables,
                               key_mask=decode_key_mask((positions + 1).tolist(), width, BS))
        return self.model.compute_logits(self.model.forward(ids, positions, batch, kv))[row]


MODELS = QUANTIZED + tuple(FLOATS) + ("smollm2", "gemma3")


@pytest.fixture(scope="module", params=MODELS)
def sequence(request, kernel, tmp_path_factory) -> Sequence:
    return Sequence(make_model(request.param, kernel, tmp_path_factory))


def test_the_engine_reports_same_bits_for_these_models(sequence):
    assert same_bits(sequence.model, sequence.decoder) == "yes"


@pytest.mark.parametrize("chunk", [1, 7, 64, 256])
def test_a_prompt_in_chunks_has_the_whole_prefills_bits(sequence, chunk):
    """Chunk boundaries anywhere: each row attends over its keys in the same chunks of the
    key axis and multiplies on the same kernels, whatever the rows beside it."""
    if chunk == 1 and sequence.model.config.num_layers > 2:
        pytest.skip("300 one-token prefills of the 30-layer model: the decode test covers one-row steps")
    kv = sequence.empty()
    logits = torch.cat([sequence.prefill(kv, s, min(chunk, L - s)) for s in range(0, L, chunk)])
    assert torch.equal(logits, sequence.ref_logits)
    assert torch.equal(sequence.kv_of(kv), sequence.ref_kv)


def test_decoding_token_by_token_has_the_prefills_bits(sequence):
    """Every token after the first decoded on the plan executor, alone: the logits and K/V of
    the prefill, bit for bit (also the torch path's decode, for a few positions)."""
    kv = sequence.empty()
    first = sequence.prefill(kv, 0, 1)
    logits = torch.cat([first] + [sequence.decode(kv, p)[None] for p in range(1, L)])
    assert torch.equal(logits, sequence.ref_logits)
    assert torch.equal(sequence.kv_of(kv), sequence.ref_kv)
    for p in (1, 127, 128, 299):
        assert torch.equal(sequence.decode(kv, p, torch_path=True), sequence.ref_logits[p])
    assert torch.equal(sequence.kv_of(kv), sequence.ref_kv)


@pytest.mark.parametrize("batch", [3, 16, 64])
def test_a_decode_row_has_the_same_bits_in_any_batch(sequence, batch):
    """Position p decoded as any row of a batch of other sequences: its prefill's logits,
    and its K/V rewritten with the same bits."""
    kv = sequence.empty()
    sequence.prefill(kv, 0, L)
    others = sequence.neighbours(kv, batch - 1, seed=batch)
    for i, p in enumerate((0, 15, 128, 200, 299)):
        row = (i * 7) % batch
        assert torch.equal(sequence.decode(kv, p, others, row), sequence.ref_logits[p]), (p, row)
    assert torch.equal(sequence.kv_of(kv), sequence.ref_kv)


def test_thread_counts_change_no_bit(sequence):
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, 2, os.cpu_count() or 1}):
            torch.set_num_threads(n)
            kv = sequence.empty()
            assert torch.equal(sequence.prefill(kv, 0, 200), sequence.ref_logits[:200]), n
            assert torch.equal(sequence.decode(kv, 200), sequence.ref_logits[200]), n
            assert torch.equal(sequence.prefill(kv, 201, L - 201), sequence.ref_logits[201:]), n
            assert torch.equal(sequence.kv_of(kv), sequence.ref_kv), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_the_packaged_gemma3_has_one_arithmetic(kernel, tmp_path_factory):
    """Gemma 3 270M as served (Q4_K, Q6_K and Q8_0 blocks, head_dim 256, one KV head), its
    sliding layers' window cut to 200 keys so that 300 tokens cross it: a prompt in chunks
    of 64, then every later token decoded on the plan executor as a row of a batch of 3,
    and a few on the torch path: the whole prefill's logits and K/V, bit for bit."""
    model = make_model("gemma3-270m", kernel, tmp_path_factory)
    model.config = dataclasses.replace(model.config, sliding_window=200)
    model.layers = [dataclasses.replace(layer, window=model.config.layer_window(i))
                    for i, layer in enumerate(model.layers)]
    seq = Sequence(model)
    assert same_bits(model, seq.decoder) == "yes"
    kv = seq.empty()
    logits = [seq.prefill(kv, s, 64) for s in range(0, 256, 64)]
    others = seq.neighbours(kv, 2, seed=3)
    logits += [seq.decode(kv, p, others, row=p % 3)[None] for p in range(256, L)]
    assert torch.equal(torch.cat(logits), seq.ref_logits)
    assert torch.equal(seq.kv_of(kv), seq.ref_kv)
    for p in (255, 299):
        assert torch.equal(seq.decode(kv, p, torch_path=True), seq.ref_logits[p])


@pytest.mark.parametrize("name", ["Q4_1", "smollm2"])
def test_a_float16_kv_cache_keeps_one_arithmetic(name, kernel, tmp_path_factory):
    """K/V stored as halves (kv_cache_dtype = "float16"): every path stores and reads the
    same rounded values."""
    seq = Sequence(make_model(name, kernel, tmp_path_factory), kv_dtype=torch.float16, seed=1)
    kv = seq.empty()
    seq.prefill(kv, 0, 100)
    logits = [seq.decode(kv, p)[None] for p in range(100, 140)]
    logits.append(seq.prefill(kv, 140, L - 140))
    assert torch.equal(torch.cat(logits), seq.ref_logits[100:])
    assert torch.equal(seq.kv_of(kv), seq.ref_kv)


def test_paths_without_one_arithmetic_say_why():
    """A float model prefilled on MKL, and a bf16 model, are reported as such (kvctl status)."""
    config = kquant_config(num_layers=2)
    w = random_weights(config, seed=3)
    on_mkl = LlamaModel(config, w.tensors, float_layout="rows")
    kv = torch.zeros(2, 2, 8, BS, config.num_kv_heads, config.head_dim)
    assert same_bits(on_mkl, plan_decoder(on_mkl, kv, BS)).startswith("no: float matrices prefill on MKL")
    assert same_bits(LlamaModel(config, w.tensors), None).startswith("no: float matrices multiply on MKL")
    bf16 = LlamaModel(config, w.tensors, dtype=torch.bfloat16)
    assert same_bits(bf16, None).startswith("no: bfloat16 activations")
