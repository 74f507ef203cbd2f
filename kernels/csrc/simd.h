// A register tile for fp32 outer-product kernels (quant_gemm.h's packed GEMM): VN is one
// vector of GEMM_VW floats; a tile is GEMM_MR rows by GEMM_NR = 2 vectors of columns. Every build does the same fp32 operations
// per lane (vn_fma is one fused multiply-add), only the widths differ.
#pragma once

#include "variant.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int GEMM_MR = 8, GEMM_VW = 16;        // 16 accumulators of 32 zmm registers
struct VN { __m512 v; };
inline VN vn_zero() { return {_mm512_setzero_ps()}; }
inline VN vn_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vn_store(float* p, VN a) { _mm512_storeu_ps(p, a.v); }
inline VN vn_bcast(const float* p) { return {_mm512_set1_ps(*p)}; }
inline VN vn_fma(VN a, VN b, VN c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VN vn_add(VN a, VN b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VN vn_sub(VN a, VN b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VN vn_mul(VN a, VN b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VN vn_max(VN a, VN b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VN vn_set1(float f) { return {_mm512_set1_ps(f)}; }
inline VN vn_floor(VN a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
inline VN vn_pow2i(VN n) {          // 2^n for an integral n in [-126, 127]
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
inline VN vn_zero_below(VN v, VN x, float lim) {       // v where x >= lim, else 0
    return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(lim), _CMP_GE_OQ), v.v)};
}
inline VN vn_div(VN a, VN b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VN vn_select_ge0(VN x, VN a, VN b) {             // a where x >= 0, else b (NaN: b)
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_GE_OQ), b.v, a.v)};
}
#elif defined(__AVX2__)
constexpr int GEMM_MR = 6, GEMM_VW = 8;         // 12 accumulators + 2 of W + 1 of x: 15 of 16 ymm
struct VN { __m256 v; };
inline VN vn_zero() { return {_mm256_setzero_ps()}; }
inline VN vn_load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vn_store(float* p, VN a) { _mm256_storeu_ps(p, a.v); }
inline VN vn_bcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
inline VN vn_fma(VN a, VN b, VN c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VN vn_add(VN a, VN b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VN vn_sub(VN a, VN b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VN vn_mul(VN a, VN b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VN vn_max(VN a, VN b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VN vn_set1(float f) { return {_mm256_set1_ps(f)}; }
inline VN vn_floor(VN a) { return {_mm256_floor_ps(a.v)}; }
inline VN vn_pow2i(VN n) {          // 2^n for an integral n in [-126, 127]
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23))};
}
inline VN vn_zero_below(VN v, VN x, float lim) {       // v where x >= lim, else 0
    return {_mm256_and_ps(v.v, _mm256_cmp_ps(x.v, _mm256_set1_ps(lim), _CMP_GE_OQ))};
}
inline VN vn_div(VN a, VN b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VN vn_select_ge0(VN x, VN a, VN b) {             // a where x >= 0, else b (NaN: b)
    return {_mm256_blendv_ps(b.v, a.v, _mm256_cmp_ps(x.v, _mm256_setzero_ps(), _CMP_GE_OQ))};
}
#else
constexpr int GEMM_MR = 4, GEMM_VW = 8;
struct VN { float f[8]; };
inline VN vn_zero() { VN r; for (int i = 0; i < 8; i++) r.f[i] = 0.0f; return r; }
inline VN vn_load(const float* p) { VN r; memcpy(r.f, p, sizeof r.f); return r; }
inline void vn_store(float* p, VN a) { memcpy(p, a.f, sizeof a.f); }
inline VN vn_bcast(const float* p) { VN r; for (int i = 0; i < 8; i++) r.f[i] = *p; return r; }
inline VN vn_fma(VN a, VN b, VN c) { VN r; for (int i = 0; i < 8; i++) r.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); return r; }
#define KVD_VN_LANES(expr) VN r; for (int i = 0; i < 8; i++) r.f[i] = (expr); return r
inline VN vn_add(VN a, VN b) { KVD_VN_LANES(a.f[i] + b.f[i]); }
inline VN vn_sub(VN a, VN b) { KVD_VN_LANES(a.f[i] - b.f[i]); }
inline VN vn_mul(VN a, VN b) { KVD_VN_LANES(a.f[i] * b.f[i]); }
inline VN vn_max(VN a, VN b) { KVD_VN_LANES(a.f[i] > b.f[i] ? a.f[i] : b.f[i]); }
inline VN vn_set1(float f) { KVD_VN_LANES(f); }
inline VN vn_floor(VN a) { KVD_VN_LANES(floorf(a.f[i])); }
inline VN vn_pow2i(VN n) { KVD_VN_LANES(ldexpf(1.0f, (int)n.f[i])); }
inline VN vn_zero_below(VN v, VN x, float lim) { KVD_VN_LANES(x.f[i] >= lim ? v.f[i] : 0.0f); }
inline VN vn_div(VN a, VN b) { KVD_VN_LANES(a.f[i] / b.f[i]); }
inline VN vn_select_ge0(VN x, VN a, VN b) { KVD_VN_LANES(x.f[i] >= 0.0f ? a.f[i] : b.f[i]); }
#undef KVD_VN_LANES
#endif
constexpr int GEMM_NV = 2, GEMM_NR = GEMM_NV * GEMM_VW;

// e^x for x <= 0 (Cephes' expf: x = n ln2 + r, a polynomial for e^r, times 2^n), within
// 2 ulp; 0 for x < -87 (and for -inf, a masked score). Every build runs these
// operations per lane, so they agree bit for bit.
inline VN vn_exp(VN x) {
    const VN xc = vn_max(x, vn_set1(-87.0f));
    const VN n = vn_floor(vn_fma(xc, vn_set1(1.44269504088896341f), vn_set1(0.5f)));
    VN r = vn_fma(n, vn_set1(-0.693359375f), xc);
    r = vn_fma(n, vn_set1(2.12194440e-4f), r);
    VN y = vn_set1(1.9875691500e-4f);
    y = vn_fma(y, r, vn_set1(1.3981999507e-3f));
    y = vn_fma(y, r, vn_set1(8.3334519073e-3f));
    y = vn_fma(y, r, vn_set1(4.1665795894e-2f));
    y = vn_fma(y, r, vn_set1(1.6666665459e-1f));
    y = vn_fma(y, r, vn_set1(5.0000001201e-1f));
    y = vn_add(vn_fma(y, vn_mul(r, r), r), vn_set1(1.0f));
    return vn_zero_below(vn_mul(y, vn_pow2i(n)), x, -87.0f);
}

// Lane sums of 16 floats whatever the build's vector width (attention_rows.h's exp_sum)
constexpr int SUM_LANES = 16;
constexpr int SUM_VECS = SUM_LANES / GEMM_VW;

// c[r][0..GEMM_NR) (row stride ldc) = (ACCUM ? c : 0) + sum over t < T of a(r, t) * b[t * ldb + 0..GEMM_NR)
// for r < GEMM_MR: one outer product per t, so each output is one fma chain over t in
// order. a(r, t) is a[t * GEMM_MR + r] when A_PACKED (a packed panel), else a[r * lda + t].
template <bool ACCUM, bool A_PACKED>
inline void outer_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t T, float* c,
                       int64_t ldc) {
    VN acc[GEMM_MR][GEMM_NV];
    for (int r = 0; r < GEMM_MR; r++)
        for (int v = 0; v < GEMM_NV; v++) acc[r][v] = ACCUM ? vn_load(c + r * ldc + v * GEMM_VW) : vn_zero();
    for (int64_t t = 0; t < T; t++) {
        VN bv[GEMM_NV];
        for (int v = 0; v < GEMM_NV; v++) bv[v] = vn_load(b + t * ldb + v * GEMM_VW);
        for (int r = 0; r < GEMM_MR; r++) {
            const VN x = vn_bcast(A_PACKED ? a + t * GEMM_MR + r : a + r * lda + t);
            for (int v = 0; v < GEMM_NV; v++) acc[r][v] = vn_fma(x, bv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < GEMM_MR; r++)
        for (int v = 0; v < GEMM_NV; v++) vn_store(c + r * ldc + v * GEMM_VW, acc[r][v]);
}

}  // namespace
