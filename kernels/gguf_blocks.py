"""GGUF block formats beyond Q4_0 / Q4_1 / Q8_0, decoded to one form: sub-blocks.

Every format here stores a row as blocks whose weights are, per sub-block of
``size`` consecutive weights (16 or 32),

    w = scale * q - min            (``min`` absent: w = scale * q)

with ``q`` a small integer (|q| <= 127) and ``scale``, ``min`` fp32 values that are
exact products of the file's fp16 super-block scales and its small integer
sub-block scales (at most 11 + 8 significant bits: exact in fp32). ``decode``
returns that form (``SubBlocks``); ``SubBlocks.dequantize`` evaluates it with the
operations, in the order, that gguf-py's ``gguf.quants.dequantize`` uses, so the
result is its result bit for bit (tests/kernels/test_gguf_blocks.py holds this).
The same form is what a load-time repack into a served block format reads
(kernels/kquant_repack.py).

The layouts (ggml's ``block_*`` structs, QK_K = 256 weights per super-block)::

    Q5_0    22 B / 32   fp16 d, u32 qh, 16 B nibbles         w = d * (q5 - 16)
    Q5_1    24 B / 32   fp16 d, fp16 m, u32 qh, 16 B         w = d * q5 + m
    IQ4_NL  18 B / 32   fp16 d, 16 B nibbles                 w = d * kvalues[q4]
    Q2_K    84 B / 256  16 B scales (lo: sc, hi: m), 64 B 2-bit q, fp16 d, fp16 dmin
    Q3_K   110 B / 256  32 B hmask, 64 B 2-bit q, 12 B 6-bit scales, fp16 d
    Q4_K   144 B / 256  fp16 d, fp16 dmin, 12 B 6-bit sc/m, 128 B nibbles
    Q5_K   176 B / 256  fp16 d, fp16 dmin, 12 B 6-bit sc/m, 32 B qh, 128 B nibbles
    Q6_K   210 B / 256  128 B low nibbles, 64 B 2-bit highs, 16 x int8 scales, fp16 d
    IQ4_XS 136 B / 256  fp16 d, u16 scales_h, 4 B scales_l, 128 B nibbles

Pure torch on whole tensors: no loop over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256

# format -> (weights per block, bytes per block)
BLOCKS = {
    "Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210), "IQ4_XS": (QK_K, 136),
}
# format -> byte offsets in a block of its fp16 fields (d, then dmin / m where it has one)
HALF_FIELDS = {
    "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
}
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class SubBlocks:
    """A ``[rows, cols]`` matrix as ``w = scale * q - min`` per sub-block of ``size``.

    q: int8 ``[rows, cols]``; scale, min: fp32 ``[rows, cols / size]`` (min None when
    the format has none). ``dequantize`` gives gguf-py's values bit for bit.

    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS also keep the factors (``factors``: scale = d * sc, min =
    dmin * mn): d, dmin fp32 ``[rows, cols / 256]`` (the file's fp16 values), sc, mn
    int16 ``[rows, cols / size]`` (its sub-block integers); None for the other formats.
    """

    size: int
    scale: torch.Tensor
    q: torch.Tensor
    min: torch.Tensor | None
    factors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None = None

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[rows, cols]``."""
        rows, cols = self.q.shape
        q = self.q.float().view(rows, cols // self.size, self.size)
        w = self.scale.unsqueeze(-1) * q
        if self.min is not None:
            w = w - self.min.unsqueeze(-1)
        return w.view(rows, cols)


def row_bytes(fmt: str, cols: int) -> int:
    """Bytes of one row of ``cols`` weights in ``fmt``; ValueError when ``cols`` is not
    a whole number of blocks."""
    per, nbytes = BLOCKS[fmt]
    if cols < 1 or cols % per:
        raise ValueError(f"{fmt} rows need a positive multiple of {per} weights, got {cols}")
    return cols // per * nbytes


def dequantize(fmt: str, data: torch.Tensor, cols: int) -> torch.Tensor:
    """fp32 ``[rows, cols]`` of uint8 ``data`` ``[rows, row_bytes(fmt, cols)]``."""
    return decode(fmt, data, cols).dequantize()


def decode(fmt: str, data: torch.Tensor, cols: int) -> SubBlocks:
    """uint8 ``data`` ``[rows, row_bytes(fmt, cols)]`` (the file's bytes, rows in order)
    as ``SubBlocks``. ValueError for another format or bytes that do not fit."""
    if fmt not in BLOCKS:
        raise ValueError(f"no decoder for GGUF type {fmt} (have: {', '.join(BLOCKS)})")
    per, nbytes = BLOCKS[fmt]
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes(fmt, cols):
        raise ValueError(f"{fmt} rows of {cols} weights need uint8 [rows, {row_bytes(fmt, cols)}], "
                         f"got {data.dtype} {list(data.shape)}")
    rows = data.shape[0]
    blocks = data.contiguous().view(rows * (cols // per), nbytes)        # [B, nbytes]
    sub = _DECODERS[fmt](blocks)
    nsub = cols // sub.size
    factors = None
    if sub.factors is not None:
        factors = tuple(None if f is None else f.reshape(rows, -1) for f in sub.factors)
    return SubBlocks(sub.size, sub.scale.reshape(rows, nsub), sub.q.reshape(rows, cols),
                     None if sub.min is None else sub.min.reshape(rows, nsub), factors)


# ------------------------------------------------------------------ helpers
def _f16(b: torch.Tensor) -> torch.Tensor:
    """[B, 2] uint8 -> [B, 1] fp32 (a little-endian fp16 field)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, n, 16*k] bytes -> [B, n, 2, 16*k]: low nibbles, then high nibbles."""
    return torch.stack([qs & 15, qs >> 4], dim=-2)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[B, n] bytes -> [B, count, n]: bit j of each byte at index j (j < count)."""
    shifts = torch.arange(count, dtype=torch.uint8).view(1, count, 1)
    return (b.unsqueeze(1) >> shifts) & 1


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> [B, 8] each (uint8)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q5_32(d_and_m: int, blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: the 32 five-bit values [B, 32] (uint8), weights 0..31 in order."""
    qh = blocks[:, d_and_m:d_and_m + 4]                                 # u32, little-endian
    high = _bits(qh, 8).transpose(1, 2).reshape(-1, 32)                 # bit j of the u32 -> weight j
    low = _nibbles(blocks[:, d_and_m + 4:].unsqueeze(1)).reshape(-1, 32)
    return low | (high << 4)


# ------------------------------------------------------------------ decoders: [B, nbytes] -> per-block SubBlocks
def _q5_0(b: torch.Tensor) -> SubBlocks:
    q = (_q5_32(2, b).to(torch.int8) - 16)
    return SubBlocks(32, _f16(b[:, 0:2]), q, None)


def _q5_1(b: torch.Tensor) -> SubBlocks:
    # min = -m: d q - (-m) is d q + m bit for bit (IEEE), gguf-py's order
    return SubBlocks(32, _f16(b[:, 0:2]), _q5_32(4, b).to(torch.int8), -_f16(b[:, 2:4]))


def _iq4_values(nib: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_KVALUES, dtype=torch.int8)[nib.long()]


def _iq4_nl(b: torch.Tensor) -> SubBlocks:
    q = _iq4_values(_nibbles(b[:, 2:].unsqueeze(1)).reshape(-1, 32))
    return SubBlocks(32, _f16(b[:, 0:2]), q, None)


def _q2_k(b: torch.Tensor) -> SubBlocks:
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    q = ((qs.view(n, 2, 1, 32) >> shifts) & 3).reshape(n, QK_K)         # [half][shift][32]
    sc, mn = scales & 0xF, scales >> 4
    return SubBlocks(16, d * sc.float(), q.to(torch.int8), dmin * mn.float(),
                     (d, dmin, sc.to(torch.int16), mn.to(torch.int16)))


def _q3_k(b: torch.Tensor) -> SubBlocks:
    n = b.shape[0]
    hmask, qs, s, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = torch.stack([s[:, 0:8] & 15, s[:, 0:8] >> 4], dim=1).reshape(n, 16)
    high = torch.stack([(s[:, 8:12] >> sh) & 3 for sh in (0, 2, 4, 6)], dim=1).reshape(n, 16)
    sc = (low | (high << 4)).to(torch.int8) - 32
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    ql = ((qs.view(n, 2, 1, 32) >> shifts) & 3).reshape(n, QK_K)
    hm = _bits(hmask, 8).reshape(n, QK_K) ^ 1                           # offset 4 when the bit is clear
    q = ql.to(torch.int8) - (hm << 2).to(torch.int8)
    return SubBlocks(16, d * sc.float(), q, None, (d, None, sc.to(torch.int16), None))


def _q45_k(b: torch.Tensor, five: bool) -> SubBlocks:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qs = b[:, 48:176] if five else b[:, 16:144]
    q = _nibbles(qs.view(n, 4, 32)).reshape(n, QK_K)                   # chunk i: sub-blocks 2i (lo), 2i+1 (hi)
    if five:
        q = q | (_bits(b[:, 16:48], 8).reshape(n, QK_K) << 4)           # bit j of qh[l] -> sub-block j, weight l
    return SubBlocks(32, d * sc.float(), q.to(torch.int8), dmin * mn.float(),
                     (d, dmin, sc.to(torch.int16), mn.to(torch.int16)))


def _q6_k(b: torch.Tensor) -> SubBlocks:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc, d = b[:, 192:208].contiguous().view(torch.int8), _f16(b[:, 208:210])
    low = _nibbles(ql.view(n, 2, 64)).reshape(n, 2, 4, 32)              # per half: 64 low nibbles, 64 high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (qh.view(n, 2, 1, 32) >> shifts) & 3                          # [half, 4, 32]
    q = (low | (high << 4)).to(torch.int8) - 32
    return SubBlocks(16, d * sc.float(), q.reshape(n, QK_K), None, (d, None, sc.to(torch.int16), None))


def _iq4_xs(b: torch.Tensor) -> SubBlocks:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sl = b[:, 4:8]
    low = torch.stack([sl & 15, sl >> 4], dim=-1).reshape(n, 8).to(torch.int32)
    high = (sh >> torch.arange(0, 16, 2, dtype=torch.int32).view(1, 8)) & 3
    sc = (low | (high << 4)) - 32
    q = _iq4_values(_nibbles(b[:, 8:].view(n, 8, 16)).reshape(n, QK_K))
    return SubBlocks(32, d * sc.float(), q, None, (d, None, sc.to(torch.int16), None))


_DECODERS = {
    "Q5_0": _q5_0, "Q5_1": _q5_1, "IQ4_NL": _iq4_nl, "Q2_K": _q2_k, "Q3_K": _q3_k,
    "Q4_K": lambda b: _q45_k(b, five=False), "Q5_K": lambda b: _q45_k(b, five=True),
    "Q6_K": _q6_k, "IQ4_XS": _iq4_xs,
}
