"""SmolLM2-135M-Instruct in kvd vs Hugging Face transformers loading the same GGUF (fp32).

The issue's bar: logits within 1e-3 over >= 8 prompts (chat-templated ones
included) and 64 identical greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from kernels import native
from kernels.attention import AttentionBatch, PrefillSeq

from .conftest import build_engine

pytestmark = pytest.mark.slow

def all_logits(engine, ids: list[int]) -> torch.Tensor:
    """kvd logits at every prompt position: [T, V]."""
    T, bs = len(ids), engine.config.block_size
    table = torch.arange(-(-T // bs), dtype=torch.int64)
    pos = torch.arange(T)
    batch = AttentionBatch(slots=table[pos // bs] * bs + pos % bs, is_prefill=True,
                           prefill=[PrefillSeq(0, T, T, table)])
    hidden = engine.model.forward(torch.tensor(ids), pos, batch, engine.kv.tier("device"))
    return engine.model.compute_logits(hidden)


def worst_logit_delta(engine, hf_model, prompts: list[list[int]]) -> float:
    """max |kvd logit - transformers logit| over every position of every prompt."""
    worst = 0.0
    for ids in prompts:
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (all_logits(engine, ids) - ref).abs().max().item())
    return worst


GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
GREEDY_16 = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_64(engine, prompts):
    """The dequantized fp32 engine's 64 greedy tokens per fidelity prompt, in one batch,
    generated once: held to transformers' below, and the reference of the native-weight
    and float16-KV engines."""
    tokens = engine.generate(prompts, GREEDY_64)
    engine.check_integrity()
    return tokens


@pytest.fixture(scope="module")
def alone_16(smollm2_weights, smollm2_source, prompts):
    """dtype -> each fidelity prompt's 16 greedy tokens from the plain engine (no prefix
    cache, whole-prompt prefill), run alone; computed once per dtype for the tests below."""
    tok, cache = smollm2_source.load_tokenizer(), {}

    def alone(dtype: str) -> list[list[int]]:
        if dtype not in cache:
            plain = build_engine(smollm2_weights, tok, dtype=dtype, enable_prefix_caching=False,
                                 prefill_chunk_tokens=0, kv_blocks=512)
            cache[dtype] = [plain.generate([p], GREEDY_16)[0] for p in prompts]
        return cache[dtype]
    return alone


def test_logits_match_transformers(engine, hf_model, prompts):
    worst = worst_logit_delta(engine, hf_model, prompts)
    assert worst <= 1e-3, f"max |logit delta| {worst}"


def test_64_greedy_tokens_match_transformers(greedy_64, hf_model, prompts):
    for ids, got in zip(prompts, greedy_64):
        ref: list[int] = []
        past = None
        x = torch.tensor([ids])
        with torch.no_grad():
            for _ in range(64):
                out = hf_model(x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = int(out.logits[0, -1].argmax())
                ref.append(nxt)
                x = torch.tensor([[nxt]])
        assert got == ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_batch_and_prefix_exactness(smollm2_weights, smollm2_source, prompts, alone_16, dtype):
    """The real model: batch of 16 == alone, and a cached prefix == cold, in both dtypes."""
    tok = smollm2_source.load_tokenizer()
    params = GREEDY_16
    batch = (prompts * 2)[:16]
    alone = alone_16(dtype)
    warm = build_engine(smollm2_weights, tok, dtype=dtype, kv_blocks=512)
    assert warm.generate(batch, params) == (alone * 2)[:16]          # batch of 16, cold cache
    assert warm.generate(prompts, params) == alone                    # every prefix now cached
    assert warm.stats.prefix_hit_tokens >= sum(len(p) // 16 * 16 for p in prompts)
    warm.check_integrity()


PREEMPT_BF16 = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_alone(smollm2_weights, smollm2_source, prompts):
    """Each prompt's bf16 greedy tokens, run alone with room to spare."""
    cold = build_engine(smollm2_weights, smollm2_source.load_tokenizer(), dtype="bfloat16",
                        enable_prefix_caching=False, kv_blocks=512)
    return [cold.generate([p], PREEMPT_BF16)[0] for p in prompts]


# Recompute rebuilds generated tokens' KV through the prefill's attention (SDPA), not the
# decode attention that first wrote it: in bf16 the two round differently, so the tokens are
# equal only while no greedy choice is that close. On AVX-512 CPUs one of the prompts flips
# a token: a Cascade Lake Xeon (bf16 emulated by oneDNN's avx512_core kernels), a Xeon with
# AVX512-BF16 but no AMX exposed, and a Xeon with AMX-BF16 (its linears in calls of
# llama.AMX_ROWS rows); on the AVX2 hosts measured none does. dtype "auto" never runs bf16 on
# an AVX2 CPU; one path for every token's KV is the cure (the prefill and the decode
# rounding alike), not a wider tolerance here.
RECOMPUTE_BF16 = pytest.param("recompute", marks=pytest.mark.xfail(
    "avx512f" in native.cpu_flags(),
    reason="bf16 recompute rebuilds KV through another attention than decode's (see above)", strict=False))


@pytest.mark.parametrize("mode", ["swap", RECOMPUTE_BF16])
def test_real_model_preemption_exactness_bf16(smollm2_weights, smollm2_source, prompts, bf16_alone, mode):
    """bf16 under KV pressure: preempted requests give the tokens they give alone.
    With the fused decode kernel, recompute rebuilds generated tokens' KV through
    the torch prefill instead of the kernel that first wrote it; greedy tokens
    must not notice."""
    tok = smollm2_source.load_tokenizer()
    params, alone = PREEMPT_BF16, bf16_alone
    small = build_engine(smollm2_weights, tok, dtype="bfloat16", enable_prefix_caching=False, kv_blocks=24,
                         host_kv_blocks=64, preemption_mode=mode)
    assert small.generate(prompts, params) == alone
    assert small.stats.preemptions > 0
    small.check_integrity()


def test_native_weights_logits_match_transformers(native_engine, hf_model, prompts):
    """Native Q4_1 / Q8_0 weights against transformers' dequantized fp32 model of the same
    GGUF, to 0.05 (logits here reach ~30). The weights are the same values; the gap is the
    kernel's 16-bit activations (every matmul input rounded to amax / 32767 of its 32-block,
    kernels/csrc/quant_matmul.cpp). Measured on the fidelity prompts: 0.030, against 1e-4
    for fp32 activations and 0.67 for activations rounded to bf16, the format the issue
    allows (the same model with each matmul input rounded to bf16)."""
    worst = worst_logit_delta(native_engine, hf_model, prompts)
    assert worst <= 0.05, f"max |logit delta| {worst}"


def test_native_weights_64_greedy_tokens_match_the_dequantized_engine(native_engine, greedy_64, prompts):
    """64 greedy tokens per fidelity prompt, native weights (decode steps through the
    plan executor) == dequantized fp32 weights (the engine held to transformers above)."""
    assert native_engine.runner.fused is not None, "the native engine should decode on the plan executor"
    assert native_engine.generate(prompts, GREEDY_64) == greedy_64
    native_engine.check_integrity()


def test_a_float16_kv_cache_keeps_the_greedy_tokens(native_engine, greedy_64, prompts):
    """kv_cache_dtype = "float16" (K and V rounded to halves, half the bytes): 64 greedy
    tokens per fidelity prompt equal the fp32 dequantized engine's (held to transformers
    above), alone and in a batch with every prefix cached. Measured, not by construction:
    a half keeps 11 significant bits, and a near-tie in the logits could go the other way."""
    params = GREEDY_64
    half = LLMEngine(EngineConfig(model="smollm2", dtype="float32", kv_blocks=512, kv_cache_dtype="float16"),
                     native_engine.model, native_engine.tokenizer, "smollm2")
    assert half.runner.fused is not None and half.kv.tier("device").dtype == torch.float16
    want = greedy_64
    assert [half.generate([p], params)[0] for p in prompts] == want
    assert half.generate(prompts, params) == want
    assert half.stats.prefix_hit_tokens >= sum(len(p) // 16 * 16 for p in prompts)
    half.check_integrity()


def test_real_model_chunked_prefill_exactness(smollm2_weights, smollm2_source, prompts, alone_16):
    """Chunked prefill, chunks of 5 tokens (every fidelity prompt spans several, and they
    share steps with the decodes), float matrices in fp32 (prefilled on MKL): a batch of
    16 gives the greedy tokens of an unchunked prefill alone. (Native weights, greedy and
    seeded, bit for bit: tests/engine/test_determinism_engine.py. A bf16 engine ignores
    the setting: tests/engine/test_chunked_prefill.py.)"""
    tok = smollm2_source.load_tokenizer()
    params = [GREEDY_16] * len(prompts)
    want = alone_16("float32")                  # an unchunked prefill, alone
    chunked = build_engine(smollm2_weights, tok, dtype="float32", kv_blocks=512, prefill_chunk_tokens=5,
                           enable_prefix_caching=False)
    assert chunked.prefill_chunk_tokens == 5
    assert chunked.generate((prompts * 2)[:16], (params * 2)[:16]) == (want * 2)[:16]
    chunked.check_integrity()
