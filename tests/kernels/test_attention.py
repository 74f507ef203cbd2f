"""The paged attention reference kernels against dense attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import (AttentionBatch, PrefillSeq, decode_attention, decode_key_mask,
                               prefill_attention, write_kv)

BS, H, KVH, HD = 16, 6, 2, 32


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """q [T, H, hd] at positions prefix.., k/v [prefix+T, kvh, hd]: causal, in float64."""
    T, S = q.shape[0], k.shape[0]
    mask = torch.arange(S).unsqueeze(0) <= (torch.arange(T) + prefix).unsqueeze(1)
    rep = H // KVH
    o = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().repeat_interleave(rep, 1).transpose(0, 1),
        v.double().repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask, scale=HD ** -0.5)
    return o.transpose(0, 1)


def scattered_tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Non-contiguous, disjoint block tables (as a pool hands them out after churn)."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in lengths:
        need = -(-n // BS)
        tables.append(perm[at:at + need])
        at += need
    return tables


def slots_of(table: list[int], start: int, end: int) -> torch.Tensor:
    return torch.tensor([table[p // BS] * BS + p % BS for p in range(start, end)])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_over_scattered_blocks_matches_dense(dtype, tol):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 17, 40, 100]                       # context incl. the new token
    tables = scattered_tables(lengths, 64, seed=1)
    k_cache = torch.zeros(64, BS, KVH, HD, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    ks = [torch.randn(n, KVH, HD, generator=g).to(dtype) for n in lengths]
    vs = [torch.randn(n, KVH, HD, generator=g).to(dtype) for n in lengths]
    for t, k, v in zip(tables, ks, vs):
        write_kv(k_cache, v_cache, k, v, AttentionBatch(slots=slots_of(t, 0, len(k)), is_prefill=True))
    q = torch.randn(len(lengths), H, HD, generator=g).to(dtype)
    M = max(len(t) for t in tables)
    batch = AttentionBatch(slots=torch.zeros(0, dtype=torch.int64), is_prefill=False,
                           block_tables=torch.tensor([t + [0] * (M - len(t)) for t in tables]),
                           key_mask=decode_key_mask(lengths, M, BS))
    out = decode_attention(q, k_cache, v_cache, batch, HD ** -0.5)
    assert out.dtype == dtype and out.shape == (len(lengths), H, HD)
    for i, n in enumerate(lengths):
        ref = dense(q[i:i + 1], ks[i], vs[i], prefix=n - 1)[0]
        assert (out[i].double() - ref).abs().max() < tol
    # a sequence's row does not depend on the others in its batch
    alone = decode_attention(q[2:3], k_cache, v_cache, AttentionBatch(
        slots=torch.zeros(0, dtype=torch.int64), is_prefill=False,
        block_tables=torch.tensor([tables[2]]), key_mask=decode_key_mask([lengths[2]], len(tables[2]), BS)),
        HD ** -0.5)
    assert (alone[0].double() - out[2].double()).abs().max() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_with_and_without_a_cached_prefix_matches_dense(dtype, tol):
    """torch's SDPA (the reference; kernels/paged_attention.py has its own tests)."""
    g = torch.Generator().manual_seed(2)
    # seq 0: 20 new tokens, no prefix; seq 1: 32 cached + 9 new
    specs = [(0, 20), (32, 9)]
    tables = scattered_tables([p + n for p, n in specs], 32, seed=3)
    k_cache = torch.zeros(32, BS, KVH, HD, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    full_k = [torch.randn(p + n, KVH, HD, generator=g).to(dtype) for p, n in specs]
    full_v = [torch.randn(p + n, KVH, HD, generator=g).to(dtype) for p, n in specs]
    for (p, n), t, k, v in zip(specs, tables, full_k, full_v):          # the cached prefixes
        if p:
            write_kv(k_cache, v_cache, k[:p], v[:p], AttentionBatch(slots=slots_of(t, 0, p), is_prefill=True))
    q = torch.randn(sum(n for _, n in specs), H, HD, generator=g).to(dtype)
    new_k = torch.cat([k[p:] for (p, _), k in zip(specs, full_k)])
    new_v = torch.cat([v[p:] for (p, _), v in zip(specs, full_v)])
    seqs, at = [], 0
    for (p, n), t in zip(specs, tables):
        seqs.append(PrefillSeq(q_start=at, q_len=n, ctx_len=p + n, block_table=torch.tensor(t)))
        at += n
    batch = AttentionBatch(slots=torch.cat([slots_of(t, p, p + n) for (p, n), t in zip(specs, tables)]),
                           is_prefill=True, prefill=seqs)
    write_kv(k_cache, v_cache, new_k, new_v, batch)
    out = prefill_attention(q, new_k, new_v, k_cache, v_cache, batch, HD ** -0.5)
    assert out.dtype == dtype
    for (p, n), s, k, v in zip(specs, seqs, full_k, full_v):
        ref = dense(q[s.q_start:s.q_start + n], k, v, prefix=p)
        assert (out[s.q_start:s.q_start + n].double() - ref).abs().max() < tol
