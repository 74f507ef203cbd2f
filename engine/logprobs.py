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

``TokenLogprobs`` is also a wire value (``kvd.protocol.TokenChunk``): orjson
writes it as the object of its fields and ``from_json`` validates one back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import MAX_LOGPROBS

LOGPROB_FLOOR = -9999.0      # what -inf (and anything below) is reported as
# prompt rows turned into log probabilities per matmul: [rows, V] fp32 at a time (~25 MB at V = 49K)
PROMPT_ROWS_PER_SLICE = 128


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's answer: the logprob of ``token_id`` (the sampled or
    prompt token there) and the ``top`` most likely tokens as (id, logprob),
    most likely first, as many as the request asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_json(cls, value: object) -> "TokenLogprobs":
        """Validate the JSON object orjson writes for one (a wire field): raises
        ValueError for anything else."""
        if isinstance(value, TokenLogprobs):
            return value
        if not (isinstance(value, dict) and value.keys() == {"token_id", "logprob", "top"}):
            raise ValueError("a token's logprobs must be an object of token_id, logprob and top")
        token, logprob, top = value["token_id"], value["logprob"], value["top"]
        if not (type(token) is int and token >= 0 and _logprob(logprob)):
            raise ValueError("a token's logprobs need a token id >= 0 and a logprob in [floor, 0]")
        if not (isinstance(top, list) and len(top) <= MAX_LOGPROBS
                and all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int and e[0] >= 0
                        and _logprob(e[1]) for e in top)):
            raise ValueError(f"top logprobs must be at most {MAX_LOGPROBS} [token id, logprob] pairs")
        return cls(token, float(logprob), tuple((t, float(lp)) for t, lp in top))


def _logprob(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and LOGPROB_FLOOR <= x <= 0.0


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
