// GGUF blocks in registers: the formats, fp16 scales, a 16-lane fp32 vector (V16) and
// one block's 32 weights dequantized exactly (dequant_block). Included by quant_gemm.h;
// the arithmetic contract is in quant_matmul.cpp's header comment.
#pragma once

#include "variant.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Q4_0, Q4_1, Q8_0: ggml's blocks as the file has them. The others are kvd's own, what
// kernels/kquant_repack.py makes at load of the K-quants, Q5_0 / Q5_1 and IQ4_NL / IQ4_XS,
// every weight's value kept, every field a 16-bit word.
//
// KQ5_0, KQ5_1: ggml's Q5_0 / Q5_1 blocks at the file's size, their u32 qh bits permuted into
// the hbits order, every field a 16-bit word:
//
//     KQ5_0  22 B  fp16 d, u32 hbits, 16 B nibbles            w = d * (q + 16 h - 16)
//     KQ5_1  24 B  fp16 d, fp16 m, u32 hbits, 16 B nibbles    w = d * (q + 16 h) + m
//
// (hbits: bit t (t < 8) = high bit of weight 2t, bit 8 + t: of 2t + 16, bit 16 + t: of 2t + 1,
// bit 24 + t: of 2t + 17: so that the 16-bit lane 2r + j of the x8 layout's two hbits words,
// interleaved, holds every high bit row r's quant word t needs at its lane: bit t, 8 + t).
//
// KS4, KS5, KS6: Q4_K / Q5_K / Q6_K super-blocks of 256 weights at the file's size (KS4, KS5:
// 4 bytes more), every field a 16-bit word, the sub-block scales small integers that the
// kernels multiply by the fp16 super-block scale in registers (exact: the file's fp32 scales,
// so the same bits):
//
//     KS4  148 B  fp16 d, fp16 dmin, 8 x (u8 sc, u8 m), 8 x [16 B nibbles]
//                 sub-block s: w = (d sc_s) q - dmin m_s
//     KS5  180 B  the same, 8 x [u32 hbits, 16 B nibbles]           q + 16 h for q
//     KS6  210 B  fp16 d, 16 x int8 sc, 8 x [16 B nibbles, 8 B highs]
//                 sub-block s: w = (d sc_2s) (q - 32) (weights 0..15), (d sc_2s+1) (q - 32)
//
// (nibbles as in a Q4 block; KS6's q = nibble + 16 hi, hi's two bits stored XOR 2 (so that
// they read as the signed hi - 2): high byte 2u + j holds in nibble e (t = 2u + e) the bits of
// weight 2t + j (bits 0, 1) and of 2t + 16 + j (bits 2, 3)).
//
// KS2: Q2_K's super-block at the file's size, its fields regrouped into 16-bit words, a scale
// and a min per 16 weights:
//
//     KS2   84 B  fp16 d, fp16 dmin, 16 x u8 (sc | m << 4), 8 x [8 B of 2-bit quants]
//                 weights 16k .. 16k + 15: w = (d sc_k) q - dmin m_k     (q 0..3)
//
// (sub-block s's byte 2u + j holds in bits 2e, 2e + 1 (e < 4) the quant of weight 2t + j,
// t = u + 4e: so a 16-bit word u carries pairs u, u + 4 (weights 0..15) and u + 8, u + 12
// (16..31) of every row)
//
// KS3: Q3_K's super-block, its 6-bit scales widened to bytes (4 bytes more), a scale per 16:
//
//     KS3  114 B  fp16 d, 16 x int8 sc, 8 x [u32 hbits, 8 B of 2-bit quants]
//                 weights 16k .. 16k + 15: w = (d sc_k) (q + 4 h - 4)       (-4 .. 3)
//
// (sc: the file's 6-bit scale - 32; h: its hmask bit, in the hbits order; the 2-bit quants
// as KS2's)
//
// KI4, KSI4: IQ4_NL's block as the file has it, IQ4_XS's super-block with its 6-bit scales
// widened to bytes (2 bytes more); the nibbles index IQ4's 16 int8 values (IQ4_VALUES):
//
//     KI4    18 B  fp16 d, 16 B nibbles                       w = d * v[q]
//     KSI4  138 B  fp16 d, 8 x int8 sc, 8 x [16 B nibbles]    sub-block s: w = (d sc_s) v[q]
enum Format { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, KQ5_0 = 3, KQ5_1 = 4, KI4 = 5, KS4 = 6, KS5 = 7, KS6 = 8, KS2 = 9,
              KS3 = 10, KSI4 = 11 };
constexpr int FORMAT_LAST = KSI4;                // formats are 0 .. FORMAT_LAST
constexpr int QK = 32;                          // weights per block (a super-block's sub-block)
constexpr int SUBS = 8;                         // sub-blocks of a super-block

constexpr bool super_block(int f) { return f >= KS4; }
constexpr int64_t block_weights(int f) { return super_block(f) ? SUBS * QK : QK; }
constexpr int64_t block_bytes(int f) {
    return f == Q4_0 ? 18 : f == Q4_1 ? 20 : f == Q8_0 ? 34 : f == KQ5_0 ? 22 : f == KQ5_1 ? 24 : f == KS4 ? 148
           : f == KS5 ? 180 : f == KS6 ? 210 : f == KS2 ? 84 : f == KS3 ? 114 : f == KI4 ? 18 : 138;
}
// a super-block's bytes before its sub-blocks, and each sub-block's
constexpr int64_t head_bytes(int f) { return f == KS6 || f == KS3 ? 18 : f == KSI4 ? 10 : 20; }
constexpr int64_t sub_bytes(int f) {
    return f == KS4 || f == KSI4 ? 16 : f == KS5 ? 20 : f == KS2 ? 8 : f == KS3 ? 12 : 24;
}
constexpr bool has_min(int f) { return f == Q4_1 || f == KQ5_1 || f == KS4 || f == KS5 || f == KS2; }
constexpr bool int8_quants(int f) { return f == Q8_0; }              // else nibbles (KS2, KS3: 2 bits)
constexpr bool has_hbits(int f) { return f == KQ5_0 || f == KQ5_1 || f == KS5 || f == KS3; }  // 5-bit (KS3: 3-bit)
constexpr bool two_scales(int f) { return f == KS6 || f == KS2 || f == KS3; }    // a scale per 16 weights
constexpr bool two_bit_quants(int f) { return f == KS2 || f == KS3; }             // (KS3: and its hbits)
constexpr bool iq4_values(int f) { return f == KI4 || f == KSI4; }                // nibbles index IQ4_VALUES
// IQ4_NL / IQ4_XS's values (ggml's kvalues_iq4nl)
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr bool mins16(int f) { return f == KS2; }                                 // and a min per 16
// the offset every quant carries (w = d * (q - zero_point)): taken off the integer dot as
// zero_point * (sum of x's q), exact
constexpr int zero_point(int f) { return f == Q4_0 ? 8 : f == KQ5_0 ? 16 : 0; }
// a 16-bit-word format's byte offset of its u32 hbits in a block (after d, and m if any; KS5:
// in a sub-block)
constexpr int64_t hbits_at(int f) { return f == KQ5_0 ? 2 : f == KS5 || f == KS3 ? 0 : 4; }

inline float fp16_to_f32(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    // exact: a half is (1024 + man) * 2^(exp - 25), or man * 2^-24 when subnormal
    const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f = exp == 0 ? ldexpf((float)man, -24)
              : exp == 31 ? (man ? NAN : INFINITY)
              : ldexpf((float)(man | 0x400), exp - 25);
    return (h & 0x8000) ? -f : f;
#endif
}

// ------------------------------------------------------------------ V16: 16 fp32 lanes
#if defined(__AVX512F__)
struct V16 { __m512 v; };
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vset1(float f) { return {_mm512_set1_ps(f)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline __m256 fold16(V16 a) {      // lanes j + j+8
    __m256 lo = _mm512_castps512_ps256(a.v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
    return _mm256_add_ps(lo, hi);
}
inline V16 i8_to_v16(const uint8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}
// 16 bytes of nibbles -> lo: the 16 low nibbles, hi: the 16 high nibbles (as floats)
inline void nibbles(const uint8_t* p, V16* lo, V16* hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));    // one byte per lane
    *lo = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))};
    *hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
}
// fp16 d and m at p, p + 2 -> broadcast fp32
inline void scales(const uint8_t* p, V16* d, V16* m) {
    int32_t bits;
    memcpy(&bits, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    *d = {_mm512_broadcastss_ps(dm)};
    *m = {_mm512_broadcastss_ps(_mm_movehdup_ps(dm))};
}
#elif defined(__AVX2__)
struct V16 { __m256 a, b; };    // lanes 0-7, 8-15
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 a) { _mm256_storeu_ps(p, a.a); _mm256_storeu_ps(p + 8, a.b); }
inline V16 vset1(float f) { __m256 v = _mm256_set1_ps(f); return {v, v}; }
inline V16 vmul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline V16 vsub(V16 x, V16 y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
inline V16 vadd(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline V16 vfma(V16 x, V16 y, V16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline __m256 fold16(V16 x) { return _mm256_add_ps(x.a, x.b); }
inline V16 i8_to_v16(const uint8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
// 16 bytes of nibbles -> lo: the 16 low nibbles, hi: the 16 high nibbles (as floats).
// Widen bytes to dwords straight from memory, then mask/shift: 6 ops, no lane shuffles.
inline void nibbles(const uint8_t* p, V16* lo, V16* hi) {
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
    const __m256i mask = _mm256_set1_epi32(15);
    *lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask))};
    *hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
}
// fp16 d and m at p, p + 2 -> broadcast fp32 (one conversion for both)
inline void scales(const uint8_t* p, V16* d, V16* m) {
    int32_t bits;
    memcpy(&bits, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    const __m256 dv = _mm256_broadcastss_ps(dm), mv = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    *d = {dv, dv};
    *m = {mv, mv};
}
#else
struct V16 { float f[16]; };
inline V16 vzero() { V16 r; for (int i = 0; i < 16; i++) r.f[i] = 0.0f; return r; }
inline V16 vload(const float* p) { V16 r; memcpy(r.f, p, sizeof r.f); return r; }
inline void vstore(float* p, V16 a) { memcpy(p, a.f, sizeof a.f); }
inline V16 vset1(float v) { V16 r; for (int i = 0; i < 16; i++) r.f[i] = v; return r; }
inline V16 vmul(V16 x, V16 y) { V16 r; for (int i = 0; i < 16; i++) r.f[i] = x.f[i] * y.f[i]; return r; }
inline V16 vsub(V16 x, V16 y) { V16 r; for (int i = 0; i < 16; i++) r.f[i] = x.f[i] - y.f[i]; return r; }
inline V16 vadd(V16 x, V16 y) { V16 r; for (int i = 0; i < 16; i++) r.f[i] = x.f[i] + y.f[i]; return r; }
inline V16 vfma(V16 x, V16 y, V16 z) { V16 r; for (int i = 0; i < 16; i++) r.f[i] = fmaf(x.f[i], y.f[i], z.f[i]); return r; }
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
// The fixed tree: (j + j+8) -> (j + j+4) -> (j + j+2) -> (0 + 1).
inline float vsum(V16 x) {
    __m256 s8 = fold16(x);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#else
inline float vsum(V16 x) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = x.f[i] + x.f[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}
inline void nibbles(const uint8_t* p, V16* lo, V16* hi) {
    for (int i = 0; i < 16; i++) { lo->f[i] = (float)(p[i] & 15); hi->f[i] = (float)(p[i] >> 4); }
}
inline V16 i8_to_v16(const uint8_t* p) {
    V16 r;
    for (int i = 0; i < 16; i++) r.f[i] = (float)(int8_t)p[i];
    return r;
}
inline void scales(const uint8_t* p, V16* d, V16* m) {
    *d = vset1(fp16_to_f32(p));
    *m = vset1(fp16_to_f32(p + 2));
}
#endif

// ------------------------------------------------------------------ fp16 KV rows
// A KV cache of IEEE halves (kv_cache_dtype = "float16", engine/config.py): 16 halves widened
// to fp32 (exact), and fp32 rows stored as halves the way the torch path stores them
// (kernels/attention.py, store_kv): clamped to +-65504, the largest finite half (NaN stays
// NaN), then rounded to nearest even, subnormal halves included. Every build, the same bits.
constexpr float HALF_MAX = 65504.0f;

inline float half_to_f32(uint16_t h) { return fp16_to_f32((const uint8_t*)&h); }

inline uint16_t f32_to_half(float f) {
#if defined(__F16C__)
    const __m128 c = _mm_min_ss(_mm_set_ss(HALF_MAX), _mm_max_ss(_mm_set_ss(-HALF_MAX), _mm_set_ss(f)));
    return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));     // NaN stays NaN
    float a;
    memcpy(&a, &ax, 4);
    if (a >= HALF_MAX) return (uint16_t)(sign | 0x7bff);                              // clamped
    if (a < 6.103515625e-05f) {                 // below the smallest normal half: steps of 2^-24
        const float r = nearbyintf(a * 16777216.0f);                                   // exact scaling
        return (uint16_t)(sign | (uint16_t)r);  // r <= 1024: 1024 is the smallest normal, as it should be
    }
    // normal: drop 13 mantissa bits, rounding to nearest even (a carry into the exponent is right)
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
    return (uint16_t)(sign | (uint16_t)((r - (112u << 23)) >> 13));
#endif
}

#if defined(__AVX512F__)
inline V16 vload_half(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
#elif defined(__AVX2__)
inline V16 vload_half(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
#else
inline V16 vload_half(const uint16_t* p) { V16 r; for (int i = 0; i < 16; i++) r.f[i] = half_to_f32(p[i]); return r; }
#endif

// out[0, n) = x[0, n) as halves (f32_to_half's rounding)
inline void store_half_row(const float* x, int64_t n, uint16_t* out) {
    int64_t i = 0;
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))
    const __m256 hi = _mm256_set1_ps(HALF_MAX), lo = _mm256_set1_ps(-HALF_MAX);
    for (; i + 8 <= n; i += 8) {
        const __m256 c = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(x + i)));
        _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; i < n; i++) out[i] = f32_to_half(x[i]);
}

// Sub-block s of a KS super-block (its bytes as a row holds them): its 32 integer weights
// (KS6: q - 32; KS3: q + 4 h - 4) and fp32 scales: w = dw q - mn (KS6, KS3: dw q for weights
// 0..15, mn q for 16..31;
// KS2: dw q - dmin m0 for weights 0..15, mn q - dmin m1 for 16..31, mins = {m0, m1, -dmin}).
template <int F>
inline void super_sub(const uint8_t* blk, int s, int16_t w[QK], float* dw, float* mn, float* mins = nullptr) {
    const float d = fp16_to_f32(blk);
    const uint8_t* sub = blk + head_bytes(F) + s * sub_bytes(F);
    if constexpr (F == KSI4) {
        *dw = d * (float)(int8_t)blk[2 + s];
        *mn = 0.0f;
        for (int i = 0; i < 16; i++) {
            w[i] = IQ4_VALUES[sub[i] & 15];
            w[i + 16] = IQ4_VALUES[sub[i] >> 4];
        }
    } else if constexpr (F == KS3) {
        *dw = d * (float)(int8_t)blk[2 + 2 * s];
        *mn = d * (float)(int8_t)blk[3 + 2 * s];
        uint32_t h;
        memcpy(&h, sub, 4);
        for (int i = 0; i < 16; i++) {             // weight i = 2t + j, t = u + 4e (KS2's)
            const int t = i / 2, j = i % 2;
            w[i] = (int16_t)(((sub[4 + 2 * (t % 4) + j] >> (2 * (t / 4))) & 3) + 4 * ((h >> (16 * j + t)) & 1) - 4);
            w[i + 16] = (int16_t)(((sub[4 + 2 * (t % 4) + j] >> (2 * (t / 4) + 4)) & 3)
                                  + 4 * ((h >> (16 * j + 8 + t)) & 1) - 4);
        }
    } else if constexpr (F == KS2) {
        const uint8_t s0 = blk[4 + 2 * s], s1 = blk[5 + 2 * s];
        *dw = d * (float)(s0 & 15);
        *mn = d * (float)(s1 & 15);
        if (mins) {
            mins[0] = (float)(s0 >> 4);
            mins[1] = (float)(s1 >> 4);
            mins[2] = -fp16_to_f32(blk + 2);
        }
        for (int i = 0; i < QK; i++) {             // weight i = 2t + j, t = u + 4e
            const int t = i / 2, j = i % 2;
            w[i] = (int16_t)((sub[2 * (t % 4) + j] >> (2 * (t / 4))) & 3);
        }
    } else if constexpr (F == KS6) {
        *dw = d * (float)(int8_t)blk[2 + 2 * s];
        *mn = d * (float)(int8_t)blk[3 + 2 * s];
        for (int i = 0; i < 16; i++) {
            const int t = i / 2, j = i % 2, e = t % 2;
            const int hb = (sub[16 + 2 * (t / 2) + j] >> (4 * e)) & 15;
            w[i] = (int16_t)((sub[i] & 15) + 16 * ((hb & 3) ^ 2) - 32);
            w[i + 16] = (int16_t)((sub[i] >> 4) + 16 * (((hb >> 2) & 3) ^ 2) - 32);
        }
    } else {
        *dw = d * (float)blk[4 + 2 * s];
        *mn = fp16_to_f32(blk + 2) * (float)blk[5 + 2 * s];
        uint32_t h = 0;
        if constexpr (F == KS5) memcpy(&h, sub, 4);
        const uint8_t* q = sub + (F == KS5 ? 4 : 0);
        for (int i = 0; i < 16; i++) {
            const int t = i / 2, j = i % 2;
            w[i] = (int16_t)((q[i] & 15) | (((h >> (16 * j + t)) & 1) << 4));
            w[i + 16] = (int16_t)((q[i] >> 4) | (((h >> (16 * j + 8 + t)) & 1) << 4));
        }
    }
}

// Sub-block s of a KS super-block in fp32 (gguf-py's operations: (d sc) q, then - dmin m)
template <int F>
inline void dequant_sub(const uint8_t* blk, int s, V16* lo, V16* hi) {
    int16_t w[QK];
    float dw, mn, f[QK];
    float mins[3];
    super_sub<F>(blk, s, w, &dw, &mn, mins);
    for (int i = 0; i < QK; i++) f[i] = (float)w[i];
    if constexpr (F == KS2) {                       // gguf-py's: (d sc) q, then - (dmin m)
        *lo = vsub(vmul(vset1(dw), vload(f)), vset1(-mins[2] * mins[0]));
        *hi = vsub(vmul(vset1(mn), vload(f + 16)), vset1(-mins[2] * mins[1]));
    } else if constexpr (F == KSI4) {                // gguf-py's: (d sc) v (exact)
        *lo = vmul(vset1(dw), vload(f));
        *hi = vmul(vset1(dw), vload(f + 16));
    } else if constexpr (F == KS6 || F == KS3) {
        *lo = vmul(vset1(dw), vload(f));
        *hi = vmul(vset1(mn), vload(f + 16));
    } else {
        *lo = vsub(vmul(vset1(dw), vload(f)), vset1(mn));
        *hi = vsub(vmul(vset1(dw), vload(f + 16)), vset1(mn));
    }
}

// One block's 32 weights in fp32: lo = elements 0..15, hi = 16..31 (exact, see the header).
template <int F>
inline void dequant_block(const uint8_t* blk, V16* lo, V16* hi) {
    if constexpr (F == KQ5_0 || F == KQ5_1) {
        // the file's operations: d * (q - 16) (exact), or d * q rounded, then + m (gguf-py's order)
        uint32_t h;
        memcpy(&h, blk + hbits_at(F), 4);
        float ql[16], qh[16];
        for (int i = 0; i < 16; i++) {
            const uint8_t b = blk[hbits_at(F) + 4 + i];
            const int t = i / 2, j = i % 2;         // weight i = 2t + j; weight 16 + i likewise
            ql[i] = (float)((b & 15) | (((h >> (16 * j + t)) & 1) << 4)) - (float)zero_point(F);
            qh[i] = (float)((b >> 4) | (((h >> (16 * j + 8 + t)) & 1) << 4)) - (float)zero_point(F);
        }
        const V16 d = vset1(fp16_to_f32(blk));
        if constexpr (F == KQ5_1) {
            const V16 m = vset1(fp16_to_f32(blk + 2));
            *lo = vadd(vmul(d, vload(ql)), m);
            *hi = vadd(vmul(d, vload(qh)), m);
        } else {
            *lo = vmul(d, vload(ql));
            *hi = vmul(d, vload(qh));
        }
    } else if constexpr (F == KI4) {               // gguf-py's: d v (exact)
        float ql[16], qh[16];
        for (int i = 0; i < 16; i++) {
            ql[i] = (float)IQ4_VALUES[blk[2 + i] & 15];
            qh[i] = (float)IQ4_VALUES[blk[2 + i] >> 4];
        }
        const V16 d = vset1(fp16_to_f32(blk));
        *lo = vmul(d, vload(ql));
        *hi = vmul(d, vload(qh));
    } else if constexpr (F == Q8_0) {
        const V16 d = vset1(fp16_to_f32(blk));
        *lo = vmul(d, i8_to_v16(blk + 2));
        *hi = vmul(d, i8_to_v16(blk + 18));
    } else if constexpr (F == Q4_0) {
        const V16 d = vset1(fp16_to_f32(blk)), eight = vset1(8.0f);
        V16 ql, qh;
        nibbles(blk + 2, &ql, &qh);
        *lo = vmul(d, vsub(ql, eight));
        *hi = vmul(d, vsub(qh, eight));
    } else {
        V16 ql, qh, d, m;
        scales(blk, &d, &m);
        nibbles(blk + 4, &ql, &qh);
        *lo = vfma(d, ql, m);
        *hi = vfma(d, qh, m);
    }
}
}  // namespace
