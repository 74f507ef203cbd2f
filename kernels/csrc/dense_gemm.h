// fp32 matmul of a float model's weights for the decode-plan executor (plan_decode.cpp):
// y[m, n] = x[m, :] · W[n, :] with W fp32 [N, K], row-major (F.linear's [out, in]), K a
// multiple of 16.
//
// Arithmetic (the contract): each output is one dot product of 16 lanes, lane j summing
// x[k] W[n, k] for k = j, j + 16, ... in turn (a product, then fused multiply-adds), then
// the lanes added along vsum's fixed tree (quant_blocks.h). Nothing in it depends on M, on
// the other rows, on which rows a thread computes, or on the build (V16 is the same
// operations per lane on AVX-512, AVX2 and the portable build), so a row's result is the
// same bit for bit alone or in any batch, with any thread count. It is not torch's order
// (MKL's), so it agrees with LlamaModel.forward's float matmul to fp32 rounding.
//
// Decode reads every weight once: rows of W stream from memory in address order, four
// at a time (four independent sums per row of x, each x chunk loaded once for the four);
// a batch runs tiles of rows of x by rows of W (BATCH_X by BATCH_W), each chunk loaded once
// for the tile's other side.
#pragma once

#include <stdint.h>

#include "quant_blocks.h"

namespace {

constexpr int64_t DENSE_ROWS = 4;               // rows of W a pass reads together
constexpr int64_t DENSE_PREFETCH_BYTES = 4096;  // ahead of each row's stream (a hint)

inline void dense_prefetch(const float* p) {
#if defined(__AVX2__)
    _mm_prefetch((const char*)p + DENSE_PREFETCH_BYTES, _MM_HINT_T0);
#else
    (void)p;
#endif
}

// R rows of W (w, row stride K) against X rows of x (row stride ldx): out[i * R + r] = x_i · w_r
// in the contract's order; each chunk of W loaded once for the X rows.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: each V16 sum is two ymm (lanes 0-7 and 8-15, V16's own halves); a chunk's low halves
// are done for every (x row, W row) pair before its high halves, so that only one ymm of each
// row of x is live at a time: X * R * 2 accumulators, X of x, one of W. The same operations
// per lane as vmul and vfma on V16.
template <int R, int X>
inline void dense_dots(const float* w, int64_t K, const float* x, int64_t ldx, float* out) {
    V16 acc[X][R];
    for (int h = 0; h < 2; h++) {
        __m256 xv[X];
        for (int i = 0; i < X; i++) xv[i] = _mm256_loadu_ps(x + i * ldx + 8 * h);
        for (int r = 0; r < R; r++) {
            const __m256 wv = _mm256_loadu_ps(w + r * K + 8 * h);
            for (int i = 0; i < X; i++) (h ? acc[i][r].b : acc[i][r].a) = _mm256_mul_ps(xv[i], wv);
        }
    }
    for (int64_t k = 16; k < K; k += 16) {
        for (int r = 0; r < R; r++) dense_prefetch(w + r * K + k);     // the line 4 KiB ahead
        for (int h = 0; h < 2; h++) {
            __m256 xv[X];
            for (int i = 0; i < X; i++) xv[i] = _mm256_loadu_ps(x + i * ldx + k + 8 * h);
            for (int r = 0; r < R; r++) {
                const __m256 wv = _mm256_loadu_ps(w + r * K + k + 8 * h);
                for (int i = 0; i < X; i++) {
                    __m256& a = h ? acc[i][r].b : acc[i][r].a;
                    a = _mm256_fmadd_ps(xv[i], wv, a);
                }
            }
        }
    }
    for (int i = 0; i < X; i++)
        for (int r = 0; r < R; r++) out[i * R + r] = vsum(acc[i][r]);
}
#else
template <int R, int X>
inline void dense_dots(const float* w, int64_t K, const float* x, int64_t ldx, float* out) {
    V16 acc[X][R];
    for (int i = 0; i < X; i++) {
        const V16 x0 = vload(x + i * ldx);
        for (int r = 0; r < R; r++) acc[i][r] = vmul(x0, vload(w + r * K));
    }
    for (int64_t k = 16; k < K; k += 16) {
        for (int r = 0; r < R; r++) dense_prefetch(w + r * K + k);     // the line 4 KiB ahead
        V16 xv[X];
        for (int i = 0; i < X; i++) xv[i] = vload(x + i * ldx + k);
        for (int r = 0; r < R; r++) {
            const V16 wv = vload(w + r * K + k);
            for (int i = 0; i < X; i++) acc[i][r] = vfma(xv[i], wv, acc[i][r]);
        }
    }
    for (int i = 0; i < X; i++)
        for (int r = 0; r < R; r++) out[i * R + r] = vsum(acc[i][r]);
}
#endif

// A batch's register tile: BATCH_X rows of x against BATCH_W rows of W, each chunk of x
// loaded once for BATCH_W rows and each chunk of W once for BATCH_X rows. AVX-512: 16
// accumulators of 32 registers; AVX2: 6 (each V16 two of its 16 ymm).
#if defined(__AVX512F__)
constexpr int BATCH_X = 4, BATCH_W = 4;
#else
constexpr int BATCH_X = 2, BATCH_W = 3;
#endif

// W rows [n, n + R) against rows [m0, m1) of x: X rows at a time, then fewer.
template <int R>
inline void dense_rows(const float* w, int64_t K, int64_t n, const float* x, int64_t ldx, int64_t m0, int64_t m1,
                       float* y, int64_t ldy) {
    float out[BATCH_X * R];
    int64_t m = m0;
    auto store = [&](int rows) {
        for (int i = 0; i < rows; i++)
            for (int r = 0; r < R; r++) y[(m + i) * ldy + n + r] = out[i * R + r];
    };
    for (; m + BATCH_X <= m1; m += BATCH_X) {
        dense_dots<R, BATCH_X>(w + n * K, K, x + m * ldx, ldx, out);
        store(BATCH_X);
    }
    for (; m < m1; m++) {
        dense_dots<R, 1>(w + n * K, K, x + m * ldx, ldx, out);
        store(1);
    }
}

// y[m, n] (row stride ldy) for n in [n0, n1), m < M; x row stride ldx. One row of x takes
// DENSE_ROWS rows of W a pass; a batch, tiles of BATCH_X rows of x by BATCH_W rows of W.
inline void dense_range(const float* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t M,
                        float* y, int64_t ldy) {
    int64_t n = n0;
    if (M == 1)
        for (; n + DENSE_ROWS <= n1; n += DENSE_ROWS) dense_rows<DENSE_ROWS>(w, K, n, x, ldx, 0, M, y, ldy);
    else
        for (; n + BATCH_W <= n1; n += BATCH_W) dense_rows<BATCH_W>(w, K, n, x, ldx, 0, M, y, ldy);
    for (; n < n1; n++) dense_rows<1>(w, K, n, x, ldx, 0, M, y, ldy);
}

}  // namespace
