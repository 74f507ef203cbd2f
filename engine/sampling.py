"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows are one vectorised argmax. Random rows are sampled one by one,
each by inverse CDF (``draw``): one uniform number against the running sum of
the row's weights, ~0.25 ms a row of SmolLM2's 49,152 where ``torch.multinomial``
took ~1.7 ms on a Cascade Lake Xeon (tools/bench_sampling.py).
A seeded request's draw for its output token ``i`` comes from a generator
seeded with ``draw_seed(seed, i)``: it depends on nothing but the seed and the
token's position, so the same tokens come out whatever else shares the batch,
and a request that moves between nodes (a prefill node samples token 0, a
decode node the rest; a replica resumes after a failure) needs no generator
state carried with it.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of output token ``position`` of a request seeded
    ``seed`` (splitmix64 of the pair: neighbouring positions and seeds give
    unrelated streams). A non-negative int below 2**63."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A generator for a seeded random request (reseeded before every draw,
    see ``sample``); None for greedy or unseeded."""
    if params.greedy or params.seed is None:
        return None
    return torch.Generator()


def apply_min_tokens(logits: torch.Tensor, banned: list[tuple[int, list[int]]]) -> None:
    """Mask stop/EOS ids for rows that have not reached min_tokens. Mutates logits."""
    for row, ids in banned:
        logits[row, ids] = float("-inf")


def greedy(logits: torch.Tensor) -> list[int]:
    """The first index of each row's maximum (a NaN counts as the maximum):
    ``torch.argmax``'s indices. fp32 rows go through numpy's argmax, about
    10x faster than torch's on CPU (tools/bench_sampling.py)."""
    if logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], positions: list[int],
           greedy_ids: list[int] | None = None) -> list[int]:
    """logits: [B, V] fp32 -> one token id per row. ``positions[row]``: the
    output index of the token drawn for that row (its seeded draw's key).
    ``greedy_ids``: each row's ``greedy`` index when the caller already has it
    (the decode executor computes it with the logits), else None."""
    out = list(greedy_ids) if greedy_ids is not None else greedy(logits)
    for row, p in enumerate(params):
        if p.greedy:
            continue
        g = generators[row]
        if g is not None:
            g.manual_seed(draw_seed(p.seed, positions[row]))
        out[row] = _sample_row(logits[row], p, g)
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
    return draw(x, g)


def draw(x: torch.Tensor, g: torch.Generator | None) -> int:
    """One index of the 1-D logits ``x`` drawn with probability softmax(x): the
    first index whose running sum of weights e^(x - max) (in float64) exceeds u,
    u uniform in [0, total) from ``g`` (torch's default generator when None). An
    index of weight 0 (a logit of -inf: masked by top-k, top-p or min_tokens) is
    never drawn. RuntimeError for a row with no finite weight (NaN, or all -inf),
    as torch.multinomial raises."""
    w = (x - x.max()).exp_()
    cdf = w.cumsum(0, dtype=torch.float64)
    total = float(cdf[-1])
    if not total > 0.0 or total == float("inf"):
        raise RuntimeError(f"cannot sample from logits whose weights sum to {total}")
    u = torch.rand((), dtype=torch.float64, generator=g) * total
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= x.shape[0]:                         # u rounded up to the total: the last index of weight > 0
        i = int(torch.nonzero(w).max())
    return i
