"""GGUF files of the K-quant, Q5 and IQ4 types (tools/random_gguf.py: random valid
blocks), loaded end to end: the fp32 loader against gguf-py, the native loader, the engine."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from engine.engine import EngineConfig, LLMEngine, build_model
from engine.model.config import tiny_config
from engine.model.llama import LlamaModel
from engine.model.weights import load_gguf, reverse_permute_qk
from engine.request import SamplingParams
from kernels import gguf_blocks, kquant_repack
from kernels.quant import QuantTensor
from kernels.quant_linear import QuantKernel
from tools.random_gguf import write_llama

from .test_quant_weights import prefill_logits

FORMATS = tuple(gguf_blocks.BLOCKS)


def kquant_config(**overrides):
    """Every row length a multiple of 256 (the K-quants' super-block)."""
    base = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=64, bos_token_id=1, eos_token_ids=(2,), rms_norm_eps=2.0 ** -17)
    return tiny_config(**{**base, **overrides})


@pytest.fixture(scope="module", params=FORMATS)
def kquant_gguf(request, tmp_path_factory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("kq") / f"{request.param}.gguf"
    write_llama(path, kquant_config(), request.param, seed=7)
    return request.param, path


def test_the_fp32_loader_gives_gguf_py_values(kquant_gguf):
    fmt, path = kquant_gguf
    loaded = load_gguf(path)
    cfg = loaded.config
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, name, heads in (("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", cfg.num_heads),
                                   ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight",
                                    cfg.num_kv_heads),
                                   ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
                                   ("token_embd.weight", "model.embed_tokens.weight", None)):
        t = by_name[gguf_name]
        assert gguf.GGMLQuantizationType(t.tensor_type).name == fmt
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        if heads:
            want = reverse_permute_qk(want, heads)
        assert torch.equal(loaded.tensors[name], want), name


# ------------------------------------------------------------------ native: repacked blocks
@pytest.fixture(scope="module")
def kernel() -> QuantKernel:
    k = QuantKernel.create()
    assert k is not None, "no quantized-weights kernel on this host (see tests/kernels/test_quant_linear.py)"
    return k


def test_the_native_loader_repacks_every_matrix_keeping_its_weights(kquant_gguf):
    fmt, path = kquant_gguf
    native, fp32 = load_gguf(path, quantized=True), load_gguf(path)
    assert native.config == fp32.config and set(native.tensors) == set(fp32.tensors)
    for name, t in native.tensors.items():
        want = fp32.tensors[name]
        if want.dim() == 1:
            continue
        assert isinstance(t, QuantTensor) and t.fmt.name == kquant_repack.TARGET[fmt], name
        assert torch.equal(t.dequantize(), want), name


def test_every_type_loads_in_a_layout_of_its_own_every_weight_kept(kquant_gguf):
    fmt, path = kquant_gguf
    assert fmt in kquant_repack.NATIVE
    weight = load_gguf(path, quantized=True).tensors["model.layers.0.mlp.down_proj.weight"]
    assert weight.fmt.name == kquant_repack.TARGET[fmt]


def test_the_native_model_matches_the_dequantized_model(kquant_gguf, kernel):
    """The kernels round each matmul's input to 16 bits per 32-block: the same tolerance
    as tests/engine/test_quant_weights.py's, against the weights they compute with."""
    fmt, path = kquant_gguf
    weights = load_gguf(path, quantized=True)
    native = LlamaModel(weights.config, weights.tensors, quant_kernel=kernel)
    exact = LlamaModel(weights.config, weights.dequantized().tensors)
    prompts = [[5, 17, 300, 2, 9, 44, 101], list(range(40, 75))]
    for a, b in zip(prefill_logits(native, prompts), prefill_logits(exact, prompts)):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_batch_of_16_gives_each_row_its_tokens_alone(kquant_gguf, kernel, tokenizer, sampling):
    fmt, path = kquant_gguf
    cfg = EngineConfig(model=str(path), dtype="float32", kv_blocks=256, host_kv_blocks=64, max_num_seqs=32)
    engine = LLMEngine(cfg, build_model(cfg, load_gguf(path, quantized=True)), tokenizer, "kq")
    assert engine.kernels()["decode"] == f"plan:{kernel.variant}"      # the plan executor, not torch
    prompts = [[3 + i, 40 + 7 * i, 9, 100 + i] + list(range(i)) for i in range(16)]

    def params(i: int) -> SamplingParams:
        if sampling == "greedy":
            return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True)

    together = engine.generate(prompts, [params(i) for i in range(16)])
    for i, p in enumerate(prompts):
        assert engine.generate([p], params(i))[0] == together[i], (fmt, i)
    assert len({tuple(t) for t in together}) > 1                         # not one answer for all


def test_a_k_m_mix_of_types_decodes_on_the_plan_executor(tmp_path, kernel, tokenizer):
    """A _K_M file's mix: q/k in Q4_K beside v in Q6_K (one qkv matrix of two formats), gate
    in Q5_0 beside up in Q4_K, down in Q6_K, a Q8_0 embedding. The executor runs the mixed
    matrices part by part: the torch path's tokens, and a batch of 16 gives each row's alone."""
    path = tmp_path / "k_m.gguf"
    write_llama(path, kquant_config(), "Q4_K", seed=9,
                types={"attn_v": "Q6_K", "ffn_gate": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q8_0"})
    weights = load_gguf(path, quantized=True)
    engines = {}
    for decode in ("auto", "torch"):
        cfg = EngineConfig(model=str(path), dtype="float32", kv_blocks=256, host_kv_blocks=64, max_num_seqs=32,
                           decode_kernel=decode)
        engines[decode] = LLMEngine(cfg, build_model(cfg, weights), tokenizer, "k_m")
    assert engines["auto"].kernels()["decode"] == f"plan:{kernel.variant}"
    assert {p.fmt.name for p in engines["auto"].model.layers[0].qkv.parts} == {"KS4", "KS6"}
    prompts = [[3 + i, 40 + 7 * i, 9, 100 + i] + list(range(i)) for i in range(16)]
    for sp in (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
               SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)):
        together = engines["auto"].generate(prompts, sp)
        assert together == engines["torch"].generate(prompts, sp)
        for i in (0, 7, 15):
            assert engines["auto"].generate([prompts[i]], sp)[0] == together[i]
