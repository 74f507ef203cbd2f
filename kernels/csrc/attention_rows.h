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

// Split over keys. Sequence b's keys 0..ctx-1 are cut into chunks of key_chunk(ctx) keys, a
// function of ctx alone; a work item is one chunk of one sequence for every query head, so each
// key's K and V rows (every KV head, side by side in the cache) are read once, in address order,
// and a single sequence's keys are spread over the whole team. Chunk c of head h leaves
//     m_c = max_t s_t,  l_c = sum_t e^(s_t - m_c) (exp_sum),  o_c = sum_t e^(s_t - m_c) v_t (key order)
// with s_t = (q . k_t) * scale; then per (sequence, head), chunks in order:
//     M = max_c m_c,  a_c = e^(m_c - M),  L = sum_c a_c l_c,  O = sum_c a_c o_c,  out = O * (1 / L).
// Every step is a fixed sequence of fp32 operations on the sequence's own keys: the output does
// not depend on the batch, on which thread takes which item, or on the build.
constexpr int64_t KEY_CHUNKS = 16;               // chunks a sequence is cut into (more past 4,096 keys)
constexpr int64_t KEY_CHUNK_STEP = 16;           // a chunk's length is a multiple of this ...
constexpr int64_t KEY_CHUNK_MAX = 256;           // ... and at most this

// Keys a chunk of a sequence of ctx keys: 16 up to 256 keys, then 16 more per 256, at most 256.
inline int64_t key_chunk(int64_t ctx) {
    const int64_t c = KEY_CHUNK_STEP * ((ctx + KEY_CHUNKS * KEY_CHUNK_STEP - 1) / (KEY_CHUNKS * KEY_CHUNK_STEP));
    return c < KEY_CHUNK_MAX ? c : KEY_CHUNK_MAX;
}

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

// Keys between a K row's prefetch and its use. Prefetching K rows ahead and V rows during the
// score pass: 10% off a step at 1,000 and 4,000 keys, block table scattered (docs/benchmarks.md).
constexpr int64_t KV_AHEAD = 4;

inline void prefetch_lines(const void* p, int64_t bytes) {       // a hint: changes no result
#if defined(__AVX2__)
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch((const char*)p + at, _MM_HINT_T0);
#else
    (void)p, (void)bytes;
#endif
}

// A sequence's attention inputs: its rotated queries [H][hd], its block table and length.
struct AttnSeq {
    const float* q;
    const int64_t* table;
    int64_t ctx;
};

// Item [t0, t1) of one sequence, every head: m, l [H] and o [H][hd] as above. kc, vc: the
// layer's caches (KV: float, or uint16_t for halves, widened as they are read); scores:
// [H][t1 - t0] scratch.
template <class KV>
void attend_chunk(const AttnSeq& seq, int64_t t0, int64_t t1, const KV* kc, const KV* vc, int block_size,
                  int64_t kvh_stride, int H, int group, int hd, float scale, float* scores, float* m, float* l,
                  float* o) {
    const int64_t n = t1 - t0;
    int64_t row[KEY_CHUNK_MAX];                  // key t0 + i's offset in the caches
    for (int64_t i = 0, blk = t0 / block_size, at = t0 % block_size; i < n; i++) {
        row[i] = (seq.table[blk] * block_size + at) * kvh_stride;
        if (++at == block_size) at = 0, blk++;
    }
    const int64_t row_bytes = kvh_stride * (int64_t)sizeof(KV);
    const int chunks = hd / 16;
    for (int64_t i = 0; i < n; i++) {
        const KV* k = kc + row[i];
        // the cache is cold (the step's weights streamed through since this layer last ran):
        // ask for key i + KV_AHEAD's K row and key i's V row (read in the second pass)
        if (i + KV_AHEAD < n) prefetch_lines(kc + row[i + KV_AHEAD], row_bytes);
        prefetch_lines(vc + row[i], row_bytes);
        // each KV head's K row loaded (a half cache's widened) once for the query heads that
        // share it; a score is q·k in 16-lane chunks (a product, then FMAs in order), vsum's
        // fixed tree, then the scale
        for (int g = 0; g < H / group; g++) {
            V16 kk[16];                          // hd <= 256
            for (int c = 0; c < chunks; c++) kk[c] = vload_kv(k + g * hd + 16 * c);
            for (int j = 0; j < group; j++) {
                const float* q = seq.q + (int64_t)(g * group + j) * hd;
                V16 acc = vmul(vload(q), kk[0]);
                for (int c = 1; c < chunks; c++) acc = vfma(vload(q + 16 * c), kk[c], acc);
                scores[(g * group + j) * n + i] = vsum(acc) * scale;
            }
        }
    }
    for (int h = 0; h < H; h++) {
        float* s = scores + h * n;
        float mx = s[0];
        for (int64_t i = 1; i < n; i++) mx = s[i] > mx ? s[i] : mx;
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
