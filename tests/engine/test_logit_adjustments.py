"""logit_bias, repetition_penalty and min_p (engine/sampling.py): their
definition on a row, and the engine's tokens against a plain reference (every
position's logits from a whole-sequence prefill, adjusted in Python, argmax)
on both decode paths: the plan executor, which hands back greedy ids computed
before any adjustment, and the torch model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.request import SamplingParams
from engine.sampling import adjust_row, apply_min_p, sample
from kernels.attention import AttentionBatch, PrefillSeq

from .test_sampling_extremes import engine_on

MAX_TOKENS = 10


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 30))] for _ in range(n)]


def next_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits after ``ids`` [V], from a prefill of the whole sequence into a scratch cache."""
    c, bs = model.config, 16
    n = -(-len(ids) // bs)
    kv = torch.zeros(c.num_layers, 2, n, bs, c.num_kv_heads, c.head_dim, dtype=model.dtype)
    table = torch.arange(n, dtype=torch.int64)
    pos = torch.arange(len(ids))
    batch = AttentionBatch(slots=table[pos // bs] * bs + pos % bs, is_prefill=True,
                           prefill=[PrefillSeq(0, len(ids), len(ids), table)])
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids), pos, batch, kv)
        logits = model.compute_logits(hidden[-1:])[0]
    return logits.clone()                                       # a normal tensor: callers adjust it


def reference_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy tokens as the definition reads, one token at a time, in plain Python:
    bias added, then each distinct seen token's logit divided by the penalty when
    positive, multiplied otherwise; the first maximum."""
    out: list[int] = []
    for _ in range(p.max_tokens):
        logits = next_logits(model, prompt + out)               # fp32, token by token below
        for t, b in p.logit_bias:
            logits[t] += b
        r = p.repetition_penalty
        for t in set(prompt + out):
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        out.append(int(torch.argmax(logits)))                   # the first maximum
    return out


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


# ----------------------------------------------------------------- on a row
def test_adjust_row_biases_then_penalizes_each_seen_token_once():
    row = torch.tensor([2.0, -2.0, 4.0, 0.0, float("-inf"), 1.0])
    p = SamplingParams(logit_bias=((0, 1.0), (5, -3.0)), repetition_penalty=2.0)
    adjust_row(row, p, prompt_ids=[0, 1, 1, 4], output_ids=[5, 0])
    # 0: (2 + 1) / 2; 1: -2 * 2 (seen twice, penalized once); 2, 3 unseen; 4: -inf stays; 5: (1 - 3) * 2
    assert row.tolist() == [1.5, -4.0, 4.0, 0.0, float("-inf"), -4.0]
    big = torch.tensor([3.0e38, -1.0])
    adjust_row(big, SamplingParams(repetition_penalty=1e-300), [0, 1], [])
    assert big.tolist() == [torch.finfo(torch.float32).max, -0.0]      # no +inf: still drawable


def test_min_p_keeps_the_tokens_within_its_share_of_the_most_likely():
    row = torch.tensor([0.0, -math.log(2), -math.log(4) - 1e-4, float("-inf"), -math.log(8)])
    apply_min_p(row, SamplingParams(min_p=0.25))
    assert row.isfinite().tolist() == [True, True, False, False, False]
    hot = torch.tensor([0.0, -1.0, -3.0])                # at T = 2: shares 1, e^-0.5, e^-1.5
    apply_min_p(hot, SamplingParams(temperature=2.0, min_p=0.5))
    assert hot.isfinite().tolist() == [True, True, False]


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_bias_moves_greedy_and_random_rows_and_the_executor_ids_are_not_trusted(path, make_tiny):
    kernel = make_tiny().runner.sampler if path == "kernel" else None
    x = torch.randn(4, 49152, generator=torch.Generator().manual_seed(1))
    stale = x.argmax(dim=-1).tolist()                       # what the executor computed before the bias
    ps = [greedy(logit_bias=((77, 100.0),)), greedy(),
          SamplingParams(temperature=1.0, seed=4, logit_bias=((78, 100.0),)),
          SamplingParams(temperature=1.0, seed=5, min_p=1.0)]
    got = sample(x.clone(), ps, [None, None, torch.Generator(), torch.Generator()], [0] * 4,
                 greedy_ids=stale, kernel=kernel)
    assert got == [77, stale[1], 78, stale[3]]


# ------------------------------------------------------------ in the engine
ADJUSTED = [greedy(logit_bias=((1234, 100.0),)),
            greedy(repetition_penalty=2.0),
            greedy(repetition_penalty=0.5),
            greedy(repetition_penalty=1.7, logit_bias=((321, 3.0), (4000, -100.0))),
            greedy(logit_bias=tuple((t, -100.0) for t in range(100, 400)))]


@pytest.mark.parametrize("path", ["executor", "torch"])
def test_greedy_with_adjustments_is_the_adjusted_argmax(make_tiny, path):
    eng = engine_on(make_tiny, path)
    ps = prompts(3, seed=7)
    plain = eng.generate(ps, greedy())
    assert plain == [reference_greedy(eng.model, p, greedy()) for p in ps]      # the reference is sound
    batch = [(p, params) for p in ps for params in ADJUSTED]
    got = eng.generate([p for p, _ in batch], [params for _, params in batch])   # one batch, with each other
    for (p, params), tokens in zip(batch, got):
        assert tokens == reference_greedy(eng.model, p, params), params
    assert all(t == 1234 for tokens in got[0::len(ADJUSTED)] for t in tokens)    # +100 forces its token
    # the penalties change the text (a tiny random model repeats itself)
    assert got[1::len(ADJUSTED)] != plain and got[2::len(ADJUSTED)] != plain
    eng.check_integrity()


@pytest.mark.parametrize("path", ["executor", "torch"])
def test_seeded_sampling_with_adjustments_repeats_and_min_p_keeps_to_its_share(make_tiny, path):
    eng = engine_on(make_tiny, path)
    ps = prompts(2, seed=8)
    # the tiny model's logits span ~1: at T = 0.1, min_p = 0.3 keeps those within 0.12 of the best
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.1, seed=s, ignore_eos=True, **kw)
              for s, kw in enumerate([dict(min_p=0.3), dict(repetition_penalty=1.5, top_k=50),
                                      dict(logit_bias=((55, 100.0),)), dict(min_p=0.05, top_p=0.9)])]
    alone = [eng.generate([p], q)[0] for p in ps for q in params]
    together = eng.generate([p for p in ps for _ in params], [q for _ in ps for q in params])
    assert together == alone                                 # batch-independent, reproducible
    assert all(t == 55 for tokens in together[2::len(params)] for t in tokens)
    free = eng.generate([p for p in ps for _ in params],
                        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.1, seed=s, ignore_eos=True)
                         for _ in ps for s in range(len(params))])
    assert together[0::len(params)] != free[0::len(params)]  # min_p drops most of the vocabulary
    assert together[1::len(params)] != free[1::len(params)]
    for p, tokens in zip(ps, together[0::len(params)]):      # each drawn token within min_p of the best
        for i, t in enumerate(tokens):
            logits = next_logits(eng.model, p + tokens[:i])
            assert (logits[t] - logits.max()) / 0.1 >= math.log(0.3) - 1e-3
