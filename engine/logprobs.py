"""Log probabilities of tokens, as a request asks for them with
``SamplingParams.logprobs`` (each output token) and ``prompt_logprobs``
(each prompt token but the first).

Definition (vLLM's default, ``logprobs_mode = "raw_logprobs"``): a
position's log probabilities are ``log_softmax``, in float32, of the model's
logits at that position, before anything adjusts or filters them
(``logit_bias``, ``repetition_penalty``, the ``min_tokens`` mask,
``temperature``, ``min_p``, ``top_k``, ``top_p``). They are computed from the
very tensor the sampler then reads (engine/runner.py), so the sampled token's
logprob is its probability under the model, whatever the sampling parameters.
A logprob below ``LOGPROB_FLOOR`` (-inf among them) is reported as the floor,
as vLLM's server does: JSON has no -inf.

Only rows whose request asks pay anything: a step where none does computes
no ``log_softmax``.

The answers are ``engine.request.TokenLogprobs`` (torch-free: the wire and
the coordinator carry them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import LOGPROB_FLOOR, TokenLogprobs

# prompt rows turned into log probabilities per matmul: [rows, V] fp32 at a time (~25 MB at V = 49K)
PROMPT_ROWS_PER_SLICE = 128


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> their float32 log_softmax [R, V] (a new tensor: the
    logits are not changed)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int], top: Sequence[int]) -> list[TokenLogprobs]:
    """Row r of ``logprobs`` [R, V] (``log_probs``) answered for token
    ``token_ids[r]`` with its ``top[r]`` most likely tokens."""
    n = len(token_ids)
    if n == 0:
        return []
    ids = torch.tensor(token_ids, dtype=torch.int64)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].clamp_(min=LOGPROB_FLOOR).tolist()
    k = max(top)
    if k:
        # one pass over the vocabulary (a sort would be V log V); most likely first
        values, indices = torch.topk(logprobs, k, dim=-1, sorted=True)
        values = values.clamp_(min=LOGPROB_FLOOR).tolist()
        indices = indices.tolist()
    out = []
    for r in range(n):
        best = tuple(zip(indices[r][:top[r]], values[r][:top[r]])) if top[r] else ()
        out.append(TokenLogprobs(token_ids[r], chosen[r], best))
    return out


def prompt_logprobs(hidden: torch.Tensor, compute_logits, targets: Sequence[int], top: int) -> list[TokenLogprobs]:
    """The logprobs of ``targets[j]`` at the position whose hidden state is
    ``hidden[j]`` ([n, D], one row per target), with ``top`` most likely each:
    the LM head runs on ``PROMPT_ROWS_PER_SLICE`` rows at a time, so a long
    prompt never holds its whole [n, V] logits."""
    out: list[TokenLogprobs] = []
    for a in range(0, len(targets), PROMPT_ROWS_PER_SLICE):
        b = min(a + PROMPT_ROWS_PER_SLICE, len(targets))
        logprobs = log_probs(compute_logits(hidden[a:b]))
        out += token_logprobs(logprobs, targets[a:b], [top] * (b - a))
    return out
