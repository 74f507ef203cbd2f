"""GGUF block-quantized matmul (kernels/quant.py, kernels/quant_linear.py, csrc/quant_matmul.cpp).

The kernel of this host is exercised, never skipped: ``HOST`` is the build
the engine would pick here (AVX2 on the project's machines). The portable
build (scalar integers and fmaf) is the arithmetic's definition; every build
must give its bits. Agreement with the exact product of x and the dequantized
weights is bounded by the rounding of x to 16 bits per block plus the
standard forward-error bound of the fp32 chain (see ``error_bound``).
"""

from __future__ import annotations

import re
import subprocess

import gguf
import numpy as np
import pytest
import torch

from kernels import native
from kernels.quant import FORMATS, GGUF_FORMATS, QuantTensor
from kernels.quant_linear import (SERVING_VARIANTS, VARIANTS, QuantKernel, QuantLinear, host_variant,
                                  library_flags, runs_here)
from kernels.weight_arena import WeightArena

U = 2.0 ** -24                                   # fp32 unit roundoff
HOST = host_variant()
FMTS = list(FORMATS)


@pytest.fixture(scope="module")
def host() -> QuantKernel:
    assert HOST is not None, "this CPU has no quantized-weights kernel (needs AVX2, FMA, F16C)"
    kernel = QuantKernel.create()
    assert kernel is not None and kernel.variant == HOST, "the host's kernel did not build or load"
    return kernel


@pytest.fixture(scope="module")
def portable() -> QuantKernel:
    return QuantKernel.load("portable")


# kvd's block formats (the K-quants repacked at load) -> the GGUF type a test quantizes
# with gguf-py, or draws as random valid blocks (a K-quant), and repacks
KQ_SOURCE = {"KQ5_0": "Q5_0", "KQ5_1": "Q5_1", "KS4": "Q4_K", "KS5": "Q5_K", "KS6": "Q6_K",
             "KS2": "Q2_K", "KS3": "Q3_K", "KI4": "IQ4_NL", "KSI4": "IQ4_XS"}
# the bytes of fp16 scales at the start of a format's blocks
HALF_SCALE_BYTES = {"Q4_1": 4, "KQ5_1": 4, "KS4": 4, "KS5": 4, "KS2": 4}
# a KS format's bytes before its quants (its head)
KS_HEAD_BYTES = {"KS4": 20, "KS5": 20, "KS6": 18, "KS2": 20, "KS3": 18, "KSI4": 10}


def width(fmt: str, k: int) -> int:
    """k rounded up to a whole number of ``fmt``'s blocks (256 weights for a KS format)."""
    per = FORMATS[fmt].weights
    return -(-k // per) * per


def quantized(n: int, k: int, fmt: str, seed: int, scale: float = 0.05) -> QuantTensor:
    """A random [n, k] matrix quantized by gguf-py (llama.cpp's reference quantizer);
    a KQ format's through its ``KQ_SOURCE`` and kernels/kquant_repack.py."""
    from kernels import gguf_blocks, kquant_repack
    from tools.random_gguf import random_type_blocks

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * scale).numpy()
    if fmt in KQ_SOURCE:
        src = KQ_SOURCE[fmt]
        if src.endswith("_K") or src.startswith("IQ4"):   # random valid blocks (gguf-py quantizes none)
            data = torch.from_numpy(random_type_blocks(src, n, k, g))
            return kquant_repack.repack(src, gguf_blocks.decode(src, data, k))
        data = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[src])))
        return kquant_repack.repack_to(fmt, gguf_blocks.decode(src, data, k))
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])
    return QuantTensor(fmt, (n, k), torch.from_numpy(np.ascontiguousarray(blocks)))


def random_blocks(n: int, k: int, fmt: str, seed: int) -> QuantTensor:
    """Arbitrary block bytes (every nibble and int8 value, every finite fp16 scale
    sign and exponent, subnormals included), not only what a quantizer writes."""
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k // f.weights, f.block_bytes), generator=g, dtype=torch.uint8)
    scales = HALF_SCALE_BYTES.get(fmt, 2)
    half = data[..., :scales].clone().view(torch.int16)
    half &= ~0x4000                               # exponent < 16: finite, |v| < 2 (no inf/nan)
    data[..., :scales] = half.view(torch.uint8)
    return QuantTensor(fmt, (n, k), data.reshape(n, -1))


def block_mins(qt: QuantTensor) -> torch.Tensor:
    """fp32 [rows, cols]: each weight's block m (Q4_1's and KQ5_1's offset, the K-quants'
    -dmin m; 0 for the other formats)."""
    rows, cols = qt.shape
    bb = qt.fmt.block_bytes
    if qt.fmt.name in ("KS4", "KS5"):                # dmin m per sub-block
        b = qt.data.view(rows, cols // 256, bb)
        dmin = b[..., 2:4].contiguous().view(torch.float16).float()          # [R, ns, 1]
        m = -(dmin * b[..., 5:20:2].float())                                 # [R, ns, 8]
        return m.unsqueeze(-1).expand(rows, cols // 256, 8, 32).reshape(rows, cols)
    if qt.fmt.name == "KS2":                         # dmin m per 16 weights
        b = qt.data.view(rows, cols // 256, bb)
        dmin = b[..., 2:4].contiguous().view(torch.float16).float()
        m = -(dmin * (b[..., 4:20] >> 4).float())                           # [R, ns, 16]
        return m.unsqueeze(-1).expand(rows, cols // 256, 16, 16).reshape(rows, cols)
    if qt.fmt.name not in ("Q4_1", "KQ5_1"):
        return torch.zeros(rows, cols)
    m = qt.data.view(rows, cols // 32, bb)[..., 2:4].contiguous().view(torch.float16).float()
    return m.expand(rows, cols // 32, 32).reshape(rows, cols)


def error_bound(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """|kernel - x @ W.T computed exactly| (W = qt.dequantize()), elementwise [M, N].

    Two parts (quant_matmul.cpp's arithmetic):
    - x is rounded to d q per block, d = amax / 32767, so |x - d q| <= d / 2 (a
      little more for the rounding of 32767 / amax and of x times it: 0.51 d);
      it multiplies the weights' d q_w part, w - m (all of w but Q4_1's m, which
      takes the exact fp32 block sum of x instead; KS2's mins take x's rounded sums:
      all of w);
    - the fp32 chain (a product, a conversion and a fused multiply-add per block,
      the m chain, the block sums of x) is a sum of at most K / 16 + 8 <= K
      rounded terms, each bounded by gamma_K (Higham, Accuracy and Stability of
      Numerical Algorithms, 3.1) times the sum of |x||w| and |x||m|."""
    k = x.shape[1]
    w, m = qt.dequantize().double(), block_mins(qt).double()
    xd = x.double()
    d = xd.abs().view(x.shape[0], k // 32, 32).amax(-1) / 32767                  # [M, nb]
    rounded = w if qt.fmt.name == "KS2" else w - m
    rounding = 0.51 * d.repeat_interleave(32, dim=1) @ rounded.abs().t()
    gamma = k * U / (1 - k * U)
    return rounding + 2 * gamma * (xd.abs() @ ((w - m).abs() + m.abs()).t()) + 1e-30


# ------------------------------------------------------------------ formats (any CPU)
@pytest.mark.parametrize("fmt", GGUF_FORMATS)        # KQ*: tests/engine/test_kquant_weights.py
def test_dequantize_is_gguf_py_bit_for_bit(fmt):
    for qt in (quantized(40, 96, fmt, seed=1), random_blocks(40, 96, fmt, seed=2)):
        ref = gguf.quants.dequantize(qt.data.numpy(), gguf.GGMLQuantizationType[fmt])
        assert torch.equal(qt.dequantize(), torch.from_numpy(np.ascontiguousarray(ref)))
        ids = torch.tensor([39, 0, 7, 7])
        assert torch.equal(qt.dequantize_rows(ids), qt.dequantize()[ids])


def test_bits_per_weight_and_bytes():
    assert FORMATS["Q4_1"].bits_per_weight() == 5.0          # 16 B of nibbles + fp16 d, m per 32
    assert FORMATS["Q4_0"].bits_per_weight() == 4.5 and FORMATS["Q8_0"].bits_per_weight() == 8.5
    assert quantized(8, 64, "Q4_1", seed=0).nbytes == 8 * 2 * 20


def test_bad_tensors_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantTensor("Q4_1", (4, 48), torch.zeros(4, 30, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs uint8 bytes"):
        QuantTensor("Q4_1", (4, 64), torch.zeros(4, 39, dtype=torch.uint8))      # a truncated row
    with pytest.raises(ValueError, match="needs uint8 bytes"):
        QuantTensor("Q8_0", (4, 64), torch.zeros(4, 68, dtype=torch.int8))
    with pytest.raises(KeyError):
        QuantTensor("Q5_0", (4, 64), torch.zeros(4, 44, dtype=torch.uint8))
    with pytest.raises(ValueError, match="one format"):
        QuantTensor.cat_rows([quantized(4, 64, "Q4_1", 0), quantized(4, 64, "Q8_0", 0)])


def test_variant_choice_follows_the_cpu_flags():
    assert host_variant({"avx2", "fma", "f16c"}) == "avx2"
    assert host_variant({"avx2", "fma", "f16c", "avx512f", "avx512bw"}) == "avx512"
    assert host_variant({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}) == "avx512vnni"
    assert host_variant({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile",
                         "amx_int8"}) == "avx512amx"
    assert host_variant({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                         "amx_tile", "amx_bf16"}) == "avx512vnni"        # tiles without their int8 dots
    assert host_variant({"avx2", "f16c"}) is None                      # no FMA: no serving build
    assert host_variant(set()) is None


def test_the_amx_build_is_offered_only_where_the_tile_state_is_granted():
    """native.cpu_flags() keeps the AMX flags only when Linux grants this process the tile
    state (arch_prctl); on a CPU without AMX the request is refused, not a crash."""
    with open("/proc/cpuinfo") as f:
        has_amx = "amx_tile" in f.read().split()
    granted = native.amx_permitted()
    assert isinstance(granted, bool) and (granted or not ("amx_tile" in native.cpu_flags()))
    if not has_amx:
        assert not granted and host_variant() != "avx512amx"


def test_the_capability_variable_caps_the_host_build(monkeypatch):
    host = host_variant()
    monkeypatch.setenv("KVD_CPU_CAPABILITY", "avx2")
    assert host_variant() == "avx2"                                    # every serving host runs it
    assert host_variant({"avx2", "fma", "f16c", "avx512f", "avx512bw"}) == "avx512"   # given flags: not read
    monkeypatch.setenv("KVD_CPU_CAPABILITY", "avx512amx")              # the top: no cap
    assert host_variant() == host
    monkeypatch.setenv("KVD_CPU_CAPABILITY", "avx9000")                # unknown: ignored
    assert host_variant() == host


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_build_names_itself_the_variant_it_was_built_as(variant):
    """Each library reports csrc/variant.h's KVD_VARIANT and Python refuses one that names
    another build, so a wrong name silently sends that CPU family to the torch path (it did:
    prefill attention on AVX-512 VNNI hosts). Read with the preprocessor under each build's
    flags, so this host checks the names of builds it cannot run too."""
    proc = subprocess.run([native.COMPILER, "-dM", "-E", "-x", "c++", *VARIANTS[variant][1],
                           str(native.SOURCES / "variant.h")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r'^#define KVD_VARIANT "(\w+)"$', proc.stdout, re.M) == [variant]


@pytest.mark.parametrize("fmt", FMTS)
def test_the_x8_layout_is_the_same_bytes_reordered(fmt):
    """pack() groups rows by 8 (the last padded with zero blocks) and transposes each
    group-block's 2-byte words; unpack() is its inverse, and the values do not move."""
    k = 3 * FORMATS[fmt].weights                  # 3 blocks
    qt = random_blocks(13, k, fmt, seed=3)
    packed = qt.pack()
    assert packed.layout == "x8" and packed.shape == qt.shape and packed.pack() is packed
    bb, nb = FORMATS[fmt].block_bytes, 3
    assert tuple(packed.data.shape) == (2, 8 * nb * bb)
    # group 1, block 2, 2-byte word 1 of row 12 (row 4 of its group): bytes 2..3 of its block
    at = 2 * 8 * bb + 16 * 1 + 2 * 4
    assert packed.data[1, at:at + 2].tolist() == qt.data[12, 2 * bb + 2:2 * bb + 4].tolist()
    assert not packed.data[1, 2 * 5:2 * 8].any()                         # rows 13..15: padding
    assert torch.equal(packed.unpack().data, qt.data)
    in_arena = qt.pack(WeightArena())                                     # the model's way: huge pages
    assert in_arena.layout == "x8" and torch.equal(in_arena.data, packed.data)
    assert torch.equal(packed.dequantize(), qt.dequantize())
    ids = torch.tensor([12, 0, 5])
    assert torch.equal(packed.dequantize_rows(ids), qt.dequantize_rows(ids))
    with pytest.raises(ValueError, match="rows layout"):
        packed.take_rows(ids)
    with pytest.raises(ValueError, match="layout x8 needs"):
        QuantTensor(fmt, (13, k), qt.data, layout="x8")                  # unpadded bytes
    with pytest.raises(ValueError, match="unknown layout"):
        QuantTensor(fmt, (13, k), qt.data, layout="cols")


def test_torch_reference_is_dequantize_then_matmul():
    qt = quantized(24, 64, "Q4_1", seed=3)
    x = torch.randn(5, 64)
    ref = QuantLinear([qt], None)
    assert torch.allclose(ref(x), x @ qt.dequantize().t(), rtol=0, atol=1e-6)
    assert torch.equal(ref.embed(torch.tensor([3, 1])), qt.dequantize()[[3, 1]])
    with pytest.raises(ValueError, match="out of range"):
        ref.embed(torch.tensor([24]))


# ------------------------------------------------------------------ the host's kernel
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (130, 576), (64, 1536)])
def test_kernel_matches_the_exact_product_within_its_bound(host, fmt, n, k):
    k = width(fmt, k)
    qt = quantized(n, k, fmt, seed=n + k)
    w = qt.dequantize().double()
    for m in (1, 2, 3, 4, 17, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.logspace(-2, 2, k)
        got = QuantLinear([qt], host)(x)
        ref = x.double() @ w.t()
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert ((got.double() - ref).abs() <= error_bound(x, qt)).all(), (fmt, m)
        # and far inside the bound of x rounded to bf16 (8 significant bits), the format
        # the issue allows: 2^-9 |x| per element against 2^-16 of the block's largest
        bf16 = (x.abs().double() * 2.0 ** -9) @ (w.abs() + block_mins(qt).double().abs()).t()
        assert ((got.double() - ref).abs() <= bf16 + 1e-30).all(), (fmt, m)


@pytest.mark.parametrize("fmt", FMTS)
def test_every_build_computes_the_same_bits(host, portable, fmt):
    """The host's SIMD build, and every slower serving build this CPU runs (the AVX-512
    builds' two groups on 16 lanes, AVX2's one on 8), against the portable one (scalar
    integers and fmaf, the arithmetic's definition): bit for bit, on arbitrary block bytes,
    on the one-row register path, the widened-group paths, a pair of groups whose second is
    partial and a partial last group alone."""
    # the host's and every slower one (a faster one, the AMX build, needs the tile state granted)
    builds = {v: QuantKernel.load(v) for v in SERVING_VARIANTS[SERVING_VARIANTS.index(HOST):] if runs_here(v)}
    k = width(fmt, 192)
    for n in (45, 37):                               # 5 groups + 5 rows; 4 groups + 5 rows
        qt = random_blocks(n, k, fmt, seed=n)
        x = torch.randn(40, k) * torch.logspace(-3, 3, k)           # magnitudes that round
        x[3, 32:64] = 0.0                                            # an all-zero block: d = 0
        for m in (1, 2, 3, 4, 7, 20, 33, 40):        # one row, groups, past one chunk of 32 rows
            want = QuantLinear([qt], portable)(x[:m])
            for v, kernel in builds.items():
                assert torch.equal(QuantLinear([qt], kernel)(x[:m]), want), (v, n, m)
    ids = torch.tensor([0, 36, 12, 30, 7])
    packed = qt.pack()
    assert torch.equal(host.rows(packed, ids), portable.rows(packed, ids))
    assert torch.equal(host.rows(packed, ids), qt.dequantize()[ids])


@pytest.mark.parametrize("fmt", FMTS)
def test_the_tile_path_computes_the_same_bits(portable, fmt):
    """The AMX tile path (the avx512amx build's, for 16 rows of x or more), its tile
    instructions emulated (the amxemu build, any AVX2 host): the portable build's bits, on
    shapes that leave every partial piece (x rows past a tile of 16, a pass of four groups
    with one, two or three, rows past a group of 8), on arbitrary block bytes, and on the
    largest dots (every weight at its top against x at +-32767). On an AMX host the test
    above holds the real instructions to the same bits."""
    emulated = QuantKernel.load("amxemu")
    for n, k in [(1, 32), (17, 64), (45, 192), (70, 96)]:
        k = width(fmt, k)
        qt = random_blocks(n, k, fmt, seed=n)
        x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-3, 3, k)
        x[2, :32] = 0.0                                              # an all-zero block: d = 0
        for m in (1, 3, 16, 17, 40):
            got, want = QuantLinear([qt], emulated)(x[:m]), QuantLinear([qt], portable)(x[:m])
            assert torch.isfinite(want).all() and torch.equal(got, want), (n, k, m)
    # the largest dots: every weight at its format's top (nibble 15, int8 127) against blocks
    # of x that quantize to +-32767 throughout
    k = width(fmt, 64)
    qt = random_blocks(24, k, fmt, seed=1)
    off = KS_HEAD_BYTES.get(fmt, HALF_SCALE_BYTES.get(fmt, 2))
    blocks = qt.data.view(24, k // FORMATS[fmt].weights, -1).clone()
    blocks[..., off:] = 0x7F if fmt == "Q8_0" else 0xFF
    qt = QuantTensor(fmt, (24, k), blocks.view(24, -1))
    x = torch.ones(20, k)
    x[1::2] = -1.0
    assert torch.equal(QuantLinear([qt], emulated)(x), QuantLinear([qt], portable)(x))


@pytest.mark.parametrize("fmt", FMTS)
def test_a_row_alone_equals_the_row_in_a_batch_of_16_bit_for_bit(host, fmt):
    qt = quantized(200, width(fmt, 576), fmt, seed=6)
    x = torch.randn(16, width(fmt, 576))
    lin = QuantLinear([qt], host)
    batch = lin(x)                                   # 16 rows: widened groups of W
    for r in range(16):
        assert torch.equal(lin(x[r:r + 1])[0], batch[r]), f"row {r} differs alone"   # the register path
    for lo, hi in [(0, 2), (5, 8), (3, 7), (0, 9), (2, 15)]:
        assert torch.equal(lin(x[lo:hi]), batch[lo:hi])


@pytest.mark.parametrize("fmt", FMTS)
def test_many_rows_give_each_row_its_bits_alone(host, portable, fmt):
    """Many rows (prefill: chunks of 32 rows of x, widened groups of 8 rows of
    W) against rows computed one at a time (the register path), on shapes
    that leave partial pieces: M not a multiple of 32, N not a multiple of 8
    or below it, K of one block and K of 48 blocks."""
    for n, k in [(1, 32), (17, 64), (37, 1536)]:
        k = width(fmt, k)
        qt = random_blocks(n, k, fmt, seed=n)
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-3, 3, k)
        lin = QuantLinear([qt], host)
        full = lin(x)
        assert torch.equal(full, QuantLinear([qt], portable)(x)), (n, k)
        for m in (16, 17, 23):
            assert torch.equal(lin(x[:m]), full[:m]), (n, k, m)
        for r in (0, 5, 6, 69):
            assert torch.equal(lin(x[r:r + 1])[0], full[r]), (n, k, r)


@pytest.mark.parametrize("fmt", ["Q4_1", "KQ5_0", "KS4", "KS5", "KS6", "KS2", "KS3", "KI4", "KSI4"])
def test_thread_count_does_not_change_a_bit(host, fmt):
    k = width(fmt, 576)
    qt = quantized(300, k, fmt, seed=7)
    lin = QuantLinear([qt], host)
    for m in (1, 16):
        x = torch.randn(m, k)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = lin(x)
            torch.set_num_threads(2)
            two = lin(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two)


def test_strided_and_bf16_inputs(host):
    qt = quantized(48, 64, "Q8_0", seed=8)
    lin = QuantLinear([qt], host)
    wide = torch.randn(6, 200)
    x = wide[:, 10:74]                                # rows with a stride of 200
    assert torch.equal(lin(x), lin(x.contiguous()))
    row = torch.randn(1, 64)
    assert torch.equal(lin(row.expand(3, 64)), lin(row).expand(3, 48))    # stride-0 rows
    xb = torch.randn(4, 64).bfloat16()
    out = lin(xb)
    assert out.dtype == torch.bfloat16 and torch.equal(out, lin(xb.float()).bfloat16())


def test_stacked_parts_of_mixed_formats(host):
    """q/k/v stored in different types: one QuantLinear, one output, each part
    as if alone (a float part runs a plain matmul)."""
    a, b, c = quantized(32, 64, "Q4_1", 9), quantized(32, 64, "Q4_1", 10), quantized(16, 64, "Q8_0", 11)
    f = torch.randn(8, 64)
    lin = QuantLinear([a, b, c, f], host)
    assert len(lin.parts) == 3                        # a and b merged: one kernel call
    assert lin.out_features == 88 and lin.nbytes == a.nbytes + b.nbytes + c.nbytes + f.numel() * 4
    x = torch.randn(3, 64)
    want = torch.cat([QuantLinear([a], host)(x), QuantLinear([b], host)(x), QuantLinear([c], host)(x),
                      x @ f.t()], dim=1)
    assert torch.equal(lin(x), want)


def test_bad_input_is_refused(host):
    qt = quantized(8, 64, "Q4_0", seed=12)
    lin = QuantLinear([qt], host)
    with pytest.raises(ValueError, match=r"expects \[M, 64\]"):
        lin(torch.randn(2, 32))
    with pytest.raises(ValueError, match="do not fit"):
        host.matmul_into(qt.pack(), torch.randn(2, 64), torch.empty(3, 8))
    with pytest.raises(ValueError, match="x8 layout"):         # the file's layout, read as x8: refused
        host.matmul_into(qt, torch.randn(2, 64), torch.empty(2, 8))
    with pytest.raises(ValueError, match="x8 layout"):
        host.rows(qt, torch.tensor([0]))
    with pytest.raises(ValueError, match="out of range"):
        lin.embed(torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="out of range"):
        lin.embed(torch.tensor([-1]))
    with pytest.raises(ValueError, match="input width"):
        QuantLinear([qt, quantized(8, 96, "Q4_0", seed=0)], host)


def test_every_variant_compiles():
    """Builds this CPU cannot run are still compiled here, so a mistake in their
    code path shows up on any machine (they share the arithmetic above); the plan
    executor includes the same matmul, and the row ops the executor's row functions, so
    their builds are compiled too; and the sampler's, which shares simd.h's exp."""
    jobs = [(library, library_flags(library, variant))
            for variant in VARIANTS for library in ("quant_matmul", "plan_decode", "row_ops", "sample_rows")]
    for job, path in zip(jobs, native.build_many(jobs)):
        assert path.exists(), job


def test_the_avx512_gemm_alone_is_scheduled_for_register_pressure():
    """library_flags: the AVX-512 builds' many-row GEMM takes GCC's pressure-aware scheduler,
    their one-row decode path (the plan executor) does not; the AVX2 builds take it
    everywhere. What a kernel loads is what ``python -m kernels`` (make install) builds."""
    pressure = {"-fschedule-insns", "-fsched-pressure"}
    for variant in ("avx512vnni", "avx512"):
        assert pressure <= set(library_flags("quant_matmul", variant))
        assert not pressure & set(library_flags("plan_decode", variant))
    for library in ("quant_matmul", "plan_decode"):
        assert pressure <= set(library_flags(library, "avx2"))
        assert library_flags(library, "avx512amx") == VARIANTS["avx512amx"][1]
    if (variant := host_variant()) is not None:
        want = native.library_path("quant_matmul", library_flags("quant_matmul", variant))
        assert want.exists(), "make install built another quant_matmul than the one the kernel loads"


def test_gcc_only_flags_reach_gcc_alone(monkeypatch):
    flags = ("-mavx2", *sorted(native.GCC_ONLY_FLAGS), "-ffp-contract=off")
    monkeypatch.setattr(native, "_compiler_version", lambda: "g++ (Debian 12.2.0-14) 12.2.0")
    assert native.for_compiler(flags) == flags
    monkeypatch.setattr(native, "_compiler_version", lambda: "Debian clang version 16.0.6 (15~deb12u1)")
    assert native.for_compiler(flags) == ("-mavx2", "-ffp-contract=off")
    plain = ("-mavx2", "-ffp-contract=off")
    assert native.library_path("quant_matmul", flags) == native.library_path("quant_matmul", plain)
