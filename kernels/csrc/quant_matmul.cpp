// y = x · Wᵀ with W kept in a GGUF block format (Q4_0, Q4_1, Q8_0) or one of kvd's (quant_blocks.h:
// KQ5_0, KQ5_1, KI4, KS4-KS6, KS2, KS3, KSI4: the K-quants, Q5 and IQ4 types repacked at load), activations
// quantized to 16 bits per 32-block.
//
// Called through ctypes from kernels/quant_linear.py, which documents the
// contract; this file documents the layouts and the arithmetic.
//
// W is [N, K] in the GGUF file's blocks: row n is K/32 blocks of 32 weights, each
// block its scale(s) then its quants (ggml's block_q4_0 / q4_1 / q8_0), held in the
// x8 layout described below:
//
//     Q4_0  18 B  fp16 d, 16 B nibbles     w = d * (q - 8)
//     Q4_1  20 B  fp16 d, fp16 m, 16 B     w = d * q + m
//     Q8_0  34 B  fp16 d, 32 x int8        w = d * q
//
// In Q4 blocks, byte j holds weight j in its low nibble and weight j + 16 in
// its high nibble. Every w above is exact in fp32 (d * q has at most 19
// significant bits), so the weights this kernel computes with are bit for bit
// those that gguf-py's dequantize (the `weights = "dequantize"` path) gives.
//
// Arithmetic (the contract every path and every build keeps). Each row of x is first
// quantized per 32-block to 16 bits (quant_gemm.h, quantize_block):
//
//     d = amax / 32767,  q[i] = round-half-even(x[i] * (32767 / amax)),  s = fp32 sum of x (fixed tree)
//
// so |x[i] - d q[i]| <= d / 2 = amax / 65534: finer than bf16 (8 significant bits) for
// any element within 2^7 of its block's largest. One output y[m, n] is then, block
// after block in order,
//
//     isum = sum_i q_w[i] * q_x[i]                    exact int32 (Q4_0 / KQ5_0: minus 8 / 16 * sum_i q_x[i])
//     acc  = fma(d_w * d_x, (float)isum, acc)
//     accm = fma(m_w, s_x, accm)                      the formats with a min (has_min)
//
// (KS6, KS2 and KS3, two scales a block: isum over weights 0..15 with d0, then acc = fma(d1 * d_x,
// (float)isum1, acc) over 16..31; a KS format's d_w, m_w are formed in registers, exact; KS2's
// mins, one per 16 weights, take x's exact integer sums over the halves, qs0 and qs1:
// accm = fma(-dmin * d_x, m0 * qs0 + m1 * qs1, accm), that integer exact in fp32) and
// y = acc + accm (a format with a min) or acc. Nothing in that sequence depends on M, on the
// other rows, on the thread count or on the path: the integer dot is exact in any
// order, and every path and build runs the same fp32 chain per output, so a row's
// result is the same bit for bit alone or in any batch, in a prefill or a decode
// step. The AVX2, AVX-512 and AMX builds (the last's tile path: quant_gemm.h) and the
// portable build (scalar ints, fmaf) agree bit for bit (the tests hold this host's build to
// the portable one).
//
// The kernels read W in the x8 layout (kernels/quant.py's QuantTensor.pack; quant_gemm.h
// gives the bytes): the same blocks, 8 rows' blocks interleaved by 2-byte word. Work is
// handed to threads in chunks of whole groups of 8 output rows of W (n), never split by k
// (row_claims.h: each thread takes its own share first, then what the others have not
// started, so a thread that loses its CPU does not hold up the call).

#include "quant_gemm.h"
#include "row_claims.h"
#include "spin_barrier.h"

namespace {

// x's quantized rows live in a buffer the calling thread keeps between calls, up to this
// size (a prefill chunk's calls take inputs of a few shapes): one made per call would be
// allocated, zeroed and faulted in -- M x K x 2 bytes and more, 0.8 MB for a 256-row chunk
// of SmolLM2's down projection -- on one thread while the team waits.
constexpr size_t KEEP_QROWS_BYTES = 32 << 20;

// Groups of 8 output rows a thread claims at a time (row_claims.h): about CLAIM_BYTES of W,
// and a multiple of 4 groups, so that the AMX build's passes of 32 rows stay whole.
inline int64_t claim_groups(int64_t group_bytes) {
    const int64_t g = CLAIM_BYTES / (group_bytes > 0 ? group_bytes : 1);
    return g <= 4 ? 4 : (g + 3) / 4 * 4;
}

void matmul(int format, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, int64_t ldx, float* y,
            int64_t ldy, int nt) {
    thread_local QRowsBuf buf;
    const QRows q = buf.rows(M, K);
    SpinBarrier barrier(nt);
    RowClaims claims(nt);
    const int64_t chunk = claim_groups(group_bytes(format, K));
#pragma omp parallel num_threads(nt)
    {
        const int T = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t m0, m1;
        split(M, T, tid, &m0, &m1);
        quantize_rows(x, ldx, m0, m1, q);
        barrier.wait(T, tid);
        claims.run_units((N + 7) / 8, chunk, T, tid, 0, [&](int64_t g0, int64_t g1) {
            matmul_range(format, w, g0 * 8, g1 * 8 < N ? g1 * 8 : N, q, M, y, ldy);
        });
    }
    if (buf.bytes() > KEEP_QROWS_BYTES) buf = QRowsBuf();
}

}  // namespace

extern "C" {

// Which build this is (variant.h): a key of kernels/quant_linear.py's VARIANTS.
const char* kvd_quant_variant() { return KVD_VARIANT; }

// y[m, n] (row stride ldy) = sum_k x[m, k] (row stride ldx) * W[n, k] for m < M, n < N;
// W in the x8 layout (ceil(N / 8) groups).
// Returns 0, or -1 for an unknown format or a K that is not a positive multiple of its block
// (32 weights; 256 for a KS format)
// (nothing written).
int kvd_quant_matmul(int format, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M,
                     int64_t ldx, float* y, int64_t ldy, int num_threads) {
    if (format < Q4_0 || format > FORMAT_LAST) return -1;
    if (K <= 0 || K % block_weights(format) || N < 0 || M < 0 || ldx < K || ldy < N) return -1;
    const int nt = num_threads < 1 ? 1 : num_threads;
    if (M == 0 || N == 0) return 0;
    matmul(format, w, N, K, x, M, ldx, y, ldy, nt);
    return 0;
}

// out[t, :] = W[ids[t], :] dequantized (an embedding lookup; W in the x8 layout). Returns 0, or -1 for
// an unknown format, a bad K or an id outside [0, N) (nothing written).
int kvd_quant_rows(int format, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids, int64_t T,
                   float* out) {
    if (format < Q4_0 || format > FORMAT_LAST || K <= 0 || K % block_weights(format)) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    return gather_rows_any(format, w, K, ids, T, out) ? 0 : -1;
}

}  // extern "C"
