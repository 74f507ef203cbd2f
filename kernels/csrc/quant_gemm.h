// GGUF block-quantized matmul with 16-bit activations, shared by quant_matmul.cpp (the
// standalone matmul) and plan_decode.cpp (the decode-step executor). Each .so is one
// translation unit that includes this once; the arithmetic contract is in
// quant_matmul.cpp's header comment, restated where each piece implements it.
//
//   x rows (fp32) --quantize_rows--> QRows: per 32-block b of a row
//                                      q[32] int16, d (x ≈ d q), s (fp32 sum of x), qs (sum of q)
//   W rows (GGUF blocks) x QRows ----> y: per output, per block, an exact integer dot
//                                      isum = sum q_w q_x, then d_w d_x isum (+ m_w s) in fp32
//
// The integer dot is exact whatever order computes it, so a path is free to reduce it
// however is fastest (pmaddwd pairs, a horizontal tree across 8 rows of W, VNNI); only
// the fp32 chain after it is fixed, and every path runs it the same.
#pragma once

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "quant_blocks.h"

namespace {

// [begin, end): part `part` of `parts` of n items (threads split output rows, never k)
inline void split(int64_t n, int parts, int part, int64_t* begin, int64_t* end) {
    *begin = n * part / parts;
    *end = n * (part + 1) / parts;
}

// ------------------------------------------------------------------ activations
constexpr float QX_MAX = 32767.0f;

// Rows of x quantized per 32-block. Row m, block b: x[m, 32b + i] ≈ d * q[i], |q| <= 32767.
struct QRows {
    int16_t* q;         // [M][K]
    float* d;           // [M][nb]  amax / 32767 (0 for an all-zero block)
    float* s;           // [M][nb]  sum of the block's 32 x in fp32, a fixed tree (Q4_1's m term)
    int32_t* qs;        // [M][nb]  sum of the block's 32 q (Q4_0's -8 term), exact
    int64_t K, nb;
};

// Owner of QRows storage for up to M rows of depth K.
struct QRowsBuf {
    std::vector<int16_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> qs;
    QRows rows(int64_t M, int64_t K) {
        const int64_t nb = K / QK;
        if ((int64_t)q.size() < M * K) q.resize((size_t)(M * K));
        if ((int64_t)d.size() < M * nb) { d.resize((size_t)(M * nb)); s.resize((size_t)(M * nb)); qs.resize((size_t)(M * nb)); }
        return {q.data(), d.data(), s.data(), qs.data(), K, nb};
    }
};

// One block: amax = max |x|; d = amax / 32767; q = round-half-even(x * (32767 / amax));
// s = ((x[j] + x[j+8]) + x[j+16]) + x[j+24] per j < 8, then (j + j+4) -> (j + j+2) -> (0 + 1).
// Every build computes each of these with the same fp32 operations, so they agree bit for bit.
inline void quantize_block(const float* x, int16_t* q, float* d, float* s, int32_t* qs) {
#if defined(__AVX2__)
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
                 x3 = _mm256_loadu_ps(x + 24);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, absmask), _mm256_and_ps(x1, absmask)),
                              _mm256_max_ps(_mm256_and_ps(x2, absmask), _mm256_and_ps(x3, absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const float inv = amax > 0.0f ? QX_MAX / amax : 0.0f;
    *d = amax / QX_MAX;
    const __m256 iv = _mm256_set1_ps(inv);
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, iv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, iv)),
                  q2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, iv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, iv));
    // packs works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7]; the permute puts a before b
    _mm256_storeu_si256((__m256i*)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8));
    _mm256_storeu_si256((__m256i*)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q2, q3), 0xD8));
    __m256i qsum = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    __m128i qs4 = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
    qs4 = _mm_add_epi32(qs4, _mm_shuffle_epi32(qs4, 0x4E));
    *qs = _mm_cvtsi128_si32(_mm_add_epi32(qs4, _mm_shuffle_epi32(qs4, 0xB1)));
    const __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(x0, x1), x2), x3);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    *s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
#else
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float inv = amax > 0.0f ? QX_MAX / amax : 0.0f;
    *d = amax / QX_MAX;
    int32_t sum = 0;
    for (int i = 0; i < QK; i++) {
        const float r = nearbyintf(x[i] * inv);      // the default rounding: half to even
        q[i] = (int16_t)(r > QX_MAX ? QX_MAX : r < -QX_MAX ? -QX_MAX : r);
        sum += q[i];
    }
    *qs = sum;
    float t[8], s4[4], s2[2];
    for (int j = 0; j < 8; j++) t[j] = ((x[j] + x[j + 8]) + x[j + 16]) + x[j + 24];
    for (int j = 0; j < 4; j++) s4[j] = t[j] + t[j + 4];
    for (int j = 0; j < 2; j++) s2[j] = s4[j] + s4[j + 2];
    *s = s2[0] + s2[1];
#endif
}

// Rows [m0, m1) of x (row stride ldx, depth K = out.K) into out.
inline void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, const QRows& out) {
    for (int64_t m = m0; m < m1; m++)
        for (int64_t b = 0; b < out.nb; b++) {
            const int64_t i = m * out.nb + b;
            quantize_block(x + m * ldx + b * QK, out.q + m * out.K + b * QK, &out.d[i], &out.s[i], &out.qs[i]);
        }
}

// ------------------------------------------------------------------ 8 rows of W, one block
// A group is 8 consecutive rows of W (fewer at the end of a range: `nr` live rows, the
// others read as zero blocks and their outputs dropped). For block b the group's weights
// are widened to int16 (Q4: the nibble values 0..15; Q8_0: the int8 values) and its
// fp16 scales converted:
//     dw[r] = d of row r, mw[r] = m of row r (Q4_1; 0 otherwise)
// then for each x row: isum[r] = sum_i qw[r][i] qx[i] (exact int32: |q_w| <= 128 and
// |q_x| <= 32767, 32 terms), minus 8 * qs for Q4_0 (its weights are q - 8), and the fp32
// chain of every output:
//     acc = fma(dw[r] * d_x, (float)isum[r], acc);   accm = fma(mw[r], s_x, accm)   (Q4_1)
//     y = acc + accm (Q4_1), acc (Q4_0, Q8_0)
// with acc, accm starting at 0 and blocks in order.

#if defined(__AVX2__)
// With AVX512BW, two rows of x run at once in 512-bit vectors (row m in the low 256 bits,
// row m + 1 in the high): the same integer dots, the same per-lane fp32 chain.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVD_GEMM_ROW_PAIRS 1
#endif

struct WGroup {
    __m256i w[8][2];                    // weights 0..15 and 16..31 of each row
    __m256 dw, mw;
#if KVD_GEMM_ROW_PAIRS
    __m512i w2[8][2];                   // each w twice, for a pair of x rows
#endif
};

inline __m256 fp16x8(__m256i lanes) {   // the low 16 bits of each 32-bit lane, fp16 -> fp32
    const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(lanes, _mm256_set1_epi32(0xffff)), lanes);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

// one block's 32 weights as int16: w0 = elements 0..15, w1 = 16..31
template <int F>
inline void widen(const uint8_t* blk, __m256i* w0, __m256i* w1) {
    if constexpr (F == Q8_0) {
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 2)));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 18)));
    } else {
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(blk + (F == Q4_1 ? 4 : 2))));
        *w0 = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
        *w1 = _mm256_srli_epi16(bytes, 4);
    }
}

// the fp16 d (and Q4_1's m) of block b in 8 rows (rows >= nr: 0), as fp32 lanes
template <int F>
inline void group_scales(const uint8_t* w, int64_t row_bytes, int64_t b, int nr, __m256* dw, __m256* mw) {
    int32_t h[8];
    for (int r = 0; r < 8; r++) {
        h[r] = 0;
        if (r < nr) memcpy(&h[r], w + r * row_bytes + b * block_bytes(F), 4);
    }
    // built in registers (a 32-byte load of 8 fresh 4-byte stores would stall on forwarding)
    const __m256i v = _mm256_setr_epi32(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
    *dw = fp16x8(v);
    *mw = F == Q4_1 ? fp16x8(_mm256_srli_epi32(v, 16)) : _mm256_setzero_ps();
}

// A group is 8 whole rows, one contiguous run of 8 * row_bytes. While block b of a group is
// read, block b's even share of the cache lines PREFETCH_GROUPS groups ahead is prefetched
// (8 rows interleaved by block are more streams than the hardware prefetcher follows; the
// LM head streams from DRAM). A hint: no effect on any result; past the matrix's end it is
// dropped (prefetches do not fault).
constexpr int64_t PREFETCH_GROUPS = 2;

// The share of block b is bytes [8 b bb, 8 (b + 1) bb) of the group's run, bb = block_bytes(F)
// (the run is 8 nb blocks long): no division in the loop.
template <int F>
inline void prefetch_ahead(const uint8_t* group, int64_t row_bytes, int64_t b) {
    const char* next = (const char*)(group + PREFETCH_GROUPS * 8 * row_bytes);
    constexpr int64_t share = 8 * block_bytes(F);
    for (int64_t at = (b * share) & ~(int64_t)63; at < (b + 1) * share; at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
}

template <int F>
inline void load_group(const uint8_t* w, int64_t row_bytes, int64_t b, int nr, WGroup* g) {
    prefetch_ahead<F>(w, row_bytes, b);
    for (int r = 0; r < 8; r++) {
        if (r >= nr) {
            g->w[r][0] = g->w[r][1] = _mm256_setzero_si256();
            continue;
        }
        widen<F>(w + r * row_bytes + b * block_bytes(F), &g->w[r][0], &g->w[r][1]);
    }
    group_scales<F>(w, row_bytes, b, nr, &g->dw, &g->mw);
#if KVD_GEMM_ROW_PAIRS
    for (int r = 0; r < 8; r++)
        for (int h = 0; h < 2; h++) g->w2[r][h] = _mm512_inserti64x4(_mm512_castsi256_si512(g->w[r][h]), g->w[r][h], 1);
#endif
}

inline __m256i dot_pairs(__m256i w0, __m256i w1, __m256i x0, __m256i x1) {   // 8 lanes, each 4 products
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(w0, x0), w1, x1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
#endif
}

// lane r = the sum of p[r]'s 8 lanes
inline __m256i hsum8(const __m256i p[8]) {
    __m256i t[4];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    // t[i] = [a0+a2, b0+b2, a1+a3, b1+b3 | ...] for (a, b) = (p[2i], p[2i+1])
    const __m256i u0 = _mm256_add_epi32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
    const __m256i u1 = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
    // u0 = [p0 p1 p2 p3 | p0 p1 p2 p3] halves summed per 128-bit lane
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

struct Acc { __m256 acc, accm; };

template <int F>
inline void group_block_row(const WGroup& g, const int16_t* xq, float dx, float sx, int32_t qsx, Acc* a) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i*)xq), x1 = _mm256_loadu_si256((const __m256i*)(xq + 16));
    __m256i p[8];
    for (int r = 0; r < 8; r++) p[r] = dot_pairs(g.w[r][0], g.w[r][1], x0, x1);
    __m256i isum = hsum8(p);
    if constexpr (F == Q4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * qsx));
    a->acc = _mm256_fmadd_ps(_mm256_mul_ps(g.dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(isum), a->acc);
    if constexpr (F == Q4_1) a->accm = _mm256_fmadd_ps(g.mw, _mm256_set1_ps(sx), a->accm);
}

#if KVD_GEMM_ROW_PAIRS
inline __m512 f32x2(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline __m256 f32_hi(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// hsum8 for two rows at once: lane r of each 256-bit half = the sum of that half's p[r]
inline __m512i hsum8x2(const __m512i p[8]) {
    __m512i t[4];
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
    const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
    // 128-bit lanes of u0: [row m: p0-3 of elements 0-3, of 4-7 | row m+1: the same]; u1: p4-7
    const __m512i lo = _mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i hi = _mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i sum = _mm512_add_epi32(lo, hi);          // [m p0-3, m+1 p0-3, m p4-7, m+1 p4-7]
    return _mm512_shuffle_i64x2(sum, sum, _MM_SHUFFLE(3, 1, 2, 0));
}

struct Acc2 { __m512 acc, accm; };      // rows m (low half) and m + 1 (high half)

// group_block_row for rows a (low half) and b (high half): per lane the same operations
template <int F>
inline void group_block_2rows(const WGroup& g, const QRows& x, int64_t ma, int64_t b, Acc2* a) {
    const int64_t ia = ma * x.nb + b, ib = ia + x.nb;
    const int16_t* xa = x.q + ma * x.K + b * QK;
    const int16_t* xb = xa + x.K;
    const __m512i x0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)xa)),
                                          _mm256_loadu_si256((const __m256i*)xb), 1);
    const __m512i x1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(xa + 16))),
                                          _mm256_loadu_si256((const __m256i*)(xb + 16)), 1);
    __m512i p[8];
    for (int r = 0; r < 8; r++) {
#if defined(__AVX512VNNI__)
        p[r] = _mm512_dpwssd_epi32(_mm512_madd_epi16(g.w2[r][0], x0), g.w2[r][1], x1);
#else
        p[r] = _mm512_add_epi32(_mm512_madd_epi16(g.w2[r][0], x0), _mm512_madd_epi16(g.w2[r][1], x1));
#endif
    }
    __m512i isum = hsum8x2(p);
    if constexpr (F == Q4_0)
        isum = _mm512_sub_epi32(isum, _mm512_inserti64x4(_mm512_set1_epi32(8 * x.qs[ia]),
                                                         _mm256_set1_epi32(8 * x.qs[ib]), 1));
    const __m512 dx = f32x2(_mm256_set1_ps(x.d[ia]), _mm256_set1_ps(x.d[ib]));
    a->acc = _mm512_fmadd_ps(_mm512_mul_ps(f32x2(g.dw, g.dw), dx), _mm512_cvtepi32_ps(isum), a->acc);
    if constexpr (F == Q4_1)
        a->accm = _mm512_fmadd_ps(f32x2(g.mw, g.mw), f32x2(_mm256_set1_ps(x.s[ia]), _mm256_set1_ps(x.s[ib])), a->accm);
}
#endif

// One x row against a full group of 8 W rows, every block: the decode step's shape, kept in
// registers (the same chain as group_block_row, which would widen the group into memory).
template <int F>
inline void group_one_row(const uint8_t* w, int64_t row_bytes, const QRows& x, int64_t m, Acc* a) {
    const int16_t* xq = x.q + m * x.K;
    for (int64_t b = 0; b < x.nb; b++) {
        prefetch_ahead<F>(w, row_bytes, b);
        const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + b * QK));
        const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + b * QK + 16));
        __m256i p[8];
        for (int r = 0; r < 8; r++) {
            const uint8_t* blk = w + r * row_bytes + b * block_bytes(F);
            __m256i w0, w1;
            widen<F>(blk, &w0, &w1);
            p[r] = dot_pairs(w0, w1, x0, x1);
        }
        __m256i isum = hsum8(p);
        const int64_t i = m * x.nb + b;
        if constexpr (F == Q4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * x.qs[i]));
        // the 8 rows' scales: ~16 ops a block, a quarter of the block's work (an AVX2
        // gather of the 8 words measured 5-15% slower on Zen 3)
        __m256 dw, mw;
        group_scales<F>(w, row_bytes, b, 8, &dw, &mw);
        a->acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x.d[i])), _mm256_cvtepi32_ps(isum), a->acc);
        if constexpr (F == Q4_1) a->accm = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[i]), a->accm);
    }
}

template <int F>
inline void store_group(const Acc& a, float* y, int nr) {
    alignas(32) float out[8];
    _mm256_store_ps(out, F == Q4_1 ? _mm256_add_ps(a.acc, a.accm) : a.acc);
    for (int r = 0; r < nr; r++) y[r] = out[r];
}
#else
struct WGroup { int16_t w[8][QK]; float dw[8], mw[8]; };

template <int F>
inline void load_group(const uint8_t* w, int64_t row_bytes, int64_t b, int nr, WGroup* g) {
    for (int r = 0; r < 8; r++) {
        g->dw[r] = g->mw[r] = 0.0f;
        for (int i = 0; i < QK; i++) g->w[r][i] = 0;
        if (r >= nr) continue;
        const uint8_t* blk = w + r * row_bytes + b * block_bytes(F);
        g->dw[r] = fp16_to_f32(blk);
        if constexpr (F == Q8_0) {
            for (int i = 0; i < QK; i++) g->w[r][i] = (int8_t)blk[2 + i];
        } else {
            const uint8_t* qs = blk + (F == Q4_1 ? 4 : 2);
            if constexpr (F == Q4_1) g->mw[r] = fp16_to_f32(blk + 2);
            for (int i = 0; i < 16; i++) { g->w[r][i] = qs[i] & 15; g->w[r][i + 16] = qs[i] >> 4; }
        }
    }
}

struct Acc { float acc[8], accm[8]; };

template <int F>
inline void group_block_row(const WGroup& g, const int16_t* xq, float dx, float sx, int32_t qsx, Acc* a) {
    for (int r = 0; r < 8; r++) {
        int32_t isum = 0;
        for (int i = 0; i < QK; i++) isum += (int32_t)g.w[r][i] * xq[i];
        if constexpr (F == Q4_0) isum -= 8 * qsx;
        a->acc[r] = fmaf(g.dw[r] * dx, (float)isum, a->acc[r]);
        if constexpr (F == Q4_1) a->accm[r] = fmaf(g.mw[r], sx, a->accm[r]);
    }
}

template <int F>
inline void store_group(const Acc& a, float* y, int nr) {
    for (int r = 0; r < nr; r++) y[r] = F == Q4_1 ? a.acc[r] + a.accm[r] : a.acc[r];
}
#endif

inline Acc acc_zero() { Acc a; memset(&a, 0, sizeof a); return a; }

// ------------------------------------------------------------------ a range of W rows
// Rows of x are taken in chunks of ROW_CHUNK (their quantized blocks, ~100 KiB at K = 1536,
// stay in L2 while every group of W passes over them); within a chunk each group of W
// is widened block by block once and applied to every row. The order in which rows,
// groups and blocks are visited changes no output: each is its own chain over blocks.
constexpr int64_t ROW_CHUNK = 32;         // 8 and 96 measured 1.6-2.5x slower (Zen 3)
// Up to this many rows of x run the one-row register path each (the group's bytes stay in
// L1 after the first): faster than widening the group into memory at 2 rows, not at 4.
constexpr int64_t ONE_ROW_MAX = 2;

// y[m, n] for n in [n0, n1), m < M. W is format F, [N, K] with K = x.K.
template <int F>
void matmul_range(const uint8_t* w, int64_t n0, int64_t n1, const QRows& x, int64_t M, float* y, int64_t ldy) {
    const int64_t nb = x.nb, row_bytes = nb * block_bytes(F);
    Acc acc[ROW_CHUNK];
#if KVD_GEMM_ROW_PAIRS
    Acc2 acc2[ROW_CHUNK / 2];
#endif
    WGroup g;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        const int64_t mc = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
        for (int64_t n = n0; n < n1; n += 8) {
            const int nr = n1 - n < 8 ? (int)(n1 - n) : 8;
            for (int64_t m = 0; m < mc; m++) acc[m] = acc_zero();
#if defined(__AVX2__)
            if (mc <= ONE_ROW_MAX && nr == 8) {
                for (int64_t m = 0; m < mc; m++) {
                    group_one_row<F>(w + n * row_bytes, row_bytes, x, m0 + m, &acc[m]);
                    store_group<F>(acc[m], y + (m0 + m) * ldy + n, nr);
                }
                continue;
            }
#endif
#if KVD_GEMM_ROW_PAIRS
            const int64_t pairs = mc / 2;
            for (int64_t p = 0; p < pairs; p++) acc2[p] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
#else
            const int64_t pairs = 0;
#endif
            for (int64_t b = 0; b < nb; b++) {
                load_group<F>(w + n * row_bytes, row_bytes, b, nr, &g);
#if KVD_GEMM_ROW_PAIRS
                for (int64_t p = 0; p < pairs; p++) group_block_2rows<F>(g, x, m0 + 2 * p, b, &acc2[p]);
#endif
                for (int64_t m = 2 * pairs; m < mc; m++) {
                    const int64_t i = (m0 + m) * nb + b;
                    group_block_row<F>(g, x.q + (m0 + m) * x.K + b * QK, x.d[i], x.s[i], x.qs[i], &acc[m]);
                }
            }
#if KVD_GEMM_ROW_PAIRS
            for (int64_t p = 0; p < pairs; p++) {
                acc[2 * p] = {_mm512_castps512_ps256(acc2[p].acc), _mm512_castps512_ps256(acc2[p].accm)};
                acc[2 * p + 1] = {f32_hi(acc2[p].acc), f32_hi(acc2[p].accm)};
            }
#endif
            for (int64_t m = 0; m < mc; m++) store_group<F>(acc[m], y + (m0 + m) * ldy + n, nr);
        }
    }
}

// The same for a format known only at run time (false: unknown format).
inline bool matmul_range(int format, const uint8_t* w, int64_t n0, int64_t n1, const QRows& x, int64_t M, float* y,
                         int64_t ldy) {
    switch (format) {
        case Q4_0: matmul_range<Q4_0>(w, n0, n1, x, M, y, ldy); return true;
        case Q4_1: matmul_range<Q4_1>(w, n0, n1, x, M, y, ldy); return true;
        case Q8_0: matmul_range<Q8_0>(w, n0, n1, x, M, y, ldy); return true;
        default: return false;
    }
}

// This thread's share of N output rows: whole groups of 8, so no group straddles two threads.
inline void split_rows(int64_t N, int parts, int part, int64_t* n0, int64_t* n1) {
    int64_t g0, g1;
    split((N + 7) / 8, parts, part, &g0, &g1);
    *n0 = g0 * 8 < N ? g0 * 8 : N;
    *n1 = g1 * 8 < N ? g1 * 8 : N;
}

// ------------------------------------------------------------------ embedding rows
// out[t, :] = row ids[t] of W (format F, [N, K]) dequantized exactly; ids already checked.
template <int F>
void gather_rows(const uint8_t* w, int64_t K, const int64_t* ids, int64_t T, float* out) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(F);
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b++) {
            V16 lo, hi;
            dequant_block<F>(w + ids[t] * row_bytes + b * block_bytes(F), &lo, &hi);
            vstore(out + t * K + b * QK, lo);
            vstore(out + t * K + b * QK + 16, hi);
        }
}

inline bool gather_rows_any(int format, const uint8_t* w, int64_t K, const int64_t* ids, int64_t T, float* out) {
    switch (format) {
        case Q4_0: gather_rows<Q4_0>(w, K, ids, T, out); return true;
        case Q4_1: gather_rows<Q4_1>(w, K, ids, T, out); return true;
        case Q8_0: gather_rows<Q8_0>(w, K, ids, T, out); return true;
        default: return false;
    }
}

}  // namespace
