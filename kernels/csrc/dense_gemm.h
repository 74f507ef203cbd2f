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
// for the tile's other side, every W row of a call (a claim's 8 or so) against a tile of x
// before the next.
#pragma once

#include <stdint.h>

#include <type_traits>

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

// Rows [n0, n1) of W, R at a time (then the 1-3 left), against rows [m, m + X) of x.
template <int R, int X>
inline void dense_strip(const float* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t m,
                        float* y, int64_t ldy) {
    float out[X * 4];
    auto tile = [&](auto rows, int64_t n) {
        constexpr int RR = decltype(rows)::value;
        dense_dots<RR, X>(w + n * K, K, x + m * ldx, ldx, out);
        for (int i = 0; i < X; i++)
            for (int r = 0; r < RR; r++) y[(m + i) * ldy + n + r] = out[i * RR + r];
    };
    int64_t n = n0;
    for (; n + R <= n1; n += R) tile(std::integral_constant<int, R>(), n);
    switch (n1 - n) {
        case 3: tile(std::integral_constant<int, 3>(), n); break;
        case 2: tile(std::integral_constant<int, 2>(), n); break;
        case 1: tile(std::integral_constant<int, 1>(), n); break;
        default: break;
    }
}

// y[m, n] (row stride ldy) for n in [n0, n1), m < M; x row stride ldx. One row of x takes
// DENSE_ROWS rows of W a pass; a batch, tiles of BATCH_X rows of x by BATCH_W rows of W,
// every tile of W rows (a claim's few: in L1 after the first) for a tile of x before the next.
inline void dense_range(const float* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t M,
                        float* y, int64_t ldy) {
    int64_t m = 0;
    if (M > 1)
        for (; m + BATCH_X <= M; m += BATCH_X) dense_strip<BATCH_W, BATCH_X>(w, K, n0, n1, x, ldx, m, y, ldy);
    for (; m < M; m++) dense_strip<DENSE_ROWS, 1>(w, K, n0, n1, x, ldx, m, y, ldy);
}

}  // namespace
