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

import contextlib
from collections.abc import Iterator, Sequence

import torch

from engine.request import LOGPROB_FLOOR, TokenLogprobs

# prompt rows turned into log probabilities per matmul: [rows, V] fp32 at a time (~25 MB at V = 49K)
PROMPT_ROWS_PER_SLICE = 128
TOP_K_BLOCK = 256            # columns per block of top_k's first pass


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's ops on this thread alone, then give back the team. A step's
    logprobs are a few memory-bound passes over [R, V] (~1 ms each): on a
    host whose cores are busy, every op torch splits across its team waits at
    a barrier for a descheduled thread and costs several times the op
    (tools/bench/engine/bench_logprobs.py)."""
    team = torch.get_num_threads()
    if team == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(team)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> their float32 log_softmax [R, V] (a new tensor: the
    logits are not changed). Computed on one thread (``one_thread``)."""
    with one_thread():
        return torch.log_softmax(logits.float(), dim=-1)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x`` [R, V] and their columns, largest
    first: ``torch.topk``'s answer, found in blocks::

        row:    [ b0 | b1 | b2 | ... | b(C-1) | tail ]    C blocks of TOP_K_BLOCK columns
        step 1: each block's maximum                      one pass over the row
        step 2: the k blocks with the largest maxima      hold every one of the k largest
        step 3: topk over those k blocks and the tail     k * TOP_K_BLOCK + tail columns

    (a value among the k largest is at most its block's maximum, so at most k
    blocks have a maximum that large.) torch's CPU topk over a whole [32, 49K]
    row set costs several times a pass over it; this is one pass and a small topk."""
    r, v = x.shape
    full = v - v % TOP_K_BLOCK
    if full < k * TOP_K_BLOCK * 2:
        return torch.topk(x, k, dim=-1)
    blocks = x[:, :full].reshape(r, full // TOP_K_BLOCK, TOP_K_BLOCK)           # a view of contiguous rows
    chosen = torch.topk(blocks.amax(dim=-1), k, dim=-1).indices                 # [R, k]
    values = blocks.gather(1, chosen[:, :, None].expand(r, k, TOP_K_BLOCK)).reshape(r, k * TOP_K_BLOCK)
    columns = (chosen[:, :, None] * TOP_K_BLOCK + torch.arange(TOP_K_BLOCK)).reshape(r, k * TOP_K_BLOCK)
    if full < v:
        values = torch.cat([values, x[:, full:]], dim=1)
        columns = torch.cat([columns, torch.arange(full, v).expand(r, v - full)], dim=1)
    best, at = torch.topk(values, k, dim=-1)
    return best, columns.gather(1, at)


def token_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int], top: Sequence[int]) -> list[TokenLogprobs]:
    """Row r of ``logprobs`` [R, V] (``log_probs``) answered for token
    ``token_ids[r]`` with its ``top[r]`` most likely tokens. Computed on one
    thread (``one_thread``)."""
    with one_thread():
        return _token_logprobs(logprobs, token_ids, top)


def _token_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int], top: Sequence[int]) -> list[TokenLogprobs]:
    n = len(token_ids)
    if n == 0:
        return []
    ids = torch.tensor(token_ids, dtype=torch.int64)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].clamp_(min=LOGPROB_FLOOR).tolist()
    k = max(top)
    if k:
        values, indices = top_k(logprobs, k)
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
