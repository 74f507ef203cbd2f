"""Block-quantized matrices: GGUF's Q4_0, Q4_1, Q8_0 as the file stores them, and
kvd's KQ5_0, KQ5_1, KI4, KS4, KS5, KS6, KS2, KS3, KSI4 that the K-quants, the Q5 and the
IQ4 types are repacked into at load (kernels/kquant_repack.py).

A ``QuantTensor`` is a matrix ``[rows, cols]`` whose every row is
``cols / 32`` blocks of 32 weights in one of these block formats::

    Q4_0  18 B / 32 weights  fp16 d, 16 B nibbles      w = d * (q - 8)
    Q4_1  20 B / 32 weights  fp16 d, fp16 m, 16 B      w = d * q + m
    Q8_0  34 B / 32 weights  fp16 d, 32 x int8         w = d * q
    KQ5_0 22 B / 32 weights  fp16 d, u32 hbits, 16 B             w = d * (q + 16 h - 16)
    KQ5_1 24 B / 32 weights  fp16 d, fp16 m, u32 hbits, 16 B     w = d * (q + 16 h) + m
    KS4  148 B / 256 weights fp16 d, dmin, 8 x (u8 sc, m), 8 x 16 B        w = (d sc) q - dmin m
    KS5  180 B / 256 weights the same, 8 x (u32 hbits, 16 B)
    KS6  210 B / 256 weights fp16 d, 16 x int8 sc, 8 x (16 B, 8 B highs)   w = (d sc) (q - 32) per 16
    KS2   84 B / 256 weights fp16 d, dmin, 16 x u8 (sc | m << 4), 8 x 8 B   w = (d sc) q - dmin m per 16
    KS3  114 B / 256 weights fp16 d, 16 x int8 sc, 8 x (u32 hbits, 8 B)    w = (d sc) (q + 4 h - 4) per 16
    KI4   18 B / 32 weights  fp16 d, 16 B nibbles                          w = d * v[q]
    KSI4 138 B / 256 weights fp16 d, 8 x int8 sc, 8 x 16 B                 w = (d sc) v[q] per 32

(v: IQ4_NL / IQ4_XS's 16 values, ``IQ4_VALUES``)

(the KS formats: Q4_K / Q5_K / Q6_K / Q2_K / Q3_K super-blocks, every field a 2-byte word; their
sub-block scales are fp32 products the kernels form in registers, exact, so they
compute with the file's values; quant_blocks.h draws KS6's highs and KS2 / KS3's 2-bit quants)

(in a 4- or 5-bit block, byte j holds weight j in its low nibble and weight j + 16 in
its high nibble; the hbits order of KQ5_0, KQ5_1 and KS5 is kernels/csrc/quant_blocks.h's:
KQ5_0 / KQ5_1 are ggml's Q5_0 / Q5_1 blocks with their qh bits in that order). The bytes are held in a ``uint8`` tensor in one of two
layouts:

- ``rows`` (the file's): ``[rows, row_bytes]``, so a row permutation or a
  concatenation of rows is a plain tensor op on whole rows of blocks;
- ``x8`` (the kernels', ``pack()``): rows in groups of 8, the last padded with
  zero blocks, ``[ceil(rows / 8), 8 * row_bytes]``; for each group and block the
  8 rows' blocks transposed as 2-byte words (word i of rows 0..7, then word
  i + 1). The same bytes, reordered so that one vector load holds a word of 8
  rows (kernels/csrc/quant_gemm.h says what the kernels make of it).

``dequantize`` is the torch reference: it gives bit for bit what gguf-py's
``gguf.quants.dequantize`` gives for the file's tensor (every ``d * q`` is exact in
fp32, so the only rounding is the ``+ m``). The kernels (kernels/quant_linear.py)
compute with exactly these weight values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.weight_arena import WeightArena

BLOCK = 32                      # weights per block (a KS super-block: 8 of them)
GROUP = 8                       # rows per group in the x8 layout
ROWS, X8 = "rows", "x8"         # layouts


@dataclass(frozen=True)
class BlockFormat:
    """One ggml block format: its name, the kernel's code for it, bytes per block."""

    name: str
    code: int                   # enum Format in kernels/csrc/quant_blocks.h
    block_bytes: int
    weights: int = BLOCK        # weights per block

    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / self.weights


FORMATS = {f.name: f for f in (BlockFormat("Q4_0", 0, 18), BlockFormat("Q4_1", 1, 20),
                                BlockFormat("Q8_0", 2, 34), BlockFormat("KQ5_0", 3, 22),
                                BlockFormat("KQ5_1", 4, 24), BlockFormat("KI4", 5, 18),
                                BlockFormat("KS4", 6, 148, weights=256), BlockFormat("KS5", 7, 180, weights=256),
                                BlockFormat("KS6", 8, 210, weights=256), BlockFormat("KS2", 9, 84, weights=256),
                                BlockFormat("KS3", 10, 114, weights=256), BlockFormat("KSI4", 11, 138, weights=256))}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# the formats a GGUF file stores (the others are kvd's, made at load)
GGUF_FORMATS = ("Q4_0", "Q4_1", "Q8_0")


class QuantTensor:
    """A ``[rows, cols]`` matrix in a GGUF block format (see the module docstring).

    ``data``: uint8 in ``layout`` (the module docstring): ``[rows, cols / 32 *
    block_bytes]`` for ``rows``, ``[ceil(rows / 8), 8 * cols / 32 * block_bytes]``
    for ``x8``; contiguous, not copied, treat it as read-only. Raises
    ``ValueError`` when the bytes do not fit the shape, format and layout, so a
    truncated or mislabelled tensor fails at load.
    """

    __slots__ = ("fmt", "shape", "data", "layout")

    def __init__(self, fmt: BlockFormat | str, shape: tuple[int, int], data: torch.Tensor,
                 layout: str = ROWS) -> None:
        fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
        rows, cols = (int(s) for s in shape)
        if rows < 1 or cols < 1 or cols % fmt.weights:
            raise ValueError(f"{fmt.name} matrix [{rows}, {cols}]: rows must be >= 1 and cols a positive "
                             f"multiple of {fmt.weights}")
        row_bytes = cols // fmt.weights * fmt.block_bytes
        if layout == ROWS:
            want = (rows, row_bytes)
        elif layout == X8:
            want = (-(-rows // GROUP), GROUP * row_bytes)
        else:
            raise ValueError(f"unknown layout {layout!r} (expected {ROWS!r} or {X8!r})")
        if data.dtype != torch.uint8 or tuple(data.shape) != want:
            raise ValueError(f"{fmt.name} matrix [{rows}, {cols}] in layout {layout} needs uint8 bytes "
                             f"{list(want)}, got {data.dtype} {list(data.shape)}")
        self.fmt, self.shape, self.data, self.layout = fmt, (rows, cols), data.contiguous(), layout

    def __repr__(self) -> str:
        return f"QuantTensor({self.fmt.name}, {list(self.shape)}{', x8' if self.layout == X8 else ''})"

    def pack(self, arena: WeightArena | None = None) -> QuantTensor:
        """This matrix in the x8 layout (itself when it is): the same bytes reordered,
        plus zero blocks padding the last group of 8 rows; held in memory from
        ``arena`` (kernels/weight_arena.py), or torch's when None."""
        if self.layout == X8:
            return self
        rows, cols = self.shape
        groups, nb = -(-rows // GROUP), cols // self.fmt.weights
        data = self.data
        if groups * GROUP != rows:
            data = torch.cat([data, data.new_zeros(groups * GROUP - rows, data.shape[1])])
        blocks = data.view(groups, GROUP, nb, self.fmt.block_bytes)
        packed = (torch.empty(groups * GROUP * data.shape[1], dtype=torch.uint8) if arena is None
                  else arena.take(groups * GROUP * data.shape[1])).view(groups, nb, GROUP * self.fmt.block_bytes)
        words = blocks.view(groups, GROUP, nb, self.fmt.block_bytes // 2, 2)   # -> [g, nb, words, 8, 2]
        packed.view(groups, nb, self.fmt.block_bytes // 2, GROUP, 2).copy_(words.permute(0, 2, 3, 1, 4))
        return QuantTensor(self.fmt, self.shape, packed.view(groups, -1), X8)

    def unpack(self) -> QuantTensor:
        """This matrix in the rows layout (itself when it is): ``pack``'s inverse."""
        if self.layout == ROWS:
            return self
        rows, cols = self.shape
        groups, nb, bb = self.data.shape[0], cols // self.fmt.weights, self.fmt.block_bytes
        words = self.data.view(groups, nb, bb // 2, GROUP, 2)
        blocks = torch.empty(groups, GROUP, nb, bb, dtype=torch.uint8)
        blocks.view(groups, GROUP, nb, bb // 2, 2).copy_(words.permute(0, 3, 1, 2, 4))
        return QuantTensor(self.fmt, self.shape, blocks.view(groups * GROUP, -1)[:rows])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[rows, cols]``, equal to gguf-py's dequantize bit for bit."""
        return _dequantize(self.fmt, self.unpack().data, self.shape[1])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 ``[len(ids), cols]``: rows ``ids`` only (an embedding lookup)."""
        return _dequantize(self.fmt, self.unpack().data.index_select(0, ids), self.shape[1])

    def take_rows(self, index: torch.Tensor) -> QuantTensor:
        """The matrix whose row i is this one's row ``index[i]`` (a row permutation);
        rows layout only (ValueError otherwise)."""
        if self.layout != ROWS:
            raise ValueError("take_rows needs the rows layout")
        return QuantTensor(self.fmt, (len(index), self.shape[1]), self.data.index_select(0, index))

    @staticmethod
    def cat_rows(parts: list[QuantTensor]) -> QuantTensor:
        """Rows of ``parts`` one after another; all of one format and width, in the
        rows layout."""
        fmt, cols = parts[0].fmt, parts[0].shape[1]
        if any(p.fmt != fmt or p.shape[1] != cols or p.layout != ROWS for p in parts):
            raise ValueError("cat_rows needs parts of one format and one width, in the rows layout")
        return QuantTensor(fmt, (sum(p.shape[0] for p in parts), cols), torch.cat([p.data for p in parts]))


def _dequantize(fmt: BlockFormat, data: torch.Tensor, cols: int) -> torch.Tensor:
    rows = data.shape[0]
    blocks = data.view(rows, cols // fmt.weights, fmt.block_bytes)    # [R, nb, block_bytes]

    def half(at: int) -> torch.Tensor:                                 # fp16 field -> fp32 [R, nb, 1]
        return blocks[..., at:at + 2].contiguous().view(torch.float16).float()

    if fmt.name in ("KS4", "KS5", "KS6", "KS2", "KS3", "KSI4"):
        return _dequantize_ks(fmt.name, blocks).reshape(rows, cols)
    d = half(0)
    if fmt.name in ("KQ5_0", "KQ5_1"):
        at = 2 if fmt.name == "KQ5_0" else 4                           # the hbits
        q = _five_bits(blocks[..., at:at + 4], blocks[..., at + 4:])
        return (d * (q - 16) if fmt.name == "KQ5_0" else d * q + half(2)).reshape(rows, cols)
    if fmt.name == "KI4":
        return (d * _iq4(blocks[..., 2:])).reshape(rows, cols)
    if fmt.name == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()      # [R, nb, 32]
        w = q * d
    else:
        qs = blocks[..., 4:] if fmt.name == "Q4_1" else blocks[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()              # weights 0..15, then 16..31
        w = d * q + half(2) if fmt.name == "Q4_1" else d * (q - 8)
    return w.reshape(rows, cols)


def _five_bits(hbits: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """[R, nb, 4] u32 hbits (quant_blocks.h's order) and [R, nb, 16] nibbles -> the 32
    five-bit quants as fp32 [R, nb, 32], weights in order."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).float() + 16 * _high_bits(hbits)


def _iq4(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] nibbles -> the 32 IQ4 values they index, fp32 [..., 32], weights in order."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32)[torch.cat([qs & 15, qs >> 4], dim=-1).long()]


def _high_bits(hbits: torch.Tensor) -> torch.Tensor:
    """[R, nb, 4] u32 hbits (quant_blocks.h's order) -> each weight's bit, fp32 [R, nb, 32]."""
    h = hbits.clone(memory_format=torch.contiguous_format).view(torch.int32)   # [R, nb, 1]
    bit = torch.arange(32, dtype=torch.int32)                           # hbits bit of weight i:
    j = torch.where(bit < 16, bit, bit - 16)                            # i < 16: t = i // 2, odd i: +16
    at = (j // 2) + 16 * (j % 2) + 8 * (bit >= 16)
    return ((h >> at) & 1).float()


def _two_bits(qs: torch.Tensor) -> torch.Tensor:
    """[..., 8] bytes of a KS2 / KS3 sub-block -> its 32 2-bit quants [..., 32] (uint8): weight
    2t + j in byte 2 (t % 4) + j, bits 2 (t // 4)."""
    i = torch.arange(32)
    t = i // 2
    return (qs[..., 2 * (t % 4) + i % 2] >> (2 * (t // 4)).to(torch.uint8)) & 3


def _dequantize_ks(name: str, blocks: torch.Tensor) -> torch.Tensor:
    """[R, nb, block_bytes] of a KS format -> fp32 [R, nb, 8, 32] (gguf-py's operations:
    (d sc) q, then - dmin m)."""
    rows, nb = blocks.shape[:2]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()           # [R, nb, 1]
    if name == "KS2":                       # (d sc) q - (dmin m) per 16 weights
        dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
        scm = blocks[..., 4:20]                                             # [R, nb, 16]
        q = _two_bits(blocks[..., 20:].reshape(rows, nb, 8, 8))
        dl, ml = d * (scm & 15).float(), dmin * (scm >> 4).float()         # [R, nb, 16]
        w = dl.unsqueeze(-1) * q.reshape(rows, nb, 16, 16).float() - ml.unsqueeze(-1)
        return w.view(rows, nb, 8, 32)
    if name == "KSI4":                      # (d sc) v[q] per 32 weights
        sc = blocks[..., 2:10].contiguous().view(torch.int8).float()        # [R, nb, 8]
        return (d * sc).unsqueeze(-1) * _iq4(blocks[..., 10:].reshape(rows, nb, 8, 16))
    if name == "KS3":                       # (d sc) (q + 4 h - 4) per 16 weights
        sc = blocks[..., 2:18].contiguous().view(torch.int8).float()        # [R, nb, 16]
        sub = blocks[..., 18:].reshape(rows, nb, 8, 12)
        q = _two_bits(sub[..., 4:]).float() + 4 * _high_bits(sub[..., :4]) - 4          # [R, nb, 8, 32]
        return ((d * sc).unsqueeze(-1) * q.reshape(rows, nb, 16, 16)).view(rows, nb, 8, 32)
    if name == "KS6":
        sc = blocks[..., 2:18].contiguous().view(torch.int8).float().view(rows, nb, 8, 2, 1)
        sub = blocks[..., 18:].reshape(rows, nb, 8, 24)
        qs, hb = sub[..., :16], sub[..., 16:]                               # [R, nb, 8, 16], [.., 8]
        t = torch.arange(16) // 2
        byte = hb[..., 2 * (t // 2) + torch.arange(16) % 2] >> (4 * (t % 2)).to(torch.uint8)
        high = torch.cat([(byte & 3) ^ 2, ((byte >> 2) & 3) ^ 2], dim=-1).float()
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float() + 16 * high - 32   # [R, nb, 8, 32]
        return (d.view(rows, nb, 1, 1, 1) * sc * q.view(rows, nb, 8, 2, 16)).view(rows, nb, 8, 32)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    scm = blocks[..., 4:20].reshape(rows, nb, 8, 2).float()
    scale, mins = d.unsqueeze(-1) * scm[..., 0:1], dmin.unsqueeze(-1) * scm[..., 1:2]   # [R, nb, 8, 1]
    sub = blocks[..., 20:].reshape(rows, nb, 8, -1)
    if name == "KS5":
        q = _five_bits(sub[..., :4], sub[..., 4:])
    else:
        q = torch.cat([sub & 15, sub >> 4], dim=-1).float()
    return scale * q - mins
