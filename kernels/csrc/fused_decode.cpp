// One bf16 decode step of a Llama decoder (all layers + LM head) on AVX512-BF16 CPUs.
//
// Called through ctypes from kernels/fused_decode.py, which documents the
// contract; this file documents the layouts and the arithmetic.
//
// Packed weight tiles (made once at load by fused_decode.pack_tiles):
//
//     W [N, K] row-major (out, in)  ->  [ceil(N/32)][K/2][32][2]
//                                        tile   k-pair  col  k&1
//
// One tile is 32 output columns; one 64-byte zmm load is 32 columns x 2 k.
// _mm512_dpbf16_ps adds x[2k]*w[2k] + x[2k+1]*w[2k+1] into each column's own
// fp32 lane, so a column's sum runs sequentially over k in one lane: no
// horizontal reduction, and the same instruction sequence per output whatever
// the batch size, the other rows or the thread count (tiles, never a
// column's k-range, are split between threads). That is the batch-invariance
// contract: row r's result depends only on row r's inputs.
//
// Every rounding to bf16 sits where the torch path (engine/model/llama.py)
// rounds, so the two paths differ only by the order of the fp32 sums inside
// matmuls and attention.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

typedef uint16_t bf16;

namespace {

constexpr int TILE = 32;  // output columns per packed tile

// ------------------------------------------------------------------ bf16 helpers
// Round-to-nearest-even fp32 -> bf16 (in the low 16 bits of each lane), NaN ->
// 0x7fc0: c10::BFloat16's conversion, so results match torch bit for bit.
inline __m512i bf16_bits(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}
inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline __m512 load_bf16(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load_bf16_mask(const bf16* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store_bf16(bf16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(bf16_bits(v))); }
inline void store_bf16_mask(bf16* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline float bf16_to_f32(bf16 x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
inline bf16 f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (bf16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// e^x, ~1 ulp: x = n ln2 + r, |r| <= ln2/2, Taylor to r^7.
inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline void split(int n, int parts, int part, int* begin, int* end) {
    *begin = (int)((int64_t)n * part / parts);
    *end = (int)((int64_t)n * (part + 1) / parts);
}

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

}  // namespace

// ------------------------------------------------------------------ the model
// Filled once by fused_decode.py (a ctypes.Structure of the same layout).
struct KvdModel {
    int32_t num_layers, hidden, inter, heads, kv_heads, head_dim, vocab;
    int32_t block_size, num_blocks, max_positions;
    float eps, scale;
    const bf16* embed;          // [vocab, hidden]
    const bf16* norms;          // [2*num_layers + 1, hidden]: input, post per layer; final last
    const bf16* cos;            // [max_positions, head_dim]
    const bf16* sin;            // [max_positions, head_dim], first half negated (rope_tables)
    const bf16* packed;         // every packed matrix (offsets below, in elements)
    const int64_t* offsets;     // [num_layers, 4]: qkv, o, gate_up, down
    int64_t head_offset;        // LM head [vocab, hidden]
};

namespace {

// Sizes derived from the model; padding columns/k are zero in the packed weights.
struct Dims {
    int D, Dp;          // hidden, padded to even (k of qkv, gate_up, head)
    int nqkv, qkv_tiles, qkv_stride;
    int q_size, kv_size;
    int o_tiles;
    int Ip;             // intermediate padded to 16: gate/up interleave in 16-column halves
    int gu_tiles;
    int down_tiles;
    int head_tiles;
    explicit Dims(const KvdModel& m) {
        D = m.hidden; Dp = round_up(D, 2);
        q_size = m.heads * m.head_dim; kv_size = m.kv_heads * m.head_dim;
        nqkv = q_size + 2 * kv_size;
        qkv_tiles = (nqkv + TILE - 1) / TILE; qkv_stride = qkv_tiles * TILE;
        o_tiles = (D + TILE - 1) / TILE;
        Ip = round_up(m.inter, 16);
        gu_tiles = Ip / 16;
        down_tiles = o_tiles;
        head_tiles = (m.vocab + TILE - 1) / TILE;
    }
};

// R rows x one tile: acc[r] holds columns [0,16) and [16,32) of the tile.
template <int R, class Epilogue>
inline void tile_rows(const bf16* tile, int k2, const bf16* x, int x_stride, int row0, int t, Epilogue& epi) {
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; r++) { acc0[r] = _mm512_setzero_ps(); acc1[r] = _mm512_setzero_ps(); }
    const bf16* xr[R];
    for (int r = 0; r < R; r++) xr[r] = x + (size_t)(row0 + r) * x_stride;
    for (int k = 0; k < k2; k++) {
        const bf16* w = tile + (size_t)k * 2 * TILE;
        // both lines of the k-pair 16 steps (2 KiB) ahead; the hardware
        // prefetchers restart at every phase, this does not wait for them
        _mm_prefetch((const char*)(w + 16 * 2 * TILE), _MM_HINT_T0);
        _mm_prefetch((const char*)(w + 16 * 2 * TILE + TILE), _MM_HINT_T0);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + TILE);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, xr[r] + 2 * k, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], xb, w0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], xb, w1);
        }
    }
    for (int r = 0; r < R; r++) epi(t, row0 + r, acc0[r], acc1[r]);
}

// This thread's share of tiles, every row: epi(tile, row, cols 0-15, cols 16-31).
template <class Epilogue>
void gemv(const bf16* w, int tiles, int k, const bf16* x, int x_stride, int B,
          int tid, int nt, Epilogue epi) {
    int t0, t1;
    split(tiles, nt, tid, &t0, &t1);
    const int k2 = k / 2;
    for (int t = t0; t < t1; t++) {
        const bf16* tile = w + (size_t)t * k2 * 2 * TILE;
        int r = 0;
        for (; r + 4 <= B; r += 4) tile_rows<4>(tile, k2, x, x_stride, r, t, epi);
        switch (B - r) {
            case 3: tile_rows<3>(tile, k2, x, x_stride, r, t, epi); break;
            case 2: tile_rows<2>(tile, k2, x, x_stride, r, t, epi); break;
            case 1: tile_rows<1>(tile, k2, x, x_stride, r, t, epi); break;
            default: break;
        }
    }
}

// HF LlamaRMSNorm in bf16: y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))); out[D..Dp) = 0.
void rms_norm_row(const bf16* x, const bf16* w, int D, int Dp, float eps, bf16* out) {
    __m512 ss = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) { __m512 v = load_bf16(x + d); ss = _mm512_fmadd_ps(v, v, ss); }
    __mmask16 tail = (__mmask16)((1u << (D - d)) - 1);
    if (tail) { __m512 v = load_bf16_mask(x + d, tail); ss = _mm512_fmadd_ps(v, v, ss); }
    float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)D + eps);
    __m512 vi = _mm512_set1_ps(inv);
    for (d = 0; d + 16 <= D; d += 16)
        store_bf16(out + d, round_bf16(_mm512_mul_ps(load_bf16(w + d), round_bf16(_mm512_mul_ps(load_bf16(x + d), vi)))));
    if (tail)
        store_bf16_mask(out + d, round_bf16(_mm512_mul_ps(load_bf16_mask(w + d, tail),
                                                          round_bf16(_mm512_mul_ps(load_bf16_mask(x + d, tail), vi)))), tail);
    for (int p = D; p < Dp; p++) out[p] = 0;
}

// rotate_half RoPE with torch's roundings: bf16(bf16(x*cos) + bf16(swap(x)*sin)).
void rope_head(const bf16* x, const bf16* cos, const bf16* sin, int hd, bf16* out) {
    const int half = hd / 2;
    for (int d = 0; d < hd; d++) {
        float sw = bf16_to_f32(x[d < half ? d + half : d - half]);
        float a = rbf(bf16_to_f32(x[d]) * bf16_to_f32(cos[d]));
        float b = rbf(sw * bf16_to_f32(sin[d]));
        out[d] = f32_to_bf16(a + b);
    }
}

// One query head over its sequence's paged keys: fp32 scores, softmax, sum of
// p_t * v_t in key order. hd is a multiple of 16 (checked by the caller).
void attend_head(const bf16* q, const bf16* kc, const bf16* vc, const int64_t* table, int ctx,
                 int block_size, int kvh_stride, int hd, float scale, float* scores, bf16* out) {
    const int chunks = hd / 16;
    __m512 qv[16];
    for (int c = 0; c < chunks; c++) qv[c] = load_bf16(q + 16 * c);
    float mx = -INFINITY;
    for (int t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {      // block by block: no division per key
        const bf16* k = kc + table[blk] * block_size * kvh_stride;
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int i = 0; i < n; i++, k += kvh_stride) {
            __m512 acc = _mm512_mul_ps(qv[0], load_bf16(k));
            for (int c = 1; c < chunks; c++) acc = _mm512_fmadd_ps(qv[c], load_bf16(k + 16 * c), acc);
            float s = _mm512_reduce_add_ps(acc) * scale;
            scores[t0 + i] = s;
            mx = s > mx ? s : mx;
        }
    }
    __m512 vmx = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
    int t = 0;
    for (; t + 16 <= ctx; t += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + t), vmx));
        _mm512_storeu_ps(scores + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (t < ctx) {
        __mmask16 m = (__mmask16)((1u << (ctx - t)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), vmx));
        _mm512_mask_storeu_ps(scores + t, m, e);
        vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
    }
    float inv = 1.0f / _mm512_reduce_add_ps(vsum);
    __m512 o[16];
    for (int c = 0; c < chunks; c++) o[c] = _mm512_setzero_ps();
    for (int t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
        const bf16* v = vc + table[blk] * block_size * kvh_stride;
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int i = 0; i < n; i++, v += kvh_stride) {
            __m512 p = _mm512_set1_ps(scores[t0 + i] * inv);
            for (int c = 0; c < chunks; c++) o[c] = _mm512_fmadd_ps(p, load_bf16(v + 16 * c), o[c]);
        }
    }
    for (int c = 0; c < chunks; c++) store_bf16(out + 16 * c, o[c]);
}

inline __mmask16 lanes_below(int n, int base) {
    int k = n - base;
    return k >= 16 ? (__mmask16)0xffff : k <= 0 ? (__mmask16)0 : (__mmask16)((1u << k) - 1);
}

}  // namespace

extern "C" {

// Phases timed when kvd_decode_step gets a non-null `phase_seconds` (added to, by
// thread 0, barrier waits included): see PHASES in fused_decode.py.
enum { PH_SETUP, PH_NORM, PH_QKV, PH_ROPE_KV, PH_ATTN, PH_O, PH_NORM2, PH_GATE_UP, PH_DOWN, PH_HEAD, PH_COUNT };

// Returns 0, or -1 when an id, position or block is out of range (nothing written).
int kvd_decode_step(const KvdModel* m, bf16* kv, int B, const int64_t* ids, const int64_t* positions,
                    const int64_t* tables, int max_blocks, float* logits, int num_threads,
                    double* phase_seconds) {
    double clock = phase_seconds ? omp_get_wtime() : 0.0;
    auto lap = [&](int phase) {
        if (phase_seconds) { double now = omp_get_wtime(); phase_seconds[phase] += now - clock; clock = now; }
    };
    const Dims dm(*m);
    const int bs = m->block_size, hd = m->head_dim, H = m->heads, KVH = m->kv_heads;
    for (int b = 0; b < B; b++) {
        if (ids[b] < 0 || ids[b] >= m->vocab || positions[b] < 0 || positions[b] >= m->max_positions
            || positions[b] / bs >= max_blocks)
            return -1;
        for (int j = 0; j <= positions[b] / bs; j++)
            if (tables[(size_t)b * max_blocks + j] < 0 || tables[(size_t)b * max_blocks + j] >= m->num_blocks)
                return -1;
    }
    int64_t max_ctx = 1;
    for (int b = 0; b < B; b++) max_ctx = positions[b] + 1 > max_ctx ? positions[b] + 1 : max_ctx;

    // scratch, row-major per sequence
    std::vector<bf16> h((size_t)B * dm.D), x((size_t)B * dm.Dp), qkv((size_t)B * dm.qkv_stride),
        qr((size_t)B * dm.q_size), ao((size_t)B * dm.q_size), act((size_t)B * dm.Ip);
    for (int b = 0; b < B; b++) memcpy(&h[(size_t)b * dm.D], m->embed + ids[b] * dm.D, dm.D * sizeof(bf16));

    const size_t layer_kv = (size_t)2 * m->num_blocks * bs * KVH * hd;   // one layer's K and V
    const size_t half_kv = layer_kv / 2;
    const int kvh_stride = KVH * hd;
    const int n_qkv_heads = H + 2 * KVH;
    const int group = H / KVH;
    const int nt = num_threads < 1 ? 1 : num_threads;
    lap(PH_SETUP);

#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num(), T = omp_get_num_threads();
        std::vector<float> scores((size_t)max_ctx + 16);
        int r0, r1;
        split(B, T, tid, &r0, &r1);
        for (int l = 0; l < m->num_layers; l++) {
            const bf16* in_norm = m->norms + (size_t)(2 * l) * dm.D;
            const bf16* post_norm = in_norm + dm.D;
            const int64_t* off = m->offsets + 4 * l;
            bf16* kcache = kv + l * layer_kv;
            bf16* vcache = kcache + half_kv;

            for (int r = r0; r < r1; r++) rms_norm_row(&h[(size_t)r * dm.D], in_norm, dm.D, dm.Dp, m->eps, &x[(size_t)r * dm.Dp]);
#pragma omp barrier
            if (tid == 0) lap(PH_NORM);
            gemv(m->packed + off[0], dm.qkv_tiles, dm.Dp, x.data(), dm.Dp, B, tid, T,
                 [&](int t, int r, __m512 a0, __m512 a1) {
                     bf16* o = &qkv[(size_t)r * dm.qkv_stride + t * TILE];
                     store_bf16(o, a0);
                     store_bf16(o + 16, a1);
                 });
#pragma omp barrier
            if (tid == 0) lap(PH_QKV);
            {   // RoPE on q and k heads; k and v into their cache slots
                int i0, i1;
                split(B * n_qkv_heads, T, tid, &i0, &i1);
                for (int i = i0; i < i1; i++) {
                    int b = i / n_qkv_heads, j = i % n_qkv_heads;
                    int64_t pos = positions[b];
                    int64_t slot = tables[(size_t)b * max_blocks + pos / bs] * bs + pos % bs;
                    const bf16* src = &qkv[(size_t)b * dm.qkv_stride + (size_t)j * hd];
                    const bf16* c = m->cos + pos * hd;
                    const bf16* s = m->sin + pos * hd;
                    if (j < H) rope_head(src, c, s, hd, &qr[(size_t)b * dm.q_size + (size_t)j * hd]);
                    else if (j < H + KVH) rope_head(src, c, s, hd, kcache + slot * kvh_stride + (j - H) * hd);
                    else memcpy(vcache + slot * kvh_stride + (j - H - KVH) * hd, src, hd * sizeof(bf16));
                }
            }
#pragma omp barrier
            if (tid == 0) lap(PH_ROPE_KV);
            {
                int i0, i1;
                split(B * H, T, tid, &i0, &i1);
                for (int i = i0; i < i1; i++) {
                    int b = i / H, head = i % H, g = head / group;
                    attend_head(&qr[(size_t)b * dm.q_size + (size_t)head * hd], kcache + g * hd, vcache + g * hd,
                                tables + (size_t)b * max_blocks, (int)positions[b] + 1, bs, kvh_stride, hd,
                                m->scale, scores.data(), &ao[(size_t)b * dm.q_size + (size_t)head * hd]);
                }
            }
#pragma omp barrier
            if (tid == 0) lap(PH_ATTN);
            auto residual = [&](int t, int r, __m512 a0, __m512 a1) {
                int n = t * TILE;
                bf16* hr = &h[(size_t)r * dm.D + n];
                __mmask16 m0 = lanes_below(dm.D, n), m1 = lanes_below(dm.D, n + 16);
                store_bf16_mask(hr, _mm512_add_ps(load_bf16_mask(hr, m0), round_bf16(a0)), m0);
                if (m1) store_bf16_mask(hr + 16, _mm512_add_ps(load_bf16_mask(hr + 16, m1), round_bf16(a1)), m1);
            };
            gemv(m->packed + off[1], dm.o_tiles, dm.q_size, ao.data(), dm.q_size, B, tid, T, residual);
#pragma omp barrier
            if (tid == 0) lap(PH_O);
            for (int r = r0; r < r1; r++) rms_norm_row(&h[(size_t)r * dm.D], post_norm, dm.D, dm.Dp, m->eps, &x[(size_t)r * dm.Dp]);
#pragma omp barrier
            if (tid == 0) lap(PH_NORM2);
            // tile t = gate columns [16t, 16t+16) then the same up columns: silu(gate) * up
            gemv(m->packed + off[2], dm.gu_tiles, dm.Dp, x.data(), dm.Dp, B, tid, T,
                 [&](int t, int r, __m512 gate, __m512 up) {
                     __m512 g = round_bf16(gate);
                     __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                          exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
                     store_bf16(&act[(size_t)r * dm.Ip + t * 16], _mm512_mul_ps(s, round_bf16(up)));
                 });
#pragma omp barrier
            if (tid == 0) lap(PH_GATE_UP);
            gemv(m->packed + off[3], dm.down_tiles, dm.Ip, act.data(), dm.Ip, B, tid, T, residual);
#pragma omp barrier
            if (tid == 0) lap(PH_DOWN);
        }
        for (int r = r0; r < r1; r++)
            rms_norm_row(&h[(size_t)r * dm.D], m->norms + (size_t)(2 * m->num_layers) * dm.D, dm.D, dm.Dp, m->eps,
                         &x[(size_t)r * dm.Dp]);
#pragma omp barrier
        if (tid == 0) lap(PH_NORM);
        const int V = m->vocab;
        gemv(m->packed + m->head_offset, dm.head_tiles, dm.Dp, x.data(), dm.Dp, B, tid, T,
             [&](int t, int r, __m512 a0, __m512 a1) {
                 int n = t * TILE;
                 float* o = logits + (size_t)r * V + n;
                 __mmask16 m0 = lanes_below(V, n), m1 = lanes_below(V, n + 16);
                 _mm512_mask_storeu_ps(o, m0, round_bf16(a0));
                 if (m1) _mm512_mask_storeu_ps(o + 16, m1, round_bf16(a1));
             });
    }
    lap(PH_HEAD);
    return 0;
}

}  // extern "C"
