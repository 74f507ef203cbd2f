"""How far the native kernels' next-token distributions are from the exact path's, as
llama.cpp's ``llama-perplexity --kl-divergence`` measures a quantization:

    .venv/bin/python tools/kl_divergence.py FILE.gguf [FILE.gguf ...]
        [--text tools/loadgen/data/sonnets.txt] [--ctx 512] [--tokens 0] [--out results/kl_divergence.json]

For each GGUF file the text is tokenized with the file's tokenizer and cut into
chunks of ``--ctx`` tokens; each chunk is one prefill on two models of the same
file: the served one (``weights = "native"``: block-quantized matrices, the host's
kernels, activations rounded to 16 bits per 32-block) and the exact one
(``weights = "dequantize"``, float32: gguf-py's values, torch's fp32 matmuls).
At every position from ``--first`` on (llama.cpp scores the second half of each
chunk; the bundled text is ~2,700 tokens, so by default every position but a
chunk's first is scored) it computes, in float64,

    KL(P_exact || P_native) = sum_v p_exact(v) (log p_exact(v) - log p_native(v))

and whether both put the same token on top, and prints and writes (JSON, appended
to ``--out``) the mean, median, 99th percentile and largest KL, the top-1
agreement, both perplexities of the text, the file's tensor types and the machine.
The targets are docs/benchmarks.md's (mean KL <= 1e-4, top-1 >= 99.5%).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "tools" / "loadgen" / "data" / "sonnets.txt"
RESULTS = REPO / "results" / "kl_divergence.json"


def chunk_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 [len(ids), V]: every position's logits, ``ids`` as one prompt in one prefill."""
    from kernels.attention import AttentionBatch, PrefillSeq

    c, bs = model.config, 16
    blocks = -(-len(ids) // bs)
    kv = torch.zeros(c.num_layers, 2, blocks, bs, c.num_kv_heads, c.head_dim, dtype=model.dtype)
    batch = AttentionBatch(slots=torch.arange(len(ids)), is_prefill=True,
                           prefill=[PrefillSeq(0, len(ids), len(ids), torch.arange(blocks))])
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), batch, kv)
    return model.compute_logits(hidden).float()


def compare(exact: torch.Tensor, native: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position (rows of ``exact`` / ``native`` [T, V]; ``targets`` [T] the next tokens):
    KL(exact || native), top-1 agreement, and each model's negative log-likelihood."""
    lp, lq = torch.log_softmax(exact.double(), -1), torch.log_softmax(native.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    same = exact.argmax(-1) == native.argmax(-1)
    rows = torch.arange(len(targets))
    return {"kl": kl, "same": same, "nll_exact": -lp[rows, targets], "nll_native": -lq[rows, targets]}


def measure(path: Path, text: str, ctx: int, first: int, max_tokens: int) -> dict:
    """One file's figures (the module docstring)."""
    import gguf

    from engine.model.llama import LlamaModel
    from engine.model.registry import resolve_model
    from engine.model.weights import load_gguf
    from kernels.quant_linear import QuantKernel

    ids = resolve_model(str(path)).load_tokenizer().encode(text)
    if max_tokens:
        ids = ids[:max_tokens]
    kernel = QuantKernel.create()
    if kernel is None:
        raise SystemExit("no quantized-weights kernel on this CPU: nothing native to measure")
    native_w, exact_w = load_gguf(path, quantized=True), load_gguf(path)
    native = LlamaModel(native_w.config, native_w.tensors, quant_kernel=kernel)
    exact = LlamaModel(exact_w.config, exact_w.tensors)
    parts: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    for at in range(0, len(ids) - 1, ctx):
        chunk = ids[at:at + ctx + 1]                     # + the token after the last position scored
        if len(chunk) <= first + 1:
            break
        x, targets = chunk[:-1], torch.tensor(chunk[1:])
        with torch.no_grad():
            a, b = chunk_logits(exact, x), chunk_logits(native, x)
        for k, v in compare(a[first:], b[first:], targets[first:]).items():
            parts[k].append(v)
    got = {k: torch.cat(v) for k, v in parts.items()}
    kl = got["kl"]
    types = collections.Counter(gguf.GGMLQuantizationType(t.tensor_type).name
                                for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)
    return {"file": str(path), "tensor_types": dict(types.most_common()), "tokens_scored": len(kl),
            "mean_kl": float(kl.mean()), "median_kl": float(kl.median()),
            "p99_kl": float(torch.quantile(kl, 0.99)), "max_kl": float(kl.max()),
            "top1_agreement": float(got["same"].double().mean()),
            "ppl_exact": float(got["nll_exact"].mean().exp()), "ppl_native": float(got["nll_native"].mean().exp()),
            "kernel": kernel.variant}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", type=Path, nargs="+", help="GGUF files to measure")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (one prefill each)")
    ap.add_argument("--first", type=int, default=1, help="first position of a chunk that is scored")
    ap.add_argument("--tokens", type=int, default=0, help="use the text's first N tokens (0: all)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not 0 <= args.first < args.ctx:
        ap.error("--first must be in [0, --ctx)")
    sys.path.insert(0, str(REPO))
    from tools.bench.engine.bench_engine import append_result, machine

    text = args.text.read_text(encoding="utf-8")
    host = machine()
    print(f"# {host['cpu']}; {' '.join(host['isa'])}")
    print(f"{'file':<44} {'mean KL':>10} {'p99 KL':>10} {'max KL':>9} {'top-1':>8} {'ppl exact':>10} {'native':>8}")
    for path in args.files:
        started = time.perf_counter()
        row = measure(path, text, args.ctx, args.first, args.tokens)
        row["seconds"] = round(time.perf_counter() - started, 1)
        print(f"{path.name:<44} {row['mean_kl']:>10.3g} {row['p99_kl']:>10.3g} {row['max_kl']:>9.3g} "
              f"{100 * row['top1_agreement']:>7.2f}% {row['ppl_exact']:>10.4f} {row['ppl_native']:>8.4f}   "
              f"({row['tokens_scored']} tokens; {row['tensor_types']})")
        append_result(args.out, {"bench": "kl_divergence", "machine": host, "ctx": args.ctx, "first": args.first,
                                 "text": str(args.text), **row})
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
