// fp32 matmul of a float model's weights for the decode-plan executor (plan_decode.cpp):
// y[m, n] = x[m, :] · W[n, :] with W [N, K], row-major (F.linear's [out, in]), K a multiple of
// 16, its elements fp32, bf16 or IEEE halves (WF32, WBF16, WF16): 16-bit ones widened to fp32
// in registers, exactly, so a 16-bit W gives the bits of its fp32 copy and reads half the bytes.
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

#include <string.h>

#include <type_traits>

#include "quant_blocks.h"

namespace {

constexpr int64_t DENSE_ROWS = 4;               // rows of W a pass reads together
constexpr int64_t DENSE_PREFETCH_BYTES = 4096;  // ahead of each row's stream (a hint)

inline void dense_prefetch(const void* p) {
#if defined(__AVX2__)
    _mm_prefetch((const char*)p + DENSE_PREFETCH_BYTES, _MM_HINT_T0);
#else
    (void)p;
#endif
}

// W's element types: 16 of them (AVX2: 8) widened to fp32, exactly.
struct WF32 {
    using elem = float;
    static V16 load16(const float* p) { return vload(p); }
#if defined(__AVX2__) && !defined(__AVX512F__)
    static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif
};
struct WBF16 {                  // bf16: the high half of an fp32
    using elem = uint16_t;
#if defined(__AVX512F__)
    static V16 load16(const uint16_t* p) {
        return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
    }
#elif defined(__AVX2__)
    static __m256 load8(const uint16_t* p) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
    }
    static V16 load16(const uint16_t* p) { return {load8(p), load8(p + 8)}; }
#else
    static V16 load16(const uint16_t* p) {
        V16 r;
        for (int i = 0; i < 16; i++) {
            const uint32_t b = (uint32_t)p[i] << 16;
            memcpy(&r.f[i], &b, 4);
        }
        return r;
    }
#endif
};
struct WF16 {                   // IEEE halves (quant_blocks.h's vload_half)
    using elem = uint16_t;
    static V16 load16(const uint16_t* p) { return vload_half(p); }
#if defined(__AVX2__) && !defined(__AVX512F__)
    static __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif
};

// R rows of W (w, row stride K) against X rows of x (row stride ldx): out[i * R + r] = x_i · w_r
// in the contract's order; each chunk of W loaded once for the X rows.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: each V16 sum is two ymm (lanes 0-7 and 8-15, V16's own halves); a chunk's low halves
// are done for every (x row, W row) pair before its high halves, so that only one ymm of each
// row of x is live at a time: X * R * 2 accumulators, X of x, one of W. The same operations
// per lane as vmul and vfma on V16.
template <class W, int R, int X>
inline void dense_dots(const typename W::elem* w, int64_t K, const float* x, int64_t ldx, float* out) {
    V16 acc[X][R];
    for (int h = 0; h < 2; h++) {
        __m256 xv[X];
        for (int i = 0; i < X; i++) xv[i] = _mm256_loadu_ps(x + i * ldx + 8 * h);
        for (int r = 0; r < R; r++) {
            const __m256 wv = W::load8(w + r * K + 8 * h);
            for (int i = 0; i < X; i++) (h ? acc[i][r].b : acc[i][r].a) = _mm256_mul_ps(xv[i], wv);
        }
    }
    for (int64_t k = 16; k < K; k += 16) {
        for (int r = 0; r < R; r++) dense_prefetch(w + r * K + k);     // the line 4 KiB ahead
        for (int h = 0; h < 2; h++) {
            __m256 xv[X];
            for (int i = 0; i < X; i++) xv[i] = _mm256_loadu_ps(x + i * ldx + k + 8 * h);
            for (int r = 0; r < R; r++) {
                const __m256 wv = W::load8(w + r * K + k + 8 * h);
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
template <class W, int R, int X>
inline void dense_dots(const typename W::elem* w, int64_t K, const float* x, int64_t ldx, float* out) {
    V16 acc[X][R];
    for (int i = 0; i < X; i++) {
        const V16 x0 = vload(x + i * ldx);
        for (int r = 0; r < R; r++) acc[i][r] = vmul(x0, W::load16(w + r * K));
    }
    for (int64_t k = 16; k < K; k += 16) {
        for (int r = 0; r < R; r++) dense_prefetch(w + r * K + k);     // the line 4 KiB ahead
        V16 xv[X];
        for (int i = 0; i < X; i++) xv[i] = vload(x + i * ldx + k);
        for (int r = 0; r < R; r++) {
            const V16 wv = W::load16(w + r * K + k);
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
template <class W, int R, int X>
inline void dense_strip(const typename W::elem* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t m,
                        float* y, int64_t ldy) {
    float out[X * 4];
    auto tile = [&](auto rows, int64_t n) {
        constexpr int RR = decltype(rows)::value;
        dense_dots<W, RR, X>(w + n * K, K, x + m * ldx, ldx, out);
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
template <class W>
inline void dense_range(const typename W::elem* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t ldx,
                        int64_t M, float* y, int64_t ldy) {
    int64_t m = 0;
    if (M > 1)
        for (; m + BATCH_X <= M; m += BATCH_X) dense_strip<W, BATCH_W, BATCH_X>(w, K, n0, n1, x, ldx, m, y, ldy);
    for (; m < M; m++) dense_strip<W, DENSE_ROWS, 1>(w, K, n0, n1, x, ldx, m, y, ldy);
}

// A float matrix's element type as the callers name it (plan_decode.cpp's PlanWeight.format,
// row_ops.cpp's kvd_dense_matmul; kernels/row_ops.py's DENSE_FORMATS): fp32, bf16, IEEE halves.
constexpr int32_t FMT_F32 = 16, FMT_BF16 = 17, FMT_F16 = 18;

inline bool dense(int32_t format) { return format >= FMT_F32 && format <= FMT_F16; }
inline int64_t dense_elem_bytes(int32_t format) { return format == FMT_F32 ? 4 : 2; }

// dense_range for a W of element type `format` (dense(format)).
inline void dense_range_fmt(int32_t format, const void* w, int64_t K, int64_t n0, int64_t n1, const float* x,
                            int64_t ldx, int64_t M, float* y, int64_t ldy) {
    if (format == FMT_BF16)
        dense_range<WBF16>((const uint16_t*)w, K, n0, n1, x, ldx, M, y, ldy);
    else if (format == FMT_F16)
        dense_range<WF16>((const uint16_t*)w, K, n0, n1, x, ldx, M, y, ldy);
    else
        dense_range<WF32>((const float*)w, K, n0, n1, x, ldx, M, y, ldy);
}

}  // namespace
