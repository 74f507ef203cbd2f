"""The fused bf16 decode step against the torch decode path (kernels/fused_decode.py).

Agreement with torch is to bf16 rounding; batch invariance, thread-count
invariance and the KV slots written are checked bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model import llama
from engine.model.decode_kernels import fused_decoder, fused_unsupported_reason
from engine.model.llama import LlamaModel, Step
from engine.model.registry import resolve_model
from engine.request import SamplingParams
from kernels.attention import AttentionBatch, PrefillSeq, decode_key_mask
from kernels.fused_decode import FusedDecoder, cpu_unsupported_reason, interleave_gate_up, pack_tiles

BS, NUM_BLOCKS = 16, 160
CPU_REASON = cpu_unsupported_reason()
needs_cpu = pytest.mark.skipif(CPU_REASON is not None, reason=f"fused decode kernel: {CPU_REASON}")


@pytest.fixture(scope="module")
def tiny():
    w = resolve_model("tiny:7").load_weights()
    return LlamaModel(w.config, w.tensors, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def smollm2_source():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    w = smollm2_source.load_weights()
    return LlamaModel(w.config, w.tensors, dtype=torch.bfloat16)


def empty_kv(model: LlamaModel) -> torch.Tensor:
    c = model.config
    return torch.zeros(c.num_layers, 2, NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, dtype=torch.bfloat16)


def fused(model: LlamaModel, kv: torch.Tensor) -> FusedDecoder:
    dec = fused_decoder(model, kv, BS)
    assert dec is not None, "the CPU supports the kernel but it did not build or load (see the log)"
    return dec


def prefilled(model: LlamaModel, lengths: list[int], seed: int):
    """A KV cache holding ``lengths[i]`` random tokens for each sequence i in
    scattered blocks (torch prefill), and the decode inputs of each one's next
    token: ids [B], positions [B], block tables [B, M] (room for the new token)."""
    g = torch.Generator().manual_seed(seed)
    kv = empty_kv(model)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, at = [], 0
    for n in lengths:
        need = n // BS + 1
        tables.append(perm[at:at + need])
        at += need
    # one prefill step for all sequences (one matmul shape: oneDNN pays per new shape)
    seqs, slots, positions = [], [], []
    for table, n in zip(tables, lengths):
        seqs.append(PrefillSeq(len(slots), n, n, torch.tensor(table)))
        slots += [table[p // BS] * BS + p % BS for p in range(n)]
        positions += range(n)
    batch = AttentionBatch(slots=torch.tensor(slots), is_prefill=True, prefill=seqs)
    model.forward(torch.randint(0, 1000, (len(slots),), generator=g), torch.tensor(positions), batch, kv)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    ids = torch.randint(0, 1000, (len(lengths),), generator=g)
    return kv, ids, torch.tensor(lengths), block_tables


def torch_decode(model: LlamaModel, kv, ids, positions, block_tables) -> torch.Tensor:
    """The torch path's logits for one decode step (mutates kv like the kernel)."""
    slots = torch.stack([block_tables[b, p // BS] * BS + p % BS for b, p in enumerate(positions.tolist())])
    batch = AttentionBatch(slots=slots, is_prefill=False, block_tables=block_tables,
                           key_mask=decode_key_mask((positions + 1).tolist(), block_tables.shape[1], BS))
    return model.compute_logits(model.forward(ids, positions, batch, kv))


# ------------------------------------------------------------------ layout (any CPU)
def test_pack_tiles_layout():
    w = torch.arange(70 * 5, dtype=torch.float32).view(70, 5).to(torch.bfloat16)   # N=70, K=5 (odd)
    p = pack_tiles(w)
    assert p.shape == (3, 3, 32, 2)                     # ceil(70/32) tiles, ceil(5/2) k-pairs
    for n, k in [(0, 0), (1, 3), (33, 4), (69, 1)]:
        assert p[n // 32, k // 2, n % 32, k % 2] == w[n, k]
    assert p[2, :, 6:].abs().sum() == 0                 # columns 70..95: zero padding
    assert p[:, 2, :, 1].abs().sum() == 0               # k = 5: zero padding


def test_interleave_gate_up_groups_of_16():
    inter, d = 20, 3
    gu = torch.arange(2 * inter * d, dtype=torch.float32).view(2 * inter, d)
    out = interleave_gate_up(gu, inter)                 # I padded to 32: tiles of gate16 + up16
    assert out.shape == (64, d)
    assert torch.equal(out[0:16], gu[0:16]) and torch.equal(out[16:32], gu[20:36])
    assert torch.equal(out[32:36], gu[16:20]) and torch.equal(out[48:52], gu[36:40])
    assert out[36:48].abs().sum() == 0 and out[52:64].abs().sum() == 0


def test_fp32_and_unsupported_shapes_keep_the_torch_path():
    w = resolve_model("tiny:7").load_weights()
    fp32 = LlamaModel(w.config, w.tensors, dtype=torch.float32)
    assert "dtype" in fused_unsupported_reason(fp32)
    assert fused_decoder(fp32, torch.zeros(1), BS) is None
    stage = LlamaModel(w.config, w.tensors, dtype=torch.bfloat16, layer_range=(0, 2))
    assert "pipeline stage" in fused_unsupported_reason(stage)


def test_a_model_change_in_llama_py_turns_the_kernel_off(monkeypatch):
    """The kernel writes the layer out in C++: a layer plan it does not implement (here
    a made-up per-head q/k norm) declines it, by name, and bf16 decode stays on forward."""
    w = resolve_model("tiny:7").load_weights()
    bf16 = LlamaModel(w.config, w.tensors, dtype=torch.bfloat16)
    assert "layer plan" not in (fused_unsupported_reason(bf16) or "")
    steps = llama.LAYER_STEPS[:2] + (Step("qk_norm", "qkv", "qkv", "input_norm"),) + llama.LAYER_STEPS[2:]
    monkeypatch.setattr(bf16, "steps", steps)
    assert "layer plan" in fused_unsupported_reason(bf16)
    assert fused_decoder(bf16, torch.zeros(1), BS) is None


def test_decode_kernel_option_is_validated():
    with pytest.raises(ValueError, match="decode_kernel"):
        EngineConfig(decode_kernel="triton")


# ------------------------------------------------------------------ the kernel
@needs_cpu
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_logits_and_kv_match_the_torch_path(which, request):
    model = request.getfixturevalue(which)
    kv, ids, pos, tables = prefilled(model, [1, 5, 16, 17, 40, 100], seed=1)
    kv_torch, kv_fused = kv.clone(), kv.clone()
    ref = torch_decode(model, kv_torch, ids, pos, tables)
    out = fused(model, kv).decode(ids, pos, tables, kv_fused)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # bf16 tolerance: a few ulps of the largest logits
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # only the new tokens' slots changed, in every layer, to (nearly) torch's K/V
    slots = [tables[b, p // BS].item() * BS + p % BS for b, p in enumerate(pos.tolist())]
    flat = lambda t: t.view(t.shape[0], 2, -1, *t.shape[4:])          # noqa: E731  [L, 2, N*bs, kvh, hd]
    changed = (flat(kv_fused) != flat(kv)).flatten(3).any(-1).any(0).any(0)     # [N*bs]
    assert sorted(changed.nonzero().flatten().tolist()) == sorted(slots)
    new_f, new_t = flat(kv_fused)[:, :, slots].float(), flat(kv_torch)[:, :, slots].float()
    assert (new_f - new_t).abs().max() <= 0.05 * new_t.abs().max()


@needs_cpu
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_batch_of_16_rows_equal_each_row_alone_bit_for_bit(which, request):
    model = request.getfixturevalue(which)
    lengths = [1, 3, 15, 16, 17, 31, 32, 33, 47, 64, 70, 90, 100, 120, 5, 9]
    kv, ids, pos, tables = prefilled(model, lengths, seed=2)
    dec = fused(model, kv)
    batch_kv = kv.clone()
    batch = dec.decode(ids, pos, tables, batch_kv)
    alone_kv = kv.clone()
    for r in range(len(lengths)):
        row = dec.decode(ids[r:r + 1], pos[r:r + 1], tables[r:r + 1, :lengths[r] // BS + 1], alone_kv)
        assert torch.equal(row[0], batch[r]), f"row {r} differs alone"
    assert torch.equal(alone_kv, batch_kv)              # and wrote the same K/V


@needs_cpu
def test_thread_count_does_not_change_a_bit(smollm2):
    kv, ids, pos, tables = prefilled(smollm2, [7, 33, 80], seed=3)
    dec = fused(smollm2, kv)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dec.decode(ids, pos, tables, kv.clone())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, dec.decode(ids, pos, tables, kv.clone()))


@needs_cpu
def test_staged_step_gives_decodes_logits_and_their_argmax(tiny):
    """The engine's door (DecodeStaging, numpy's argmax here) against decode()."""
    kv, ids, pos, tables = prefilled(tiny, [1, 17, 40, 100], seed=8)
    dec = fused(tiny, kv)
    want_kv = kv.clone()
    want = dec.decode(ids, pos, tables, want_kv)
    got_kv = kv.clone()
    st = dec.staging(got_kv)
    B, M = tables.shape
    st.reserve(B, M)
    st.ids[:B], st.positions[:B], st.tables[:B, :M] = ids.numpy(), pos.numpy(), tables.numpy()
    logits, greedy = st.run(B)
    assert torch.equal(logits, want) and torch.equal(got_kv, want_kv)
    assert greedy == want.argmax(-1).tolist()
    with pytest.raises(ValueError, match="does not match"):
        dec.staging(kv.float())


@needs_cpu
def test_bad_input_is_refused_before_writing(tiny):
    kv, ids, pos, tables = prefilled(tiny, [4, 20], seed=4)
    dec = fused(tiny, kv)
    before = kv.clone()
    for bad_ids, bad_pos, bad_tables in [
            (torch.tensor([5, tiny.config.vocab_size]), pos, tables),      # token id
            (ids, torch.tensor([4, 40]), tables),                          # position past the table
            (ids, pos, torch.tensor([[NUM_BLOCKS, 0], [1, 2]]))]:          # block id
        with pytest.raises(ValueError):
            dec.decode(bad_ids, bad_pos, bad_tables, kv)
    with pytest.raises(ValueError):
        dec.decode(ids, pos, tables, kv.float())
    assert torch.equal(kv, before)


# ------------------------------------------------------------------ in the engine
def smollm2_engine(model: LlamaModel, source, kernel: str) -> LLMEngine:
    cfg = EngineConfig(model="smollm2", dtype="bfloat16", kv_blocks=128, host_kv_blocks=0,
                       decode_kernel=kernel)
    return LLMEngine(cfg, model, source.load_tokenizer(), "smollm2")


@needs_cpu
def test_engine_picks_the_kernel_by_config(smollm2, smollm2_source):
    assert smollm2_engine(smollm2, smollm2_source, "auto").runner.fused is not None
    assert smollm2_engine(smollm2, smollm2_source, "torch").runner.fused is None


def torch_prefill_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """The torch path's fp32 logits [V] after ``ids`` (one prefill on a fresh cache)."""
    n = len(ids)
    kv = empty_kv(model)
    batch = AttentionBatch(slots=torch.arange(n), is_prefill=True,
                           prefill=[PrefillSeq(0, n, n, torch.arange(-(-n // BS)))])
    return model.compute_logits(model.forward(torch.tensor(ids), torch.arange(n), batch, kv)[-1:])[0]


@needs_cpu
def test_greedy_tokens_equal_the_torch_path_for_32_steps(smollm2, smollm2_source):
    """Equal tokens, or a first divergence at a bf16 near-tie of the torch path's logits.

    Known case (torch 2.13 CPU): "def fibonacci(n):" diverges at step 25, where
    the torch logits of the two candidates (ids 19 and 3272) are both 34.25 — an
    exact bf16 tie that the kernel's different (fp32) summation order breaks the
    other way. On a Xeon with AVX512-BF16 and no AMX a second prompt meets such a tie
    too: what is held is that every divergence is at a near-tie, on at most half of
    the prompts."""
    tok = smollm2_source.load_tokenizer()
    prompts = [tok.encode(t) for t in (
        "The history of the Roman Empire begins",
        "def fibonacci(n):",
        "Paris is the capital of",
        "Once upon a time, in a small village,",
    )]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    fused_out = smollm2_engine(smollm2, smollm2_source, "auto").generate(prompts, sp)
    torch_out = smollm2_engine(smollm2, smollm2_source, "torch").generate(prompts, sp)
    diverged = 0
    for prompt, f, t in zip(prompts, fused_out, torch_out):
        if f == t:
            continue
        diverged += 1
        step = next(i for i, (a, b) in enumerate(zip(f, t)) if a != b)
        logits = torch_prefill_logits(smollm2, prompt + t[:step])
        top = logits.max().item()
        ulp = 2.0 ** (torch.tensor(abs(top)).log2().floor().item() - 7)   # bf16: 8 significant bits
        gap = abs(logits[f[step]].item() - logits[t[step]].item())
        assert gap <= 2 * ulp, f"diverged at step {step} with a logit gap of {gap} (not a near-tie)"
    assert diverged <= len(prompts) // 2, f"{diverged} of {len(prompts)} prompts diverged from the torch path"
