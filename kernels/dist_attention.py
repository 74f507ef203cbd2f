"""DistAttention (Infinite-LLM §4.2): attention over a sequence whose KV is in parts.

A sequence's keys are cut into chunks of ``KEY_CHUNK`` keys at fixed places
(chunk c: keys c * KEY_CHUNK .. (c + 1) * KEY_CHUNK - 1), the places the paged
attention kernel cuts them for every row (csrc/attention_rows.h). A *part* is
a range of whole chunks [lo, hi) held by one KV memory: this engine's blocks,
or blocks another engine lends. Its *micro-attention* leaves, per query row,
head and chunk::

    m = max_t s_t,   l = sum_t e^(s_t - m),   o = sum_t e^(s_t - m) v_t      s_t = (q . k_t) * scale

and the *scale-reduce* combines a row's chunks, gathered from every part, in
chunk order::

    M = max_c m_c,   a_c = e^(m_c - M),   out = (sum_c a_c o_c) / (sum_c a_c l_c)

Contract: parts cut at chunk boundaries (a part's length a multiple of
KEY_CHUNK keys, except the last part's) leave every chunk's results the bits
the unsplit kernel computes, and the combine reads them in the unsplit
kernel's order, so the output is ``PagedAttention.attend``'s bit for bit, in
2 parts or in 20, on whichever engine each part was computed. A sliding
window cuts only the row's first chunk, as it does unsplit.

The kernels are ``PagedAttention.partials`` and ``PagedAttention.combine``
(kernels/paged_attention.py); ``micro_attention_ref`` and ``combine_ref`` are
their torch references (fp32, any head size and GQA grouping), agreeing with
``F.scaled_dot_product_attention`` to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Keys a chunk: attention_rows.h's KEY_CHUNK. Parts are cut at multiples of it.
KEY_CHUNK = 128


@dataclass
class Partials:
    """Per-chunk results of a micro-attention: m, l [T, C, H], o [T, C, H, hd], fp32; a row's
    chunk c at slot c - lo of its sequence's part. A slot a row does not attend to holds
    m = -inf, l = 0, o = 0."""

    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor

    @classmethod
    def empty(cls, rows: int, slots: int, heads: int, head_dim: int) -> Partials:
        """Slots that hold no chunk yet (m = -inf, l = 0, o = 0)."""
        return cls(torch.full((rows, slots, heads), -torch.inf), torch.zeros(rows, slots, heads),
                   torch.zeros(rows, slots, heads, head_dim))

    def slots(self, rows: slice, at: int, width: int) -> Partials:
        """Views of slots ``at`` .. ``at`` + ``width`` of ``rows`` (``copy_`` into them is a
        ``place`` whose views are made once)."""
        return Partials(self.m[rows, at:at + width], self.l[rows, at:at + width], self.o[rows, at:at + width])

    def copy_(self, part: Partials) -> None:
        """Copy ``part``'s m, l and o into this one's (the same shapes)."""
        self.m.copy_(part.m)
        self.l.copy_(part.l)
        self.o.copy_(part.o)

    def place(self, part: Partials, rows: torch.Tensor | slice, at: int) -> None:
        """Copy ``part``'s slots into this one's slots ``at`` .. ``at`` + its width, for
        ``rows`` of this one (``part`` has one row per selected row): the parts of a
        sequence fill disjoint slot ranges of one gather."""
        width = part.m.shape[1]
        self.m[rows, at:at + width] = part.m
        self.l[rows, at:at + width] = part.l
        self.o[rows, at:at + width] = part.o


def chunks_of(keys: int) -> int:
    """Chunks that hold ``keys`` keys (the last one may be partial)."""
    return -(-keys // KEY_CHUNK)


def first_key(ctx: int, window: int | None) -> int:
    """The first key a row of ``ctx`` keys (its position + 1) attends to."""
    return ctx - window if window and ctx > window else 0


def micro_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: torch.Tensor,
                        tables: torch.Tensor, chunks: torch.Tensor, scale: float, slots: int,
                        window: int | None = None) -> Partials:
    """Torch reference of ``PagedAttention.partials`` (same arguments and result), in fp32:
    q [T, H, hd]; caches [N, bs, KVH, hd] fp32 or float16; seqs int64 [S, 3] (first row,
    rows, context length); tables [S, max_blocks]; chunks int64 [S, 2] (each sequence's
    part [lo, hi) in chunks)."""
    T, H, hd = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = Partials.empty(T, slots, H, hd)
    for (start, n, ctx), (lo, hi), table in zip(seqs.tolist(), chunks.tolist(), tables):
        k0, k1 = lo * KEY_CHUNK, min(hi * KEY_CHUNK, ctx)
        if n == 0 or k1 <= k0:
            continue
        pos = torch.arange(k0, k1)
        slot_ids = table[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, kvh, hd)[slot_ids].float().repeat_interleave(H // kvh, dim=1)   # [n_k, H, hd]
        v = v_cache.reshape(-1, kvh, hd)[slot_ids].float().repeat_interleave(H // kvh, dim=1)
        qpos = torch.arange(ctx - n, ctx)                                   # [n]
        s = torch.einsum("thd,khd->thk", q[start:start + n].float(), k) * scale     # [n, H, n_k]
        lo_key = torch.tensor([first_key(p + 1, window) for p in qpos.tolist()])
        keep = (pos[None, :] <= qpos[:, None]) & (pos[None, :] >= lo_key[:, None])   # [n, n_k]
        s = s.masked_fill(~keep[:, None, :], -torch.inf)
        width = hi - lo
        pad = width * KEY_CHUNK - (k1 - k0)
        s = torch.nn.functional.pad(s, (0, pad), value=-torch.inf).view(n, H, width, KEY_CHUNK)
        vv = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(width, KEY_CHUNK, H, hd)
        m = s.amax(dim=-1)                                                  # [n, H, width]
        e = torch.exp(s - m.clamp(min=torch.finfo(torch.float32).min).unsqueeze(-1))   # an empty chunk: e = 0
        l = e.sum(dim=-1)
        o = torch.einsum("nhck,ckhd->nchd", e, vv)                          # [n, width, H, hd]
        out.m[start:start + n, :width] = m.transpose(1, 2)
        out.l[start:start + n, :width] = l.transpose(1, 2)
        out.o[start:start + n, :width] = o
    return out


def combine_ref(parts: Partials, seqs: torch.Tensor, chunk_lo: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
    """Torch reference of ``PagedAttention.combine``: each row's attention [T, H, hd] from the
    slots of its chunks (first_key(p + 1) // KEY_CHUNK .. p // KEY_CHUNK, less chunk_lo of its
    sequence), by scale-reduce."""
    T, C, H, hd = parts.o.shape
    out = torch.zeros(T, H, hd)
    for (start, n, ctx), lo in zip(seqs.tolist(), chunk_lo.tolist()):
        for i in range(n):
            row, p = start + i, ctx - n + i
            a, b = first_key(p + 1, window) // KEY_CHUNK - lo, p // KEY_CHUNK + 1 - lo
            if a < 0 or b > C:
                raise ValueError(f"row {row}'s chunks fall outside its {C} slots")
            m, l, o = parts.m[row, a:b], parts.l[row, a:b], parts.o[row, a:b]   # [c, H], [c, H], [c, H, hd]
            scale = torch.exp(m - m.amax(dim=0))                                # [c, H]
            out[row] = (scale.unsqueeze(-1) * o).sum(dim=0) / (scale * l).sum(dim=0).unsqueeze(-1)
    return out
