// Causal prefill attention of one sequence, blocked over keys with an online
// softmax (flash-attention style), the query heads of one KV head together (GQA).
//
// Called through ctypes from kernels/prefill_attention.py, which documents the
// contract. Layouts (fp32; a token's heads contiguous, tokens ld* floats apart, so that
// views into wider rows -- q and k of the fused qkv projection -- are read in place):
//
//     q    [T, H, hd]     row stride ldq: the new tokens' queries, at positions P .. P + T - 1 (P = S - T)
//     k, v [S, KVH, hd]   row strides ldk, ldv: the sequence's keys and values, positions 0 .. S - 1
//     out  [T, H, hd]     row stride ldo
//
// Work unit: (KV head g, a block of QB query positions). Its rows are the QB
// positions times the G = H / KVH query heads that read KV head g, so one
// block of keys is loaded once for all of them:
//
//     row r  <->  position i0 + r / G, query head g * G + r % G
//
//     for each block of KB keys [j0, j0 + KB) up to the unit's last position:
//         s[r][n]   = (q[r] * scale) . k[j0 + n]          outer-product tile (simd.h), fma over d
//         s[r][n]   = -inf where key j0 + n is after row r's position
//         m'        = max(m, max_n s[r][n]);  p = exp(s - m');  alpha = exp(m - m')
//         l         = l * alpha + sum_n p;   acc[r] = acc[r] * alpha + sum_n p[r][n] v[j0 + n]
//     out[r] = acc[r] / l
//
// A row's sequence of operations depends only on its own query, position and
// keys: key blocks are aligned to key 0, not to the query block, every dot
// product and every accumulation runs in a fixed order, and a key block past a
// row's position (the unit's other rows need it) changes nothing in that row
// (p = 0, alpha = 1). So a token's output is the same bit for bit whichever
// query block, batch or cached prefix it is computed in, and with any thread
// count (units are whole, one thread each). The dot products, the accumulations and
// the row sums (simd.h's exp_sum) run in the same order on every build, so the
// AVX-512, AVX2 and portable builds give the same bits too.

#include <omp.h>

#include <vector>

#include "simd.h"

namespace {

constexpr int64_t QB = 32;          // query positions per unit
constexpr int64_t KB = 128;         // keys per block: s holds QB * G * KB floats, L2-resident
constexpr size_t KEEP_KT_BYTES = 32 << 20;   // most transposed keys a calling thread keeps between calls

struct Scratch {
    std::vector<float> q, s, acc, m, l;
    Scratch(int64_t rows, int64_t hd)
        : q(rows * hd), s(rows * KB), acc(rows * hd), m(rows), l(rows) {}
};

// One unit: KV head g, query positions [i0, i1). kt: [KVH][hd][s_pad] (keys transposed).
void unit(const float* q, int64_t ldq, const float* kt, const float* v, int64_t ldv, float* out, int64_t ldo,
          int64_t T, int64_t S, int64_t s_pad, int H, int KVH, int hd, float scale, int g, int64_t i0, int64_t i1,
          Scratch& w) {
    const int G = H / KVH;
    const int64_t prefix = S - T, rows = (i1 - i0) * G;
    const int64_t rows_pad = (rows + GEMM_MR - 1) / GEMM_MR * GEMM_MR;
    float* qs = w.q.data();
    float* s = w.s.data();
    float* acc = w.acc.data();
    for (int64_t r = 0; r < rows_pad; r++) {
        const float* src = q + (i0 + r / G) * ldq + (g * G + r % G) * hd;
        for (int d = 0; d < hd; d++) qs[r * hd + d] = r < rows ? src[d] * scale : 0.0f;
        for (int d = 0; d < hd; d++) acc[r * hd + d] = 0.0f;
        w.m[r] = -INFINITY;
        w.l[r] = 0.0f;
    }
    const float* ktg = kt + (int64_t)g * hd * s_pad;
    const int64_t end = prefix + i1;                    // keys [0, end) are seen by some row
    for (int64_t j0 = 0; j0 < end; j0 += KB) {
        const int64_t kb = end - j0 < KB ? end - j0 : KB;
        const int64_t kb_pad = (kb + GEMM_NR - 1) / GEMM_NR * GEMM_NR;
        for (int64_t r = 0; r < rows_pad; r += GEMM_MR)
            for (int64_t n = 0; n < kb_pad; n += GEMM_NR)
                outer_tile<false, false>(qs + r * hd, hd, ktg + j0 + n, s_pad, hd, s + r * KB + n, KB);
        for (int64_t r = 0; r < rows_pad; r++) {
            float* sr = s + r * KB;
            // keys [j0, j0 + valid) are at or before this row's position
            int64_t valid = r < rows ? prefix + i0 + r / G - j0 + 1 : 0;
            valid = valid < 0 ? 0 : valid > kb ? kb : valid;
            for (int64_t n = valid; n < kb_pad; n++) sr[n] = -INFINITY;
            if (valid == 0) {                           // nothing to add: p = 0, m, l, acc unchanged
                for (int64_t n = 0; n < kb_pad; n++) sr[n] = 0.0f;
                continue;
            }
            VN mx = vn_set1(-INFINITY);
            for (int64_t n = 0; n < kb_pad; n += GEMM_VW) mx = vn_max(mx, vn_load(sr + n));
            alignas(64) float lanes[GEMM_VW];
            vn_store(lanes, mx);
            float m_new = w.m[r];
            for (int i = 0; i < GEMM_VW; i++) m_new = lanes[i] > m_new ? lanes[i] : m_new;
            const float l_blk = exp_sum(sr, kb_pad, m_new);          // -inf - m -> 0
            if (m_new != w.m[r]) {                      // rescale what the earlier blocks summed
                vn_store(lanes, vn_exp(vn_set1(w.m[r] - m_new)));
                const float alpha = lanes[0];
                w.l[r] *= alpha;
                for (int d = 0; d < hd; d++) acc[r * hd + d] *= alpha;
                w.m[r] = m_new;
            }
            w.l[r] += l_blk;
        }
        const float* vb = v + j0 * ldv + (int64_t)g * hd;
        for (int64_t r = 0; r < rows_pad; r += GEMM_MR)
            for (int d = 0; d < hd; d += GEMM_NR)
                outer_tile<true, false>(s + r * KB, KB, vb + d, ldv, kb, acc + r * hd + d, hd);
    }
    for (int64_t r = 0; r < rows; r++) {
        float* dst = out + (i0 + r / G) * ldo + (g * G + r % G) * hd;
        const float inv = 1.0f / w.l[r];
        for (int d = 0; d < hd; d++) dst[d] = acc[r * hd + d] * inv;
    }
}

}  // namespace

extern "C" {

const char* kvd_attention_variant() { return KVD_VARIANT; }

// out = causal attention of q over k, v (layouts above). Returns 0, or -1 for a shape
// this kernel does not take (nothing written): T > S, H not a multiple of KVH, hd not a
// positive multiple of GEMM_NR, or a row stride shorter than its row.
int kvd_prefill_attention(const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv,
                          float* out, int64_t ldo, int64_t T, int64_t S, int H, int KVH, int hd, float scale,
                          int num_threads) {
    if (T < 0 || S < T || KVH < 1 || H < KVH || H % KVH || hd < 1 || hd % GEMM_NR) return -1;
    if (ldq < (int64_t)H * hd || ldo < (int64_t)H * hd || ldk < (int64_t)KVH * hd || ldv < (int64_t)KVH * hd)
        return -1;
    if (T == 0) return 0;
    const int nt = num_threads < 1 ? 1 : num_threads;
    const int64_t s_pad = (S + GEMM_NR - 1) / GEMM_NR * GEMM_NR + KB;   // a block's padded tile stays inside
    // [KVH][hd][s_pad]: in a buffer the calling thread keeps between calls (a prompt's layers
    // ask for the same size; zeroing a new one per call would run on one thread), freed after
    // a call that needed more than KEEP_KT_BYTES. Columns S and up hold whatever an earlier
    // call left: their scores are always masked (set, not added).
    thread_local std::vector<float> kt_buf;
    if (kt_buf.size() < (size_t)KVH * hd * s_pad) kt_buf.resize((size_t)KVH * hd * s_pad);
    float* const kt = kt_buf.data();
    const int64_t qblocks = (T + QB - 1) / QB, units = qblocks * KVH;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t gd = 0; gd < (int64_t)KVH * hd; gd++) {
            const int64_t g = gd / hd, d = gd % hd;
            for (int64_t j = 0; j < S; j++) kt[gd * s_pad + j] = k[j * ldk + g * hd + d];
        }
        Scratch w(QB * (H / KVH) + GEMM_MR, hd);
        // the last query blocks see the most keys: hand them out first
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            const int64_t qb = qblocks - 1 - u / KVH;
            const int g = (int)(u % KVH);
            const int64_t i0 = qb * QB, i1 = i0 + QB < T ? i0 + QB : T;
            unit(q, ldq, kt, v, ldv, out, ldo, T, S, s_pad, H, KVH, hd, scale, g, i0, i1, w);
        }
    }
    if (kt_buf.size() * sizeof(float) > KEEP_KT_BYTES) std::vector<float>().swap(kt_buf);
    return 0;
}

}  // extern "C"
