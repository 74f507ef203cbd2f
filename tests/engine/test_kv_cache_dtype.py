"""``kv_cache_dtype = "float16"``: an fp32 model's KV cache stored as IEEE halves.

Exactness is by construction: every step attends to the K/V the cache holds
(a prefill too, to its own new tokens: kernels.attention.store_kv), so a
prompt's tokens cannot depend on the batch, on chunked prefill, on a cached
prefix or on swap preemption; recompute preemption rebuilds decode-written
K/V through prefill, measured here as for the fp32 cache. Both decode paths
run: the plan executor (native GGUF weights, and float weights) and the
torch model (float weights, decode_kernel = "torch"). The real SmolLM2 is in test_fidelity.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model.config import tiny_config
from engine.model.weights import random_weights
from engine.request import SamplingParams

from .test_chunked_prefill import alone, prompts
from .test_quant_weights import kernel, native_engine, tiny_gguf  # noqa: F401  (fixtures)
from .test_weights import write_gguf

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def q4_1_gguf(tmp_path_factory):
    """test_quant_weights' tiny GGUF in the bundled model's layer format (test_plan_decode
    runs the executor over a float16 cache in all three)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q4_1.gguf"
    write_gguf(path, random_weights(tiny_config(vocab_size=512), seed=11, std=0.08), "Q4_1")
    return path


@pytest.fixture(params=["plan", "plan-float", "torch"])
def make(request, make_tiny, q4_1_gguf, tokenizer, kernel):  # noqa: F811
    """Engines of one model over a float16 cache: native weights decoding on the plan
    executor, float weights decoding on it, or float weights decoding through the torch
    model."""
    def build(**overrides):
        overrides.setdefault("kv_cache_dtype", "float16")
        if request.param == "plan":
            eng = native_engine(q4_1_gguf, tokenizer, **overrides)
            assert eng.runner.fused is not None
        elif request.param == "plan-float":
            eng = make_tiny(**overrides)
            assert eng.runner.fused is not None and not eng.model.quantized
        else:
            eng = make_tiny(decode_kernel="torch", **overrides)
            assert eng.runner.fused is None
        return eng
    return build


def test_the_option_is_validated(make_tiny):
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):    # a bf16 model's cache is 16-bit already
        make_tiny(dtype="bfloat16", kv_cache_dtype="float16")


def test_a_float16_cache_holds_half_the_bytes(make):
    half, full = make(), make(kv_cache_dtype="auto")
    assert half.kv.tier("device").dtype == half.kv.tier("host").dtype == torch.float16
    assert full.kv.tier("device").dtype == torch.float32
    assert 2 * half.kv.bytes_per_block == full.kv.bytes_per_block
    assert half.pool.kv_layout().dtype == torch.float16          # what transfers and replicas carry
    assert half.kernels()["kv_cache"] == "float16" and full.kernels()["kv_cache"] == "float32"


def test_tokens_do_not_depend_on_the_batch_chunks_or_cached_prefixes(make):
    system = prompts(1, lo=40, hi=41, seed=5)[0]
    ps = [system + p for p in prompts(15, lo=3, hi=90, seed=6)]
    want = alone(make(prefill_chunk_tokens=0, enable_prefix_caching=False), ps, PARAMS)
    assert make(prefill_chunk_tokens=0, enable_prefix_caching=False).generate(ps, PARAMS) == want
    for chunk in (5, 16, 37):
        eng = make(prefill_chunk_tokens=chunk)
        assert eng.generate(ps[:1], PARAMS) == want[:1], chunk       # caches the shared prefix
        assert eng.generate(ps, PARAMS) == want, chunk               # a batch of 15 with prefix hits
        assert eng.stats.prefix_hit_tokens >= 14 * 32, chunk
        eng.check_integrity()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_keep_their_tokens(make, mode):
    ps = prompts(8, lo=20, hi=90, seed=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = alone(make(enable_prefix_caching=False), ps, params)
    eng = make(kv_blocks=24, host_kv_blocks=64, preemption_mode=mode, enable_prefix_caching=False,
               prefill_chunk_tokens=16)
    assert eng.generate(ps, params) == want
    assert eng.stats.preemptions > 0
    eng.check_integrity()


def test_the_plan_executor_and_the_torch_model_give_the_same_tokens(tiny_gguf, tokenizer, kernel):  # noqa: F811
    """Native weights over a float16 cache, decode on the executor against decode through
    forward: the same greedy tokens (the two agree to fp32 rounding before the K/V are
    rounded to halves; measured on the tiny models of every block format)."""
    ps = prompts(6, lo=5, hi=120, seed=12)
    plan = native_engine(tiny_gguf, tokenizer, kv_cache_dtype="float16")
    forward = native_engine(tiny_gguf, tokenizer, kv_cache_dtype="float16", decode_kernel="torch")
    assert plan.runner.fused is not None and forward.runner.fused is None
    assert plan.generate(ps, PARAMS) == forward.generate(ps, PARAMS)
