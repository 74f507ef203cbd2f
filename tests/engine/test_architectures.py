"""The architectures of one decoder: llama, qwen2, qwen3, gemma3, phi3.

Random GGUFs of each (tools/random_gguf.py ``write_architecture``: F32 and Q8_0
matrices) loaded on the exact path (dequantized, fp32) give transformers'
logits on the same file within 1e-3 and its greedy tokens. Sliding-window
layers (gemma3's) stay exact with chunked prefill, the prefix cache,
preemption, disaggregation and recovery: greedy and seeded tokens equal the
plain single-node engine's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.exactness import same_bits
from engine.model.config import tiny_config
from engine.model.decode_kernels import plan_unsupported_reason
from engine.model.llama import LlamaModel, layer_steps
from engine.model.weights import load_gguf, random_weights
from engine.request import SamplingParams
from kernels.plan_decode import PlanDecoder
from tools.random_gguf import ARCH_SLIDING_WINDOW, write_architecture

from .conftest import build_engine
from .test_disagg import reference, run_disaggregated
from .test_fidelity import all_logits
from .test_resume import drain, replicate

ARCHES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
# what transformers' GGUF loader does not read from these files and defaults otherwise:
# qwen3's head size (it assumes 128) and gemma3's query scale (256; llama.cpp scales by
# the head size, as kvd does)
HF_OVERRIDES = {"qwen3": {"head_dim": 16}, "gemma3": {"query_pre_attn_scalar": 16}}
GREEDY_TOKENS = 12


def _prompts(vocab: int) -> list[list[int]]:
    """Three prompts, two longer than gemma3's window (ARCH_SLIDING_WINDOW)."""
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 23, 41)]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("arch")


def _gguf(gguf_dir, arch: str, tensor_type: str):
    path = gguf_dir / f"{arch}-{tensor_type}.gguf"
    if not path.exists():
        write_architecture(arch, path, tensor_type)
    return path


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            step = hf(x, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ARCHES)
def test_logits_and_greedy_tokens_match_transformers(gguf_dir, tokenizer, arch, tensor_type):
    transformers = pytest.importorskip("transformers")
    path = _gguf(gguf_dir, arch, tensor_type)
    weights = load_gguf(path)
    assert weights.config.architecture == arch
    engine = build_engine(weights, tokenizer, name=arch, dtype="float32", kv_blocks=64, host_kv_blocks=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **HF_OVERRIDES.get(arch, {})).eval()
    prompts = _prompts(weights.config.vocab_size)
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        worst = (all_logits(engine, ids) - ref).abs().max().item()
        assert worst <= 1e-3, f"{arch} {tensor_type}: max |logit delta| {worst}"
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, params) == [_hf_greedy(hf, ids, GREEDY_TOKENS) for ids in prompts]
    engine.check_integrity()


def test_each_architecture_reads_as_its_layer_plan(gguf_dir):
    """What the metadata and tensors say lands in the config, and the config in the plan."""
    configs = {arch: load_gguf(_gguf(gguf_dir, arch, "F32")).config for arch in ARCHES}
    ops = {arch: [s.op for s in layer_steps(c)] for arch, c in configs.items()}
    assert ops["llama"] == ops["phi3"] == ["rms_norm", "linear", "rope_attention", "linear_add", "rms_norm",
                                           "linear", "silu_mul", "linear_add"]
    assert "add_bias" in ops["qwen2"] and "qk_norm" not in ops["qwen2"]
    assert "qk_norm" in ops["qwen3"] and "add_bias" not in ops["qwen3"]
    assert ops["gemma3"].count("rms_norm") == 4 and "gelu_mul" in ops["gemma3"] and "qk_norm" in ops["gemma3"]
    g = configs["gemma3"]
    assert g.embed_scale == 8.0 and g.sliding_window == ARCH_SLIDING_WINDOW
    assert [g.layer_window(i) for i in range(g.num_layers)] == [8, 8, 8, 8, 8, None, 8]
    assert g.layer_rope_theta(0) == 10000.0 and g.layer_rope_theta(5) == 1e6
    assert not configs["qwen2"].tie_word_embeddings and configs["qwen3"].tie_word_embeddings


def test_the_window_changes_what_a_long_prompt_sees(gguf_dir, tokenizer):
    """The transformers test above can fail on the window: without it a gemma3 prompt
    longer than the window gets other logits, a short one the same (to rounding)."""
    weights = load_gguf(_gguf(gguf_dir, "gemma3", "F32"))
    wide = dataclasses.replace(weights, config=dataclasses.replace(weights.config, sliding_window=2048))
    engines = [build_engine(w, tokenizer, kv_blocks=16, host_kv_blocks=0) for w in (weights, wide)]
    short, _, long = _prompts(weights.config.vocab_size)
    assert (all_logits(engines[0], short) - all_logits(engines[1], short)).abs().max() < 1e-5
    assert (all_logits(engines[0], long) - all_logits(engines[1], long)).abs().max() > 1e-2


def test_the_plan_executor_runs_or_declines_each_architecture_by_name(gguf_dir):
    reasons = {}
    for arch in ARCHES:
        w = load_gguf(_gguf(gguf_dir, arch, "F32"))
        reasons[arch] = plan_unsupported_reason(LlamaModel(w.config, w.tensors, float_layout="rows"))
    assert reasons["llama"] is None and reasons["phi3"] is None
    assert reasons["qwen2"] is None and reasons["qwen3"] is None        # add_bias, qk_norm: executor ops
    assert reasons["gemma3"] is None        # gelu_mul, add; windows, RoPE per layer kind, embed_scale: plan data
    w = load_gguf(_gguf(gguf_dir, "gemma3", "F32"))
    capped = dataclasses.replace(w.config, attn_logit_softcap=50.0)
    assert "gemma3: attention logit softcapping" in plan_unsupported_reason(
        LlamaModel(capped, w.tensors, float_layout="rows"))


def test_bad_architecture_metadata_is_refused_by_name(gguf_dir, tmp_path):
    import gguf

    path = tmp_path / "phi3-bad.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    for key, value in (("embedding_length", 64), ("block_count", 1), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("vocab_size", 32)):
        w.add_uint32(f"phi3.{key}", value)
    w.add_tensor("token_embd.weight", torch.zeros(32, 64).numpy())
    w.add_tensor("output_norm.weight", torch.ones(64).numpy())
    w.add_tensor("blk.0.attn_qkv.weight", torch.zeros(64 + 32, 64).numpy())       # k and v need 32 rows each
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="attn_qkv|qkv_proj.*96 rows"):
        load_gguf(path)


# ------------------------------------------------------------------ sliding windows in the engine
@pytest.fixture(scope="module")
def sliding_weights():
    """A tiny gemma3: layers 0 and 2 slide over 12 keys (RoPE base 10000), 1 and 3 are global."""
    config = tiny_config(architecture="gemma3", qk_norm=True, sandwich_norms=True, activation="gelu_tanh",
                         embed_scale=8.0, sliding_window=12, global_layer_every=2, rope_theta=1e6,
                         rope_local_theta=10000.0)
    return random_weights(config, seed=3)


@pytest.fixture
def make_sliding(sliding_weights, tokenizer):
    """Engines of the tiny gemma3, its float matrices prefilled on the executor's kernel
    (batch_invariant): one arithmetic per token on every path."""
    def make(**overrides):
        return build_engine(sliding_weights, tokenizer, name="gemma3-tiny", **({"batch_invariant": True} | overrides))
    return make


PROMPTS = [[5, 9, 200, 17] * 10 + [3, 4, 5], list(range(40, 70)), [3] * 20]
PARAMS = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)]


@pytest.fixture(scope="module")
def plain_tokens(sliding_weights, tokenizer):
    """The plain single-node engine's tokens (no chunking, no prefix cache), per params."""
    engine = build_engine(sliding_weights, tokenizer, name="gemma3-tiny", enable_prefix_caching=False,
                          prefill_chunk_tokens=0, batch_invariant=True)
    return [[engine.generate([p], params)[0] for p in PROMPTS] for params in PARAMS]


@pytest.mark.parametrize("k", [0, 1], ids=["greedy", "seeded"])
def test_the_sliding_model_decodes_on_the_executor_with_the_torch_paths_tokens(make_sliding, plain_tokens, k):
    """One arithmetic per token: the plan executor's decode steps and the torch path's give
    the same tokens, greedy and seeded."""
    engine = make_sliding()
    assert isinstance(engine.runner.fused, PlanDecoder)
    assert same_bits(engine.model, engine.runner.fused) == "yes"
    on_torch = make_sliding(decode_kernel="torch", enable_prefix_caching=False)
    assert on_torch.runner.fused is None
    assert [on_torch.generate([p], PARAMS[k])[0] for p in PROMPTS] == plain_tokens[k]


def test_the_window_matters_to_the_sliding_model(make_sliding, plain_tokens):
    engine = make_sliding()
    wide = build_engine(random_weights(dataclasses.replace(engine.model.config, sliding_window=2048), seed=3),
                        engine.tokenizer, name="wide", enable_prefix_caching=False)
    assert wide.generate(PROMPTS[:1], PARAMS[0]) != plain_tokens[0][:1]


@pytest.mark.parametrize("k", [0, 1], ids=["greedy", "seeded"])
def test_sliding_window_chunked_prefill_and_batching_are_exact(make_sliding, plain_tokens, k):
    chunked = make_sliding(prefill_chunk_tokens=5, enable_prefix_caching=False)
    assert chunked.prefill_chunk_tokens == 5
    assert [chunked.generate([p], PARAMS[k])[0] for p in PROMPTS] == plain_tokens[k]
    assert chunked.generate(PROMPTS, PARAMS[k]) == plain_tokens[k]
    chunked.check_integrity()


@pytest.mark.parametrize("k", [0, 1], ids=["greedy", "seeded"])
def test_sliding_window_prefix_cache_hit_equals_miss(make_sliding, plain_tokens, k):
    engine = make_sliding(enable_prefix_caching=True)
    assert [engine.generate([p], PARAMS[k])[0] for p in PROMPTS] == plain_tokens[k]     # misses
    hits = engine.pool.hit_tokens
    assert [engine.generate([p], PARAMS[k])[0] for p in PROMPTS] == plain_tokens[k]     # hits
    assert engine.pool.hit_tokens - hits >= 32
    engine.check_integrity()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("k", [0, 1], ids=["greedy", "seeded"])
def test_sliding_window_preemption_is_exact(make_sliding, plain_tokens, k, mode):
    small = make_sliding(kv_blocks=8, host_kv_blocks=64, enable_prefix_caching=False, preemption_mode=mode)
    assert small.generate(PROMPTS, PARAMS[k]) == plain_tokens[k]
    assert small.stats.preemptions > 0
    small.check_integrity()


@pytest.mark.parametrize("k", [0, 1], ids=["greedy", "seeded"])
def test_sliding_window_disaggregated_is_exact(make_sliding, plain_tokens, k):
    ref_engine, p, d = (make_sliding() for _ in range(3))
    for i, prompt in enumerate(PROMPTS):
        got = run_disaggregated(p, d, f"r{i}", prompt, PARAMS[k])
        assert got[0] == plain_tokens[k][i]
        assert got[0] == reference(ref_engine, prompt, PARAMS[k])[0]
    for e in (p, d):
        e.check_integrity()


@pytest.mark.parametrize("k", [0, 1], ids=["greedy", "seeded"])
def test_sliding_window_resume_from_a_replica_is_exact(make_sliding, plain_tokens, k):
    src, dst = make_sliding(), make_sliding()
    bs = src.config.block_size
    prompt = PROMPTS[0]
    src.add_request("r", prompt, PARAMS[k])
    tokens = []
    for _ in range(20):
        for out in src.step():
            tokens += out.new_token_ids
    full = src.requests["r"].num_computed // bs
    hold = replicate(src, dst, "r", None, full, 0)
    hold.commit((prompt + tokens)[:full * bs])
    assert dst.resume_request("r", prompt, tokens, PARAMS[k]) is None
    more, _ = drain(dst)
    assert tokens + more == plain_tokens[k][0]
    dst.check_integrity()
