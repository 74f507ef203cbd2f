"""Logprobs on the exact path (SmolLM2, ``weights = "dequantize"``, fp32) against
Hugging Face transformers loading the same GGUF: prompt and output logprobs,
and their top tokens, within 1e-4 of log_softmax of transformers' logits."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams

from .test_sampling_extremes import run

pytestmark = pytest.mark.slow

K = 5


def test_prompt_and_output_logprobs_match_transformers(engine, hf_model, prompts):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    got = run(engine, {f"p{i}": (ids, params) for i, ids in enumerate(prompts[:4])})
    worst = 0.0
    for i, ids in enumerate(prompts[:4]):
        out = got[f"p{i}"]
        seq = ids + out.new_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].double(), dim=-1)   # [T, V]
        entries = out.prompt_logprobs + out.logprobs          # token j's at j - 1
        assert [e.token_id for e in entries] == seq[1:]
        for j, e in enumerate(entries):
            row = ref[j]
            worst = max(worst, abs(e.logprob - float(row[e.token_id])))
            for t, lp in e.top:
                worst = max(worst, abs(lp - float(row[t])))
            assert {t for t, _ in e.top} <= set(torch.topk(row, K + 2).indices.tolist())   # near-ties may swap
    assert worst <= 1e-4, f"max |logprob delta| {worst}"
