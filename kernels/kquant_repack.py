"""The K-quants and their kin, repacked at load into block formats the kernels serve.

A GGUF tensor of a kernels/gguf_blocks.py format, decoded to ``SubBlocks``
(``w = scale * q - min`` per sub-block of 16 or 32), becomes a ``QuantTensor``
(kernels/quant.py) in one of::

    Q4_K          -> KS4   the file's super-block, sub-block scales as bytes   every weight kept
    Q5_K          -> KS5   the same, 5-bit quants                              every weight kept
    Q6_K          -> KS6   the file's super-block, fields regrouped             every weight kept
    Q2_K          -> KS2   the file's super-block, fields regrouped             every weight kept
    Q3_K          -> KS3   the file's super-block, scales as bytes (4 B more)   every weight kept
    Q5_0, Q5_1    -> KQ5_0, KQ5_1  the file's block, qh bits reordered (its size)
    IQ4_NL        -> KI4   the file's block                                     every weight kept
    IQ4_XS        -> KSI4  the file's super-block, scales as bytes (2 B more)   every weight kept

"Kept" means the kernel computes with the file's weights: a sub-block's scale and
min are exact fp32 products of the file's fp16 and integer scales, the quants
are the file's integers (KQ5_0's ``d (q - 16)`` as the file computes it), so
``QuantTensor.dequantize`` is gguf-py's dequantization bit for bit.

``NATIVE`` are the types repacked (all of them, each into a layout of its own).
"""

from __future__ import annotations

import torch

from kernels.gguf_blocks import BLOCKS, SubBlocks
from kernels.quant import BLOCK, FORMATS, IQ4_VALUES, QuantTensor

# GGUF type -> the served format it is repacked into
TARGET = {"Q4_K": "KS4", "Q5_K": "KS5", "Q5_1": "KQ5_1", "Q5_0": "KQ5_0", "Q6_K": "KS6",
          "Q2_K": "KS2", "Q3_K": "KS3", "IQ4_NL": "KI4", "IQ4_XS": "KSI4"}
NATIVE = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")


def repack(fmt: str, sub: SubBlocks) -> QuantTensor:
    """``sub`` (decoded from a ``fmt`` tensor ``[rows, cols]``) as a ``QuantTensor`` in the
    rows layout of ``TARGET[fmt]``."""
    return repack_to(TARGET[fmt], sub)


def repack_to(target: str, sub: SubBlocks) -> QuantTensor:
    """``sub`` as a ``QuantTensor`` in the rows layout of ``target``, every weight kept (a
    KS target needs ``sub.factors``, the others a sub-block of 32)."""
    rows, cols = sub.q.shape
    nb = cols // BLOCK
    if target in ("KS4", "KS5", "KS6", "KS2", "KS3", "KSI4"):
        data = _super_blocks(target, sub)
        return QuantTensor(target, (rows, cols), data.reshape(rows, -1).contiguous())
    if target == "KI4":                                         # IQ4_NL's block: fp16 d, nibbles
        q = _iq4_index(sub.q.view(rows, nb, 32))
        body = [_f16(sub.scale.view(rows, nb, 1)), q[..., :16] | (q[..., 16:] << 4)]
    elif target in ("KQ5_0", "KQ5_1"):                          # fp16 d (, m), hbits, nibbles
        q = (sub.q.view(rows, nb, 32).to(torch.int16) + (16 if target == "KQ5_0" else 0)).to(torch.uint8)
        body = [_f16(sub.scale.view(rows, nb, 1))]
        if target == "KQ5_1":
            body.append(_f16(-sub.min.view(rows, nb, 1)))
        lo = q & 15
        body += [_hbits(q >> 4), lo[..., :16] | (lo[..., 16:] << 4)]
    else:
        raise ValueError(f"no repack into {target!r} (have: {', '.join(sorted(set(TARGET.values())))})")
    data = torch.cat(body, dim=-1).reshape(rows, nb * FORMATS[target].block_bytes)
    return QuantTensor(target, (rows, cols), data.contiguous())


def _super_blocks(target: str, sub: SubBlocks) -> torch.Tensor:
    """uint8 [rows, nsup, block_bytes] of a KS format (kernels/quant.py) from a Q4_K / Q5_K
    / Q6_K / Q2_K / Q3_K / IQ4_XS tensor's sub-blocks and factors."""
    rows, cols = sub.q.shape
    ns = cols // 256
    d, dmin, sc, mn = sub.factors
    if target == "KSI4":
        q = _iq4_index(sub.q.view(rows, ns, 8, 32))
        nibbles = (q[..., :16] | (q[..., 16:] << 4)).reshape(rows, ns, 128)
        return torch.cat([_f16(d.view(rows, ns, 1)), sc.view(rows, ns, 8).to(torch.int8).view(torch.uint8), nibbles],
                         dim=-1)
    if target == "KS3":                 # q + 4: 2 low bits as KS2's, the third in hbits
        q = (sub.q.view(rows, ns, 8, 32).to(torch.int16) + 4).to(torch.uint8)            # 0..7
        subs = torch.cat([_hbits(q >> 2), _two_bit_bytes(q & 3)], dim=-1).reshape(rows, ns, 96)
        return torch.cat([_f16(d.view(rows, ns, 1)), sc.view(rows, ns, 16).to(torch.int8).view(torch.uint8), subs],
                         dim=-1)
    if target == "KS2":
        quants = _two_bit_bytes(sub.q.view(rows, ns, 8, 32).to(torch.uint8)).reshape(rows, ns, 64)
        scm = (sc.view(rows, ns, 16) | (mn.view(rows, ns, 16) << 4)).to(torch.uint8)
        return torch.cat([_f16(d.view(rows, ns, 1)), _f16(dmin.view(rows, ns, 1)), scm, quants], dim=-1)
    if target == "KS6":
        q = (sub.q.view(rows, ns, 8, 32).to(torch.int16) + 32).to(torch.uint8)          # 0..63
        lo, hb = q & 15, (q >> 4) ^ 2
        u, j = torch.arange(4).view(4, 1), torch.arange(2).view(1, 2)
        first = hb[..., 4 * u + j] | (hb[..., 4 * u + 16 + j] << 2)                      # t = 2u
        second = hb[..., 4 * u + 2 + j] | (hb[..., 4 * u + 18 + j] << 2)                 # t = 2u + 1
        highs = (first | (second << 4)).reshape(rows, ns, 8, 8)
        subs = torch.cat([lo[..., :16] | (lo[..., 16:] << 4), highs], dim=-1).reshape(rows, ns, -1)
        head = [_f16(d.view(rows, ns, 1)), sc.view(rows, ns, 16).to(torch.int8).view(torch.uint8)]
        return torch.cat([*head, subs], dim=-1)
    q = sub.q.view(rows, ns, 8, 32).to(torch.uint8)
    lo = q & 15
    nibbles = lo[..., :16] | (lo[..., 16:] << 4)
    subs = torch.cat([_hbits(q >> 4), nibbles], dim=-1) if target == "KS5" else nibbles
    scm = torch.stack([sc.view(rows, ns, 8), mn.view(rows, ns, 8)], dim=-1).to(torch.uint8).view(rows, ns, 16)
    return torch.cat([_f16(d.view(rows, ns, 1)), _f16(dmin.view(rows, ns, 1)), scm, subs.reshape(rows, ns, -1)],
                     dim=-1)


def _iq4_index(v: torch.Tensor) -> torch.Tensor:
    """int8 IQ4 values -> the nibbles (uint8) that index them in IQ4_VALUES."""
    index = torch.zeros(256, dtype=torch.uint8)
    index[torch.tensor(IQ4_VALUES) + 128] = torch.arange(16, dtype=torch.uint8)
    return index[v.long() + 128]


def _two_bit_bytes(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] quants 0..3 -> a KS2 / KS3 sub-block's 8 bytes [..., 8]: byte 2u + j, bits 2e:
    weight 2 (u + 4e) + j."""
    u, j, e = torch.arange(4).view(4, 1, 1), torch.arange(2).view(1, 2, 1), torch.arange(4).view(1, 1, 4)
    parts = q[..., (2 * (u + 4 * e) + j).reshape(-1)].view(*q.shape[:-1], 8, 4) << (2 * e.view(4)).to(torch.uint8)
    return parts.sum(dim=-1, dtype=torch.uint8)                         # disjoint bits: the sum is their or


def _f16(t: torch.Tensor) -> torch.Tensor:
    """fp32 [..., n] of fp16 values (the file's scales, exact) -> their fp16 bytes [..., 2 n]."""
    return t.contiguous().to(torch.float16).view(torch.uint8)


def _hbits(h: torch.Tensor) -> torch.Tensor:
    """[rows, nb, 32] high bits (0/1) -> the u32 hbits [rows, nb, 4] (quant_blocks.h's
    order: weight 2t at bit t, 2t + 16 at 8 + t, 2t + 1 at 16 + t, 2t + 17 at 24 + t)."""
    t = torch.arange(8)
    order = torch.cat([2 * t, 2 * t + 16, 2 * t + 1, 2 * t + 17])      # bit b holds weight order[b]
    bits = h[..., order].to(torch.int64) << torch.arange(32)
    return bits.sum(dim=-1, keepdim=True).view(torch.uint8)[..., :4]       # the low 4 bytes
