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
nothing. A row costs two passes over its logits and writes no [R, V]
``log_softmax``: its log-sum-exp and top ``k`` are taken before anything
changes the logits (``summarize``), and the sampled token's logprob is read
once it is drawn (``PendingLogprobs.answer``). The C++ kernel
(kernels/logprob_rows.py) does the passes where the CPU has one; torch's
``logsumexp`` and ``topk`` otherwise, and for a row the kernel declines.

The answers are ``engine.request.TokenLogprobs`` (torch-free: the wire and
the coordinator carry them).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Sequence

import torch

from engine.request import LOGPROB_FLOOR, TokenLogprobs
from kernels.logprob_rows import LogprobKernel, RowSummary

# prompt rows turned into log probabilities per matmul: [rows, V] fp32 at a time (~25 MB at V = 49K)
PROMPT_ROWS_PER_SLICE = 128


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's ops on this thread alone, then give back the team. A row's
    summary is a few memory-bound passes over [V]: on a host whose cores are
    busy, every op torch splits across its team waits at a barrier for a
    descheduled thread and costs several times the op."""
    team = torch.get_num_threads()
    if team == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(team)


def _float32(x: float) -> float:
    """``x`` rounded to float32, floored at ``LOGPROB_FLOOR`` (-inf and NaN among the floored)."""
    v = ctypes.c_float(x).value
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


def _torch_summary(row: torch.Tensor, k: int) -> RowSummary:
    """``RowSummary`` of one fp32 row [V] by torch (any values: NaN, +-inf)."""
    lse = float(torch.logsumexp(row.double(), dim=-1))
    if k == 0:
        return RowSummary(lse, ())
    values, ids = torch.topk(row, k)
    return RowSummary(lse, tuple((int(i), float(v) - lse) for i, v in zip(ids.tolist(), values.tolist())))


class PendingLogprobs:
    """A step's logprob summaries, taken from the raw logits (``summarize``);
    ``answer`` completes them once the tokens are drawn."""

    def __init__(self, rows: Sequence[int], tops: Sequence[int], summaries: Sequence[RowSummary],
                 raw: dict[int, torch.Tensor]) -> None:
        self.rows, self.tops, self.summaries, self.raw = list(rows), list(tops), list(summaries), raw

    def answer(self, logits: torch.Tensor, token_ids: Sequence[int]) -> list[TokenLogprobs]:
        """Row ``rows[j]``'s answer for ``token_ids[j]`` with its ``tops[j]`` most
        likely tokens. ``logits`` is the tensor ``summarize`` read: the drawn token's
        logit is read from it (a masked token is never drawn, so masks leave it
        as it was), or from the copy taken of a row its sampling changes in place."""
        picked = logits[self.rows, list(token_ids)].tolist() if self.rows else []    # one gather
        out = []
        for j, (row, tok) in enumerate(zip(self.rows, token_ids)):
            s = self.summaries[j]
            x = float(self.raw[row][tok]) if row in self.raw else picked[j]
            top = tuple((i, _float32(v)) for i, v in s.top[:self.tops[j]])
            out.append(TokenLogprobs(tok, _float32(x - s.lse), top))
        return out


def summarize(logits: torch.Tensor, rows: Sequence[int], tops: Sequence[int],
              kernel: LogprobKernel | None, changed: Sequence[int] = ()) -> PendingLogprobs:
    """Take what ``rows`` of ``logits`` (fp32 [B, V]) need for their logprobs, each
    with its ``tops[j]`` most likely tokens, before anything changes the logits;
    ``changed``: rows among them that sampling will change in place (a copy of each
    is kept). Torch's ops run on one thread (``one_thread``)."""
    k = max(tops, default=0)
    summaries: list[RowSummary | None]
    if kernel is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1 and k <= kernel.max_top:
        summaries = kernel.summarize(logits, rows, k)
    else:
        summaries = [None] * len(rows)
    with one_thread():
        for j, s in enumerate(summaries):
            if s is None:
                summaries[j] = _torch_summary(logits[rows[j]].float(), min(k, logits.shape[-1]))
        raw = {row: logits[row].clone() for row in changed}
    return PendingLogprobs(rows, tops, summaries, raw)


def prompt_logprobs(hidden: torch.Tensor, compute_logits, targets: Sequence[int], top: int,
                    kernel: LogprobKernel | None) -> list[TokenLogprobs]:
    """The logprobs of ``targets[j]`` at the position whose hidden state is
    ``hidden[j]`` ([n, D], one row per target), with ``top`` most likely each:
    the LM head runs on ``PROMPT_ROWS_PER_SLICE`` rows at a time, so a long
    prompt never holds its whole [n, V] logits."""
    out: list[TokenLogprobs] = []
    for a in range(0, len(targets), PROMPT_ROWS_PER_SLICE):
        b = min(a + PROMPT_ROWS_PER_SLICE, len(targets))
        logits = compute_logits(hidden[a:b]).float()
        rows = range(b - a)
        out += summarize(logits, rows, [top] * (b - a), kernel).answer(logits, targets[a:b])
    return out
