"""Decode attention over a bf16 paged cache: native bf16 SDPA vs widening K/V to
fp32 first (what ``kernels.attention.decode_attention`` does), side by side.

    .venv/bin/python -m tools.bench.kernels.bench_attention

SmolLM2 shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16). The two
variants alternate round by round; medians in microseconds per call, and each
one's max error against float64. Appends to results/bench_attention.json.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

H, KVH, HD, BS = 9, 3, 64, 16
RESULTS = Path("results/bench_attention.json")


def attend(q, kc, vc, tables, mask, dtype):
    B = tables.shape[0]
    flat = tables.flatten()
    k = kc.index_select(0, flat).to(dtype).view(B, -1, KVH, HD).transpose(1, 2)
    v = vc.index_select(0, flat).to(dtype).view(B, -1, KVH, HD).transpose(1, 2)
    return F.scaled_dot_product_attention(q.to(dtype).unsqueeze(2), k, v, attn_mask=mask,
                                          scale=HD ** -0.5, enable_gqa=True).squeeze(2)


def main() -> None:
    rows = []
    for B, S in ((1, 144), (1, 1024), (16, 400)):
        nb = S // BS
        kc = torch.randn(B * nb + 8, BS, KVH, HD).bfloat16()
        vc = torch.randn_like(kc)
        tables = torch.randperm(B * nb + 8)[:B * nb].view(B, nb)
        q = torch.randn(B, H, HD).bfloat16()
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        ref = attend(q, kc, vc, tables, mask, torch.float64)
        times = {"bf16": [], "widened": []}
        for _ in range(7):
            for name, dt in (("bf16", torch.bfloat16), ("widened", torch.float32)):
                attend(q, kc, vc, tables, mask, dt)
                t = time.perf_counter()
                for _ in range(50):
                    attend(q, kc, vc, tables, mask, dt)
                times[name].append((time.perf_counter() - t) / 50 * 1e6)
        err = {n: (attend(q, kc, vc, tables, mask, dt).double() - ref).abs().max().item()
               for n, dt in (("bf16", torch.bfloat16), ("widened", torch.float32))}
        row = {"batch": B, "keys": S, "bf16_us": statistics.median(times["bf16"]),
               "widened_us": statistics.median(times["widened"]), "bf16_err": err["bf16"],
               "widened_err": err["widened"], "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        row["speedup"] = row["bf16_us"] / row["widened_us"]
        rows.append(row)
        print(f"| {B} x {S} keys | {row['bf16_us']:.0f} us | {row['widened_us']:.0f} us | "
              f"**{row['speedup']:.2f}x** | {err['bf16']:.1e} / {err['widened']:.1e} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps({"torch": torch.__version__, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
