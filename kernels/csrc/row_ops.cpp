// A layer's row-local ops (row_ops.h) over every row of a prefill, rows split between
// OpenMP threads. Called through ctypes from kernels/row_ops.py, which documents the
// contract and checks every shape; these functions trust their arguments.

#include <omp.h>

#include "dense_gemm.h"
#include "row_ops.h"

extern "C" {

// Which build this is (variant.h).
const char* kvd_row_ops_variant() { return KVD_VARIANT; }

// out[m, :D] = rms_norm_row(x[m, :D], w) for m < M; x rows ldx floats apart, out contiguous.
void kvd_rms_norm_rows(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps, float* out,
                       int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t m = 0; m < M; m++) rms_norm_row(x + m * ldx, w, D, eps, out + m * D);
}

// out[m, :I] = silu(gu[m, :I]) * gu[m, I:2I] for m < M; gu [M, 2I] and out [M, I] contiguous.
void kvd_silu_mul_rows(const float* gu, int64_t M, int64_t I, float* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t m = 0; m < M; m++) silu_mul_row(gu + m * 2 * I, gu + m * 2 * I + I, I, out + m * I);
}

// out[m, :I] = gelu(gu[m, :I]) * gu[m, I:2I] (tanh approximation) for m < M; as kvd_silu_mul_rows.
void kvd_gelu_mul_rows(const float* gu, int64_t M, int64_t I, float* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t m = 0; m < M; m++) gelu_mul_row(gu + m * 2 * I, gu + m * 2 * I + I, I, out + m * I);
}

// out[t, j, :] = rope_head(x[t, j, :], cos[t], sin[t]) for t < T, j < heads: x row t at
// x + t * ldx holds the heads hd floats apart; cos, sin [T, hd]; out [T, heads, hd] contiguous.
void kvd_rope_rows(const float* x, int64_t ldx, int64_t T, int64_t heads, int hd, const float* cos,
                   const float* sin, float* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t i = 0; i < T * heads; i++) {
        const int64_t t = i / heads, j = i % heads;
        rope_head(x + t * ldx + j * hd, cos + t * hd, sin + t * hd, hd, out + i * hd);
    }
}

// y[m, :N] = x[m, :K] · W[n, :K] for m < M, W [N, K] row-major of element type fmt (dense_gemm.h's
// FMT_F32, FMT_BF16, FMT_F16), K a multiple of 16: the plan executor's dense matmul, W's rows split
// between OpenMP threads in blocks of 8; x rows ldx floats apart, y rows ldy.
void kvd_dense_matmul(int fmt, const void* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t M,
                      float* y, int64_t ldy, int num_threads) {
    const int64_t blocks = (N + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t b = 0; b < blocks; b++)
        dense_range_fmt(fmt, w, K, 8 * b, 8 * b + 8 < N ? 8 * b + 8 : N, x, ldx, M, y, ldy);
}

}  // extern "C"
