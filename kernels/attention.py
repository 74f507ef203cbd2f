"""Attention over paged KV blocks: the torch reference kernels.

KV layout (owned by ``engine.memory.kv_cache``; one tensor per tier)::

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
          layer      K/V   block id   slot in block

so ``kv[layer, 0]`` is that layer's K cache ``[num_blocks, block_size, kvh, hd]``,
contiguous. Gathering a sequence's blocks ``k_cache[block_table]`` gives
``[n_blocks, block_size, kvh, hd]`` whose first two dims merge for free into the
sequence axis: one copy per tensor, which is what a contiguous (HF-style) cache
pays per step for its ``torch.cat`` anyway.

A token's slot is ``(block_table[pos // block_size], pos % block_size)``.

These functions are the reference: a GPU build replaces them with Triton
kernels of the same contract. They never allocate KV memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F



@dataclass
class PrefillSeq:
    """One sequence's share of a prefill step.

    ``q_start:q_start+q_len`` are its rows in the flattened token batch;
    ``ctx_len`` = cached prefix + q_len (the keys it attends to);
    ``block_table`` holds the blocks of all ``ctx_len`` tokens.
    """

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] int64


@dataclass
class AttentionBatch:
    """Metadata of one engine step, shared by every layer.

    ``slots`` say where each new token's K/V is written: ``block * block_size +
    offset`` in the flattened ``[N * bs, kvh, hd]`` view of a layer's cache.
    A decode step fills ``block_tables``/``context_lens``/``key_mask``;
    a prefill step fills ``prefill``.
    """

    slots: torch.Tensor                  # [T] int64
    is_prefill: bool
    prefill: list[PrefillSeq] | None = None
    block_tables: torch.Tensor | None = None   # [B, max_blocks] int64 (decode)
    key_mask: torch.Tensor | None = None       # [B, 1, 1, max_blocks*bs] bool (decode)
    # the step's rows as kernels.paged_attention takes them, made once per step (paged_rows)
    paged: tuple[torch.Tensor, torch.Tensor] | None = None

    def paged_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(seqs int64 [S, 3]: each sequence's first row, rows and context length; tables
        int64 [S, max_blocks]) for ``PagedAttention.attend``: a prefill's sequences, or a
        decode's one row each at ``positions`` [B]. Made on the first call, kept for every
        layer of the step."""
        if self.paged is None:
            if self.is_prefill:
                seqs = torch.tensor([(s.q_start, s.q_len, s.ctx_len) for s in self.prefill], dtype=torch.int64)
                width = max(len(s.block_table) for s in self.prefill)
                tables = torch.zeros(len(self.prefill), width, dtype=torch.int64)
                for i, s in enumerate(self.prefill):
                    tables[i, :len(s.block_table)] = s.block_table
            else:
                B = self.block_tables.shape[0]
                seqs = torch.stack((torch.arange(B), torch.ones(B, dtype=torch.int64), positions + 1), dim=1)
                tables = self.block_tables
            self.paged = (seqs, tables)
        return self.paged


# The largest finite IEEE half: a float16 KV cache stores K and V clamped to it.
HALF_MAX = 65504.0


def store_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (K or V rows) as a KV cache of ``dtype`` holds it: ``x`` itself in the
    model's dtype; in a float16 cache of an fp32 model (``kv_cache_dtype``), clamped to
    +-65504 (a larger value saturates, it does not become inf; NaN stays NaN) and
    rounded to nearest even, as the plan executor's ``store_half_row`` stores it, bit
    for bit."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float16:
        return x.clamp(-HALF_MAX, HALF_MAX).to(dtype)
    return x.to(dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, batch: AttentionBatch) -> None:
    """Store new tokens' K/V in their slots. Mutates the caches.

    k_cache, v_cache: [N, bs, kvh, hd] (contiguous); k, v: [T, kvh, hd], of the
    caches' dtype (``store_kv``). ``index_copy_`` on the flat view: advanced-index
    assignment is orders of magnitude slower on CPU for these shapes.
    """
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, batch.slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, batch.slots, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous keys (or values) of one sequence: [length, kvh, hd].

    cache: [N, bs, kvh, hd]; block_table: [n_blocks].
    """
    blocks = cache.index_select(0, block_table)          # [n, bs, kvh, hd]
    return blocks.flatten(0, 1)[:length]                 # [n*bs, kvh, hd] -> [length, ...]


def window_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility, bool [..., Q, K]: query at position p
    sees key k when k <= p and, with ``window``, p - window < k (its ``window`` last
    keys, its own included). qpos [..., Q, 1], kpos [..., 1, K]."""
    seen = kpos <= qpos
    return seen if window is None else seen & (kpos > qpos - window)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None, gqa: bool) -> torch.Tensor:
    """SDPA over [.., H, Q, hd] x [.., kvh, K, hd] with a bool mask; with ``softcap``, the
    scores capped (c * tanh(s / c)) before the mask and softmax, spelled out (SDPA has no cap)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: AttentionBatch, scale: float, window: int | None = None,
                     positions: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context.

    q: [B, H, hd] -> out [B, H, hd]. Keys beyond a sequence's length are masked
    (``key_mask``), so padding to the longest table contributes exactly zero.
    ``window`` (needs ``positions`` [B], the queries' positions): keys at or before
    position - window are masked too. ``softcap``: scores capped (``_attend``).
    """
    tables = batch.block_tables                           # [B, M]
    B, M = tables.shape
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    # index_select, not k_cache[tables]: advanced indexing with a 2-D index
    # takes milliseconds on CPU where index_select takes microseconds.
    # [B*M, bs, kvh, hd] -> [B, M*bs, kvh, hd] (free) -> [B, kvh, S, hd] (view)
    # A 16-bit cache is widened to fp32 after the gather: for one query row the
    # CPU's bf16 SDPA is slower than widening + fp32 SDPA, and less exact
    # (docs/benchmarks.md, Kernels: tools/bench/kernels/bench_attention.py).
    flat = tables.flatten()
    k = k_cache.index_select(0, flat).float().view(B, -1, n_kv, hd).transpose(1, 2)
    v = v_cache.index_select(0, flat).float().view(B, -1, n_kv, hd).transpose(1, 2)
    mask = batch.key_mask
    if window is not None:
        kpos = torch.arange(mask.shape[-1]).view(1, 1, 1, -1)
        mask = mask & (kpos > positions.view(-1, 1, 1, 1) - window)
    out = _attend(q.float().unsqueeze(2), k, v, mask, scale, softcap, q.shape[1] != n_kv)   # [B, H, 1, hd]
    return out.squeeze(2).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: AttentionBatch, scale: float, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Causal attention for each sequence's new tokens, over cached prefix + new, in torch.

    q: [T, H, hd]; k, v: [T, kvh, hd] (the new tokens, already written to the
    cache, with the values the cache holds: a 16-bit cache's, widened to q's dtype).
    Returns [T, H, hd]. A sequence with no cached prefix attends to its
    own k/v directly; one with a prefix gathers its context from the cache.

    The reference, and what a 16-bit model runs: an fp32 model's attention runs
    kernels/paged_attention.py, in the decode step's arithmetic. ``window`` (a sliding
    layer: ``window_mask``) and ``softcap`` (``_attend``) take an explicit mask.
    """
    out = torch.empty(q.shape, dtype=q.dtype)
    n_heads, n_kv = q.shape[1], k.shape[1]
    gqa = n_heads != n_kv
    plain = window is None and softcap is None
    for seq in batch.prefill:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        qs = q[rows].transpose(0, 1)                      # [H, q_len, hd]
        if seq.ctx_len == seq.q_len:
            ks = k[rows].transpose(0, 1)                  # [kvh, q_len, hd]
            vs = v[rows].transpose(0, 1)
        else:
            ks = gather_kv(k_cache, seq.block_table, seq.ctx_len).to(q.dtype).transpose(0, 1)
            vs = gather_kv(v_cache, seq.block_table, seq.ctx_len).to(q.dtype).transpose(0, 1)
        if seq.ctx_len == seq.q_len and plain:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # query i sits at absolute position prefix + i and sees keys <= it (in its window).
            prefix = seq.ctx_len - seq.q_len
            qpos = torch.arange(prefix, seq.ctx_len).unsqueeze(1)
            kpos = torch.arange(seq.ctx_len).unsqueeze(0)
            o = _attend(qs, ks, vs, window_mask(qpos, kpos, window), scale, softcap, gqa)
        out[rows] = o.transpose(0, 1)
    return out


def decode_key_mask(context_lens: list[int], max_blocks: int, block_size: int) -> torch.Tensor:
    """[B, 1, 1, max_blocks*block_size] bool: True where a key exists."""
    lens = torch.tensor(context_lens, dtype=torch.int64).unsqueeze(1)
    pos = torch.arange(max_blocks * block_size).unsqueeze(0)
    return (pos < lens).view(len(context_lens), 1, 1, -1)
