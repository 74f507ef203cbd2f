"""Chunked prefill (``prefill_chunk_tokens``): a long prompt computed over
several steps, beside the running decodes, gives the tokens of an unchunked
prefill — alone, in a batch of 16, with prefix-cache hits, under preemption,
seeded, with stop strings, on the prefill leg of a disaggregated request —
and leaves the pool as it found it. The real SmolLM2 is in test_fidelity.py."""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.llama import LlamaModel
from engine.model.config import tiny_config
from engine.model.weights import NATIVE_GGUF_TYPES, load_gguf, random_weights
from engine.request import SamplingParams
from engine.scheduler import SchedulerConfig
from kernels.attention import AttentionBatch, PrefillSeq

from .test_disagg import reference, run_disaggregated
from .test_quant_weights import _args, kernel, native_engine, tiny_gguf  # noqa: F401  (fixtures)
from .test_weights import write_gguf

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHUNKS = [5, 16, 37]


def prompts(n: int, lo: int = 20, hi: int = 200, seed: int = 3, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def alone(engine, ps, params=GREEDY):
    return [engine.generate([p], params)[0] for p in ps]


def test_chunked_equals_unchunked_alone_and_in_a_batch_of_16(make_tiny):
    ps = prompts(16)
    want = alone(make_tiny(prefill_chunk_tokens=0, enable_prefix_caching=False), ps)
    for chunk in CHUNKS:
        eng = make_tiny(prefill_chunk_tokens=chunk, enable_prefix_caching=False)
        assert alone(eng, ps[:4]) == want[:4], chunk
        steps = eng.stats.steps
        assert eng.generate(ps, GREEDY) == want, chunk
        # the batch's prompt tokens went through in chunks: at least one step per chunk
        assert eng.stats.steps - steps >= sum(map(len, ps)) // chunk
        eng.check_integrity()
        assert eng.pool.stats()["device"]["used"] == 0


def test_a_bf16_engine_prefills_whole_prompts(make_tiny):
    """16-bit activations ignore prefill_chunk_tokens (LLMEngine.effective_chunk_tokens):
    a 600-token prompt is one step, and the tokens are the unchunked engine's."""
    ps = prompts(4, lo=100, hi=600, seed=5)
    want = alone(make_tiny(dtype="bfloat16", prefill_chunk_tokens=0, enable_prefix_caching=False), ps)
    eng = make_tiny(dtype="bfloat16", prefill_chunk_tokens=16, enable_prefix_caching=False, kv_blocks=256)
    assert eng.prefill_chunk_tokens == 0 and eng.scheduler.config.prefill_chunk_tokens == 0
    assert alone(eng, ps) == want
    assert make_tiny(prefill_chunk_tokens=16).prefill_chunk_tokens == 16


def test_running_streams_decode_in_every_step_of_a_long_prefill(make_tiny):
    """The point of chunking: while a 600-token prompt is computed 64 tokens at a
    time, each running request gets a token in every step; unchunked, the whole
    prompt is one step in which nobody decodes."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    long_prompt = prompts(1, lo=600, hi=601)[0]
    for chunk, want_stalls in ((64, 0), (0, 1)):
        eng = make_tiny(prefill_chunk_tokens=chunk, kv_blocks=256)
        for i, p in enumerate(prompts(3, lo=5, hi=30, seed=9)):
            eng.add_request(f"run{i}", p, params)
        eng.step()                                  # prefill of the three short prompts
        eng.add_request("long", long_prompt, params)
        stalls = 0
        for _ in range(8):                          # fewer than the long prompt's 10 chunks
            outs = {o.request_id for o in eng.step()}
            assert "long" not in outs or chunk == 0
            stalls += not {"run0", "run1", "run2"} <= outs
        assert stalls == want_stalls, chunk
        while eng.has_unfinished():
            eng.step()
        eng.check_integrity()


def test_prefix_cache_hits_with_chunks(make_tiny):
    """A cached prefix then chunks of the rest (chunk boundaries off the block
    boundaries): the tokens of a cold unchunked run."""
    system = prompts(1, lo=70, hi=71, seed=5)[0]
    ps = [system + p for p in prompts(6, lo=3, hi=60, seed=6)]
    cold = alone(make_tiny(prefill_chunk_tokens=0, enable_prefix_caching=False), ps)
    eng = make_tiny(prefill_chunk_tokens=11)
    assert eng.generate(ps[:1], GREEDY) == cold[:1]
    assert eng.generate(ps, GREEDY) == cold
    assert eng.stats.prefix_hit_tokens >= 5 * 64
    eng.check_integrity()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_while_prefills_are_chunked(make_tiny, mode):
    """KV pressure with requests mid-prefill among the victims: every request
    still yields its unchunked tokens, and every block comes back."""
    ps = prompts(8, lo=30, hi=120, seed=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = alone(make_tiny(prefill_chunk_tokens=0, enable_prefix_caching=False), ps, params)
    eng = make_tiny(kv_blocks=36, host_kv_blocks=64, preemption_mode=mode, enable_prefix_caching=False,
                    prefill_chunk_tokens=16)
    assert eng.generate(ps, params) == want
    assert eng.stats.preemptions > 0
    eng.check_integrity()
    assert eng.pool.stats()["device"]["used"] == 0


def test_seeded_sampling_and_stop_strings_are_unchanged(make_tiny):
    ps = prompts(6, lo=40, hi=150, seed=4)
    seeded = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(len(ps))]
    plain, chunked = make_tiny(prefill_chunk_tokens=0), make_tiny(prefill_chunk_tokens=13)
    assert chunked.generate(ps, seeded) == plain.generate(ps, seeded)
    stopped = 0
    for i, p in enumerate(ps):
        free = reference(plain, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[1]
        if len(free) < 6:
            continue
        stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(free[3:6],))
        want = reference(plain, p, stop)
        stopped += want[2].finish_reason == "stop"
        got = reference(chunked, p, stop)
        assert (got[0], got[1], got[2].finish_reason) == (want[0], want[1], want[2].finish_reason), i
    assert stopped >= 2


def test_abort_mid_prefill_frees_everything(make_tiny):
    """An abort between chunks frees the request's blocks; the full blocks of
    the chunks already computed stay in the prefix cache (unlocked), as they
    would have for a finished request."""
    eng = make_tiny(prefill_chunk_tokens=8)
    eng.add_request("long", prompts(1, lo=150, hi=151)[0], GREEDY)
    eng.step()
    eng.step()
    req = eng.requests["long"]
    assert req.prefilling and 0 < req.num_computed < len(req.prompt_ids)
    computed_blocks = req.num_computed // 16
    out = eng.abort_request("long")
    assert out.finished and out.finish_reason == "abort"
    assert not eng.has_unfinished()
    eng.check_integrity()
    device = eng.pool.stats()["device"]
    assert device["request_owned"] == 0
    assert device["cached"] == device["evictable"] == computed_blocks


def test_prefill_leg_streams_every_layer_once_from_a_chunked_prompt(make_tiny):
    """Disaggregation with the prefill engine chunking: the KV of the earlier
    chunks is in the blocks when the last chunk runs, whose layer loop streams
    every layer of the whole prompt once, in order (run_disaggregated checks);
    the decode engine yields one engine's tokens."""
    ref_engine = make_tiny(prefill_chunk_tokens=0)
    p, d = make_tiny(prefill_chunk_tokens=16), make_tiny()
    for i, prompt in enumerate(prompts(3, lo=60, hi=200, seed=12)):
        for params in (SamplingParams(max_tokens=10, temperature=0.0),
                       SamplingParams(max_tokens=10, temperature=0.9, seed=7 + i)):
            want = reference(ref_engine, prompt, params)
            got = run_disaggregated(p, d, f"r{i}-{params.temperature}", prompt, params)
            assert (got[0], got[1]) == (want[0], want[1]), (i, params)
    assert p.stats.steps >= 3 * 2 * 60 // 16
    for e in (p, d):
        e.pool.flush()
        e.check_integrity()


def test_native_weights_chunked_equals_unchunked(tiny_gguf, tokenizer, kernel):  # noqa: F811
    """Native GGUF weights: decode on the plan executor beside chunked prefills;
    a batch of 16 and prefix hits give the unchunked tokens."""
    ps = prompts(16, lo=10, hi=160, seed=2)
    want = alone(native_engine(tiny_gguf, tokenizer, prefill_chunk_tokens=0, enable_prefix_caching=False), ps)
    eng = native_engine(tiny_gguf, tokenizer, prefill_chunk_tokens=24)
    assert eng.runner.fused is not None
    assert eng.generate(ps, GREEDY) == want
    assert eng.generate(ps[:4], GREEDY) == want[:4]             # now with cached prefixes
    eng.check_integrity()


def test_config_is_validated():
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        SchedulerConfig(prefill_chunk_tokens=-1)


# ------------------------------------------------------------- the model alone
def chunked_prefill(model, prompt: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's logits [len(prompt), V] and the KV, the prompt computed
    ``chunk`` tokens per forward call (chunk >= len(prompt): one call), each
    call attending to the KV the earlier calls wrote, as the engine's chunks do."""
    c, bs = model.config, 16
    kv = torch.zeros(c.num_layers, 2, 64, bs, c.num_kv_heads, c.head_dim, dtype=model.dtype)
    table = torch.arange(-(-len(prompt) // bs))
    logits = []
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        seq = PrefillSeq(0, end - start, end, table[:-(-end // bs)])
        batch = AttentionBatch(slots=torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(start, end)]),
                               is_prefill=True, prefill=[seq])
        hidden = model.forward(torch.tensor(prompt[start:end]), torch.arange(start, end), batch, kv)
        logits.append(model.compute_logits(hidden))
    return torch.cat(logits), kv


@pytest.mark.parametrize("fmt", NATIVE_GGUF_TYPES)
def test_native_weights_chunks_are_bit_for_bit_the_whole_prompt(tmp_path, kernel, fmt):  # noqa: F811
    """Native weights (16-bit activations): the quantized matmul gives a row the same
    bits whatever M is, the blocked attention a query the same bits however its
    prompt is split, and every other op is row-local: every position's logits and
    every layer's KV are identical, chunked or not (by construction, checked here).
    head_dim 32: the blocked attention kernel's smallest (the tiny model's 16 runs
    torch's SDPA, whose masked path for a chunk rounds otherwise than its causal
    path for a whole prompt: exact by measurement, the tests above)."""
    path = tmp_path / "hd32.gguf"
    write_gguf(path, random_weights(tiny_config(vocab_size=512, hidden_size=128, head_dim=32), seed=5, std=0.08), fmt)
    model = LlamaModel(*_args(load_gguf(path, quantized=True)), quant_kernel=kernel)
    assert model.quantized and model.attention_kernel is not None
    prompt = prompts(1, lo=300, hi=301, seed=1)[0]
    whole, kv = chunked_prefill(model, prompt, len(prompt))
    for chunk in (1, 7, 16, 100):
        logits, kv_chunked = chunked_prefill(model, prompt, chunk)
        assert torch.equal(logits, whole), chunk
        assert torch.equal(kv_chunked, kv), chunk
