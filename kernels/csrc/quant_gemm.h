// GGUF block-quantized matmul with 16-bit activations, shared by quant_matmul.cpp (the
// standalone matmul) and plan_decode.cpp (the decode-step executor). Each .so is one
// translation unit that includes this once; the arithmetic contract is in
// quant_matmul.cpp's header comment, restated where each piece implements it.
//
//   x rows (fp32) --quantize_rows--> QRows: per 32-block b of a row
//                                      q[32] int16, d (x ≈ d q), s (fp32 sum of x), qs (sum of q)
//   W (GGUF blocks, x8 layout) x QRows --> y: per output, per block, an exact integer dot
//                                      isum = sum q_w q_x, then d_w d_x isum (+ m_w s) in fp32
//
// The integer dot is exact whatever order computes it, so a path is free to reduce it
// however is fastest (pmaddwd on 8 rows' weight pairs at once, VNNI); only the fp32 chain
// after it is fixed, and every path runs it the same.
#pragma once

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "amx_tiles.h"
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
    int32_t* qs0;       // [M][nb]  sum of the block's first 16 q (KS2's per-16 mins), exact
    int64_t K, nb;
    // AMX builds only (else null): q's bytes apart, q = 256 hi + lo, for ceil(M / 16) * 16 rows
    int8_t* hi = nullptr;   // [M16][K]  q >> 8 (arithmetic): -128..127
    uint8_t* lo = nullptr;  // [M16][K]  q & 255
};

// Owner of QRows storage for up to M rows of depth K.
struct QRowsBuf {
    std::vector<int16_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> qs, qs0;
#if defined(KVD_AMX)
    std::vector<int8_t> hi;
    std::vector<uint8_t> lo;
#endif
    // Bytes held (what reusing the buffer keeps allocated).
    size_t bytes() const {
        size_t n = q.capacity() * sizeof(int16_t) + (d.capacity() + s.capacity()) * sizeof(float)
                   + (qs.capacity() + qs0.capacity()) * sizeof(int32_t);
#if defined(KVD_AMX)
        n += hi.capacity() + lo.capacity();
#endif
        return n;
    }
    QRows rows(int64_t M, int64_t K) {
        const int64_t nb = K / QK;
#if defined(KVD_AMX)
        // the tile path reads whole tiles of 16 rows: the rows past M are read, never used
        const int64_t rows = (M + 15) / 16 * 16;
        if ((int64_t)hi.size() < rows * K) { hi.resize((size_t)(rows * K)); lo.resize((size_t)(rows * K)); }
#else
        const int64_t rows = M;
#endif
        if ((int64_t)q.size() < M * K) q.resize((size_t)(M * K));
        if ((int64_t)d.size() < rows * nb) {
            d.resize((size_t)(rows * nb)); s.resize((size_t)(rows * nb)); qs.resize((size_t)(rows * nb));
            qs0.resize((size_t)(rows * nb));
        }
        QRows r{q.data(), d.data(), s.data(), qs.data(), qs0.data(), K, nb};
#if defined(KVD_AMX)
        r.hi = hi.data();
        r.lo = lo.data();
#endif
        return r;
    }
};

#if defined(__AVX2__)
// the sum of 8 int32 lanes (exact)
inline int32_t hsum_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
}
#endif

// One block: amax = max |x|; d = amax / 32767; q = round-half-even(x * (32767 / amax));
// s = ((x[j] + x[j+8]) + x[j+16]) + x[j+24] per j < 8, then (j + j+4) -> (j + j+2) -> (0 + 1).
// qs, qs0: the exact sums of q over the block and over its first 16.
// Every build computes each of these with the same fp32 operations, so they agree bit for bit.
inline void quantize_block(const float* x, int16_t* q, float* d, float* s, int32_t* qs, int32_t* qs0) {
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
    const __m256i half = _mm256_add_epi32(q0, q1);
    *qs0 = hsum_epi32(half);
    *qs = hsum_epi32(_mm256_add_epi32(half, _mm256_add_epi32(q2, q3)));
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
        if (i == QK / 2 - 1) *qs0 = sum;
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
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t b = 0; b < out.nb; b++) {
            const int64_t i = m * out.nb + b;
            quantize_block(x + m * ldx + b * QK, out.q + m * out.K + b * QK, &out.d[i], &out.s[i], &out.qs[i],
                           &out.qs0[i]);
        }
#if defined(KVD_AMX)
        const int16_t* q = out.q + m * out.K;
        for (int64_t k = 0; k < out.K; k++) {
            out.hi[m * out.K + k] = (int8_t)(q[k] >> 8);
            out.lo[m * out.K + k] = (uint8_t)(q[k] & 255);
        }
#endif
    }
}

// ------------------------------------------------------------------ W in the x8 layout
// The kernels read W in the x8 layout (kernels/quant.py, QuantTensor.pack): rows in
// groups of 8 (the last group padded with zero blocks), and for each group and block b the
// 8 rows' GGUF blocks transposed as 2-byte words: word i of rows 0..7 side by side, then
// word i + 1. A group-block is the same 8 * block_bytes(F) bytes as the 8 GGUF blocks:
//
//     bytes [0, 16)      word 0: the 8 rows' fp16 d
//     bytes [16, 32)     word 1: the 8 rows' fp16 m (Q4_1; Q4_0 and Q8_0 start their quants here)
//     then quant word t: 16 bytes, row r's block bytes (2t, 2t + 1) at (2r, 2r + 1)
//
//
// A Q4 block's byte j holds weight j in its low nibble and j + 16 in its high, so quant
// word t (t < 8) carries every row's weight pair (2t, 2t + 1) in its low nibbles and pair
// (2t + 16, 2t + 17) in its high ones; a Q8_0 word t (t < 16) carries pair (2t, 2t + 1).
// Widened to int16 a word is 8 lanes of 32 bits, lane r = row r's pair, so pmaddwd against
// x's pair broadcast leaves row r's partial dot in lane r: a block's 8 integer dots are 16
// multiply-adds and adds, no horizontal sum, and its 8 scales one fp16 -> fp32 conversion.
// For each output the arithmetic is the contract's, unchanged: the exact integer dot per
// block (in another order, which exact integers do not see), then the same fp32 chain.

constexpr int64_t GROUP = 8;
constexpr int PAIRS = QK / 2;                       // x's 32 values as 16 int16 pairs
constexpr int64_t group_block_bytes(int f) { return GROUP * block_bytes(f); }
// bytes of one group (8 rows, every block) of a [N, K] matrix in format f
constexpr int64_t group_bytes(int f, int64_t K) { return K / block_weights(f) * group_block_bytes(f); }
// where a group-block's quant words start, in 16-byte units: after the 8 rows' scales (and
// KQ5_0 / KQ5_1's hbits; quant_blocks.h gives the formats). A KS format's "group-block" of a block of
// 32 is its group-sub-block (block_quants): 8 rows' sub-block s, its quant words from its start
// (KS5: after its hbits words); the scales are the group-super-block's head.
constexpr int quant_word0(int f) {
    return f == Q4_1 ? 2 : f == KQ5_1 ? 4 : f == KQ5_0 ? 3 : f == KS5 ? 2
           : f == KS4 || f == KS6 || f == KS2 || f == KSI4 ? 0 : f == KS3 ? 2 : 1;
}
// bytes of 8 rows' weights of one block of 32 (a KS format: the sub-block, its share of the head)
constexpr int64_t group_block32_bytes(int f) {
    return super_block(f) ? GROUP * (sub_bytes(f) + head_bytes(f) / SUBS) : group_block_bytes(f);
}

// Where block b (of 32 weights) of a group starts: its group-block, or a KS format's group-sub-block
template <int F>
inline const uint8_t* block_quants(const uint8_t* group, int64_t b) {
    if constexpr (super_block(F))
        return group + b / SUBS * group_block_bytes(F) + GROUP * (head_bytes(F) + b % SUBS * sub_bytes(F));
    else
        return group + b * group_block_bytes(F);
}

// Prefetch distance for the one-row path, which streams each thread's groups in address
// order. Every matmul of a SmolLM2 decode step on Zen 3, 2 threads, 4 KiB pages: 5.0-5.2 ms
// without prefetching, 4.0-4.5 ms at any distance from 1 to 16 KiB (within noise).
constexpr int64_t PREFETCH_BYTES = 4096;

// A hint for the group-block of BYTES at gb: the ceil(BYTES / 64) lines at gb + PREFETCH_BYTES
// + 64 i, unrolled (no branch). A block's lines and the next block's first one cover every
// line of the block PREFETCH_BYTES ahead (some are asked for twice). No effect on any result;
// past the matrix's end it is dropped (prefetches do not fault).
template <int64_t BYTES>
inline void prefetch_ahead(const uint8_t* gb) {
#if defined(__AVX2__)
    for (int64_t i = 0; i < (BYTES + 63) / 64; i++) _mm_prefetch((const char*)gb + PREFETCH_BYTES + 64 * i, _MM_HINT_T0);
#else
    (void)gb;
#endif
}

#if defined(__AVX2__)
// x's int16 pair p of a block (q[2p], q[2p + 1]) in every 32-bit lane
inline __m256i pair_bcast(const int16_t* q, int p) {
    int32_t v;
    memcpy(&v, q + 2 * p, 4);
    return _mm256_set1_epi32(v);
}

// acc + (per 32-bit lane) w0 x0 + w1 x1 over int16 pairs: exact
inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

// Quant word t of a group-block (gb) widened to int16, lanes 2r, 2r + 1 = row r's weights of
// one pair (Q4: the nibble values 0..15): Q4 word t gives pair t in *lo and pair t + 8 in
// *hi; a Q8_0 word t gives pair t in *lo (and leaves *hi alone).
// KQ5_0 / KQ5_1 / KS5 / KS3: the high bits come from the hbits, two 16-bit words (the 8 rows' low
// halves, then their high halves), interleaved here so that 16-bit lane 2r + j holds at bit t
// the high bit of row r's weight 2t + j, at bit 8 + t of 2t + 16 + j.
template <int F>
inline __m256i hbits_lanes(const uint8_t* gb) {
    const __m128i lo = _mm_loadu_si128((const __m128i*)(gb + 8 * hbits_at(F)));
    const __m128i hi = _mm_loadu_si128((const __m128i*)(gb + 8 * hbits_at(F) + 16));
    return _mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi));
}

// KS6: the high words after a group-sub-block's nibbles (16 bytes each: row r's high bytes
// 2u, 2u + 1 at 2r, 2r + 1, widened to lane 2r + j), their 2-bit fields moved to the top of
// each 16-bit lane and shifted back arithmetically: hi - 2, signed (quant_blocks.h), so
// q - 32 = nibble + 16 (hi - 2).
template <int F>
inline void widen_word(const uint8_t* gb, int t, __m256i* lo, __m256i* hi) {
    if constexpr (two_bit_quants(F)) {  // word t % 4, bits 2 (t / 4): pair t; bits 2 (t / 4) + 4: pair t + 8
        const __m256i bytes =
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(gb + 16 * (quant_word0(F) + t % 4))));
        const __m256i v = _mm256_srl_epi16(bytes, _mm_cvtsi32_si128(2 * (t / 4))), three = _mm256_set1_epi16(3);
        *lo = _mm256_and_si256(v, three);
        *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), three);
        if constexpr (F == KS3) {       // + 4 h - 4: the hbits' bit t (pair t), 8 + t (pair t + 8)
            const __m256i h = _mm256_srl_epi16(hbits_lanes<F>(gb), _mm_cvtsi32_si128(t));
            const __m256i four = _mm256_set1_epi16(4);
            *lo = _mm256_sub_epi16(_mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(h, 2), four)), four);
            *hi = _mm256_sub_epi16(_mm256_or_si256(*hi, _mm256_and_si256(_mm256_srli_epi16(h, 6), four)), four);
        }
        return;
    }
    if constexpr (iq4_values(F)) {      // the nibbles' IQ4 values, looked up 16 bytes at a time
        const __m128i word = _mm_loadu_si128((const __m128i*)(gb + 16 * (quant_word0(F) + t)));
        const __m128i table = _mm_loadu_si128((const __m128i*)IQ4_VALUES), nib = _mm_set1_epi8(15);
        *lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(word, nib)));
        *hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(word, 4), nib)));
        return;
    }
    const __m128i word = _mm_loadu_si128((const __m128i*)(gb + 16 * (quant_word0(F) + t)));
    if constexpr (int8_quants(F)) {
        *lo = _mm256_cvtepi8_epi16(word);
    } else {
        const __m256i bytes = _mm256_cvtepu8_epi16(word);
        *lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
        *hi = _mm256_srli_epi16(bytes, 4);
        if constexpr (F == KS6) {
            const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(gb + 16 * (8 + t / 2))));
            const int e = 4 * (t % 2);
            const __m256i hl = _mm256_srai_epi16(_mm256_sll_epi16(h, _mm_cvtsi32_si128(14 - e)), 14);
            const __m256i hh = _mm256_srai_epi16(_mm256_sll_epi16(h, _mm_cvtsi32_si128(12 - e)), 14);
            *lo = _mm256_add_epi16(*lo, _mm256_slli_epi16(hl, 4));
            *hi = _mm256_add_epi16(*hi, _mm256_slli_epi16(hh, 4));
        }
        if constexpr (has_hbits(F)) {
            const __m256i h = _mm256_srl_epi16(hbits_lanes<F>(gb), _mm_cvtsi32_si128(t));
            const __m256i bit4 = _mm256_set1_epi16(16);
            *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
            *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srli_epi16(h, 4), bit4));
        }
    }
}

// Pairs t and t + 8 of every row (t < 8): a Q4 word t holds both, an int8 format's words t
// and t + 8 one each.
template <int F>
inline void widen_pairs(const uint8_t* gb, int t, __m256i* lo, __m256i* hi) {
    widen_word<F>(gb, t, lo, hi);
    if constexpr (int8_quants(F)) {
        __m256i unused;
        widen_word<F>(gb, t + 8, hi, &unused);
    }
}

// lane r = row r's exact integer dot of block gb with x's quantized block xq. Four
// independent sums: with VNNI each multiply-add also adds into its sum (5 cycles of latency
// on Intel), and two chains of eight made the one-row path wait on them, not on memory.
// s1 and s3 take pairs 8..15 (weights 16..31), so a two-scale format has its halves' dots apart:
// *second = the dot of weights 16..31 (its own scale), the result that of 0..15.
template <int F>
inline __m256i block_dots(const uint8_t* gb, const int16_t* xq, __m256i* second = nullptr) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256(), s2 = _mm256_setzero_si256(),
            s3 = _mm256_setzero_si256(), lo, hi;
    for (int t = 0; t < 8; t += 2) {
        widen_pairs<F>(gb, t, &lo, &hi);
        s0 = dot_acc(s0, lo, pair_bcast(xq, t));
        s1 = dot_acc(s1, hi, pair_bcast(xq, t + 8));
        widen_pairs<F>(gb, t + 1, &lo, &hi);
        s2 = dot_acc(s2, lo, pair_bcast(xq, t + 1));
        s3 = dot_acc(s3, hi, pair_bcast(xq, t + 9));
    }
    if constexpr (two_scales(F)) {
        *second = _mm256_add_epi32(s1, s3);
        return _mm256_add_epi32(s0, s2);
    }
    return _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));
}

// the group-block's 8 d (and the 8 m of a format with one) as fp32 lanes
template <int F>
inline void group_scales(const uint8_t* gb, __m256* dw, __m256* mw) {
    *dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)gb));
    *mw = has_min(F) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(gb + 16))) : _mm256_setzero_ps();
}

// KS2's 8 rows' mins of a sub-block: its halves' 4-bit m0, m1 (as fp32) and -dmin
struct Mins16 { __m256 m0, m1, ndmin; };

// A KS format's 8 rows' scales of sub-block s: d sc_s, -(dmin m_s) (KS6, KS2: d sc_2s, d sc_2s+1;
// KS2's mins into *mn), each product exact in fp32 (fp16 times a small integer)
template <int F>
inline void super_scales(const uint8_t* head, int s, __m256* dw, __m256* mw, Mins16* mn) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)head));
    if constexpr (F == KSI4) {          // sc_s: byte s % 2 of the rows' scale word 1 + s / 2
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(head + 16 + 16 * (s / 2))));
        const __m256i sc = _mm256_srai_epi32(_mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * (s % 2))), 24);
        *dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        *mw = _mm256_setzero_ps();
    } else if constexpr (F == KS2) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(head + 32 + 16 * s)));
        const __m256i f = _mm256_set1_epi32(15);
        *dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v, f)));
        *mw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), f)));
        mn->m0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), f));
        mn->m1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 12));
        mn->ndmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(head + 16))), _mm256_set1_ps(-0.0f));
    } else if constexpr (F == KS6 || F == KS3) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(head + 16 + 16 * s)));
        *dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24)));
        *mw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24)));
    } else {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(head + 16)));
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(head + 32 + 16 * s)));
        *dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(255))));
        *mw = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 8))),
                            _mm256_set1_ps(-0.0f));
    }
}

// block b's 8 rows' scales, group_scales' lanes (KS2: and its mins)
template <int F>
inline void block_scales(const uint8_t* group, int64_t b, __m256* dw, __m256* mw, Mins16* mn) {
    if constexpr (super_block(F)) super_scales<F>(group + b / SUBS * group_block_bytes(F), (int)(b % SUBS), dw, mw, mn);
    else group_scales<F>(group + b * group_block_bytes(F), dw, mw);
}

struct Acc { __m256 acc, accm; };

// The fp32 chain of 8 outputs for one block: lane r's isum with row r's scales, x row i's.
// A two-scale format: isum1 is weights 16..31's dot, chained after isum's with its own scale (mw).
// KS2: then its mins, through x's exact integer half sums: accm += (-dmin d_x) (m0 qs0 + m1 qs1),
// the integer exact in fp32 (|m qs| < 2^23 each, so the product and the fma do not round).
template <int F>
inline void chain(__m256i isum, __m256 dw, __m256 mw, const QRows& x, int64_t i, Acc* a,
                  __m256i isum1 = _mm256_setzero_si256(), const Mins16* mn = nullptr) {
    if constexpr (zero_point(F) != 0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(zero_point(F) * x.qs[i]));
    const __m256 dx = _mm256_set1_ps(x.d[i]);
    a->acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum), a->acc);
    if constexpr (two_scales(F)) a->acc = _mm256_fmadd_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(isum1), a->acc);
    if constexpr (mins16(F)) {
        const __m256 m = _mm256_fmadd_ps(mn->m1, _mm256_set1_ps((float)(x.qs[i] - x.qs0[i])),
                                         _mm256_mul_ps(mn->m0, _mm256_set1_ps((float)x.qs0[i])));
        a->accm = _mm256_fmadd_ps(_mm256_mul_ps(mn->ndmin, dx), m, a->accm);
    } else if constexpr (has_min(F)) {
        a->accm = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[i]), a->accm);
    }
}

// A group-block widened once for many rows of x (L1-resident, 512 B): w[p] = every row's
// weight pair p, as widen_word gives it.
struct WGroup {
    __m256i w[PAIRS];
    __m256 dw, mw;
    Mins16 mn;                      // KS2's
};

template <int F>
inline void load_group(const uint8_t* group, int64_t b, WGroup* g) {
    const uint8_t* gb = block_quants<F>(group, b);
    if constexpr (int8_quants(F)) {
        __m256i unused;
        for (int t = 0; t < PAIRS; t++) widen_word<F>(gb, t, &g->w[t], &unused);
    } else {
        for (int t = 0; t < 8; t++) widen_word<F>(gb, t, &g->w[t], &g->w[t + 8]);
    }
    block_scales<F>(group, b, &g->dw, &g->mw, &g->mn);
}

// R rows of x (m, m + 1, ...) against one widened group-block: each weight vector is loaded
// once for all R rows (one row at a time loads one for every multiply-add, beside x's
// broadcast), and the 2R sums are independent chains.
template <int F, int R>
inline void group_block_rows(const WGroup& g, const QRows& x, int64_t m, int64_t b, Acc* a) {
    const int16_t* xq[R];
    __m256i s0[R], s1[R];
    for (int r = 0; r < R; r++) {
        xq[r] = x.q + (m + r) * x.K + b * QK;
        s0[r] = _mm256_setzero_si256();
        s1[r] = _mm256_setzero_si256();
    }
    // pairs p and p + 1 (two scales: p and p + 8, the block's halves, whose dots it keeps apart)
    constexpr int STEP = two_scales(F) ? 1 : 2, OTHER = two_scales(F) ? PAIRS / 2 : 1;
    for (int p = 0; p < (two_scales(F) ? PAIRS / 2 : PAIRS); p += STEP) {
        const __m256i w0 = g.w[p], w1 = g.w[p + OTHER];
        for (int r = 0; r < R; r++) {
            s0[r] = dot_acc(s0[r], w0, pair_bcast(xq[r], p));
            s1[r] = dot_acc(s1[r], w1, pair_bcast(xq[r], p + OTHER));
        }
    }
    for (int r = 0; r < R; r++) {
        if constexpr (two_scales(F)) chain<F>(s0[r], g.dw, g.mw, x, (m + r) * x.nb + b, &a[r], s1[r], &g.mn);
        else chain<F>(_mm256_add_epi32(s0[r], s1[r]), g.dw, g.mw, x, (m + r) * x.nb + b, &a[r]);
    }
}

// One x row against one group, every block, W read straight into registers (the decode
// step's shape: each byte of W is used once, so it streams from memory in address order).
template <int F>
inline void group_one_row(const uint8_t* group, const QRows& x, int64_t m, Acc* a) {
    const int16_t* xq = x.q + m * x.K;
    Acc acc = *a;                   // in registers, not through a (which may alias x)
    for (int64_t b = 0; b < x.nb; b++) {
        const uint8_t* gb = block_quants<F>(group, b);
        prefetch_ahead<group_block32_bytes(F)>(gb);
        __m256 dw, mw;
        Mins16 mn;
        block_scales<F>(group, b, &dw, &mw, &mn);
        __m256i second;
        const __m256i first = block_dots<F>(gb, xq + b * QK, &second);
        chain<F>(first, dw, mw, x, m * x.nb + b, &acc, second, &mn);
    }
    *a = acc;
}

template <int F>
inline void store_group(const Acc& a, float* y, int nr) {
    if (nr == 8) {
        _mm256_storeu_ps(y, has_min(F) ? _mm256_add_ps(a.acc, a.accm) : a.acc);
        return;
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, has_min(F) ? _mm256_add_ps(a.acc, a.accm) : a.acc);
    for (int r = 0; r < nr; r++) y[r] = out[r];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Two groups side by side in 16 lanes (AVX-512 builds): lanes 0-7 = group g's 8 rows, lanes
// 8-15 group g + 1's, each lane the very integers and fp32 chain of the 8-lane path, so the
// same bits; one vpdpwssd (or pmaddwd + add) then does the multiply-adds of two, and x's pair
// is broadcast (folded into the instruction's operand) once for 16 outputs instead of 8.
#define KVD_TWO_GROUPS 1
inline __m512i dot_acc512(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

struct WGroup2 {
    __m512i w[PAIRS];
    __m512 dw, mw;
    __m512 m0, m1, ndmin;           // KS2's mins (Mins16 on 16 lanes)
};

inline __m512i join256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m512 join256(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

template <int F>
inline void load_group2(const uint8_t* group0, const uint8_t* group1, int64_t blk, WGroup2* g) {
    WGroup a, b;
    load_group<F>(group0, blk, &a);
    load_group<F>(group1, blk, &b);
    for (int p = 0; p < PAIRS; p++) g->w[p] = join256(a.w[p], b.w[p]);
    g->dw = join256(a.dw, b.dw);
    g->mw = join256(a.mw, b.mw);
    if constexpr (mins16(F)) {
        g->m0 = join256(a.mn.m0, b.mn.m0);
        g->m1 = join256(a.mn.m1, b.mn.m1);
        g->ndmin = join256(a.mn.ndmin, b.mn.ndmin);
    }
}

struct Acc2 { __m512 acc, accm; };

// R rows of x against two widened group-blocks (group_block_rows on 16 lanes)
template <int F, int R>
inline void group2_block_rows(const WGroup2& g, const QRows& x, int64_t m, int64_t b, Acc2* a) {
    const int16_t* xq[R];
    __m512i s0[R], s1[R];
    for (int r = 0; r < R; r++) {
        xq[r] = x.q + (m + r) * x.K + b * QK;
        s0[r] = _mm512_setzero_si512();
        s1[r] = _mm512_setzero_si512();
    }
    // as group_block_rows: pairs p and p + 1, or p and p + 8 (two scales: the halves, kept apart)
    constexpr int STEP = two_scales(F) ? 1 : 2, OTHER = two_scales(F) ? PAIRS / 2 : 1;
    for (int p = 0; p < (two_scales(F) ? PAIRS / 2 : PAIRS); p += STEP) {
        const __m512i w0 = g.w[p], w1 = g.w[p + OTHER];
        for (int r = 0; r < R; r++) {
            int32_t v0, v1;
            memcpy(&v0, xq[r] + 2 * p, 4);
            memcpy(&v1, xq[r] + 2 * (p + OTHER), 4);
            s0[r] = dot_acc512(s0[r], w0, _mm512_set1_epi32(v0));
            s1[r] = dot_acc512(s1[r], w1, _mm512_set1_epi32(v1));
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t i = (m + r) * x.nb + b;
        const __m512 dx = _mm512_set1_ps(x.d[i]);
        __m512i isum = two_scales(F) ? s0[r] : _mm512_add_epi32(s0[r], s1[r]);
        if constexpr (zero_point(F) != 0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(zero_point(F) * x.qs[i]));
        a[r].acc = _mm512_fmadd_ps(_mm512_mul_ps(g.dw, dx), _mm512_cvtepi32_ps(isum), a[r].acc);
        if constexpr (two_scales(F)) a[r].acc = _mm512_fmadd_ps(_mm512_mul_ps(g.mw, dx), _mm512_cvtepi32_ps(s1[r]), a[r].acc);
        if constexpr (mins16(F)) {          // chain<F>'s
            const __m512 mq = _mm512_fmadd_ps(g.m1, _mm512_set1_ps((float)(x.qs[i] - x.qs0[i])),
                                              _mm512_mul_ps(g.m0, _mm512_set1_ps((float)x.qs0[i])));
            a[r].accm = _mm512_fmadd_ps(_mm512_mul_ps(g.ndmin, dx), mq, a[r].accm);
        } else if constexpr (has_min(F)) {
            a[r].accm = _mm512_fmadd_ps(g.mw, _mm512_set1_ps(x.s[i]), a[r].accm);
        }
    }
}

// Row m's 16 outputs: n's group's first nr0 (up to 8), the next group's first nr1
template <int F>
inline void store_group2(const Acc2& a, float* y, int nr0, int nr1) {
    alignas(64) float out[16];
    _mm512_store_ps(out, has_min(F) ? _mm512_add_ps(a.acc, a.accm) : a.acc);
    memcpy(y, out, sizeof(float) * (size_t)nr0);
    memcpy(y + GROUP, out + GROUP, sizeof(float) * (size_t)nr1);
}
#endif
#else
// The portable build: the group-block unpacked to each row's 32 int16 weights, scalar ints.
struct WGroup { int16_t w[GROUP][QK]; float dw[GROUP], mw[GROUP], mins[GROUP][3]; };   // mins: KS2's m0, m1, -dmin

template <int F>
inline void load_group(const uint8_t* group, int64_t b, WGroup* g) {
    if constexpr (super_block(F)) {             // each row's super-block gathered, then decoded
        const uint8_t* sb = group + b / SUBS * group_block_bytes(F);
        uint8_t blk[block_bytes(F)];
        for (int r = 0; r < GROUP; r++) {
            for (int64_t i = 0; i < block_bytes(F) / 2; i++) memcpy(blk + 2 * i, sb + 16 * i + 2 * r, 2);
            super_sub<F>(blk, (int)(b % SUBS), g->w[r], &g->dw[r], &g->mw[r], g->mins[r]);
            if constexpr (F == KS4 || F == KS5) g->mw[r] = -g->mw[r];
        }
        return;
    }
    const uint8_t* gb = group + b * group_block_bytes(F);
    const uint8_t* q = gb + 16 * quant_word0(F);
    for (int r = 0; r < GROUP; r++) {
        g->dw[r] = fp16_to_f32(gb + 2 * r);
        g->mw[r] = has_min(F) ? fp16_to_f32(gb + 16 + 2 * r) : 0.0f;
        uint16_t h[2] = {0, 0};                 // row r's hbits lanes (widen_word's)
        if constexpr (F == KQ5_0 || F == KQ5_1) {
            memcpy(&h[0], gb + 8 * hbits_at(F) + 2 * r, 2);
            memcpy(&h[1], gb + 8 * hbits_at(F) + 16 + 2 * r, 2);
        }
        for (int t = 0; t < (int8_quants(F) ? PAIRS : 8); t++)
            for (int j = 0; j < 2; j++) {
                const uint8_t v = q[16 * t + 2 * r + j];
                if constexpr (int8_quants(F)) {
                    g->w[r][2 * t + j] = (int8_t)v;
                } else if constexpr (iq4_values(F)) {
                    g->w[r][2 * t + j] = IQ4_VALUES[v & 15];
                    g->w[r][2 * t + 16 + j] = IQ4_VALUES[v >> 4];
                } else {
                    g->w[r][2 * t + j] = (int16_t)((v & 15) | (((h[j] >> t) & 1) << 4));
                    g->w[r][2 * t + 16 + j] = (int16_t)((v >> 4) | (((h[j] >> (8 + t)) & 1) << 4));
                }
            }
    }
}

struct Acc { float acc[GROUP], accm[GROUP]; };

template <int F>
inline void group_block_row(const WGroup& g, const QRows& x, int64_t m, int64_t b, Acc* a) {
    const int16_t* xq = x.q + m * x.K + b * QK;
    const int64_t i = m * x.nb + b;
    for (int r = 0; r < GROUP; r++) {
        int32_t isum = 0, isum1 = 0;            // two scales: weights 0..15, 16..31 apart
        for (int k = 0; k < QK; k++) {
            if (two_scales(F) && k >= QK / 2) isum1 += (int32_t)g.w[r][k] * xq[k];
            else isum += (int32_t)g.w[r][k] * xq[k];
        }
        if constexpr (zero_point(F) != 0) isum -= zero_point(F) * x.qs[i];
        a->acc[r] = fmaf(g.dw[r] * x.d[i], (float)isum, a->acc[r]);
        if constexpr (two_scales(F)) a->acc[r] = fmaf(g.mw[r] * x.d[i], (float)isum1, a->acc[r]);
        if constexpr (mins16(F)) {
            const float mq = fmaf(g.mins[r][1], (float)(x.qs[i] - x.qs0[i]), g.mins[r][0] * (float)x.qs0[i]);
            a->accm[r] = fmaf(g.mins[r][2] * x.d[i], mq, a->accm[r]);
        } else if constexpr (has_min(F)) {
            a->accm[r] = fmaf(g.mw[r], x.s[i], a->accm[r]);
        }
    }
}

template <int F, int R>
inline void group_block_rows(const WGroup& g, const QRows& x, int64_t m, int64_t b, Acc* a) {
    for (int r = 0; r < R; r++) group_block_row<F>(g, x, m + r, b, &a[r]);
}

template <int F>
inline void store_group(const Acc& a, float* y, int nr) {
    for (int r = 0; r < nr; r++) y[r] = has_min(F) ? a.acc[r] + a.accm[r] : a.acc[r];
}
#endif

inline Acc acc_zero() { Acc a; memset(&a, 0, sizeof a); return a; }

// ------------------------------------------------------------------ the tile path (AMX builds)
// Many rows of x against W on the AMX tile unit. Each block's integer dots come from the tile
// multiply, in int8: x's int16 q split as 256 hi + lo (QRows.hi, signed; QRows.lo, unsigned),
// W's quants widened to int8 (Q4: the nibble 0..15; Q8_0: as they are), and
//     isum = 256 * dot(hi, w) + dot(lo, w)          exact in int32 (|isum| < 2^28)
// which is the very isum of the other paths; the fp32 chain after it is chain<F>'s, on 16
// lanes (two groups) at once, the same operations per lane. So the tile path gives every
// output the bits of every other path and build.
//
// A pass takes four groups of W (32 rows): their blocks widened once into two B tiles a block
// (8 rows of 64 bytes: row k4, bytes 4n..4n+3 = W row n's weights 4 k4..4 k4 + 3) and their
// scales into fp32, then for each 16 rows of x, block after block: A_HI, A_LO = the rows' hi
// and lo bytes of the block, four tile multiplies (hi and lo against each B tile), the 16 x 32
// dots stored to memory and chained into the rows' accumulators. (Measured on the Xeon and
// dropped: one pair of groups a pass with every tile double-buffered and the next block's tile
// work issued before this block's chain, int8 or bf16; and that issue order here. None was
// faster: the tile unit's work per block, not the chain, sets the pace.)
#if defined(KVD_AMX)
#if !defined(__AVX2__)
#error "the tile path needs an AVX2 build"
#endif
enum Tile { A_HI = 0, A_LO = 1, B0 = 2, B1 = 3, C_HI0 = 4, C_LO0 = 5, C_HI1 = 6, C_LO1 = 7 };
constexpr int TILE_M = 16;                      // rows of x per tile
constexpr int64_t TILE_B_BYTES = 8 * 64;        // one block of 16 W rows in B layout
// Fewer rows than this take the register paths (measured on the Xeon: at 8 rows the tile
// path is slower than avx512vnni's registers, at 32 it is ahead).
constexpr int64_t TILE_MIN_ROWS = 16;

inline amx::Config tile_config() {
    amx::Config c;
    for (int t : {A_HI, A_LO}) c.rows[t] = TILE_M, c.colsb[t] = QK;
    for (int t : {B0, B1}) c.rows[t] = QK / 4, c.colsb[t] = 64;
    for (int t : {C_HI0, C_LO0, C_HI1, C_LO1}) c.rows[t] = TILE_M, c.colsb[t] = 64;
    return c;
}

// Half of a B tile (32 bytes a row, 8 W rows): group-block gb's weights widened to int8, or
// zeros (gb null: past the range's last group). Quant words 2j and 2j + 1 hold every row's
// weights 4j..4j+3 (Q8_0; Q4: in their low nibbles, 4j+16..4j+19 in their high ones), and
// interleaving them by 16 bits puts each row's four side by side.
template <int F>
inline void widen_b(const uint8_t* gb, uint8_t* out /* 8 rows, stride 64 */) {
    if (gb == nullptr) {
        for (int k4 = 0; k4 < QK / 4; k4++) memset(out + 64 * k4, 0, 32);
        return;
    }
    const uint8_t* q = gb + 16 * quant_word0(F);
    const __m128i nib = _mm_set1_epi8(15);
    for (int j = 0; j < (F == Q8_0 ? 8 : 4); j++) {
        const __m128i a = _mm_loadu_si128((const __m128i*)(q + 32 * j)), b = _mm_loadu_si128((const __m128i*)(q + 32 * j + 16));
        const __m128i r03 = _mm_unpacklo_epi16(a, b), r47 = _mm_unpackhi_epi16(a, b);
        if constexpr (F == Q8_0) {
            _mm_storeu_si128((__m128i*)(out + 64 * j), r03);
            _mm_storeu_si128((__m128i*)(out + 64 * j + 16), r47);
        } else {
            _mm_storeu_si128((__m128i*)(out + 64 * j), _mm_and_si128(r03, nib));
            _mm_storeu_si128((__m128i*)(out + 64 * j + 16), _mm_and_si128(r47, nib));
            _mm_storeu_si128((__m128i*)(out + 64 * (j + 4)), _mm_and_si128(_mm_srli_epi16(r03, 4), nib));
            _mm_storeu_si128((__m128i*)(out + 64 * (j + 4) + 16), _mm_and_si128(_mm_srli_epi16(r47, 4), nib));
        }
    }
}

// 16 fp32 accumulators (two groups' 8 rows) and chain<F>'s steps on them: zmm where the build
// has AVX-512, two ymm halves where it has AVX2 alone (amxemu); the same operations per lane.
#if defined(__AVX512F__)
struct Lanes16 { __m512 v; };
inline Lanes16 lanes_zero() { return {_mm512_setzero_ps()}; }
// acc + (d_w d_x) * (float)(256 hi + lo [- 8 qs])
template <int F>
inline Lanes16 lanes_chain(Lanes16 a, const int32_t* hi, const int32_t* lo, const float* dw, float dx, int32_t qs) {
    __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi), 8), _mm512_load_si512(lo));
    if constexpr (F == Q4_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * qs));
    return {_mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(dw), _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum), a.v)};
}
inline Lanes16 lanes_fma(Lanes16 a, const float* mw, float s) {      // accm + m_w * s_x
    return {_mm512_fmadd_ps(_mm512_loadu_ps(mw), _mm512_set1_ps(s), a.v)};
}
inline void lanes_store(float* out, Lanes16 a) { _mm512_store_ps(out, a.v); }
inline void lanes_store_sum(float* out, Lanes16 a, Lanes16 b) { _mm512_store_ps(out, _mm512_add_ps(a.v, b.v)); }
#else
struct Lanes16 { __m256 a, b; };
inline Lanes16 lanes_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
template <int F>
inline __m256 lanes_chain8(__m256 a, const int32_t* hi, const int32_t* lo, const float* dw, float dx, int32_t qs) {
    __m256i isum = _mm256_add_epi32(_mm256_slli_epi32(_mm256_load_si256((const __m256i*)hi), 8),
                                    _mm256_load_si256((const __m256i*)lo));
    if constexpr (F == Q4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * qs));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dw), _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(isum), a);
}
template <int F>
inline Lanes16 lanes_chain(Lanes16 a, const int32_t* hi, const int32_t* lo, const float* dw, float dx, int32_t qs) {
    return {lanes_chain8<F>(a.a, hi, lo, dw, dx, qs), lanes_chain8<F>(a.b, hi + 8, lo + 8, dw + 8, dx, qs)};
}
inline Lanes16 lanes_fma(Lanes16 a, const float* mw, float s) {
    return {_mm256_fmadd_ps(_mm256_loadu_ps(mw), _mm256_set1_ps(s), a.a),
            _mm256_fmadd_ps(_mm256_loadu_ps(mw + 8), _mm256_set1_ps(s), a.b)};
}
inline void lanes_store(float* out, Lanes16 a) { _mm256_store_ps(out, a.a); _mm256_store_ps(out + 8, a.b); }
inline void lanes_store_sum(float* out, Lanes16 a, Lanes16 b) {
    _mm256_store_ps(out, _mm256_add_ps(a.a, b.a));
    _mm256_store_ps(out + 8, _mm256_add_ps(a.b, b.b));
}
#endif

// Block b's tile work for one pass into dots[p] (p < 2 when b1: B tile p's hi and lo dots).
inline void tile_block(const uint8_t* hi, const uint8_t* lo, int64_t K, const uint8_t* b0, const uint8_t* b1,
                       int32_t (*dots)[2][TILE_M][16]) {
    amx::load<A_HI>(hi, K);
    amx::load<A_LO>(lo, K);
    amx::load<B0>(b0, 64);
    amx::zero<C_HI0>();
    amx::zero<C_LO0>();
    amx::dp_ss<C_HI0, A_HI, B0>();
    amx::dp_us<C_LO0, A_LO, B0>();
    if (b1) {
        amx::load<B1>(b1, 64);
        amx::zero<C_HI1>();
        amx::zero<C_LO1>();
        amx::dp_ss<C_HI1, A_HI, B1>();
        amx::dp_us<C_LO1, A_LO, B1>();
    }
    amx::store<C_HI0>(dots[0][0], 64);
    amx::store<C_LO0>(dots[0][1], 64);
    if (b1) {
        amx::store<C_HI1>(dots[1][0], 64);
        amx::store<C_LO1>(dots[1][1], 64);
    }
}

// matmul_range's contract on the tile unit (any M; AMX builds choose it for M >= TILE_MIN_ROWS).
template <int F>
void matmul_range_tiles(const uint8_t* w, int64_t n0, int64_t n1, const QRows& x, int64_t M, float* y, int64_t ldy) {
    constexpr int64_t GB = group_block_bytes(F);
    const int64_t nb = x.nb, K = x.K, gbytes = group_bytes(F, K);
    // a pass's B tiles [pair][block] and scales [pair][block][16 lanes] (plain pointers below:
    // a thread_local in a shared library costs a call at each use, which spills every register)
    static thread_local std::vector<uint8_t> tile_w_buf;
    static thread_local std::vector<float> scales_buf;
    if ((int64_t)tile_w_buf.size() < 2 * nb * TILE_B_BYTES) tile_w_buf.resize((size_t)(2 * nb * TILE_B_BYTES));
    if ((int64_t)scales_buf.size() < 4 * nb * 16) scales_buf.resize((size_t)(4 * nb * 16));
    uint8_t* const tile_w = tile_w_buf.data();
    float* const dws = scales_buf.data();               // [pair][block][16]
    float* const mws = dws + 2 * nb * 16;
    alignas(64) int32_t dots[2][2][TILE_M][16];           // [pair][hi, lo][x row][W row]
    alignas(64) float out[16];
    Lanes16 acc[TILE_M][2];
    amx::configure(tile_config());
    for (int64_t n = n0; n < n1; n += 4 * GROUP) {
        const int ng = (int)((n1 - n + GROUP - 1) / GROUP < 4 ? (n1 - n + GROUP - 1) / GROUP : 4);
        const int pairs = (ng + 1) / 2;
        const uint8_t* group = w + n / GROUP * gbytes;
        for (int p = 0; p < pairs; p++)
            for (int64_t b = 0; b < nb; b++) {
                uint8_t* t = tile_w + (p * nb + b) * TILE_B_BYTES;
                const uint8_t* gb0 = group + 2 * p * gbytes + b * GB;
                const bool two = 2 * p + 1 < ng;
                widen_b<F>(gb0, t);
                widen_b<F>(two ? gb0 + gbytes : nullptr, t + 32);
                __m256 dw, mw, dw1 = _mm256_setzero_ps(), mw1 = _mm256_setzero_ps();
                group_scales<F>(gb0, &dw, &mw);
                if (two) group_scales<F>(gb0 + gbytes, &dw1, &mw1);
                float* ds = dws + (p * nb + b) * 16;
                float* ms = mws + (p * nb + b) * 16;
                _mm256_storeu_ps(ds, dw);
                _mm256_storeu_ps(ds + 8, dw1);
                _mm256_storeu_ps(ms, mw);
                _mm256_storeu_ps(ms + 8, mw1);
            }
        for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
            // a last partial tile's rows past M chain the padding's bytes and scales (QRowsBuf
            // holds whole tiles); their lanes are never stored
            const int mr = M - m0 < TILE_M ? (int)(M - m0) : TILE_M;
            const uint8_t* hi = (const uint8_t*)x.hi + m0 * K;
            const uint8_t* lo = x.lo + m0 * K;
            const float* xd = x.d + m0 * nb;
            const int32_t* xqs = x.qs + m0 * nb;
            for (int m = 0; m < TILE_M; m++) acc[m][0] = acc[m][1] = lanes_zero();
            for (int64_t b = 0; b < nb; b++) {
                tile_block(hi + b * QK, lo + b * QK, K, tile_w + b * TILE_B_BYTES,
                           pairs > 1 ? tile_w + (nb + b) * TILE_B_BYTES : nullptr, dots);
                for (int p = 0; p < pairs; p++) {
                    const float* dw = dws + (p * nb + b) * 16;
                    for (int m = 0; m < TILE_M; m++)
                        acc[m][p] = lanes_chain<F>(acc[m][p], dots[p][0][m], dots[p][1][m], dw, xd[m * nb + b],
                                                   F == Q4_0 ? xqs[m * nb + b] : 0);
                }
            }
            for (int m = 0; m < mr; m++)
                for (int p = 0; p < pairs; p++) {
                    if constexpr (F == Q4_1) {
                        Lanes16 accm = lanes_zero();             // chain<F>'s second accumulator
                        for (int64_t b = 0; b < nb; b++)
                            accm = lanes_fma(accm, mws + (p * nb + b) * 16, x.s[(m0 + m) * nb + b]);
                        lanes_store_sum(out, acc[m][p], accm);
                    } else {
                        lanes_store(out, acc[m][p]);
                    }
                    const int64_t at = n + 2 * p * GROUP;
                    const int nr = (int)(n1 - at < 2 * GROUP ? n1 - at : 2 * GROUP);
                    memcpy(y + (m0 + m) * ldy + at, out, sizeof(float) * nr);
                }
        }
    }
    amx::release();
}
#endif

// ------------------------------------------------------------------ a range of W rows
// Rows of x are taken in chunks of ROW_CHUNK (their quantized blocks, ~100 KiB at K = 1536,
// stay in L2 while every group of W passes over them); within a chunk each group-block of W
// is widened once and applied to every row. The order in which rows, groups and blocks are
// visited changes no output: each is its own chain over blocks.
constexpr int64_t ROW_CHUNK = 32;
// Up to this many rows of x run the one-row register path each (the group's bytes stay in
// L1 after the first row).
constexpr int64_t ONE_ROW_MAX = 2;
// Rows of x a widened group-block is applied to at once (group_block_rows; the tail switch
// in matmul_range covers fewer). Four with VNNI: on a Cascade Lake Xeon a decode step of
// 4-32 rows took 7-12% less than with one at a time, and on two groups' 16 lanes four beat
// 2, 3, 5, 6 and 8 (8 to 512 rows; at 6 and 8 the 2R sums and x's operands no longer fit the
// registers). One with pmaddwd + add, where four were no faster (avx2) or slower (avx512)
// there, on two groups too (avx512: 1.34x against 1.51x the one-group GMAC/s at 4 rows, level
// from 16) (docs/benchmarks.md, 2026-11-27).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int ROW_TILE = 4;
#else
constexpr int ROW_TILE = 1;
#endif

// fn(R, m) for rows [0, mc) of a chunk: tiles of ROW_TILE rows, then the rest as one tile of
// 3, 2 or 1 (R a std::integral_constant, for group_block_rows' and group2_block_rows' R)
template <class Fn>
inline void row_tiles(int64_t mc, Fn&& fn) {
    int64_t m = 0;
    for (; m + ROW_TILE <= mc; m += ROW_TILE) fn(std::integral_constant<int, ROW_TILE>{}, m);
    switch (mc - m) {
        case 3: fn(std::integral_constant<int, 3>{}, m); break;
        case 2: fn(std::integral_constant<int, 2>{}, m); break;
        case 1: fn(std::integral_constant<int, 1>{}, m); break;
        default: break;
    }
}

// y[m, n] for n in [n0, n1), m < M; n0 a multiple of 8. W is format F in the x8 layout,
// [N, K] with K = x.K and N >= n1.
template <int F>
void matmul_range(const uint8_t* w, int64_t n0, int64_t n1, const QRows& x, int64_t M, float* y, int64_t ldy) {
#if defined(KVD_AMX)
    // the tile path knows the ggml formats; kvd's KQ* blocks take the register paths
    if constexpr (F <= Q8_0) {
        if (M >= TILE_MIN_ROWS) {
            matmul_range_tiles<F>(w, n0, n1, x, M, y, ldy);
            return;
        }
    }
#endif
    const int64_t nb = x.nb, gbytes = group_bytes(F, x.K);
    Acc acc[ROW_CHUNK];
    WGroup g;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        const int64_t mc = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
        for (int64_t n = n0; n < n1; n += GROUP) {
            const int nr = n1 - n < GROUP ? (int)(n1 - n) : (int)GROUP;
            const uint8_t* group = w + n / GROUP * gbytes;
#if defined(KVD_TWO_GROUPS)
            if (mc > ONE_ROW_MAX && n + GROUP < n1) {       // this group and the next, 16 lanes
                Acc2 acc2[ROW_CHUNK];
                WGroup2 g2;
                const int nr1 = n1 - n - GROUP < GROUP ? (int)(n1 - n - GROUP) : (int)GROUP;
                for (int64_t m = 0; m < mc; m++) acc2[m].acc = acc2[m].accm = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++) {
                    load_group2<F>(group, group + gbytes, b, &g2);
                    row_tiles(mc, [&](auto r, int64_t m) {
                        group2_block_rows<F, decltype(r)::value>(g2, x, m0 + m, b, &acc2[m]);
                    });
                }
                for (int64_t m = 0; m < mc; m++) store_group2<F>(acc2[m], y + (m0 + m) * ldy + n, nr, nr1);
                n += GROUP;
                continue;
            }
#endif
            for (int64_t m = 0; m < mc; m++) acc[m] = acc_zero();
#if defined(__AVX2__)
            if (mc <= ONE_ROW_MAX) {
                for (int64_t m = 0; m < mc; m++) {
                    group_one_row<F>(group, x, m0 + m, &acc[m]);
                    store_group<F>(acc[m], y + (m0 + m) * ldy + n, nr);
                }
                continue;
            }
#endif
            for (int64_t b = 0; b < nb; b++) {
                load_group<F>(group, b, &g);
                row_tiles(mc, [&](auto r, int64_t m) { group_block_rows<F, decltype(r)::value>(g, x, m0 + m, b, &acc[m]); });
            }
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
        case KQ5_0: matmul_range<KQ5_0>(w, n0, n1, x, M, y, ldy); return true;
        case KQ5_1: matmul_range<KQ5_1>(w, n0, n1, x, M, y, ldy); return true;
        case KS4: matmul_range<KS4>(w, n0, n1, x, M, y, ldy); return true;
        case KS5: matmul_range<KS5>(w, n0, n1, x, M, y, ldy); return true;
        case KS6: matmul_range<KS6>(w, n0, n1, x, M, y, ldy); return true;
        case KS2: matmul_range<KS2>(w, n0, n1, x, M, y, ldy); return true;
        case KS3: matmul_range<KS3>(w, n0, n1, x, M, y, ldy); return true;
        case KI4: matmul_range<KI4>(w, n0, n1, x, M, y, ldy); return true;
        case KSI4: matmul_range<KSI4>(w, n0, n1, x, M, y, ldy); return true;
        default: return false;
    }
}

// ------------------------------------------------------------------ embedding rows
// out[t, :] = row ids[t] of W (format F, [N, K], x8 layout) dequantized exactly; ids
// already checked. Each block is gathered back into its GGUF bytes, then dequantized.
template <int F>
void gather_rows(const uint8_t* w, int64_t K, const int64_t* ids, int64_t T, float* out) {
    constexpr int64_t BB = block_bytes(F), GB = group_block_bytes(F);
    const int64_t nb = K / block_weights(F);
    uint8_t blk[BB];
    for (int64_t t = 0; t < T; t++) {
        const uint8_t* group = w + ids[t] / GROUP * group_bytes(F, K);
        const int64_t r = ids[t] % GROUP;
        if constexpr (super_block(F)) {          // 16-bit words only; then each sub-block
            for (int64_t b = 0; b < nb; b++) {
                for (int64_t i = 0; i < BB / 2; i++) memcpy(blk + 2 * i, group + b * GB + 16 * i + 2 * r, 2);
                for (int s = 0; s < SUBS; s++) {
                    V16 lo, hi;
                    dequant_sub<F>(blk, s, &lo, &hi);
                    vstore(out + t * K + (b * SUBS + s) * QK, lo);
                    vstore(out + t * K + (b * SUBS + s) * QK + 16, hi);
                }
            }
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            for (int64_t i = 0; i < BB / 2; i++) memcpy(blk + 2 * i, group + b * GB + 16 * i + 2 * r, 2);
            V16 lo, hi;
            dequant_block<F>(blk, &lo, &hi);
            vstore(out + t * K + b * QK, lo);
            vstore(out + t * K + b * QK + 16, hi);
        }
    }
}

inline bool gather_rows_any(int format, const uint8_t* w, int64_t K, const int64_t* ids, int64_t T, float* out) {
    switch (format) {
        case Q4_0: gather_rows<Q4_0>(w, K, ids, T, out); return true;
        case Q4_1: gather_rows<Q4_1>(w, K, ids, T, out); return true;
        case Q8_0: gather_rows<Q8_0>(w, K, ids, T, out); return true;
        case KQ5_0: gather_rows<KQ5_0>(w, K, ids, T, out); return true;
        case KQ5_1: gather_rows<KQ5_1>(w, K, ids, T, out); return true;
        case KS4: gather_rows<KS4>(w, K, ids, T, out); return true;
        case KS5: gather_rows<KS5>(w, K, ids, T, out); return true;
        case KS6: gather_rows<KS6>(w, K, ids, T, out); return true;
        case KS2: gather_rows<KS2>(w, K, ids, T, out); return true;
        case KS3: gather_rows<KS3>(w, K, ids, T, out); return true;
        case KI4: gather_rows<KI4>(w, K, ids, T, out); return true;
        case KSI4: gather_rows<KSI4>(w, K, ids, T, out); return true;
        default: return false;
    }
}

}  // namespace
