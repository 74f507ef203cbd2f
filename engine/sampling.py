"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows are one vectorised argmax. Random rows are sampled one by one
with the request's own ``torch.Generator`` so a seeded request draws the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A generator for a seeded random request; None for greedy or unseeded."""
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed)
    return g


def apply_min_tokens(logits: torch.Tensor, banned: list[tuple[int, list[int]]]) -> None:
    """Mask stop/EOS ids for rows that have not reached min_tokens. Mutates logits."""
    for row, ids in banned:
        logits[row, ids] = float("-inf")


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, V] fp32 -> one token id per row."""
    out = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        out[row] = _sample_row(logits[row], p, generators[row])
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, g: torch.Generator | None) -> int:
    x = logits / p.temperature                                     # [V]
    if p.top_k > 0 and p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
        drop = probs.cumsum(-1) - probs > p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = x.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=g).item())
