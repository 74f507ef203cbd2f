"""The step-time model of a profile: what one engine step, one swap and one
KV transfer take on the profiled machine. Pure Python (no torch, no numpy).

An engine step runs its prefill part, then its decode part (``LLMEngine._step``)::

    prefill(parts)   = prefill_fixed + sum over (n, c) of  a*n + b*n*(c + n/2)
    decode(B, ctx)   = decode_batch(B) + decode_context*ctx

``decode_batch`` is the profile's table of measured batch sizes (a step's
time at zero context, per batch size), linear between its points and past
its largest with the slope ``decode_seq``: a kernel's cost is not linear in
the batch (a native decode may switch paths between batch sizes). Without
the table (an older profile) it is ``decode_fixed + decode_seq*B``.

``parts`` are the (new tokens, tokens already computed) of each request in
the prefill call: a chunk of a long prompt and a prompt after a cached prefix
are both ``(n, c)``; ``a`` is a token's own cost (the matmuls), ``b*p`` the
attention of a token at position ``p`` (the caching cost model's formula,
engine/memory/caching_cost.py, whose coefficients a profile also supplies).
``B`` is the decode batch and ``ctx`` the tokens its attention reads.
A swap moves ``swap_block`` seconds per block; a transfer of ``x`` bytes over
the profiled transport takes ``transfer_latency + x*transfer_byte``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, fields


@dataclass(frozen=True)
class StepCosts:
    """Fitted seconds; every field finite and >= 0."""

    prefill_fixed_s: float
    prefill_token_s: float
    prefill_attention_s: float
    decode_fixed_s: float
    decode_seq_s: float
    decode_context_s: float
    swap_block_s: float
    transfer_latency_s: float
    transfer_byte_s: float
    # (batch size, seconds at zero context) per measured batch size, batch sizes rising; may be empty
    decode_batch_s: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "decode_batch_s":
                continue
            v = getattr(self, f.name)
            if not _seconds(v):
                raise ValueError(f"cost {f.name} must be a finite number >= 0 (seconds), got {v!r}")
        table = self.decode_batch_s
        if not isinstance(table, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                and p[0] >= 1 and _seconds(p[1]) for p in table):
            raise ValueError("cost decode_batch_s must be a list of [batch >= 1, seconds >= 0] pairs, "
                             f"got {table!r}")
        if any(a[0] >= b[0] for a, b in zip(table, table[1:])):
            raise ValueError(f"cost decode_batch_s's batch sizes must rise, got {[p[0] for p in table]}")
        object.__setattr__(self, "decode_batch_s", tuple((int(b), float(t)) for b, t in table))

    @classmethod
    def from_dict(cls, d: dict) -> "StepCosts":
        """From a profile's ``costs`` object; raises ValueError naming a missing or bad field."""
        return from_object(cls, d, "costs")

    def as_dict(self) -> dict:
        return asdict(self)

    def prefill_seconds(self, parts: Iterable[tuple[int, int]]) -> float:
        """One prefill call over ``parts`` = (new tokens, context tokens) per request."""
        t = self.prefill_fixed_s
        for n, c in parts:
            t += n * (self.prefill_token_s + self.prefill_attention_s * (c + n / 2))
        return t

    def decode_seconds(self, batch: int, context: int) -> float:
        """One decode call of ``batch`` requests whose attention reads ``context`` tokens in all."""
        if batch == 0:
            return 0.0
        return self.decode_batch_seconds(batch) + self.decode_context_s * context

    def decode_batch_seconds(self, batch: int) -> float:
        """A decode call of ``batch`` requests at zero context (module docstring)."""
        table = self.decode_batch_s
        if not table:
            return self.decode_fixed_s + self.decode_seq_s * batch
        if batch <= table[0][0]:
            return table[0][1] * batch / table[0][0]
        for (b0, t0), (b1, t1) in zip(table, table[1:]):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        b_last, t_last = table[-1]
        return t_last + self.decode_seq_s * (batch - b_last)

    def swap_seconds(self, blocks: int) -> float:
        return self.swap_block_s * blocks

    def transfer_seconds(self, nbytes: int) -> float:
        """One message of ``nbytes`` over the profiled transport (0 bytes: nothing sent)."""
        return self.transfer_latency_s + self.transfer_byte_s * nbytes if nbytes > 0 else 0.0


def _seconds(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0


def from_object(cls, d: object, what: str):
    """A dataclass ``cls`` from a profile's object ``what`` (every field without a
    default required, others ignored); raises ValueError naming what is
    missing, or the class's own check's error."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be an object")
    missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
    if missing:
        raise ValueError(f"{what} lacks {', '.join(missing)}")
    return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Coefficients >= 0 minimising the relative squared error of ``rows @ x ~ ys``
    (each row weighted by 1/y: short steps count as much as long ones). A
    negative coefficient is dropped (fixed at 0) and the rest refitted: a cost
    is never negative. Small dense normal equations, solved by Gauss-Jordan."""
    k = len(rows[0])
    active = list(range(k))
    while True:
        x = _solve_weighted(rows, ys, active)
        neg = [j for j in active if x[j] < 0]
        if not neg:
            return x
        active = [j for j in active if j not in neg]
        if not active:
            return [0.0] * k


def _solve_weighted(rows: list[list[float]], ys: list[float], active: list[int]) -> list[float]:
    m = len(active)
    ata = [[0.0] * m for _ in range(m)]
    aty = [0.0] * m
    for row, y in zip(rows, ys):
        w = 1.0 / max(y, 1e-9) ** 2
        for i, a in enumerate(active):
            aty[i] += w * row[a] * y
            for j, b in enumerate(active):
                ata[i][j] += w * row[a] * row[b]
    for i in range(m):                     # a tiny ridge: a column of zeros stays solvable
        ata[i][i] += 1e-18 + 1e-12 * ata[i][i]
    aug = [ata[i] + [aty[i]] for i in range(m)]
    for col in range(m):
        piv = max(range(col, m), key=lambda r: abs(aug[r][col]))
        aug[col], aug[piv] = aug[piv], aug[col]
        p = aug[col][col] or 1e-300
        aug[col] = [v / p for v in aug[col]]
        for r in range(m):
            if r != col and aug[r][col]:
                f = aug[r][col]
                aug[r] = [v - f * w for v, w in zip(aug[r], aug[col])]
    x = [0.0] * len(rows[0])
    for i, a in enumerate(active):
        x[a] = aug[i][m]
    return x


def relative_error(pred: list[float], ys: list[float]) -> float:
    """Median |pred - y| / y."""
    errs = sorted(abs(p - y) / y for p, y in zip(pred, ys) if y > 0)
    return errs[len(errs) // 2] if errs else 0.0
