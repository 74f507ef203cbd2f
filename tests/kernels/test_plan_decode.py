"""The plan executor (kernels/plan_decode.py): an fp32 decode step in one C++ call, run from
llama.py's LAYER_STEPS, against LlamaModel.forward, for block-quantized models and float
ones (fp32 matrices in the rows layout: "F32" below).

Agreement with forward is to rounding (norm and attention sums in another
order, so a matmul input can differ in its last bit and then round to a
neighbouring 16-bit step; quantized matmuls are the same kernel, float ones MKL's
against dense_gemm.h's order); batch and thread-count
invariance and the KV slots written are checked bit for bit. The host's
build runs here (AVX2 on the project's machines): nothing is skipped.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading

import gguf
import numpy as np
import pytest
import torch

from engine.engine import EngineConfig, LLMEngine, build_model
from engine.memory.mempool import MemPool
from engine.model import decode_kernels, llama
from engine.model.config import tiny_config
from engine.model.decode_kernels import model_plan, plan_decoder, plan_unsupported_reason
from engine.model.llama import DENSE_PREFILL_ROWS, LlamaModel, Step
from engine.model.registry import resolve_model
from engine.model.weights import random_weights
from engine.request import SamplingParams
from kernels import native, plan_decode
from kernels.attention import AttentionBatch, PrefillSeq, decode_key_mask, store_kv
from kernels.plan_decode import PlanDecoder
from kernels.quant import QuantTensor
from kernels.quant_linear import VARIANTS, QuantKernel, runs_here

BS, NUM_BLOCKS = 16, 160


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    k = QuantKernel.create()
    assert k is not None, "no quantized-weights kernel on this host"
    return k


def quantize(weights, fmt: str) -> dict:
    """Every matrix of ``weights`` in ``fmt``'s blocks (gguf-py's quantizer), norms as they are."""
    out = {}
    for name, t in weights.tensors.items():
        if t.dim() == 2:
            blocks = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType[fmt])
            out[name] = QuantTensor(fmt, tuple(t.shape), torch.from_numpy(np.ascontiguousarray(blocks)))
        else:
            out[name] = t
    return out


FLOAT16 = {"BF16": torch.bfloat16, "F16": torch.float16}


# the architectures whose layer plans add ops the executor runs (qkv biases, q/k head norms;
# gemma3's sandwich norms and GeGLU) and what it takes beside them (gemma3: sliding layers of
# 12 keys with their own RoPE base beside global ones, an embedding scale)
GEMMA3 = {"architecture": "gemma3", "qk_norm": True, "sandwich_norms": True, "activation": "gelu_tanh",
          "embed_scale": 8.0, "sliding_window": 12, "global_layer_every": 2, "rope_theta": 1e6,
          "rope_local_theta": 10000.0}
ARCH_CONFIGS = {"llama": {}, "qwen2": {"architecture": "qwen2", "qkv_bias": True},
                "qwen3": {"architecture": "qwen3", "qk_norm": True}, "gemma3": GEMMA3}


def tiny_model(fmt: str, kernel: QuantKernel, arch: str = "llama", **config) -> LlamaModel:
    """The tiny model with its matrices in ``fmt``'s blocks, or ``"F32"``: as they are, fp32
    in the rows layout (a float model's, as build_model makes it), or ``"BF16"`` / ``"F16"``:
    rounded to that dtype and kept in it (an fp32 model of a 16-bit checkpoint). ``arch``:
    a key of ARCH_CONFIGS, its vectors (norms, biases) random around 1; ``config``: more
    LlamaConfig fields."""
    w = random_weights(tiny_config(vocab_size=512, **(ARCH_CONFIGS[arch] | config)), seed=5, std=0.08)
    if arch != "llama":
        g = torch.Generator().manual_seed(6)
        w = dataclasses.replace(w, tensors={n: t if t.dim() == 2 else 1 + 0.1 * torch.randn(t.shape, generator=g)
                                            for n, t in w.tensors.items()})
    if fmt == "F32":
        return LlamaModel(w.config, w.tensors, float_layout="rows")
    if fmt in FLOAT16:
        return LlamaModel(w.config, {n: t.to(FLOAT16[fmt]) for n, t in w.tensors.items()}, float_layout="rows")
    return LlamaModel(w.config, quantize(w, fmt), quant_kernel=kernel)


@pytest.fixture(scope="module")
def tiny(kernel) -> LlamaModel:
    return tiny_model("Q4_1", kernel)


@pytest.fixture(scope="module")
def smollm2(kernel) -> LlamaModel:
    w = resolve_model("smollm2").load_weights(quantized=True)     # Q4_1 layers, Q8_0 embedding / head
    return LlamaModel(w.config, w.tensors, quant_kernel=kernel)


@pytest.fixture(scope="module", params=["tiny-Q4_1", "tiny-Q8_0", "tiny-Q4_0", "tiny-F32", "smollm2",
                                        "qwen2-Q8_0", "qwen3-Q4_1", "qwen3-F32", "gemma3-Q8_0", "gemma3-F32"])
def model(request, kernel) -> LlamaModel:
    if request.param == "smollm2":                 # loaded only for its own cases
        return request.getfixturevalue("smollm2")
    arch, fmt = request.param.split("-")
    return tiny_model(fmt, kernel, "llama" if arch == "tiny" else arch)


def empty_kv(model: LlamaModel, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    c = model.config
    return torch.zeros(c.num_layers, 2, NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, dtype=dtype)


def decoder(model: LlamaModel, kv: torch.Tensor) -> PlanDecoder:
    dec = plan_decoder(model, kv, BS)
    assert dec is not None, "the executor did not build or load (see the log)"
    return dec


def prefilled(model: LlamaModel, lengths: list[int], seed: int, kv_dtype: torch.dtype = torch.float32):
    """A KV cache (of ``kv_dtype``: float16 is kv_cache_dtype's) holding ``lengths[i]``
    random tokens of each sequence in scattered blocks (torch prefill), and each one's
    next decode inputs: ids, positions, tables."""
    g = torch.Generator().manual_seed(seed)
    kv = empty_kv(model, kv_dtype)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, at = [], 0
    for n in lengths:
        tables.append(perm[at:at + n // BS + 1])
        at += n // BS + 1
    seqs, slots, positions = [], [], []
    for table, n in zip(tables, lengths):
        seqs.append(PrefillSeq(len(slots), n, n, torch.tensor(table)))
        slots += [table[p // BS] * BS + p % BS for p in range(n)]
        positions += range(n)
    batch = AttentionBatch(slots=torch.tensor(slots), is_prefill=True, prefill=seqs)
    vocab = model.config.vocab_size
    model.forward(torch.randint(0, vocab, (len(slots),), generator=g), torch.tensor(positions), batch, kv)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return kv, torch.randint(0, vocab, (len(lengths),), generator=g), torch.tensor(lengths), block_tables


def torch_decode(model: LlamaModel, kv, ids, positions, block_tables) -> torch.Tensor:
    slots = torch.stack([block_tables[b, p // BS] * BS + p % BS for b, p in enumerate(positions.tolist())])
    batch = AttentionBatch(slots=slots, is_prefill=False, block_tables=block_tables,
                           key_mask=decode_key_mask((positions + 1).tolist(), block_tables.shape[1], BS))
    return model.compute_logits(model.forward(ids, positions, batch, kv))


# ------------------------------------------------------------------ against forward
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_logits_and_kv_match_forward(model, kv_dtype):
    """Also over a float16 KV cache (kv_cache_dtype): both paths store K/V rounded to
    halves (kernels.attention.store_kv) and attend to the stored values."""
    kv, ids, pos, tables = prefilled(model, [1, 5, 16, 17, 40, 100], seed=1, kv_dtype=kv_dtype)
    kv_torch, kv_plan = kv.clone(), kv.clone()
    ref = torch_decode(model, kv_torch, ids, pos, tables)
    out = decoder(model, kv).decode(ids, pos, tables, kv_plan)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # differently ordered fp32 sums through every layer, each able to move a matmul input to
    # the neighbouring 16-bit step (amax / 32767 of its block): measured 1.3e-4 of the largest
    # logit on the tiny Q4_1 model; 1e-3 leaves room and still fails on any real mistake
    assert (out - ref).abs().max() <= 1e-3 * ref.abs().max()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # only the new tokens' slots changed, in every layer, to (nearly) forward's K/V
    slots = [tables[b, p // BS].item() * BS + p % BS for b, p in enumerate(pos.tolist())]
    flat = lambda t: t.view(t.shape[0], 2, -1, *t.shape[4:])          # noqa: E731  [L, 2, N*bs, kvh, hd]
    changed = (flat(kv_plan) != flat(kv)).flatten(3).any(-1).any(0).any(0)
    assert sorted(changed.nonzero().flatten().tolist()) == sorted(slots)
    new_p, new_t = flat(kv_plan)[:, :, slots].float(), flat(kv_torch)[:, :, slots].float()
    assert (new_p - new_t).abs().max() <= 1e-3 * new_t.abs().max()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_0", "F32", "BF16", "F16"])
@pytest.mark.parametrize("build", ["host", "amxemu"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_every_build_computes_the_same_bits(fmt, build, kv_dtype, kernel):
    """The host's build, and the AMX tile path with its tile instructions emulated (amxemu:
    a batch of 16 or more takes it), against the portable one (the arithmetic's definition;
    far too slow for the real model): the same logits and K/V bit for bit, so nodes of
    different CPU families agree (a prefill on one, the decode on another). A float16
    cache's K/V too: F16C's rounding and the portable build's own agree."""
    model = tiny_model(fmt, kernel)
    kv, ids, pos, tables = prefilled(model, [1, 5, 16, 17, 40, 100, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 300],
                                        seed=3, kv_dtype=kv_dtype)
    kv_host, kv_port = kv.clone(), kv.clone()
    portable = plan_decoder(model, kv, BS, variant="portable")
    assert portable is not None and portable.variant == "portable"
    dec = decoder(model, kv) if build == "host" else plan_decoder(model, kv, BS, variant=build)
    assert dec is not None
    assert torch.equal(dec.decode(ids, pos, tables, kv_host), portable.decode(ids, pos, tables, kv_port))
    assert torch.equal(kv_host, kv_port)


@pytest.mark.parametrize("fmt", ["BF16", "F16"])
def test_16bit_matrices_give_the_bits_of_their_fp32_copies(fmt, kernel):
    """An fp32 model keeping a 16-bit checkpoint's matrices (the embedding, the tied LM head
    and every layer's) reads half the bytes, and its decode steps compute what the same values
    widened to fp32 compute, bit for bit (the executor widens in registers), K/V included.
    Its prefill runs short batches on the executor's dense matmul (RowOps.linear) and long
    ones on MKL over the widened matrix: fp32 rounding from the fp32 copy's MKL prefill."""
    small = tiny_model(fmt, kernel)
    wide = LlamaModel(small.config, {n: t.to(FLOAT16[fmt]).float() for n, t in
                                     random_weights(tiny_config(vocab_size=512), seed=5, std=0.08).tensors.items()},
                      float_layout="rows")
    assert small.layers[0].qkv.dtype == small.embed.dtype == FLOAT16[fmt] and small.lm_head is small.embed
    assert wide.layers[0].qkv.dtype == torch.float32
    vectors = 4 * (small.norm.numel() + sum(x.input_norm.numel() + x.post_norm.numel() for x in small.layers))
    assert 2 * (small.weight_bytes_per_token() - vectors) == wide.weight_bytes_per_token() - vectors
    assert DENSE_PREFILL_ROWS == 56
    for lengths in ([1, 5, 17, 33], [100, 20]):                    # 56 rows: the dense matmul; 120: MKL
        kv_small, ids, pos, tables = prefilled(small, lengths, seed=4)
        kv_wide = prefilled(wide, lengths, seed=4)[0]
        assert (kv_small - kv_wide).abs().max() <= 1e-4 * kv_wide.abs().max()
        kv_wide = kv_small.clone()                                 # the decode step from the same K/V
        out_small = decoder(small, kv_small).decode(ids, pos, tables, kv_small)
        assert torch.equal(out_small, decoder(wide, kv_wide).decode(ids, pos, tables, kv_wide))
        assert torch.equal(kv_small, kv_wide)
        ref_small = torch_decode(small, kv_small.clone(), ids, pos, tables)
        ref_wide = torch_decode(wide, kv_wide.clone(), ids, pos, tables)
        assert (ref_small - ref_wide).abs().max() <= 1e-4 * ref_wide.abs().max()
        assert torch.equal(ref_small.argmax(-1), ref_wide.argmax(-1))


def test_a_build_is_refused_when_unknown_not_runnable_or_misnamed(kernel):
    """plan_decoder(variant=) gives None, and builds nothing, for a name it does not
    know or a build this CPU cannot run; a library whose reported build differs from the
    one asked for is refused (native.require_variant), whichever kernel it is."""
    model = tiny_model("Q4_1", kernel)
    kv = empty_kv(model)
    assert plan_decoder(model, kv, BS, variant="avx9000") is None
    for variant in [v for v in VARIANTS if not runs_here(v)]:     # none on a CPU that runs every build
        assert plan_decoder(model, kv, BS, variant=variant) is None
    lib = native.load(plan_decode.LIBRARY, VARIANTS["portable"][1])
    with pytest.raises(native.BuildError, match="reports portable"):
        PlanDecoder(model_plan(model), lib, kv.shape[2], BS, "avx2")
    with pytest.raises(native.BuildError, match="reports portable"):
        QuantKernel(native.load("quant_matmul", VARIANTS["portable"][1]), "avx2")


def test_batch_of_16_rows_equal_each_row_alone_bit_for_bit(model):
    lengths = [1, 3, 15, 16, 17, 31, 32, 33, 47, 64, 70, 90, 100, 120, 5, 9]
    kv, ids, pos, tables = prefilled(model, lengths, seed=2)
    dec = decoder(model, kv)
    batch_kv = kv.clone()
    batch = dec.decode(ids, pos, tables, batch_kv)
    alone_kv = kv.clone()
    for r in range(len(lengths)):
        row = dec.decode(ids[r:r + 1], pos[r:r + 1], tables[r:r + 1, :lengths[r] // BS + 1], alone_kv)
        assert torch.equal(row[0], batch[r]), f"row {r} differs alone"
    assert torch.equal(alone_kv, batch_kv)              # and wrote the same K/V


@pytest.mark.parametrize("which", ["smollm2", "tiny-F32"])
def test_thread_count_does_not_change_a_bit(which, request, kernel):
    model = request.getfixturevalue("smollm2") if which == "smollm2" else tiny_model("F32", kernel)
    kv, ids, pos, tables = prefilled(model, [7, 33, 80, 2, 50], seed=3)
    dec = decoder(model, kv)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(dec.decode(ids, pos, tables, kv.clone()))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_long_contexts_split_over_keys(tiny, kv_dtype):
    """Past 256 keys a sequence's keys are cut into longer chunks (csrc/plan_decode.cpp,
    key_chunk) that the team shares: against forward to rounding, and bit for bit with
    1, 2 and 3 threads, and alone against in a batch; over a float16 cache too."""
    lengths = [255, 257, 700, 1000]
    kv, ids, pos, tables = prefilled(tiny, lengths, seed=6, kv_dtype=kv_dtype)
    ref = torch_decode(tiny, kv.clone(), ids, pos, tables)
    dec = decoder(tiny, kv)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(dec.decode(ids, pos, tables, kv.clone()))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert (outs[0] - ref).abs().max() <= 1e-3 * ref.abs().max()
    assert torch.equal(outs[0].argmax(-1), ref.argmax(-1))
    for r, n in enumerate(lengths):
        row = dec.decode(ids[r:r + 1], pos[r:r + 1], tables[r:r + 1, :n // BS + 1], kv.clone())
        assert torch.equal(row[0], outs[0][r]), f"row {r} differs alone"


def test_long_sliding_windows_cut_their_first_chunk(kernel):
    """A window of 150 keys over contexts past 256: a row's first chunk starts at its
    window's, the rest sit at the fixed 128-key places -- forward's bits (the torch path
    attends in the same arithmetic), with 1 and 2 threads, alone and in a batch."""
    model = tiny_model("Q8_0", kernel, "gemma3", sliding_window=150)
    lengths = [120, 149, 150, 255, 257, 700]
    kv, ids, pos, tables = prefilled(model, lengths, seed=6)
    ref = torch_decode(model, kv.clone(), ids, pos, tables)
    dec = decoder(model, kv)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(dec.decode(ids, pos, tables, kv.clone()), ref), n
    finally:
        torch.set_num_threads(threads)
    for r, n in enumerate(lengths):
        row = dec.decode(ids[r:r + 1], pos[r:r + 1], tables[r:r + 1, :n // BS + 1], kv.clone())
        assert torch.equal(row[0], ref[r]), f"row {r} differs alone"


def test_a_matrix_of_parts_in_two_formats_runs_at_any_width(kernel):
    """q/k in one format beside v in another (a _K_M file's qkv: the executor's FMT_PARTS),
    over a width that is not a multiple of 256 (Gemma 3 270M's 640): each part is held to its
    own block size, and the step gives the torch path's bits."""
    w = random_weights(tiny_config(vocab_size=512), seed=5, std=0.08)
    assert w.config.hidden_size % 256
    q, q8 = quantize(w, "Q4_1"), quantize(w, "Q8_0")
    for i in range(w.config.num_layers):
        name = f"model.layers.{i}.self_attn.v_proj.weight"
        q[name] = q8[name]
    model = LlamaModel(w.config, q, quant_kernel=kernel)
    assert len(model.layers[0].qkv.parts) == 2
    kv, ids, pos, tables = prefilled(model, [3, 40], seed=8)
    ref = torch_decode(model, kv.clone(), ids, pos, tables)
    assert torch.equal(decoder(model, kv).decode(ids, pos, tables, kv.clone()), ref)


def test_another_thread_gets_the_same_bits(tiny):
    """The daemon decodes on its engine thread, not the main thread: the executor's own
    barrier (csrc/spin_barrier.h) runs there, 1 to 4 rows (every thread computing the
    row-local ops) and 6 rows (rows split between threads)."""
    for lengths in ([5], [3, 30, 17, 64], [1, 8, 40, 16, 2, 33]):
        kv, ids, pos, tables = prefilled(tiny, lengths, seed=4)
        dec = decoder(tiny, kv)
        here = dec.decode(ids, pos, tables, kv.clone())
        there: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: there.append(dec.decode(ids, pos, tables, kv.clone())))
        worker.start()
        worker.join(60)
        assert there and torch.equal(there[0], here), lengths


def test_bad_input_is_refused_before_writing(tiny):
    kv, ids, pos, tables = prefilled(tiny, [4, 20], seed=4)
    dec = decoder(tiny, kv)
    before = kv.clone()
    for bad_ids, bad_pos, bad_tables in [
            (torch.tensor([5, tiny.config.vocab_size]), pos, tables),      # token id
            (ids, torch.tensor([4, 40]), tables),                          # position past the table
            (ids, pos, torch.tensor([[NUM_BLOCKS, 0], [1, 2]])),           # block id
            (ids[:0], pos[:0], tables[:0])]:                               # empty batch
        with pytest.raises(ValueError):
            dec.decode(bad_ids, bad_pos, bad_tables, kv)
    with pytest.raises(ValueError):
        dec.decode(ids, pos, tables, kv.bfloat16())
    with pytest.raises(ValueError):
        dec.decode(ids.int(), pos, tables, kv)
    assert torch.equal(kv, before)
    with pytest.raises(ValueError):                                     # an fp32 executor, a half cache
        dec.decode(ids, pos, tables, kv.half())
    assert plan_decoder(tiny, kv.bfloat16(), BS) is None          # a cache it does not read


@pytest.mark.parametrize("build", ["host", "portable"])
def test_a_half_cache_stores_what_the_torch_path_stores(tiny, build):
    """The executor's K/V store into a float16 cache (store_half_row: F16C, or the
    portable build's own rounding) against kernels.attention.store_kv, bit for bit:
    ties to even, subnormal halves, values past the largest half (clamped), infinities
    (clamped too) and NaN (stays NaN)."""
    g = torch.Generator().manual_seed(9)
    x = torch.cat([torch.randn(4000, generator=g) * s for s in (1.0, 1e-3, 1e-5, 1e-7, 300.0, 3e4, 1e6)]
                  + [torch.tensor([65504.0, 65519.0, 65520.0, 1e30, -1e30, float("inf"), float("-inf"), 0.0, -0.0,
                                   1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26,
                                   5.96e-8, 6.1035e-05, float("nan")])])
    variant = decoder(tiny, empty_kv(tiny)).variant if build == "host" else "portable"
    lib = native.load(plan_decode.LIBRARY, plan_decode.library_flags(plan_decode.LIBRARY, variant))
    out = torch.empty(x.shape, dtype=torch.float16)
    lib.kvd_plan_store_half.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.kvd_plan_store_half(x.data_ptr(), x.numel(), out.data_ptr())
    want = store_kv(x, torch.float16)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert out[-17:-11].tolist() == [65504.0, 65504.0, 65504.0, 65504.0, -65504.0, 65504.0]


# ------------------------------------------------------------------ the engine's door
def staged_step(dec: PlanDecoder, kv: torch.Tensor, ids, pos, tables) -> tuple[torch.Tensor, list[int]]:
    st = dec.staging(kv)
    B, M = tables.shape
    st.reserve(B, M)
    st.ids[:B], st.positions[:B], st.tables[:B, :M] = ids.numpy(), pos.numpy(), tables.numpy()
    logits, greedy = st.run(B)
    return logits.clone(), greedy


def test_staged_step_gives_decodes_logits_and_their_argmax(model):
    """DecodeStaging (reused buffers, greedy tokens found by the LM head's threads) against
    decode(): the same logits bit for bit and numpy's argmax of them, with 1, 2 and 3 threads
    (the threads' candidates merged), the same K/V written."""
    kv, ids, pos, tables = prefilled(model, [1, 17, 40, 100, 3], seed=8)
    dec = decoder(model, kv)
    want_kv = kv.clone()
    want = dec.decode(ids, pos, tables, want_kv)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got_kv = kv.clone()
            logits, greedy = staged_step(dec, got_kv, ids, pos, tables)
            assert torch.equal(logits, want) and torch.equal(got_kv, want_kv), n
            assert greedy == want.numpy().argmax(axis=-1).tolist() == want.argmax(-1).tolist(), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", ["ties", "twins", "nans"])
def test_greedy_tokens_take_the_first_of_equal_logits_and_a_nan(kernel, case):
    """An LM head whose rows are all equal gives every row equal logits: the greedy token is
    0 whichever thread found which chunk. Twins: the winning row copied to rows before and
    after it, in other threads' shares and chunks: the first copy wins (a chunk whose
    largest only ties the best so far is still searched). Rows of NaN weights give NaN
    logits: the first NaN wins, as in numpy's and torch's argmax."""
    cfg = tiny_config(vocab_size=4096, tie_word_embeddings=False)
    w = random_weights(cfg, seed=5, std=0.08)
    head = w.tensors["lm_head.weight"]
    if case == "ties":
        head[:] = head[7]
    elif case == "twins":
        plain = LlamaModel(cfg, quantize(w, "Q8_0"), quant_kernel=kernel)
        kv, ids, pos, tables = prefilled(plain, [5], seed=1)
        win = staged_step(decoder(plain, kv), kv.clone(), ids, pos, tables)[1][0]
        twins = sorted({win // 3, win // 2 + 1, (win + 4096) // 2, 4095} - {win})
        for t in twins:
            head[t] = head[win]
    else:
        head[1000] = head[3000] = float("nan")
    with np.errstate(invalid="ignore"):                  # gguf's quantizer casts the NaN rows
        model = LlamaModel(cfg, quantize(w, "Q8_0"), quant_kernel=kernel)
    lengths = [5] if case == "twins" else [5, 30, 2]
    kv, ids, pos, tables = prefilled(model, lengths, seed=1)
    dec = decoder(model, kv)
    want = {"ties": [0] * 3, "nans": [1000] * 3, "twins": None}[case]
    if case == "twins":
        want = [min(twins[0], win)]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            logits, greedy = staged_step(dec, kv.clone(), ids, pos, tables)
            assert greedy == want == logits.argmax(-1).tolist() == logits.numpy().argmax(axis=-1).tolist(), n
    finally:
        torch.set_num_threads(threads)


def test_greedy_merge_does_not_depend_on_the_chunks_order():
    """kvd_plan_greedy runs the LM head threads' merge over chunks in a given order: with
    ties between chunks, NaNs, infinities and -0.0 against 0.0, every order of the chunks
    gives numpy's argmax (the first index of the largest, a NaN first)."""
    import ctypes

    from kernels.quant_linear import host_variant, library_flags
    fn = native.load(plan_decode.LIBRARY, library_flags(plan_decode.LIBRARY, host_variant())).kvd_plan_greedy
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(1, 200))
        x = rng.choice(np.array([-1.0, 0.0, -0.0, 1.0, 2.0, 2.0, np.inf, -np.inf, 3.0], np.float32), n) \
            if trial % 3 else rng.standard_normal(n).astype(np.float32)
        if trial % 7 == 0:
            x[rng.integers(0, n, 2)] = np.nan
        cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n + 1, int(rng.integers(0, 12)))])).astype(np.int64)
        order = rng.permutation(len(cuts) - 1).astype(np.int32)
        got = fn(x.ctypes.data, cuts.ctypes.data, order.ctypes.data, len(order))
        assert got == int(np.argmax(x)), (trial, x.tolist(), cuts.tolist(), order.tolist())


def test_a_smaller_decode_team_starts_no_threads_beside_torchs(tiny):
    """A step on fewer threads than torch's (a decode team, EngineConfig.decode_threads)
    runs in a region of torch's size with the rest idle: libgomp ends a pool's surplus
    threads when a smaller region starts and starts new ones for the next full-size one,
    which a torch op between two steps would pay every step. Same bits as the full team."""
    kv, ids, pos, tables = prefilled(tiny, [5, 30], seed=3)
    dec = decoder(tiny, kv)
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        want = staged_step(dec, kv.clone(), ids, pos, tables)[0]
        st = dec.staging(kv)
        B, M = tables.shape
        st.reserve(B, M)
        x = torch.ones(1 << 22)
        box: dict = {}

        def alternate():                            # a thread of its own: a pool of its own
            for i in range(6):
                if i == 2:
                    box["before"] = set(os.listdir("/proc/self/task"))
                st.ids[:B], st.positions[:B], st.tables[:B, :M] = ids.numpy(), pos.numpy(), tables.numpy()
                box["logits"] = st.run(B, threads=2)[0].clone()
                x.add_(1)                           # a torch op on all 3 threads
            box["after"] = set(os.listdir("/proc/self/task"))
        worker = threading.Thread(target=alternate)
        worker.start()
        worker.join(60)
    finally:
        torch.set_num_threads(saved)
    assert box["after"] == box["before"]
    assert torch.equal(box["logits"], want)


def test_staging_grows_and_refuses_a_bad_batch_or_kv(tiny):
    kv, ids, pos, tables = prefilled(tiny, [4, 20, 200], seed=4)
    dec = decoder(tiny, kv)
    st = dec.staging(kv)
    st.reserve(1, 1)
    st.reserve(3, 40)                           # grows: rows and table width
    assert st.ids.shape[0] >= 3 and st.tables.shape[1] >= 40
    st.ids[:3], st.positions[:3] = ids.numpy(), pos.numpy()
    st.tables[:3, :tables.shape[1]] = tables.numpy()
    before = kv.clone()
    st.ids[1] = tiny.config.vocab_size          # a token id out of range: nothing written
    with pytest.raises(ValueError, match="out of range"):
        st.run(3)
    with pytest.raises(ValueError, match="rows staged"):
        st.run(0)
    with pytest.raises(ValueError, match="rows staged"):
        st.run(st.ids.shape[0] + 1)
    assert torch.equal(kv, before)
    with pytest.raises(ValueError, match="does not match"):
        dec.staging(kv.bfloat16())


def test_small_decode_batches_run_on_the_team_the_engine_timed(tiny, monkeypatch):
    """decode_threads = 0 on a host of CALIBRATE_FROM_THREADS or more compute threads (faked
    here from 2): the engine times one-row steps on each candidate team at start, in a device
    block it borrows from MemPool and gives back, and keeps one; decode_threads = N takes N.
    Tokens are the torch engine's either way (any team gives the same bits)."""
    from engine import config as config_module

    tok = resolve_model("tiny").load_tokenizer()
    threads = torch.get_num_threads()
    monkeypatch.setattr(config_module, "CALIBRATE_FROM_THREADS", 2)
    try:
        torch.set_num_threads(2)
        assert EngineConfig().decode_team_candidates(2) == [2, 1]
        assert EngineConfig().decode_team_candidates(16) == [16, 12, 8]
        assert EngineConfig(decode_threads=3).decode_team_candidates(2) == [2]
        timed = tiny_engine(tiny, tok, "auto")
        assert timed.runner.small_batch_threads in (1, 2)
        fixed = LLMEngine(EngineConfig(model="tiny", dtype="float32", kv_blocks=128, host_kv_blocks=0,
                                       decode_threads=1), tiny, tok, "tiny")
        assert fixed.runner.small_batch_threads == 1 and fixed.kernels()["decode_threads"].startswith("1 ")
        assert timed.pool.stats()["device"] == fixed.pool.stats()["device"]   # the borrowed block is back
        timed.check_integrity()
        with monkeypatch.context() as full:                 # no block to time in: the full team, untimed
            full.setattr(MemPool, "alloc_mem", lambda self, n, tier="device": None)
            assert tiny_engine(tiny, tok, "auto").runner.small_batch_threads == 2
        with monkeypatch.context() as whole:                # a decoder without small teams (the fused
            whole.setattr(PlanDecoder, "SMALL_TEAMS", False)    # bf16 one): torch's team, set or timed
            assert tiny_engine(tiny, tok, "auto").runner.small_batch_threads == 2
            assert LLMEngine(EngineConfig(model="tiny", dtype="float32", kv_blocks=128, host_kv_blocks=0,
                                          decode_threads=1), tiny, tok, "tiny").runner.small_batch_threads == 2
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [[11, 12, 13, 14], [200, 3, 3, 40, 41, 42, 43]]
        want = tiny_engine(tiny, tok, "torch").generate(prompts, params)
        assert timed.generate(prompts, params) == fixed.generate(prompts, params) == want
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ which models
def test_models_it_does_not_run_say_why(tiny, kernel):
    w = random_weights(tiny_config(vocab_size=512), seed=5)
    assert "float weights stored [in, out]" in plan_unsupported_reason(LlamaModel(w.config, w.tensors))
    assert "dtype" in plan_unsupported_reason(LlamaModel(w.config, w.tensors, dtype=torch.bfloat16, float_layout="rows"))
    assert plan_unsupported_reason(LlamaModel(w.config, w.tensors, float_layout="rows")) is None
    odd = random_weights(tiny_config(vocab_size=512, intermediate_size=120), seed=5)
    assert "a float matrix [out, in] (fp32, bf16 or fp16) whose width is a multiple of 16" in plan_unsupported_reason(
        LlamaModel(odd.config, odd.tensors, float_layout="rows"))
    # what build_model asks before choosing the rows layout: such a model stays [in, out]
    assert "intermediate_size not a multiple of 16" in decode_kernels.float_unsupported_reason(odd.config)
    assert decode_kernels.float_unsupported_reason(w.config) is None
    cfg = EngineConfig(model="tiny", dtype="float32")
    assert not build_model(cfg, odd).rows_layout and build_model(cfg, w).rows_layout
    q = quantize(w, "Q8_0")
    assert "dtype" in plan_unsupported_reason(LlamaModel(w.config, q, dtype=torch.bfloat16, quant_kernel=kernel))
    assert "pipeline stage" in plan_unsupported_reason(LlamaModel(w.config, q, layer_range=(0, 2), quant_kernel=kernel))
    mixed = dict(q, **{"model.layers.1.mlp.down_proj.weight": w.tensors["model.layers.1.mlp.down_proj.weight"]})
    assert "down is not block-quantized tensors" in plan_unsupported_reason(
        LlamaModel(w.config, mixed, quant_kernel=kernel))
    assert plan_unsupported_reason(tiny) is None


def test_a_plan_with_an_op_it_lacks_is_declined(tiny, monkeypatch):
    """A model change the executor does not implement (here a ReLU² gate in a Llama)
    turns it off, by name, and decode stays on forward."""
    steps = tuple(dataclasses.replace(s, op="relu2_mul") if s.op == "silu_mul" else s for s in llama.LAYER_STEPS)
    monkeypatch.setattr(tiny, "steps", steps)
    assert "relu2_mul" in plan_unsupported_reason(tiny)
    assert plan_decoder(tiny, empty_kv(tiny), BS) is None


def test_the_executor_refuses_a_plan_whose_widths_do_not_fit(tiny, monkeypatch):
    """kvd_plan_check: a step whose weight does not fit its slots is refused at construction."""
    steps = tuple(dataclasses.replace(s, weight="gate_up") if s.weight == "down" else s for s in llama.LAYER_STEPS)
    monkeypatch.setattr(tiny, "steps", steps)
    assert plan_decoder(tiny, empty_kv(tiny), BS) is None


# ------------------------------------------------------------------ in the engine
def tiny_engine(model: LlamaModel, tokenizer, kernel: str) -> LLMEngine:
    cfg = EngineConfig(model="tiny", dtype="float32", kv_blocks=128, host_kv_blocks=0, decode_kernel=kernel)
    return LLMEngine(cfg, model, tokenizer, "tiny")


def test_a_float_model_decodes_on_the_executor_by_config():
    """build_model keeps an fp32 float model's matrices [out, in] (one table for the tied
    embedding and LM head) where decode_kernel = "auto" will run it on the executor, and
    [in, out] for torch's decode: the same greedy tokens either way."""
    source = resolve_model("tiny:3")
    weights, tok = source.load_weights(), source.load_tokenizer()

    def engine(kernel: str) -> LLMEngine:
        cfg = EngineConfig(model="tiny", dtype="float32", kv_blocks=128, host_kv_blocks=0, decode_kernel=kernel)
        return LLMEngine(cfg, build_model(cfg, weights), tok, "tiny")
    plan, torch_path = engine("auto"), engine("torch")
    assert isinstance(plan.runner.fused, PlanDecoder) and plan.model.rows_layout
    assert plan.model.lm_head is plan.model.embed and plan.kernels()["decode"].startswith("plan:")
    assert torch_path.runner.fused is None and not torch_path.model.rows_layout
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[11, 12, 13, 14], [200, 3, 3, 40, 41, 42, 43, 44, 45], list(range(60, 99))] * 3
    assert plan.generate(prompts, params) == torch_path.generate(prompts, params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16bit_checkpoint_is_served_in_its_own_dtype_by_default(dtype, tmp_path):
    """A Hugging Face directory of bf16 (fp16) tensors: ``weights = "native"`` (the default)
    keeps its matrices as they are for an fp32 model that decodes on the executor, half the
    bytes a step reads; ``"dequantize"`` widens them to fp32 at load. The same tokens,
    greedy and seeded, either way."""
    from engine.model.weights import LoadedWeights, save_hf_dir
    w = resolve_model("tiny:3").load_weights()
    save_hf_dir(LoadedWeights(w.config, {n: t.to(dtype) for n, t in w.tensors.items()}, "tiny:3"), tmp_path / "m")
    source, tok = resolve_model(str(tmp_path / "m")), resolve_model("tiny").load_tokenizer()

    def engine(mode: str) -> LLMEngine:
        cfg = EngineConfig(model="m", dtype="float32", kv_blocks=128, host_kv_blocks=0, weights=mode)
        return LLMEngine(cfg, build_model(cfg, source.load_weights(quantized=mode == "native")), tok, "m")
    native_engine, wide = engine("native"), engine("dequantize")
    assert native_engine.kernels()["matrices"] == str(dtype).removeprefix("torch.")
    assert wide.kernels()["matrices"] == "float32"
    assert native_engine.kernels()["decode"].startswith("plan:") and wide.kernels()["decode"].startswith("plan:")
    assert 1.9 * native_engine.model.weight_bytes_per_token() < wide.model.weight_bytes_per_token()
    prompts = [[11, 12, 13, 14], [200, 3, 3, 40, 41, 42, 43, 44, 45], list(range(60, 99))] * 2
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)] * 3
    assert native_engine.generate(prompts, params) == wide.generate(prompts, params)


def test_engine_runs_decode_on_the_executor_by_config(tiny):
    tok = resolve_model("tiny").load_tokenizer()
    assert isinstance(tiny_engine(tiny, tok, "auto").runner.fused, PlanDecoder)
    assert tiny_engine(tiny, tok, "torch").runner.fused is None
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[11, 12, 13, 14], [200, 3, 3, 40, 41, 42, 43, 44, 45], list(range(60, 99))]
    assert tiny_engine(tiny, tok, "auto").generate(prompts, params) == \
        tiny_engine(tiny, tok, "torch").generate(prompts, params)
    # min_tokens masks logits after the step (the step's greedy tokens are then not used),
    # stop_token_ids end a request, a larger batch grows the staging buffers
    mixed = [SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, stop_token_ids=(3, 40, 41)),
             SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(7,)), params] * 4
    prompts = [p + [i] for i in range(4) for p in prompts]
    assert tiny_engine(tiny, tok, "auto").generate(prompts, mixed) == \
        tiny_engine(tiny, tok, "torch").generate(prompts, mixed)
