"""Whether a model computes a token with one arithmetic on every path.

kvd's promise for reproducible output (docs/serving.md, "Reproducible output"):
a token's K/V and logits have the same bits whether it was prefilled (in any
chunk, at any place in it, after a cached prefix or not) or decoded (in any
batch, at any row), with any thread count, on any node of the same build.
Then a seeded stream gives the same text through recovery, preemption,
disaggregation and prefix-cache hits, and under any load.

That holds where every op of a step runs the same per-row arithmetic on both
paths: fp32 activations, the C++ row ops (norms, SwiGLU, GeGLU, RoPE) and
paged attention (kernels/paged_attention.py, the plan executor's arithmetic,
sliding-window layers included), and matrices on
one kernel for prefill and decode (quantized blocks always; float matrices
with ``batch_invariant``). ``same_bits`` says which, for ``kvctl status`` and
the start-up log.
"""

from __future__ import annotations

import torch

from engine.model.llama import LlamaModel
from kernels.plan_decode import PlanDecoder

YES = "yes"


def same_bits(model: LlamaModel, decoder: object | None) -> str:
    """``"yes"`` where ``model`` (decoding on ``decoder``: the one-call decoder, or None
    for the torch path) computes a token's K/V and logits with the same bits on every
    path, else ``"no: "`` and the first reason it does not."""
    if model.dtype != torch.float32:
        return (f"no: {str(model.dtype).removeprefix('torch.')} activations (prefill and decode run other "
                "kernels, in other summation orders; dtype = \"float32\" has one arithmetic)")
    if model.attention_kernel is None:
        return "no: no paged attention kernel on this CPU (torch's SDPA sums prefill and decode in other orders)"
    if model.row_ops is None:
        return "no: no row ops kernel on this CPU (torch's norms sum in another order than the decode step's)"
    cfg = model.config
    if cfg.attn_logit_softcap is not None:
        return (f"no: {cfg.architecture}'s softcapped layers attend on torch's SDPA, in other orders for "
                "prefill and decode")
    if model.quantized:
        return YES if model.quant_kernel is not None else "no: quantized matrices on torch's reference, not a kernel"
    if not isinstance(decoder, PlanDecoder):
        return "no: float matrices multiply on MKL, whose summation order may change with the row count"
    if not model.batch_invariant:
        return ("no: float matrices prefill on MKL and decode on the plan executor (batch_invariant = true "
                "prefills on the executor's kernel: the same bits, slower prefills)")
    return YES
