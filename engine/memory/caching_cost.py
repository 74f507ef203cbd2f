"""MemServe's context-caching cost model (§5.3): swap a host-tier prefix in, or recompute it?

Pure Python (no torch). A prefix hit (``MemPool.match``) may hold blocks in
the host tier; before a prefill can read them they are copied to the device
tier (``MemPool.swap_in``). Recomputing those tokens instead costs prefill
time. The model prices both from coefficients fitted on the machine that
serves (``tools/bench/engine/bench_caching_cost.py``; the defaults in ``etc/kvd.toml``
name the run that gave them).

Prefill of ``n`` new tokens after ``c`` cached tokens of the same sequence::

    t(n, c) = fixed + a*n + b*n*(c + n/2)

``a`` is what one token costs whatever its position (the weights: QKV/O/MLP
matmuls, norms); the attention of the token at position ``p`` reads ``p``
keys, so its cost is ``b*p``, and the ``n`` tokens at positions ``c .. c+n``
sum to ``b*n*(c + n/2)``. ``fixed`` is a step's overhead (the LM head of the
last token, the Python around the call). Swapping ``h`` host blocks in costs
``s*h`` (a copy of their bytes).

Keeping a hit's first ``k`` blocks (``x = k*bs`` tokens) of a ``P``-token
prompt therefore costs ``s*host(k) + t(P - x, x)``, and ``d t/d x = -(a + b*x)``:
reusing one more cached token saves that token's own compute, which grows
with its position. Within a run of host blocks the cost is concave in ``x``
(a linear swap term minus a convex saving), so its minimum lies at a run's
ends; within a device run it falls (reuse is free). The best ``k`` is thus
the start of some host run or the whole hit: :meth:`reuse_blocks` prices
only those. A host block at position ``x`` is worth its swap iff
``s < bs*(a + b*x)`` (roughly), so when ``s < bs*a`` swapping always wins.

The decision is per request. MemServe (§5.3) groups a batch for one decision
because "batch size effectively translates to prompt length" on a GPU, where
a small prefill leaves the device idle; in ``t`` above the batch's other
requests add the same time to both options (weights' cost is per token,
attention per sequence), so they cannot change the answer. The fit's
residuals (tools/bench/engine/bench_caching_cost.py) are the check that ``t`` is that
linear on the serving machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class CachingCostModel:
    """Fitted seconds: ``token_s`` = a, ``attention_s`` = b, ``fixed_s``, ``swap_block_s`` = s."""

    token_s: float
    attention_s: float
    fixed_s: float
    swap_block_s: float

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"caching cost {f.name} must be a finite number >= 0, got {v!r}")

    def prefill_seconds(self, new_tokens: int, context_tokens: int) -> float:
        """Predicted time of prefilling ``new_tokens`` after ``context_tokens`` cached ones."""
        n = new_tokens
        return self.fixed_s + n * (self.token_s + self.attention_s * (context_tokens + n / 2))

    def cost_of_keeping(self, on_host: Sequence[bool], k: int, prompt_len: int, block_size: int) -> float:
        """Predicted seconds to swap in the host blocks among a hit's first
        ``k`` blocks and prefill the rest of a ``prompt_len``-token prompt."""
        kept = k * block_size
        return (self.swap_block_s * sum(on_host[:k])
                + self.prefill_seconds(prompt_len - kept, kept))

    def reuse_blocks(self, on_host: Sequence[bool], prompt_len: int, block_size: int) -> int:
        """How many leading blocks of a prefix hit to reuse; the request recomputes the rest.

        ``on_host[i]``: block ``i`` of the hit (tokens ``[i*bs, (i+1)*bs)``) is
        in the host tier. Returns ``len(on_host)`` (swap every host block of
        the hit in) when that is cheapest, else the length of a shorter
        leading part, at least every device block before the first host one.
        Ties go to the longer reuse. Raises ValueError when the hit does not
        leave a token of the prompt to compute (``match`` is called on
        ``tokens[:-1]``, so a real hit always does)."""
        n = len(on_host)
        if n * block_size >= prompt_len:
            raise ValueError(f"a hit of {n} blocks of {block_size} leaves nothing of a "
                             f"{prompt_len}-token prompt to compute")
        # candidates: the start of each host run (recompute from there), and all
        candidates = [i for i in range(n) if on_host[i] and (i == 0 or not on_host[i - 1])] + [n]
        return min(reversed(candidates),
                   key=lambda k: self.cost_of_keeping(on_host, k, prompt_len, block_size))
