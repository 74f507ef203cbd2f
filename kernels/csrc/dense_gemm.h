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
// at a time (four independent sums per row of x, each x chunk loaded once for the four).
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

// R rows of W (w, row stride K) against one row of x: out[r] = x · w_r in the contract's order.
template <int R>
inline void dense_dots(const float* w, int64_t K, const float* x, float* out) {
    V16 acc[R];
    const V16 x0 = vload(x);
    for (int r = 0; r < R; r++) acc[r] = vmul(x0, vload(w + r * K));
    for (int64_t k = 16; k < K; k += 16) {
        const V16 xv = vload(x + k);
        for (int r = 0; r < R; r++) dense_prefetch(w + r * K + k);     // the line 4 KiB ahead
        for (int r = 0; r < R; r++) acc[r] = vfma(xv, vload(w + r * K + k), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = vsum(acc[r]);
}

// y[m, n] (row stride ldy) for n in [n0, n1), m < M; x row stride ldx.
inline void dense_range(const float* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t M,
                        float* y, int64_t ldy) {
    float out[DENSE_ROWS];
    int64_t n = n0;
    for (; n + DENSE_ROWS <= n1; n += DENSE_ROWS)
        for (int64_t m = 0; m < M; m++) {
            dense_dots<DENSE_ROWS>(w + n * K, K, x + m * ldx, out);
            for (int64_t r = 0; r < DENSE_ROWS; r++) y[m * ldy + n + r] = out[r];
        }
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            dense_dots<1>(w + n * K, K, x + m * ldx, out);
            y[m * ldy + n] = out[0];
        }
}

}  // namespace
