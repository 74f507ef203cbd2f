"""Token sampling: logit adjustments, greedy, temperature, min-p, top-k,
top-p, per-request seeds.

A row's logits are adjusted first, in vLLM's order, on every row that asks
for it (greedy or not), before the step's tokens are picked:

1. ``logit_bias``: each listed token's bias is added to its logit (min_tokens
   masks stop ids to -inf before this, which is the same: -inf stays -inf);
2. ``repetition_penalty`` ``r`` (1: off), vLLM's: every distinct token of the
   prompt and the output so far has its logit divided by ``r`` when positive,
   multiplied by ``r`` otherwise; a result beyond fp32's range is fp32's
   largest finite value.

Greedy rows then take their row's first maximum: one vectorised argmax, or
the ids the decode executor computed with the logits, except on the rows
adjusted here, whose argmax is taken again. A random row draws one token,
defined here for every node and every path:

- ``min_p`` (0: off): the tokens whose probability after temperature is
  below ``min_p`` times the most likely token's are masked to -inf first
  (in fp32: ``(l - max l) / T < ln(min_p)``); the most likely token always stays;
- weights ``w = e^((l - max l) / T)`` over the row's logits ``l`` at
  temperature ``T`` (a logit of -inf, masked by min_tokens or min_p, weighs 0);
- the kept tokens: with ``top_k`` (0 < k < V), every token whose logit is at
  least the k-th largest (ties with the k-th stay); with ``top_p`` (< 1), in
  the order logit descending then index ascending, each (top-k kept) token
  whose preceding weight is at most ``top_p`` of the top-k kept total: the
  smallest prefix that reaches top_p;
- one uniform number ``u`` in [0, 1): the token is the first kept token, in
  index order, whose running sum of weights (in double) passes ``u`` times the
  kept total (inverse CDF), so it is drawn with probability softmax over the
  kept tokens.

The engine draws all random rows of a step in one C++ call
(kernels/sampler.py: no sort of the vocabulary, rows across threads); a host
without a kernel build draws them one by one in torch (``draw_row``, the same
definition with torch's exp).

A row that cannot be drawn (no finite weight: a NaN or +inf logit, or every
logit -inf) is ``UNSAMPLED`` in ``sample``'s result, never an exception: the
engine fails that request alone.

A seeded request's ``u`` for its output token ``i`` comes from a generator
seeded with ``draw_seed(seed, i)``: it depends on nothing but the seed and the
token's position, so the same tokens come out whatever else shares the batch,
and a request that moves between nodes (a prefill node samples token 0, a
decode node the rest; a replica resumes after a failure) needs no generator
state carried with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.request import SamplingParams
from kernels.sampler import UNSAMPLED, RowSampler

_MASK64 = (1 << 64) - 1
_FP32_MAX = torch.finfo(torch.float32).max


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
    ``torch.argmax``'s indices. fp32 rows go through numpy's argmax, faster
    than torch's on CPU (docs/benchmarks.md, Kernels)."""
    if logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def adjust_row(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int] = (),
               output_ids: Sequence[int] = ()) -> None:
    """Apply ``p``'s logit_bias, then its repetition penalty over the distinct
    tokens of ``prompt_ids`` and ``output_ids``, to one fp32 row of logits [V]
    (the module docstring's definition). Mutates ``logits``. The token ids are
    within the row (SamplingParams.check_vocab, and the engine's own ids)."""
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64)
        logits[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids).union(output_ids)), dtype=torch.int64)
        x = logits[seen]
        x = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        logits[seen] = x.clamp_(max=_FP32_MAX)        # a penalty near 0 divides past fp32's range


def apply_min_p(logits: torch.Tensor, p: SamplingParams) -> None:
    """Mask to -inf the tokens of one fp32 row [V] that ``p``'s min_p drops at
    its temperature (the module docstring's definition); the row's maximum
    stays. Mutates ``logits``; a row without a finite maximum is left as it is
    (the draw reports it)."""
    m = float(logits.max())
    if math.isfinite(m):
        logits.masked_fill_((logits - m) / p.temperature < math.log(p.min_p), float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], positions: list[int],
           greedy_ids: list[int] | None = None, kernel: RowSampler | None = None,
           history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> list[int]:
    """logits: [B, V] fp32 -> one token id per row. ``positions[row]``: the
    output index of the token drawn for that row (its seeded draw's key).
    ``greedy_ids``: each row's ``greedy`` index when the caller already has it
    (the decode executor computes it with the logits), else None. ``kernel``:
    the C++ sampler that draws the random rows (all in one call), else they are
    drawn one by one through ``draw_row``. ``history[row]``: that row's
    (prompt ids, output ids so far), read by a repetition penalty (needed
    when a row has one). Mutates the rows whose parameters adjust or filter
    their logits (``adjust_row``, ``apply_min_p``); the others are read only.
    A random row without a finite weight gets ``UNSAMPLED``; this raises
    nothing for a row's values."""
    adjusted = [row for row, p in enumerate(params) if p.adjusts_logits]
    for row in adjusted:
        p = params[row]
        adjust_row(logits[row], p, *(history[row] if p.repetition_penalty != 1.0 else ((), ())))
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if len(rows) == len(params):
        out = [0] * len(params)                  # every row drawn below
    elif greedy_ids is None:
        out = greedy(logits)
    else:
        out = list(greedy_ids)
        for row in adjusted:                     # the executor's argmax was of the unadjusted row
            if params[row].greedy:
                out[row] = greedy(logits[row:row + 1])[0]
    if not rows:
        return out
    uniform = []
    for row in rows:
        p = params[row]
        if p.min_p > 0.0:
            apply_min_p(logits[row], p)
        g = generators[row]
        if g is not None:
            g.manual_seed(draw_seed(p.seed, positions[row]))
        uniform.append(float(torch.rand((), dtype=torch.float64, generator=g)))
    if kernel is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        picked = kernel.sample(logits, rows, [params[r].temperature for r in rows], [params[r].top_k for r in rows],
                               [params[r].top_p for r in rows], uniform)
    else:
        picked = [draw_row(logits[row], params[row], u) for row, u in zip(rows, uniform)]
    for row, tok in zip(rows, picked):
        out[row] = tok
    return out


def draw_row(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """The token of the 1-D ``logits`` that a random row with ``p`` and the uniform number
    ``u`` in [0, 1) draws (the module docstring's definition, min_p aside: ``sample``
    applies it; kernels/sampler.py computes the same in C++). ``UNSAMPLED`` for a row
    without a finite weight (a NaN or +inf logit, or every logit -inf)."""
    x = logits.float()
    v = x.shape[0]
    m = float(x.max()) if v else float("-inf")
    if not bool((x < float("inf")).all()) or m == float("-inf"):
        return UNSAMPLED
    w = ((x - m) / p.temperature).exp()                       # torch's exp: the C++ sampler's within rounding
    tau, last = float("-inf"), v
    by_k, by_p = 0 < p.top_k < v, p.top_p < 1.0
    if by_k or by_p:
        order = torch.sort(x, descending=True, stable=True).indices      # logit descending, index ascending
        if by_k:
            tau = float(x[order[p.top_k - 1]])                 # every token tied with the k-th stays
        if by_p:
            keep_k = x >= tau
            total = float(torch.where(keep_k, w, 0.0).double().sum())
            n_k = int(keep_k.sum())
            ws = w[order[:n_k]].double()
            before = torch.cat([ws.new_zeros(1), ws.cumsum(0)[:-1]])
            kept = int((before <= p.top_p * total).sum())     # before is nondecreasing: a prefix
            t = int(order[kept - 1])
            tau, last = float(x[t]), t
    idx = torch.arange(v)
    keep = (x > tau) | ((x == tau) & (idx <= last))
    cdf = torch.where(keep, w, 0.0).double().cumsum(0)
    total = float(cdf[-1])
    i = int(torch.searchsorted(cdf, torch.tensor(u * total, dtype=torch.float64), right=True))
    if i >= v:                                  # u * total rounded up to the total: the last kept weight
        i = int(torch.nonzero(keep & (w > 0)).max())
    return i
