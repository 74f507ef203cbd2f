// y = x · Wᵀ with W kept in a GGUF block format (Q4_0, Q4_1, Q8_0), fp32 activations.
//
// Called through ctypes from kernels/quant_linear.py, which documents the
// contract; this file documents the layouts and the arithmetic.
//
// W is [N, K] as the GGUF file stores it: row n is K/32 blocks of 32 weights,
// each block its scale(s) then its quants (ggml's block_q4_0 / q4_1 / q8_0):
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
// Arithmetic (the contract every path and every build keeps): one output
// y[m, n] is a 16-lane fp32 accumulator; lane j takes block elements j and
// j + 16, block after block, each by one fused multiply-add:
//
//     acc[j] = fma(x[32b + j], w[32b + j], acc[j]);  acc[j] = fma(x[32b + 16 + j], w[32b + 16 + j], acc[j])
//
// then y = ((acc[0..8) + acc[8..16)) folded 8 -> 4 -> 2 -> 1), a fixed tree.
// Nothing in that sequence depends on M, on the other rows, on the thread
// count or on the path (below 16 rows, blocks decoded in registers, once for
// each group of up to 3 rows; from M = 16 the packed GEMM of quant_gemm.h, which runs each lane's fma chain as one element of an
// outer-product register tile): a row's result is the same bit for bit alone
// or in any batch. The AVX2 build (V16 = two 8-lane registers), the
// AVX-512 build (one 16-lane register) and the portable build (std::fma over
// arrays) run the same operations per lane, so they agree bit for bit too
// (the tests hold this host's build to the portable one).
//
// Work is split between threads by whole output rows of W (n), never by k.

#include "quant_gemm.h"

namespace {

template <int F>
void matmul(const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, int64_t ldx, float* y,
            int64_t ldy, int nt) {
    if (M < GEMM_M) {
#pragma omp parallel num_threads(nt)
        {
            int64_t n0, n1;
            split(N, omp_get_num_threads(), omp_get_thread_num(), &n0, &n1);
            std::vector<float> buf((size_t)matmul_scratch_floats(M, K));
            matmul_range<F>(w, K, n0, n1, x, M, ldx, y, ldy, buf.data());
        }
        return;
    }
    // the packed GEMM: x packed once, its blocks shared out between the threads, then each
    // thread its rows of W against all of it (the same outputs, in the same order, as
    // gemm_range: packing is a copy)
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(F), blocks = gemm_rows_padded(M) / GEMM_MR;
    std::vector<float> xbuf((size_t)(gemm_rows_padded(M) * K + 16));
    float* xp = align64(xbuf.data());
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) pack_x(x, ldx, M, b * GEMM_MR, K, xp + b * GEMM_MR * K);
        int64_t n0, n1;
        split(N, omp_get_num_threads(), omp_get_thread_num(), &n0, &n1);
        std::vector<float> buf((size_t)gemm_tile_scratch_floats(K));
        if (n0 < n1) gemm_packed<F>(w, row_bytes, nb, n0, n1, xp, M, y, ldy, buf.data());
    }
}

}  // namespace

extern "C" {

// Which build this is: "avx512", "avx2" or "portable".
const char* kvd_quant_variant() { return KVD_VARIANT; }

// y[m, n] (row stride ldy) = sum_k x[m, k] (row stride ldx) * W[n, k] for m < M, n < N.
// Returns 0, or -1 for an unknown format or a K that is not a positive multiple of 32
// (nothing written).
int kvd_quant_matmul(int format, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M,
                     int64_t ldx, float* y, int64_t ldy, int num_threads) {
    if (K <= 0 || K % QK || N < 0 || M < 0 || ldx < K || ldy < N) return -1;
    const int nt = num_threads < 1 ? 1 : num_threads;
    if (M == 0 || N == 0) return 0;
    switch (format) {
        case Q4_0: matmul<Q4_0>(w, N, K, x, M, ldx, y, ldy, nt); return 0;
        case Q4_1: matmul<Q4_1>(w, N, K, x, M, ldx, y, ldy, nt); return 0;
        case Q8_0: matmul<Q8_0>(w, N, K, x, M, ldx, y, ldy, nt); return 0;
        default: return -1;
    }
}

// out[t, :] = W[ids[t], :] dequantized (an embedding lookup). Returns 0, or -1 for
// an unknown format, a bad K or an id outside [0, N) (nothing written).
int kvd_quant_rows(int format, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids, int64_t T,
                   float* out) {
    if (K <= 0 || K % QK) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    return gather_rows_any(format, w, K, ids, T, out) ? 0 : -1;
}

}  // extern "C"
