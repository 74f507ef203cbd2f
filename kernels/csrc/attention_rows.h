// Attention of one query row over its sequence's paged keys, in the one fixed order every
// kvd path uses: the plan executor's decode step (plan_decode.cpp) and the torch path's
// prefill and decode (paged_attention.cpp) both compute a row through these functions, so a
// token's attention output -- and with it its K/V in the next layer and its logits -- has the
// same bits whether it was prefilled (in any chunk, at any place in it) or decoded (in any
// batch, at any row), with any thread count, on every build (simd.h, quant_blocks.h: the
// same fp32 operations per lane everywhere).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "simd.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Split over keys. A row at position p attends to keys 0..p (a sliding layer of window W:
// keys max(0, p - W + 1)..p, kernels/attention.py's window_mask), cut into chunks of KEY_CHUNK
// keys at fixed places (chunk c: keys c * KEY_CHUNK .. (c + 1) * KEY_CHUNK - 1, the last one
// cut at p, the first at the window's start): a work item is one chunk of one row for every
// query head, so each key's K and V rows
// (every KV head, side by side in the cache) are read once per item, in address order, and a
// single long sequence's keys are spread over the whole team. Chunk c of head h leaves
//     m_c = max_t s_t,  l_c = sum_t e^(s_t - m_c) (exp_sum),  o_c = sum_t e^(s_t - m_c) v_t (key order)
// with s_t = (q . k_t) * scale (dot_keys); then per (row, head), chunks in order:
//     M = max_c m_c,  a_c = e^(m_c - M),  L = sum_c a_c l_c,  O = sum_c a_c o_c,  out = O * (1 / L).
// Every step is a fixed sequence of fp32 operations on the row's own query and keys, and the
// chunks sit at the same keys for every row: the output does not depend on the batch, on
// which rows share a call (a prefill's chunk or a decode batch), on which thread takes which
// item, or on the build.
constexpr int64_t KEY_CHUNK = 128;

// The first key a row of ctx keys (its position + 1) attends to on a layer of `window` keys
// (0: every key).
inline int64_t first_key(int64_t ctx, int64_t window) { return window > 0 && ctx > window ? ctx - window : 0; }

// Index of the first chunk a row attends to, and how many it attends to (ctx >= 1).
inline int64_t first_chunk(int64_t ctx, int64_t window) { return first_key(ctx, window) / KEY_CHUNK; }
inline int64_t key_chunks(int64_t ctx, int64_t window) { return (ctx - 1) / KEY_CHUNK - first_chunk(ctx, window) + 1; }

// Keys [chunk_start, chunk_end) of chunk c of such a row: the fixed chunk cut to the row's keys.
inline int64_t chunk_start(int64_t c, int64_t ctx, int64_t window) {
    const int64_t lo = first_key(ctx, window);
    return c * KEY_CHUNK > lo ? c * KEY_CHUNK : lo;
}
inline int64_t chunk_end(int64_t c, int64_t ctx) { return (c + 1) * KEY_CHUNK < ctx ? (c + 1) * KEY_CHUNK : ctx; }

// 16 of a KV row's elements as fp32: a fp32 cache's as they are, a half cache's widened (exact)
inline V16 vload_kv(const float* p) { return vload(p); }
inline V16 vload_kv(const uint16_t* p) { return vload_half(p); }

// A token's K or V row (kvh_stride floats) into the cache as its elements: a half cache rounds
// it as the torch path's store does (store_half_row), and every later read sees those values.
inline void store_kv(const float* x, int64_t n, float* out) { memcpy(out, x, (size_t)n * sizeof(float)); }
inline void store_kv(const float* x, int64_t n, uint16_t* out) { store_half_row(x, n, out); }

inline float exp_one(float x) {                 // simd.h's e^x for x <= 0, the same bits on every build
    alignas(64) float lanes[GEMM_VW];
    vn_store(lanes, vn_exp(vn_set1(x)));
    return lanes[0];
}

inline void prefetch_lines(const void* p, int64_t bytes) {       // a hint: changes no result
#if defined(__AVX2__)
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch((const char*)p + at, _MM_HINT_T0);
#else
    (void)p, (void)bytes;
#endif
}

// ------------------------------------------------------------------ scores
// A score is q·k in 16-lane chunks (a product, then FMAs in order: lane l sums d = l, l + 16,
// ...), the 16 lanes added along vsum's fixed tree (quant_blocks.h), then the scale. dot_keys
// computes DOT_KEYS keys' scores at once and adds their lanes with shuffles that pair the same
// lanes vsum pairs, in the same order: the same bits as one vsum per key, at a fraction of the
// shuffles (AVX-512: 30 for 16 keys against 64).
#if defined(__AVX512F__)
constexpr int DOT_KEYS = 16;
// vsum_keys' input m: lane 4k + e of its result sums input k + 4e, so input m is key 4 (m % 4) + m / 4
#define KVD_DOT_KEY(m) (4 * ((m) % 4) + (m) / 4)
// lane j = vsum(a[j]) for the 16 keys' accumulators a (key order)
inline __m512 vsum_keys(const V16* a) {
    __m512 z[8], w[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {           // (j + j+8): [input 2i's 8 | input 2i+1's 8]
        const __m512 x = a[KVD_DOT_KEY(2 * i)].v, y = a[KVD_DOT_KEY(2 * i + 1)].v;
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)             // (j + j+4): inputs 4i .. 4i+3's 4, one per 128-bit lane
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0xDD));
    // (j + j+2): 128-bit lane k holds input k's 2 and input 4 + k's 2 (u0), 8 + k's and 12 + k's (u1)
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x44), _mm512_shuffle_ps(w[0], w[1], 0xEE));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_ps(w[2], w[3], 0x44), _mm512_shuffle_ps(w[2], w[3], 0xEE));
    // (0 + 1): lane 4k + e = input k + 4e's sum
    return _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x88), _mm512_shuffle_ps(u0, u1, 0xDD));
}
#undef KVD_DOT_KEY
#elif defined(__AVX2__)
constexpr int DOT_KEYS = 8;
// vsum_keys' input m: lane 4h + e of its result sums input h + 2e, so input m is key 4 (m % 2) + m / 2
#define KVD_DOT_KEY(m) (4 * ((m) % 2) + (m) / 2)
// lane j = vsum(a[j]) for the 8 keys' accumulators a (key order)
inline __m256 vsum_keys(const V16* a) {
    __m256 s[8], w[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) s[i] = _mm256_add_ps(a[KVD_DOT_KEY(i)].a, a[KVD_DOT_KEY(i)].b);   // (j + j+8)
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)             // (j + j+4): [input 2i's 4 | input 2i+1's 4]
        w[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
    // (j + j+2): half h holds input h's 2 and input 2 + h's 2 (u0), 4 + h's and 6 + h's (u1)
    const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x44), _mm256_shuffle_ps(w[0], w[1], 0xEE));
    const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(w[2], w[3], 0x44), _mm256_shuffle_ps(w[2], w[3], 0xEE));
    // (0 + 1): lane 4h + e = input h + 2e's sum
    return _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xDD));
}
#undef KVD_DOT_KEY
#else
constexpr int DOT_KEYS = 1;
#endif

// s[i] = (q · k_i) * scale for the n <= DOT_KEYS keys whose rows start at k + rows[i]; q: hd =
// 16 * CH floats (CH > 0), or 16 * chunks (CH = 0: any head size).
template <int CH, class KV>
inline void dot_keys(const float* q, const KV* k, const int64_t* rows, int64_t n, int chunks, float scale,
                     float* s) {
    constexpr int QV = CH > 0 ? CH : 16;
    const int nc = CH > 0 ? CH : chunks;
    V16 qq[QV];
#pragma GCC unroll 16
    for (int c = 0; c < nc; c++) qq[c] = vload(q + 16 * c);
    V16 acc[DOT_KEYS];
#pragma GCC unroll 16
    for (int j = 0; j < DOT_KEYS; j++) {
        if (j < n) {
            const KV* kr = k + rows[j];
            V16 a = vmul(qq[0], vload_kv(kr));
#pragma GCC unroll 16
            for (int c = 1; c < nc; c++) a = vfma(qq[c], vload_kv(kr + 16 * c), a);
            acc[j] = a;
        } else {
            acc[j] = vzero();
        }
    }
#if defined(__AVX512F__)
    const __m512 sums = _mm512_mul_ps(vsum_keys(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(s, (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1), sums);
#elif defined(__AVX2__)
    const __m256 sums = _mm256_mul_ps(vsum_keys(acc), _mm256_set1_ps(scale));
    if (n == 8) {
        _mm256_storeu_ps(s, sums);
    } else {
        alignas(32) float out[8];
        _mm256_store_ps(out, sums);
        for (int64_t j = 0; j < n; j++) s[j] = out[j];
    }
#else
    s[0] = vsum(acc[0]) * scale;
#endif
}

// s[i] = e^(s[i] - m) for i < n; returns their sum: 16 lane sums (lane j adds s[j], s[j + 16],
// ... in turn), then vsum's tree over the lanes. The same bits on every build (one V16 of lane
// sums whatever the vector width), and a tree, not a chain of 16 dependent adds, ends it.
inline float exp_sum(float* s, int64_t n, float m) {
    const VN mv = vn_set1(m);
    VN acc[SUM_VECS];
    for (int v = 0; v < SUM_VECS; v++) acc[v] = vn_zero();
    int64_t i = 0;
    for (; i + SUM_LANES <= n; i += SUM_LANES)
        for (int v = 0; v < SUM_VECS; v++) {
            const VN e = vn_exp(vn_sub(vn_load(s + i + v * GEMM_VW), mv));
            vn_store(s + i + v * GEMM_VW, e);
            acc[v] = vn_add(acc[v], e);
        }
    if (i < n) {                                    // the tail: e^-inf = 0 in the lanes past n adds nothing
        alignas(64) float tail[SUM_LANES];
        for (int j = 0; j < SUM_LANES; j++) tail[j] = i + j < n ? s[i + j] - m : -INFINITY;
        for (int v = 0; v < SUM_VECS; v++) {
            const VN e = vn_exp(vn_load(tail + v * GEMM_VW));
            vn_store(tail + v * GEMM_VW, e);
            acc[v] = vn_add(acc[v], e);
        }
        for (int j = 0; i + j < n; j++) s[i + j] = tail[j];
    }
    alignas(64) float lanes[SUM_LANES];
    for (int v = 0; v < SUM_VECS; v++) vn_store(lanes + v * GEMM_VW, acc[v]);
    return vsum(vload(lanes));
}

// The largest score of s[0..n) that is not NaN (-inf when none is): the same value in any order
// and on every build (vn_max and the comparison below both pass over a NaN), so taken GEMM_VW
// lanes at a time. A NaN score then weighs 0, as vn_exp makes e^NaN.
inline float max_of(const float* s, int64_t n) {
    VN v = vn_set1(-INFINITY);
    int64_t i = 0;
    for (; i + GEMM_VW <= n; i += GEMM_VW) v = vn_max(vn_load(s + i), v);
    alignas(64) float lanes[GEMM_VW];
    vn_store(lanes, v);
    float mx = -INFINITY;
    for (int j = 0; j < GEMM_VW; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    return mx;
}

// A sequence's attention inputs: its rotated queries [H][hd], its block table and length.
struct AttnSeq {
    const float* q;
    const int64_t* table;
    int64_t ctx;
};

// Item [t0, t1) of one sequence, every head: m, l [H] and o [H][hd] as above. kc, vc: the
// layer's caches (KV: float, or uint16_t for halves, widened as they are read); scores:
// [H][t1 - t0] scratch. PREFETCH: ask for the K and V rows ahead of their use (a decode step,
// whose caches went cold while the step's weights streamed through; a prefill's are warm, and
// the hints would only cost instructions). It changes no result.
template <bool PREFETCH, class KV>
void attend_chunk(const AttnSeq& seq, int64_t t0, int64_t t1, const KV* kc, const KV* vc, int block_size,
                  int64_t kvh_stride, int H, int group, int hd, float scale, float* scores, float* m, float* l,
                  float* o) {
    const int64_t n = t1 - t0;
    int64_t row[KEY_CHUNK];                  // key t0 + i's offset in the caches
    for (int64_t i = 0, blk = t0 / block_size, at = t0 % block_size; i < n; i++) {
        row[i] = (seq.table[blk] * block_size + at) * kvh_stride;
        if (++at == block_size) at = 0, blk++;
    }
    const int64_t row_bytes = kvh_stride * (int64_t)sizeof(KV);
    const int chunks = hd / 16;
    // the cache is cold (the step's weights streamed through since this layer last ran): ask
    // for the next block of keys' K rows while one is scored, and for every V row (read in the
    // second pass) as the scores start; each block's K rows stay in L1 for every head
    if (PREFETCH)
        for (int64_t i = 0; i < n && i < DOT_KEYS; i++) prefetch_lines(kc + row[i], row_bytes);
    for (int64_t i0 = 0; i0 < n; i0 += DOT_KEYS) {
        const int64_t nb = n - i0 < DOT_KEYS ? n - i0 : DOT_KEYS;
        if (PREFETCH) {
            for (int64_t i = i0 + DOT_KEYS; i < n && i < i0 + 2 * DOT_KEYS; i++) prefetch_lines(kc + row[i], row_bytes);
            for (int64_t i = i0; i < i0 + nb; i++) prefetch_lines(vc + row[i], row_bytes);
        }
        for (int h = 0; h < H; h++) {
            const float* q = seq.q + (int64_t)h * hd;
            const KV* k = kc + (h / group) * hd;
            if (chunks == 4)                     // head_dim 64: the query in registers
                dot_keys<4>(q, k, row + i0, nb, chunks, scale, scores + h * n + i0);
            else
                dot_keys<0>(q, k, row + i0, nb, chunks, scale, scores + h * n + i0);
        }
    }
    for (int h = 0; h < H; h++) {
        float* s = scores + h * n;
        const float mx = max_of(s, n);
        m[h] = mx;
        l[h] = exp_sum(s, n, mx);                // s becomes e^(s - m)
    }
    // o[h] = sum_i s[h][i] v_i in key order, per head. With AVX-512's 32 registers the heads
    // that share a KV head go together (head_dim 64: 4 vectors a head, up to 4 heads a pass),
    // so each V row is loaded once per KV head: a step at 4,096 keys 11-12% faster on a
    // Cascade Lake Xeon. AVX2's 16 registers would spill them: one head at a time there.
#if defined(__AVX512F__)
    if (chunks == 4 && group <= 4) {
        for (int g = 0; g < H / group; g++) {
            V16 acc[4][4];
            for (int j = 0; j < group; j++)
                for (int c = 0; c < 4; c++) acc[j][c] = vzero();
            const KV* vg = vc + g * hd;
            const float* sg = scores + (int64_t)g * group * n;
            for (int64_t i = 0; i < n; i++) {
                const KV* v = vg + row[i];
                const V16 v0 = vload_kv(v), v1 = vload_kv(v + 16), v2 = vload_kv(v + 32), v3 = vload_kv(v + 48);
                for (int j = 0; j < group; j++) {
                    const V16 p = vset1(sg[j * n + i]);
                    acc[j][0] = vfma(p, v0, acc[j][0]);
                    acc[j][1] = vfma(p, v1, acc[j][1]);
                    acc[j][2] = vfma(p, v2, acc[j][2]);
                    acc[j][3] = vfma(p, v3, acc[j][3]);
                }
            }
            for (int j = 0; j < group; j++)
                for (int c = 0; c < 4; c++) vstore(o + (g * group + j) * hd + 16 * c, acc[j][c]);
        }
        return;
    }
#endif
    for (int h = 0; h < H; h++) {
        const float* s = scores + h * n;
        V16 acc[16];                             // hd <= 256
        for (int c = 0; c < chunks; c++) acc[c] = vzero();
        const KV* vg = vc + (h / group) * hd;
        for (int64_t i = 0; i < n; i++) {
            const KV* v = vg + row[i];
            const V16 p = vset1(s[i]);
            for (int c = 0; c < chunks; c++) acc[c] = vfma(p, vload_kv(v + 16 * c), acc[c]);
        }
        for (int c = 0; c < chunks; c++) vstore(o + h * hd + 16 * c, acc[c]);
    }
}

// out [hd] = head h's attention from its sequence's `count` chunk results (m, l: stride H
// per chunk; o: stride H * hd), chunks in order.
void combine_chunks(const float* m, const float* l, const float* o, int64_t count, int H, int hd, float* out) {
    float mx = m[0];
    for (int64_t c = 1; c < count; c++) mx = m[c * H] > mx ? m[c * H] : mx;
    const int chunks = hd / 16;
    V16 acc[16];
    for (int i = 0; i < chunks; i++) acc[i] = vzero();
    float sum = 0.0f;
    for (int64_t c = 0; c < count; c++) {
        const float a = exp_one(m[c * H] - mx);
        sum = sum + a * l[c * H];
        const V16 av = vset1(a);
        for (int i = 0; i < chunks; i++) acc[i] = vfma(av, vload(o + c * H * hd + 16 * i), acc[i]);
    }
    const V16 inv = vset1(1.0f / sum);
    for (int i = 0; i < chunks; i++) vstore(out + 16 * i, vmul(acc[i], inv));
}

}  // namespace
