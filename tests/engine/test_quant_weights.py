"""GGUF weights served in their blocks (``weights = "native"``): loading, the model, the engine.

Tiny random models written as real GGUF files by gguf-py, loaded both ways;
the real SmolLM2 is in test_fidelity.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine, build_model
from engine.model.config import tiny_config
from engine.model.decode_kernels import fused_unsupported_reason
from engine.model.llama import LlamaModel
from engine.model.weights import NATIVE_GGUF_TYPES, load_gguf, random_weights
from engine.request import SamplingParams
from engine.cpus import format_cpulist
from kernels import quant_linear
from kernels.attention import AttentionBatch, PrefillSeq
from kernels.quant import QuantTensor
from kernels.quant_linear import QuantKernel, QuantLinear, host_variant

from .test_weights import small_config, write_gguf

U = 2.0 ** -24


@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    k = QuantKernel.create()
    assert k is not None, "no quantized-weights kernel on this host (see tests/kernels/test_quant_linear.py)"
    return k


@pytest.fixture(scope="module", params=NATIVE_GGUF_TYPES)
def tiny_gguf(request, tmp_path_factory):
    """A tiny GGUF (the engine's tiny config, vocab cut to 512) in one block format."""
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    weights = random_weights(tiny_config(vocab_size=512), seed=11, std=0.08)
    write_gguf(path, weights, request.param)
    return path


# ------------------------------------------------------------------ loading
@pytest.mark.parametrize("fmt", NATIVE_GGUF_TYPES)
@pytest.mark.parametrize("tied", [True, False])
def test_blocks_are_kept_and_dequantize_to_the_fp32_loader(tmp_path, fmt, tied):
    path = tmp_path / "m.gguf"
    write_gguf(path, random_weights(small_config(tie_word_embeddings=tied), seed=3), fmt)
    native, fp32 = load_gguf(path, quantized=True), load_gguf(path)
    assert native.config == fp32.config and native.is_quantized and not fp32.is_quantized
    assert set(native.tensors) == set(fp32.tensors)
    for name, t in native.tensors.items():
        if isinstance(t, torch.Tensor):
            assert t.dim() == 1 and torch.equal(t, fp32.tensors[name])  # only the norms stay F32
            continue
        assert isinstance(t, QuantTensor) and t.fmt.name == fmt, name
        assert tuple(t.shape) == tuple(fp32.tensors[name].shape)
        # q/k rows un-permuted in their blocks exactly as the fp32 loader un-permutes them
        assert torch.equal(t.dequantize(), fp32.tensors[name]), name
    assert native.dequantized().tensors.keys() == fp32.tensors.keys()


def test_float_files_have_nothing_to_keep(tmp_path):
    path = tmp_path / "f16.gguf"
    write_gguf(path, random_weights(small_config(), seed=4), "F16")
    loaded = load_gguf(path, quantized=True)
    assert not loaded.is_quantized and loaded.dequantized() is loaded


@pytest.mark.parametrize("quantized", [True, False])
def test_a_truncated_file_names_the_tensor_it_cuts(tmp_path, quantized):
    path = tmp_path / "m.gguf"
    write_gguf(path, random_weights(small_config(), seed=5), "Q4_1")
    data = path.read_bytes()
    for cut, what in [(len(data) - 10, "output_norm.weight"), (len(data) // 2, "blk."), (200, None)]:
        path.write_bytes(data[:cut])
        match = f"truncated: tensor {what}" if what else "truncated GGUF header"
        with pytest.raises(ValueError, match=match):
            load_gguf(path, quantized=quantized)


def test_an_unsupported_type_is_named_in_native_mode_too(tmp_path):
    path = tmp_path / "mxfp4.gguf"
    write_gguf(path, random_weights(small_config(), seed=0), "MXFP4")
    with pytest.raises(ValueError, match="MXFP4"):
        load_gguf(path, quantized=True)


# ------------------------------------------------------------------ the model
def prefill_logits(model: LlamaModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits, all prompts in one prefill step: [len(p), V] each."""
    c, bs = model.config, 16
    kv = torch.zeros(c.num_layers, 2, 64, bs, c.num_kv_heads, c.head_dim, dtype=model.dtype)
    seqs, slots, positions, ids, block = [], [], [], [], 0
    for p in prompts:
        table = torch.arange(block, block + -(-len(p) // bs))
        block += len(table)
        seqs.append(PrefillSeq(len(ids), len(p), len(p), table))
        slots += [int(table[i // bs]) * bs + i % bs for i in range(len(p))]
        positions += range(len(p))
        ids += p
    batch = AttentionBatch(slots=torch.tensor(slots), is_prefill=True, prefill=seqs)
    hidden = model.forward(torch.tensor(ids), torch.tensor(positions), batch, kv)
    logits = model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


def test_native_model_matches_the_dequantized_model(tiny_gguf, kernel):
    """Same weights; the native kernel rounds each matmul's input to 16 bits per
    32-block (amax / 32767) and sums in another order. Tolerance: logits of this
    tiny model are O(1); each matmul differs by at most its bound in
    tests/kernels/test_quant_linear.py (the rounding of x dominates: ~1.5e-5 of a
    block's largest per element), and 4 layers grow it: measured 3.6e-4 of the
    largest logit (Q4_1), so 1e-3 of it, far below any logit gap that decides
    a token."""
    native = LlamaModel(*_args(load_gguf(tiny_gguf, quantized=True)), quant_kernel=kernel)
    fp32 = LlamaModel(*_args(load_gguf(tiny_gguf)))
    assert native.quantized and not fp32.quantized
    assert isinstance(native.lm_head, QuantLinear) and native.lm_head is native.embed      # tied: one table
    prompts = [[5, 17, 300, 2, 9, 44, 101], list(range(40, 75))]
    for a, b in zip(prefill_logits(native, prompts), prefill_logits(fp32, prompts)):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()
    assert native.weight_bytes_per_token() < fp32.weight_bytes_per_token() / 3


def test_native_prefill_rows_do_not_depend_on_the_batch(tiny_gguf, kernel):
    model = LlamaModel(*_args(load_gguf(tiny_gguf, quantized=True)), quant_kernel=kernel)
    prompts = [[5, 17, 300], list(range(40, 75)), [7] * 20, [1, 2]]
    together = prefill_logits(model, prompts)
    for p, t in zip(prompts, together):
        assert torch.equal(prefill_logits(model, [p])[0], t)


def test_the_reference_path_without_a_kernel(tiny_gguf, kernel):
    """kernel None: QuantLinear's torch reference (fp32 activations), same model, the
    same answers to the kernel's rounding (the test above)."""
    weights = load_gguf(tiny_gguf, quantized=True)
    ref = LlamaModel(*_args(weights))
    fast = LlamaModel(*_args(weights), quant_kernel=kernel)
    a, b = prefill_logits(ref, [[3, 4, 5, 6]])[0], prefill_logits(fast, [[3, 4, 5, 6]])[0]
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()


def test_the_fused_bf16_step_declines_quantized_models(tiny_gguf, kernel):
    model = LlamaModel(*_args(load_gguf(tiny_gguf, quantized=True)), dtype=torch.bfloat16, quant_kernel=kernel)
    assert "quantized" in fused_unsupported_reason(model)
    # bf16 activations over quantized weights: fp32 inside each matmul, rounded once
    logits = prefill_logits(model, [[3, 4, 5]])[0]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def _args(weights):
    return weights.config, weights.tensors


# ------------------------------------------------------------------ the engine
def native_engine(tiny_gguf, tokenizer, **overrides) -> LLMEngine:
    cfg = EngineConfig(**{"model": str(tiny_gguf), "dtype": "float32", "kv_blocks": 128, "host_kv_blocks": 64,
                          **overrides})
    weights = load_gguf(tiny_gguf, quantized=cfg.weights == "native")
    return LLMEngine(cfg, build_model(cfg, weights), tokenizer, "tiny-gguf")


def test_weights_option_is_validated():
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(weights="int4")
    assert EngineConfig().weights == "native"


def test_build_model_uses_the_host_kernel(tiny_gguf, kernel):
    model = build_model(EngineConfig(), load_gguf(tiny_gguf, quantized=True))
    assert model.quantized and model.layers[0].qkv.kernel.variant == kernel.variant
    assert not build_model(EngineConfig(), load_gguf(tiny_gguf)).quantized


def test_the_engine_names_the_kernels_of_this_host(tiny_gguf, tokenizer, kernel):
    """Native weights on a host with a build: every part runs its kernel, none falls back
    to torch (on an AVX-512 VNNI host the prefill attention once did, unnoticed)."""
    host = host_variant()
    team = torch.get_num_threads() if torch.get_num_threads() < 8 else None     # timed at start from 8
    named = native_engine(tiny_gguf, tokenizer).kernels()
    decode_threads = named.pop("decode_threads")
    assert (decode_threads.startswith("adaptive: ") if torch.get_num_threads() > 1
            else decode_threads.endswith("(batches of <= 4 rows)"))
    assert named.pop("threads") == (f"{torch.get_num_threads()} on CPUs "
                                    f"{format_cpulist(os.sched_getaffinity(0))}")
    assert named == {"weights": "native", "dtype": "float32", "matrices": "quantized", "kv_cache": "float32",
                     "matmul": host,
                     "decode": f"plan:{host}", "attention": host, "row_ops": host, "sampling": host,
                     "same_bits": "yes"}
    if team is not None:
        assert native_engine(tiny_gguf, tokenizer).runner.small_batch_threads == team
    torch_decode = native_engine(tiny_gguf, tokenizer, decode_kernel="torch").kernels()
    assert torch_decode["decode"] == "torch" and torch_decode["matmul"] == host
    floats = native_engine(tiny_gguf, tokenizer, weights="dequantize").kernels()
    assert floats["weights"] == "float" and floats["matmul"] == "torch" and floats["attention"] == host
    assert floats["same_bits"].startswith("no: float matrices prefill on MKL")
    invariant = native_engine(tiny_gguf, tokenizer, weights="dequantize", batch_invariant=True).kernels()
    assert invariant["same_bits"] == "yes"
    assert floats["row_ops"] == host and floats["sampling"] == host


def test_auto_dtype_is_float32_for_native_weights(tiny_gguf, kernel, monkeypatch):
    """Even where the CPU computes bf16 (faked here: this host has no AVX512-BF16),
    native weights run fp32; explicit dtypes and float weights are unchanged."""
    from engine import engine as engine_module
    monkeypatch.setattr(engine_module, "cpu_has_native_bf16", lambda: True)
    assert build_model(EngineConfig(), load_gguf(tiny_gguf, quantized=True)).dtype == torch.float32
    assert build_model(EngineConfig(), load_gguf(tiny_gguf)).dtype == torch.bfloat16
    assert build_model(EngineConfig(dtype="bfloat16"), load_gguf(tiny_gguf, quantized=True)).dtype == torch.bfloat16


def test_without_a_kernel_the_engine_serves_dequantized_weights(tiny_gguf, monkeypatch):
    """A CPU without AVX2 (which this machine cannot be): the weights are
    dequantized at load, exactly the fp32 loader's."""
    monkeypatch.setattr(quant_linear, "host_variant", lambda flags=None: None)
    model = build_model(EngineConfig(), load_gguf(tiny_gguf, quantized=True))
    ref = build_model(EngineConfig(), load_gguf(tiny_gguf))
    assert not model.quantized
    assert torch.equal(model.layers[1].down, ref.layers[1].down)


def test_a_request_gets_the_same_tokens_alone_and_in_a_batch_of_16(tiny_gguf, tokenizer, kernel):
    """Decode batches of 1..16 rows and prefill batches of several prompts: the
    quantized matmul is batch-invariant by construction, so greedy tokens (and
    the logits under them) cannot depend on the batch."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cold = native_engine(tiny_gguf, tokenizer, enable_prefix_caching=False)
    alone = [cold.generate([p], params)[0] for p in prompts]
    warm = native_engine(tiny_gguf, tokenizer)
    assert warm.generate(prompts, params) == alone
    assert warm.generate(prompts[:5], params) == alone[:5]            # now with cached prefixes
    warm.check_integrity()


def test_native_and_dequantized_engines_agree(tiny_gguf, tokenizer, kernel):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[11, 12, 13, 14], [200, 3, 3, 40, 41, 42, 43, 44, 45]]
    native = native_engine(tiny_gguf, tokenizer)
    fp32 = native_engine(tiny_gguf, tokenizer, weights="dequantize")
    assert native.model.quantized and not fp32.model.quantized
    assert native.generate(prompts, params) == fp32.generate(prompts, params)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_keep_their_tokens(tiny_gguf, tokenizer, kernel, mode):
    """Under KV pressure, with decode on the plan executor: swap keeps the KV bit for
    bit; recompute rebuilds decode-written KV through prefill (forward), which agrees
    with the executor only to fp32 rounding, so its exactness is measured here."""
    prompts = [[(5 * i + j) % 500 + 3 for j in range(6 + 5 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cold = native_engine(tiny_gguf, tokenizer, enable_prefix_caching=False)
    assert cold.runner.fused is not None
    alone = [cold.generate([p], params)[0] for p in prompts]
    cfg = EngineConfig(model=str(tiny_gguf), dtype="float32", kv_blocks=14, host_kv_blocks=64,
                       enable_prefix_caching=False, preemption_mode=mode)
    small = LLMEngine(cfg, cold.model, tokenizer, "tiny-gguf")
    assert small.generate(prompts, params) == alone
    assert small.stats.preemptions > 0
    small.check_integrity()
