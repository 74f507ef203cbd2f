// One decode step of a Llama decoder in fp32, its matrices GGUF block-quantized or fp32,
// executing the layer plan of engine/model/llama.py (layer_steps).
//
// Called through ctypes from kernels/plan_decode.py, which documents the
// contract. This file does not know what a Llama layer is: it runs, for every
// layer, the steps it is given (op, source slot, destination slot, weight),
// each op the fp32 equivalent of the torch op LlamaModel.forward runs for it:
//
//     rms_norm        dst = w * (x * (1 / sqrt(mean(x^2) + eps)))       per row
//     linear          dst = x Wᵀ                                       the quant matmul (quant_gemm.h:
//                                                                      x quantized to 16 bits first), or
//                                                                      for fp32 W the dense one (dense_gemm.h)
//     linear_add      dst = dst + x Wᵀ
//     silu_mul        dst = silu(x[:, :I]) * x[:, I:]
//     gelu_mul        dst = gelu(x[:, :I]) * x[:, I:]                 GELU's tanh approximation (row_ops.h)
//     add             dst = dst + x                                    per row
//     add_bias        dst = x + w                                      per row (w: fp32 [width])
//     qk_norm         dst = x, each q head rms_norm'd by w[:hd], each k  per row (w: fp32 [2 hd])
//                     head by w[hd:], v as it is
//     rope_attention  q, k = RoPE(x's q and k heads) (rotate_half, torch's three roundings)
//                     with the layer's tables; k, v into the token's cache slot (as halves
//                     in a float16 cache: store_half_row); dst = softmax(q·kᵀ scale) v over
//                     the sequence's keys 0..pos (a sliding layer's: its window's),
//                     GQA (query head h reads kv head h / (H / KVH))
//
// after the embedding (times embed_scale), then the final norm and the LM head. One OpenMP team runs the whole step:
// matmuls hand out output rows in chunks (row_claims.h), norms and silu rows,
// attention hands out chunks of a sequence's keys (every head at once; the chunk holding
// the token's own key applies RoPE to it and stores K and V first), then (sequence,
// head) pairs to combine them, the same way; a barrier separates steps. A batch of at most
// REDUNDANT_ROWS rows runs its row-local ops (norms, silu, quantizing a matmul's input,
// and combining attention's chunks when they are few) on every thread instead, which
// takes their barriers away: five per layer are left, one after each matmul and one
// after attention's chunks. Every output is computed in a fixed order that depends on
// nothing but its own row (attention: its own keys, chunked by their count
// alone), so a sequence's logits are the same bit for bit alone or in any batch,
// with any thread count (the matmul's contract, quant_matmul.cpp, and row-local
// ops everywhere else).
// The sums inside norms and attention run in another order than torch's, so
// this step agrees with LlamaModel.forward to fp32 rounding, not bit for bit.

#include "attention_rows.h"
#include "dense_gemm.h"
#include "quant_gemm.h"
#include "row_claims.h"
#include "row_ops.h"
#include "spin_barrier.h"
#include "simd.h"

#include <algorithm>

namespace {

enum Op { OP_RMS_NORM = 0, OP_LINEAR = 1, OP_ROPE_ATTENTION = 2, OP_LINEAR_ADD = 3, OP_SILU_MUL = 4,
          OP_ADD_BIAS = 5, OP_QK_NORM = 6, OP_GELU_MUL = 7, OP_ADD = 8 };

// PlanWeight.format: 0-FORMAT_LAST quant_blocks.h's Format (the x8 layout), 16-18 a float matrix [n, k],
// row-major (dense_gemm.h's FMT_F32, FMT_BF16, FMT_F16), FMT_PARTS block-quantized row blocks
// of several formats (a _K_M file's q/k in Q4_K beside its v in Q6_K), -1 an fp32 vector.
constexpr int32_t FMT_PARTS = 32;
inline bool quantized(int32_t format) { return (format >= Q4_0 && format <= FORMAT_LAST) || format == FMT_PARTS; }

// A matrix of format `format` fits an input of width k: a whole number of its blocks (16
// elements for a float matrix; a FMT_PARTS weight's parts each their own: parts_fit).
inline bool matrix_fits(int32_t format, int64_t k) {
    if (format == FMT_PARTS) return k > 0;
    return (quantized(format) && k % block_weights(format) == 0) || (dense(format) && k % 16 == 0);
}


// Bytes of 8 rows of W (the claims' unit: a group of the x8 layout)
inline int64_t rows8_bytes(int32_t format, int64_t k) {
    return dense(format) ? 8 * k * dense_elem_bytes(format) : group_bytes(format == FMT_PARTS ? Q8_0 : format, k);
}

// Batches of at most this many rows run row-local ops on every thread (kvd_plan_decode).
constexpr int REDUNDANT_ROWS = 4;
// ... and combine attention's key chunks on every thread when the batch has at most this many.
constexpr int64_t REDUNDANT_CHUNKS = 32;
// Attention's work items a claim covers, and (sequence, head) pairs of its combine: a claim
// (an atomic add) is small beside either.
constexpr int64_t ATTN_CLAIM_ITEMS = 1;
constexpr int64_t COMBINE_CLAIM_PAIRS = 8;
// Rows a claim of a row-local op (norm, silu, quantizing a matmul's input) covers.
constexpr int64_t ROW_CLAIM_ROWS = 2;

}  // namespace

extern "C" {

// Mirrors of the ctypes structures in kernels/plan_decode.py.
struct PlanStep { int32_t op, src, dst, weight; };

struct PlanWeight {
    int32_t format;             // 0-FORMAT_LAST (quant_blocks.h): a matrix [n, k] in the x8 layout; 16, 17, 18
                                // (FMT_F32, FMT_BF16, FMT_F16): a float matrix [n, k], row-major; -1: an
                                // fp32 vector [n]; FMT_PARTS: data is PlanWeight[parts], quantized
                                // matrices [n_i, k] stacked by rows (every n_i but the last a multiple of 8)
    int32_t parts;
    int64_t n, k;
    const void* data;
};

struct PlanModel {
    int32_t num_layers, num_steps, num_slots, num_weights;   // num_weights: weight slots per layer
    int32_t hidden, heads, kv_heads, head_dim, vocab, block_size, num_blocks, max_positions;
    int32_t kv_half;                // the KV cache's elements: 0 fp32, 1 IEEE halves (quant_blocks.h)
    float eps, scale;
    float embed_scale;              // the embedding's rows times this (1: as they are)
    const PlanStep* steps;          // [num_steps], run for every layer
    const int64_t* slot_width;      // [num_slots] floats per row; slot 0 is h, the residual stream
    const PlanWeight* weights;      // [num_layers][num_weights]
    const float* const* cos;        // [num_layers]: each layer's RoPE table [max_positions, head_dim]
    const float* const* sin;        // [num_layers]: [max_positions, head_dim], first half negated (rope_tables)
    const int32_t* window;          // [num_layers]: each layer's sliding window in keys, 0 for none
    PlanWeight embed;               // [vocab, hidden], a matrix
    PlanWeight head;                // [vocab, hidden], a matrix (may be the embedding)
    const float* final_norm;        // [hidden]
};

// A split step's remote parts (kvd_plan_decode_split; DistAttention, engine/dist_attention.py):
// sequence b's key chunks [0, split[b]) are local (its block table covers their blocks), the
// chunks from split[b] on are held by other engines. At every layer's rope_attention the team's
// first thread writes every row's rotated query and new K/V into q, k, v and calls
// hook(layer, 0) (the caller starts the remote micro-attentions), the team computes the local
// chunks, then the first thread calls hook(layer, 1) (the caller writes the remote chunks'
// partials into the gather: chunk c of row b at slot c) and copies them among the local ones
// before the combine. A hook returning nonzero fails the step (no later hook is called).
struct PlanRemote {
    const int64_t* split;           // [B] first remote chunk (INT64_MAX: every chunk local)
    int64_t chunks;                 // C: the gather's slots per row
    float* q;                       // [B, H, hd] rotated queries
    float* k;                       // [B, KVH, hd] rotated new keys
    float* v;                       // [B, KVH, hd] new values
    const float* m;                 // gather [B, C, H]
    const float* l;                 // gather [B, C, H]
    const float* o;                 // gather [B, C, H, hd]
    int32_t (*hook)(int32_t layer, int32_t phase);
};

}  // extern "C"

namespace {

// A FMT_PARTS weight's parts: at least one, each a single quantized matrix [n_i, k], every n_i
// but the last a multiple of 8 (a part starts on a group of the x8 layout), n the sum.
inline bool parts_fit(const PlanWeight& w) {
    const PlanWeight* part = (const PlanWeight*)w.data;
    int64_t n = 0;
    for (int i = 0; i < w.parts; i++) {
        if (part[i].format == FMT_PARTS || !quantized(part[i].format) || !matrix_fits(part[i].format, w.k)
            || part[i].k != w.k || part[i].n < 1
            || (i + 1 < w.parts && part[i].n % 8))
            return false;
        n += part[i].n;
    }
    return w.parts >= 1 && n == w.n;
}

// y[m, n] (row stride ldy) = x[m] · W[n] for n in [n0, n1), m < M: the dense kernel on x
// (row stride ldx), or the quantized one on xq (x quantized).
inline void matrix_range(const PlanWeight& w, const float* x, int64_t ldx, const QRows& xq, int64_t M, int64_t n0,
                         int64_t n1, float* y, int64_t ldy) {
    if (w.format == FMT_PARTS) {        // each part's rows of [n0, n1), at the part's own row 0
        const PlanWeight* part = (const PlanWeight*)w.data;
        for (int64_t i = 0, at = 0; i < w.parts; at += part[i].n, i++) {
            const int64_t a = n0 > at ? n0 : at, z = n1 < at + part[i].n ? n1 : at + part[i].n;
            if (a < z) matmul_range(part[i].format, (const uint8_t*)part[i].data, a - at, z - at, xq, M, y + at, ldy);
        }
    } else if (dense(w.format))
        dense_range_fmt(w.format, w.data, w.k, n0, n1, x, ldx, M, y, ldy);
    else
        matmul_range(w.format, (const uint8_t*)w.data, n0, n1, xq, M, y, ldy);
}

// out[t] = row ids[t] of an embedding table (ids checked)
inline void gather_table_rows(const PlanWeight& w, const int64_t* ids, int64_t T, float* out) {
    if (w.format == FMT_F32)
        for (int64_t t = 0; t < T; t++)
            memcpy(out + t * w.k, (const float*)w.data + ids[t] * w.k, (size_t)w.k * sizeof(float));
    else if (w.format == FMT_BF16 || w.format == FMT_F16)
        for (int64_t t = 0; t < T; t++) {
            const uint16_t* row = (const uint16_t*)w.data + ids[t] * w.k;
            for (int64_t d = 0; d < w.k; d += 16)       // k: a multiple of 16 (matrix_fits)
                vstore(out + t * w.k + d, w.format == FMT_BF16 ? WBF16::load16(row + d) : WF16::load16(row + d));
        }
    else
        gather_rows_any(w.format, (const uint8_t*)w.data, w.k, ids, T, out);
}

// A step's attention work items for layers of one window (kvd_plan_decode): item i is
// sequence seq[i]'s key chunk from t0[i]; sequence b's items are first[b] .. first[b + 1] - 1.
struct ItemList {
    int64_t window;
    std::vector<int64_t> seq, t0, first;

    std::vector<char> remote;       // item i's chunk is a remote part's (a split step's), else empty

    ItemList(int64_t w, int B, const int64_t* positions, const int64_t* split = nullptr) : window(w), first((size_t)B + 1) {
        for (int b = 0; b < B; b++) {
            const int64_t ctx = positions[b] + 1;
            first[b] = (int64_t)seq.size();
            for (int64_t c = first_chunk(ctx, w); c * KEY_CHUNK < ctx; c++) {
                seq.push_back(b), t0.push_back(chunk_start(c, ctx, w));
                if (split) remote.push_back(c >= split[b] ? 1 : 0);
            }
        }
        first[B] = (int64_t)seq.size();
    }
    int64_t size() const { return first.back(); }
};

// One layer's attention inputs: its items, RoPE tables, and the step's sequences.
struct AttnItems {
    const int64_t* seq;
    const int64_t* t0;
    const int64_t* positions;
    const int64_t* tables;          // [B, max_blocks]
    int max_blocks;
    const float* cos;
    const float* sin;
    const char* remote;             // [items] a remote part's chunk (not computed here), or null
};

// A thread's buffers for attend_items: scores [H][KEY_CHUNK], q [H][hd], k [kvh][hd] its own;
// m, l [items][H] and o [items][H][hd] the team's, each item written by the thread that takes it.
struct AttnScratch {
    float *scores, *q, *k, *part_m, *part_l, *part_o;
};

// Items [i0, i1) of one layer's rope_attention over caches of KV (kcache, and vcache at
// v_offset elements past it); x: the step's input rows (row stride in). The chunk that holds
// a token's own key first writes its K and V into the cache (no other chunk reads that slot),
// and a thread rotates a sequence's queries into its own buffer when it starts a chunk of it.
template <class KV>
void attend_items(const PlanModel* m, const AttnItems& it, int64_t i0, int64_t i1, const float* x, int64_t in,
                  KV* kcache, size_t v_offset, const AttnScratch& ws) {
    const int bs = m->block_size, hd = m->head_dim, H = m->heads, KVH = m->kv_heads;
    const int64_t kvh_stride = (int64_t)KVH * hd, q_size = (int64_t)H * hd;
    KV* vcache = kcache + v_offset;
    int64_t rotated = -1;                       // the sequence ws.q holds
    for (int64_t i = i0; i < i1; i++) {
        if (it.remote && it.remote[i]) continue;            // its partials come from the part's lender
        const int64_t b = it.seq[i], pos = it.positions[b], ctx = pos + 1;
        const int64_t t1 = chunk_end(it.t0[i] / KEY_CHUNK, ctx);
        const float* src = x + b * in;
        const float* c = it.cos + pos * hd;
        const float* sn = it.sin + pos * hd;
        if (b != rotated) {
            for (int j = 0; j < H; j++) rope_head(src + j * hd, c, sn, hd, ws.q + j * hd);
            rotated = b;
        }
        if (t1 == ctx) {
            const int64_t at = (it.tables[(size_t)b * it.max_blocks + pos / bs] * bs + pos % bs) * kvh_stride;
            for (int j = 0; j < KVH; j++) rope_head(src + (H + j) * hd, c, sn, hd, ws.k + j * hd);
            store_kv(ws.k, kvh_stride, kcache + at);
            store_kv(src + (H + KVH) * hd, kvh_stride, vcache + at);
        }
        const AttnSeq seq{ws.q, it.tables + (size_t)b * it.max_blocks, ctx};
        attend_chunk<true>(seq, it.t0[i], t1, kcache, vcache, bs, kvh_stride, H, H / KVH, hd, m->scale, ws.scores,
                     ws.part_m + i * H, ws.part_l + i * H, ws.part_o + i * q_size);
    }
}

// Storage for every matmul input of a step quantized, one buffer per slot and the last for
// the LM head's input (the final norm's rows).
using QuantizedInputs = std::vector<QRowsBuf>;

// Whether any matrix of m is block-quantized (else no input is ever quantized).
bool any_quantized(const PlanModel* m) {
    for (int64_t i = 0; i < (int64_t)m->num_layers * m->num_weights; i++)
        if (quantized(m->weights[i].format)) return true;
    return quantized(m->head.format);
}

// Rows of B for slot s of m at [s] (slots whose width is not a whole number of blocks get
// none: no matmul reads them, kvd_plan_check saw to it), the LM head's input at [num_slots];
// none at all for a model without quantized matrices.
std::vector<QRows> quantized_inputs(const PlanModel* m, int B, QuantizedInputs& bufs) {
    bufs.resize((size_t)m->num_slots + 1);
    std::vector<QRows> rows((size_t)m->num_slots + 1);
    if (!any_quantized(m)) return rows;
    for (int s = 0; s <= m->num_slots; s++) {
        const int64_t k = s < m->num_slots ? m->slot_width[s] : m->hidden;
        if (k % QK == 0) rows[s] = bufs[s].rows(B, k);
    }
    return rows;
}

// ------------------------------------------------------------------ greedy tokens
// A row's greedy token: the first index of its largest logit, a NaN counting as larger than any
// number and the first NaN winning (numpy's and torch's argmax). The LM head's threads each find
// it over the chunks of rows they computed, while the chunk is in L1, and the team's results are
// merged after the step: merge() picks the same winner in any order, so which thread computed
// which chunk does not change the token.
struct Best {
    float v;
    int64_t i;                  // < 0: no candidate yet
};

inline bool beats(const Best& a, const Best& b) {        // a ahead of b
    if (b.i < 0) return a.i >= 0;
    if (a.i < 0) return false;
    const bool an = a.v != a.v, bn = b.v != b.v;
    if (an || bn) return an && (!bn || a.i < b.i);
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

inline void merge(Best& into, const Best& b) {
    if (beats(b, into)) into = b;
}

// The winner among x[n0..n1), n0 < n1.
inline Best chunk_best(const float* x, int64_t n0, int64_t n1) {
    Best best{x[n0], n0};
    if (best.v != best.v) return best;
    for (int64_t n = n0 + 1; n < n1; n++) {
        const float v = x[n];
        if (!(v <= best.v)) {               // larger, or a NaN (which nothing after it beats)
            best = {v, n};
            if (v != v) break;
        }
    }
    return best;
}

// merge(best, chunk_best(x, n0, n1)), after a vector pass over the chunk that skips it when
// none of its values can win: no NaN and its largest below best's (most chunks, once a high
// logit is found). Same winner: the pass only decides whether to look.
inline void merge_chunk(Best& best, const float* x, int64_t n0, int64_t n1) {
#if defined(__AVX2__)
    if (best.i >= 0 && best.v == best.v) {
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t n = n0;
        for (; n + 8 <= n1; n += 8) {
            const __m256 v = _mm256_loadu_ps(x + n);
            top = _mm256_max_ps(top, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, top);
        float m = lanes[0];
        for (int i = 1; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
        bool any_nan = _mm256_movemask_ps(nan) != 0;
        for (; n < n1; n++) {
            any_nan |= x[n] != x[n];
            m = x[n] > m ? x[n] : m;
        }
        if (!any_nan && m < best.v) return;
    }
#endif
    merge(best, chunk_best(x, n0, n1));
}

}  // namespace

extern "C" {

// Which build this is (variant.h): a key of kernels/quant_linear.py's VARIANTS.
const char* kvd_plan_variant() { return KVD_VARIANT; }

// The greedy token of x[0, n) found as the LM head's threads find it: chunk c is
// [starts[c], starts[c + 1]) (starts[nchunks] = n), visited in the order `order` gives
// (a permutation of 0..nchunks-1), by one candidate; returns its index (-1 for n = 0). For
// the tests: the token must not depend on the order.
int64_t kvd_plan_greedy(const float* x, const int64_t* starts, const int32_t* order, int32_t nchunks) {
    Best best{0.0f, -1};
    for (int32_t c = 0; c < nchunks; c++) {
        const int64_t a = starts[order[c]], b = starts[order[c] + 1];
        if (a < b) merge_chunk(best, x, a, b);
    }
    return best.i;
}

// The team machinery of a step (RowClaims between SpinBarriers) on its own, for the tests:
// `rounds` claimed phases of `units` units each on `threads` threads (chunks of one unit),
// a barrier after each; thread `stall_tid` sleeps `stall_ns` before its first phase, and a
// unit's work is a spin of `unit_ns`. owner[r * units + u] = the thread that computed
// unit u in round r, claims[r * units + u] = how many times it was computed. Returns the
// team's size.
int kvd_plan_team_check(int64_t units, int threads, int rounds, int stall_tid, int64_t stall_ns, int64_t unit_ns,
                        int32_t* owner, int32_t* claims) {
    const int nt = threads < 1 ? 1 : threads;
    SpinBarrier barrier(nt);
    RowClaims team(nt);
    std::vector<std::atomic<int32_t>> count((size_t)(units * rounds));
    int size = 1;
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num(), T = omp_get_num_threads();
        if (tid == 0) size = T;
        if (tid == stall_tid) {
            const timespec pause{(time_t)(stall_ns / 1000000000), (long)(stall_ns % 1000000000)};
            nanosleep(&pause, nullptr);
        }
        for (int r = 0; r < rounds; r++) {
            team.run_units(units, 1, T, tid, r, [&](int64_t u0, int64_t u1) {
                for (int64_t u = u0; u < u1; u++) {
                    const int64_t until = now_ns() + unit_ns;
                    while (now_ns() < until) cpu_relax();
                    owner[r * units + u] = tid;
                    count[(size_t)(r * units + u)].fetch_add(1, std::memory_order_relaxed);
                }
            });
            barrier.wait(T, tid);
        }
    }
    for (int64_t i = 0; i < units * rounds; i++) claims[i] = count[(size_t)i].load();
    return size;
}

// out[0, n) = x[0, n) as a half KV cache stores them (store_half_row). For the tests: the
// torch path's kernels.attention.store_kv must give the same bits.
void kvd_plan_store_half(const float* x, int64_t n, uint16_t* out) { store_half_row(x, n, out); }

// 0 when this build can run the plan as described; -2 for an unknown op or format,
// a slot of the wrong width, a weight that does not fit its step, a negative window or a
// missing RoPE table. Called once, when the Python side builds the plan: kvd_plan_decode
// trusts a checked plan.
int kvd_plan_check(const PlanModel* m) {
    if (m->head_dim % 16 || m->head_dim > 256 || m->num_slots < 1 || m->slot_width[0] != m->hidden) return -2;
    for (int l = 0; l < m->num_layers; l++)
        if (m->window[l] < 0 || !m->cos[l] || !m->sin[l]) return -2;
    const int64_t q_size = (int64_t)m->heads * m->head_dim, kv_size = (int64_t)m->kv_heads * m->head_dim;
    for (int l = 0; l < m->num_layers; l++)
        for (int s = 0; s < m->num_steps; s++) {
            const PlanStep& st = m->steps[s];
            if (st.src < 0 || st.src >= m->num_slots || st.dst < 0 || st.dst >= m->num_slots) return -2;
            if (st.weight >= m->num_weights) return -2;
            const int64_t in = m->slot_width[st.src], out = m->slot_width[st.dst];
            const PlanWeight* w = st.weight >= 0 ? &m->weights[(size_t)l * m->num_weights + st.weight] : nullptr;
            switch (st.op) {
                case OP_RMS_NORM:
                    if (!w || w->format != -1 || w->n != in || out != in) return -2;
                    break;
                case OP_LINEAR:
                case OP_LINEAR_ADD:
                    if (!w || !matrix_fits(w->format, in) || w->k != in || w->n != out) return -2;
                    if (w->format == FMT_PARTS && !parts_fit(*w)) return -2;
                    break;
                case OP_ROPE_ATTENTION:
                    if (in != q_size + 2 * kv_size || out != q_size || m->heads % m->kv_heads) return -2;
                    break;
                case OP_SILU_MUL:
                case OP_GELU_MUL:
                    if (in != 2 * out) return -2;
                    break;
                case OP_ADD:
                    if (out != in) return -2;
                    break;
                case OP_ADD_BIAS:
                    if (!w || w->format != -1 || w->n != in || out != in) return -2;
                    break;
                case OP_QK_NORM:
                    if (!w || w->format != -1 || w->n != 2 * m->head_dim || in != q_size + 2 * kv_size || out != in)
                        return -2;
                    break;
                default:
                    return -2;
            }
        }
    if (m->embed.format == FMT_PARTS || m->head.format == FMT_PARTS) return -2;      // one table each
    if (!matrix_fits(m->embed.format, m->hidden) || m->embed.k != m->hidden || m->embed.n != m->vocab) return -2;
    if (!matrix_fits(m->head.format, m->hidden) || m->head.k != m->hidden || m->head.n != m->vocab) return -2;
    return 0;
}

// The step of kvd_plan_decode and kvd_plan_decode_split (remote: null for the first).
static int plan_decode(const PlanModel* m, void* kv, int B, const int64_t* ids, const int64_t* positions,
                       const int64_t* tables, int max_blocks, float* logits, int64_t* argmax, int num_threads,
                       int team_threads, const PlanRemote* remote) {
    const int bs = m->block_size, hd = m->head_dim, H = m->heads, KVH = m->kv_heads;
    if (B < 1) return -1;
    if (remote && (KEY_CHUNK % bs || remote->chunks < 1 || !remote->split || !remote->hook || !remote->q
                   || !remote->k || !remote->v || !remote->m || !remote->l || !remote->o))
        return -1;
    for (int b = 0; b < B; b++) {
        if (ids[b] < 0 || ids[b] >= m->vocab || positions[b] < 0 || positions[b] >= m->max_positions)
            return -1;
        // the blocks read or written here: a split sequence's local chunks' only
        int64_t blocks = positions[b] / bs + 1;
        if (remote && remote->split[b] < (positions[b] + KEY_CHUNK) / KEY_CHUNK) {
            if (remote->split[b] < 1 || (positions[b] + KEY_CHUNK) / KEY_CHUNK > remote->chunks) return -1;
            blocks = std::min(blocks, remote->split[b] * (KEY_CHUNK / bs));
        }
        if (blocks > max_blocks) return -1;
        for (int64_t j = 0; j < blocks; j++)
            if (tables[(size_t)b * max_blocks + j] < 0 || tables[(size_t)b * max_blocks + j] >= m->num_blocks)
                return -1;
    }
    // attention work items, one list per window among the layers (global layers': 0)
    std::vector<ItemList> lists;
    std::vector<int> layer_items((size_t)m->num_layers);
    int64_t items = 0;                                  // the longest list's
    for (int l = 0; l < m->num_layers; l++) {
        size_t i = 0;
        while (i < lists.size() && lists[i].window != m->window[l]) i++;
        if (i == lists.size()) lists.emplace_back(m->window[l], B, positions, remote ? remote->split : nullptr);
        layer_items[l] = (int)i;
        items = std::max(items, lists[i].size());
    }

    const int64_t D = m->hidden, q_size = (int64_t)H * hd, kvh_stride = (int64_t)KVH * hd;
    std::vector<std::vector<float>> slots((size_t)m->num_slots);
    int64_t widest = D;
    for (int s = 0; s < m->num_slots; s++) {
        slots[s].resize((size_t)B * m->slot_width[s]);
        widest = m->slot_width[s] > widest ? m->slot_width[s] : widest;
    }
    std::vector<float> tmp((size_t)B * widest), normed((size_t)B * D);
    std::vector<float> part_m((size_t)items * H), part_l((size_t)items * H), part_o((size_t)items * q_size);
    float* h = slots[0].data();
    gather_table_rows(m->embed, ids, B, h);
    if (m->embed_scale != 1.0f)                         // as forward: one fp32 product per element
        for (int64_t i = 0; i < (int64_t)B * m->hidden; i++) h[i] = h[i] * m->embed_scale;

    const size_t layer_kv = (size_t)2 * m->num_blocks * bs * kvh_stride;       // elements
    const int nt = num_threads < 1 ? 1 : num_threads;

    // Few rows: a row-local op (norm, silu, quantizing a matmul's input) on one thread while
    // the others wait at a barrier costs more than every thread computing it whole. Then
    // each thread computes it for every row into private copies of the slots only row-local
    // ops write, and a matmul reads its own copy: one barrier per matmul (after it), not three.
    // The same operations on the same inputs: the outputs do not change.
    const bool redundant = B <= REDUNDANT_ROWS;
    std::vector<char> priv_slot((size_t)m->num_slots, redundant ? 1 : 0);
    // Attention's output too, when its chunks are few (in every layer): every thread then reads every chunk's
    // partial results (at most REDUNDANT_CHUNKS * H * (hd + 2) floats, 76 KB for SmolLM2)
    // in place of waiting at a barrier for the combine to be split.
    const bool own_combine = redundant && items <= REDUNDANT_CHUNKS;
    for (int s = 0; s < m->num_steps; s++) {
        const int op = m->steps[s].op;
        if (op != OP_RMS_NORM && op != OP_SILU_MUL && op != OP_GELU_MUL
            && !(op == OP_ROPE_ATTENTION && own_combine))
            priv_slot[m->steps[s].dst] = 0;
    }
    priv_slot[0] = 0;                                   // h: the embedding writes it shared

    // matmul inputs quantized, shared by the team (only when rows are split between threads)
    QuantizedInputs team_qbufs;
    const std::vector<QRows> qx = redundant ? std::vector<QRows>() : quantized_inputs(m, B, team_qbufs);

    SpinBarrier barrier(nt);
    RowClaims claims(nt);
    bool failed = false;                                // a hook failed (the team's first thread's only)
    std::vector<Best> team_best(argmax ? (size_t)nt * B : 0, Best{0.0f, -1});    // [thread][row]
    auto work = [&](const int tid, const int T) {
        int64_t round = 0;                              // the team's claimed phases so far (RowClaims)
        QuantizedInputs own_qbufs;
        std::vector<float> scores((size_t)H * KEY_CHUNK), q_own((size_t)q_size), k_own((size_t)kvh_stride);
        const AttnScratch ws{scores.data(), q_own.data(), k_own.data(), part_m.data(), part_l.data(), part_o.data()};
        std::vector<std::vector<float>> own((size_t)m->num_slots);      // this thread's private slots
        for (int s = 0; s < m->num_slots; s++)
            if (priv_slot[s]) own[s].resize((size_t)B * m->slot_width[s]);
        auto slot = [&](int s) { return priv_slot[s] ? own[s].data() : slots[s].data(); };
        // matmul inputs quantized: this thread's own buffers, or the team's (rows split)
        const std::vector<QRows> xq = redundant ? quantized_inputs(m, B, own_qbufs) : qx;
        // a row-local op over rows [r0, r1): every row on this thread (shared false: its own
        // copy), or the rows handed out in chunks to the team (a claimed round)
        auto each_rows = [&](bool shared, auto&& fn) {
            if (shared) claims.run_units(B, ROW_CLAIM_ROWS, T, tid, round++, fn);
            else fn(int64_t(0), int64_t(B));
        };
        for (int l = 0; l < m->num_layers; l++) {
            const PlanWeight* lw = m->weights + (size_t)l * m->num_weights;
            for (int s = 0; s < m->num_steps; s++) {
                const PlanStep& st = m->steps[s];
                const float* x = slot(st.src);
                float* y = slot(st.dst);
                const int64_t in = m->slot_width[st.src], out = m->slot_width[st.dst];
                bool row_local = false;
                switch (st.op) {
                    case OP_RMS_NORM: {
                        // private output: every thread has all rows; shared: the rows claimed
                        each_rows(!priv_slot[st.dst], [&](int64_t a, int64_t z) {
                            for (int64_t r = a; r < z; r++)
                                rms_norm_row(x + r * in, (const float*)lw[st.weight].data, in, m->eps, y + r * out);
                        });
                        row_local = priv_slot[st.dst];
                        break;
                    }
                    case OP_LINEAR:
                    case OP_LINEAR_ADD: {       // x quantized for a quantized W (rows split, or whole per thread), then this thread's columns
                        const PlanWeight& w = lw[st.weight];
                        if (quantized(w.format)) {
                            each_rows(!redundant, [&](int64_t a, int64_t z) { quantize_rows(x, in, a, z, xq[st.src]); });
                            if (!redundant) barrier.wait(T, tid);
                        }
                        const bool add = st.op == OP_LINEAR_ADD;
                        claims.run(out, rows8_bytes(w.format, in), T, tid, round++, [&](int64_t n0, int64_t n1) {
                            matrix_range(w, x, in, xq[st.src], B, n0, n1, add ? tmp.data() : y, out);
                            if (add)
                                for (int64_t r = 0; r < B; r++)
                                    for (int64_t n = n0; n < n1; n++) y[r * out + n] = y[r * out + n] + tmp[r * out + n];
                        });
                        break;
                    }
                    case OP_SILU_MUL: {
                        each_rows(!priv_slot[st.dst], [&](int64_t a, int64_t z) {
                            for (int64_t r = a; r < z; r++) silu_mul_row(x + r * in, x + r * in + out, out, y + r * out);
                        });
                        row_local = priv_slot[st.dst];
                        break;
                    }
                    case OP_ADD_BIAS: {         // a matmul's output slot (shared): the rows claimed, in place
                        const float* bias = (const float*)lw[st.weight].data;
                        each_rows(!priv_slot[st.dst], [&](int64_t a, int64_t z) {
                            for (int64_t r = a; r < z; r++)
                                for (int64_t i = 0; i < in; i++) y[r * out + i] = x[r * in + i] + bias[i];
                        });
                        row_local = priv_slot[st.dst];
                        break;
                    }
                    case OP_QK_NORM: {          // each q and k head of a row normed (in place: row_ops.h reads first)
                        const float* wn = (const float*)lw[st.weight].data;
                        each_rows(!priv_slot[st.dst], [&](int64_t a, int64_t z) {
                            for (int64_t r = a; r < z; r++) {
                                for (int64_t i = 0; i < in; i++) y[r * out + i] = x[r * in + i];
                                for (int head = 0; head < H + KVH; head++)
                                    rms_norm_row(y + r * out + (int64_t)head * hd, head < H ? wn : wn + hd, hd, m->eps,
                                                 y + r * out + (int64_t)head * hd);
                            }
                        });
                        row_local = priv_slot[st.dst];
                        break;
                    }
                    case OP_GELU_MUL: {
                        each_rows(!priv_slot[st.dst], [&](int64_t a, int64_t z) {
                            for (int64_t r = a; r < z; r++) gelu_mul_row(x + r * in, x + r * in + out, out, y + r * out);
                        });
                        row_local = priv_slot[st.dst];
                        break;
                    }
                    case OP_ADD: {              // dst + x per row, as forward's add (the residual: shared)
                        each_rows(!priv_slot[st.dst], [&](int64_t a, int64_t z) {
                            for (int64_t r = a; r < z; r++)
                                for (int64_t i = 0; i < in; i++) y[r * out + i] = y[r * out + i] + x[r * in + i];
                        });
                        row_local = priv_slot[st.dst];
                        break;
                    }
                    case OP_ROPE_ATTENTION: {
                        // key chunks of every sequence, every head; the chunk that holds the
                        // token's own key first writes its K and V into the cache (no other
                        // chunk reads that slot), and a thread rotates a sequence's queries
                        // into its own buffer when it starts a chunk of that sequence
                        // (items claimed in ATTN_CLAIM_ITEMS: a thread that loses its CPU
                        // leaves what it has not started to the others)
                        const ItemList& list = lists[(size_t)layer_items[l]];
                        const AttnItems it{list.seq.data(), list.t0.data(), positions, tables, max_blocks, m->cos[l],
                                           m->sin[l], list.remote.empty() ? nullptr : list.remote.data()};
                        if (remote && tid == 0 && !failed) {
                            // every row's rotated query and new K/V for the remote parts, then their start
                            for (int b = 0; b < B; b++) {
                                const float* src = x + b * in;
                                const float* c = m->cos[l] + positions[b] * hd;
                                const float* sn = m->sin[l] + positions[b] * hd;
                                for (int j = 0; j < H; j++) rope_head(src + j * hd, c, sn, hd, remote->q + (b * H + j) * hd);
                                for (int j = 0; j < KVH; j++)
                                    rope_head(src + (H + j) * hd, c, sn, hd, remote->k + (b * KVH + j) * hd);
                                memcpy(remote->v + b * kvh_stride, src + (H + KVH) * hd, (size_t)kvh_stride * sizeof(float));
                            }
                            failed = remote->hook(l, 0) != 0;
                        }
                        claims.run_units(list.size(), ATTN_CLAIM_ITEMS, T, tid, round++, [&](int64_t i0, int64_t i1) {
                            if (m->kv_half)
                                attend_items(m, it, i0, i1, x, in, (uint16_t*)kv + l * layer_kv, layer_kv / 2, ws);
                            else
                                attend_items(m, it, i0, i1, x, in, (float*)kv + l * layer_kv, layer_kv / 2, ws);
                        });
                        if (remote && tid == 0) {
                            // the remote parts' partials, in their items' places beside the local ones
                            if (!failed) failed = remote->hook(l, 1) != 0;
                            const int64_t C = remote->chunks;
                            for (int64_t i = 0; i < list.size() && !failed; i++) {
                                if (!it.remote[i]) continue;
                                const int64_t g = it.seq[i] * C + it.t0[i] / KEY_CHUNK;
                                memcpy(&part_m[i * H], remote->m + g * H, (size_t)H * sizeof(float));
                                memcpy(&part_l[i * H], remote->l + g * H, (size_t)H * sizeof(float));
                                memcpy(&part_o[i * q_size], remote->o + g * q_size, (size_t)q_size * sizeof(float));
                            }
                        }
                        barrier.wait(T, tid);
                        // the chunks of each (sequence, head) combined: every pair on every
                        // thread into its private output, or the pairs claimed
                        auto combine = [&](int64_t i0, int64_t i1) {
                            for (int64_t i = i0; i < i1; i++) {
                                const int64_t b = i / H, head = i % H, c0 = list.first[b];
                                combine_chunks(&part_m[c0 * H + head], &part_l[c0 * H + head],
                                               &part_o[c0 * q_size + head * hd], list.first[b + 1] - c0, H, hd,
                                               y + b * out + head * hd);
                            }
                        };
                        if (priv_slot[st.dst]) combine(0, (int64_t)B * H);
                        else claims.run_units((int64_t)B * H, COMBINE_CLAIM_PAIRS, T, tid, round++, combine);
                        row_local = priv_slot[st.dst];
                        break;
                    }
                    default:
                        break;                  // ruled out by kvd_plan_check
                }
                if (!row_local) barrier.wait(T, tid);
            }
        }
        // the final norm into `normed` (private rows when redundant: each thread computes its
        // own copy of all rows), read by the LM head (a quantized head reads it quantized)
        std::vector<float> own_normed(redundant ? (size_t)B * D : 0);
        float* nrm = redundant ? own_normed.data() : normed.data();
        const QRows& qh = xq[m->num_slots];
        each_rows(!redundant, [&](int64_t a, int64_t z) {
            for (int64_t r = a; r < z; r++) rms_norm_row(h + r * D, m->final_norm, D, m->eps, &nrm[r * D]);
            if (quantized(m->head.format)) quantize_rows(nrm, D, a, z, qh);
        });
        if (!redundant) barrier.wait(T, tid);
        std::vector<Best> mine(argmax ? (size_t)B : 0, Best{0.0f, -1});
        claims.run(m->vocab, rows8_bytes(m->head.format, D), T, tid, round++, [&](int64_t n0, int64_t n1) {
            matrix_range(m->head, nrm, D, qh, B, n0, n1, logits, m->vocab);
            if (argmax)
                for (int64_t r = 0; r < B; r++) merge_chunk(mine[r], logits + r * m->vocab, n0, n1);
        });
        if (argmax) std::copy(mine.begin(), mine.end(), team_best.begin() + (size_t)tid * B);
    };
    // The step runs on nt threads, in a region of the caller's team size (team_threads: torch's
    // thread count) with the rest idle in it: a region smaller than the thread's pool makes
    // libgomp end the surplus threads, and the next full-size one (a torch op between two
    // steps) start new ones. torch's own parallel_for opens its regions the same way
    // (pytorch/pytorch#32008).
#pragma omp parallel num_threads(team_threads > nt ? team_threads : nt)
    {
        const int tid = omp_get_thread_num(), T = std::min(nt, omp_get_num_threads());
        if (tid < T) work(tid, T);
    }
    if (failed) return -2;
    if (argmax)
        for (int64_t r = 0; r < B; r++) {
            Best best{0.0f, -1};
            for (int t = 0; t < nt; t++) merge(best, team_best[(size_t)t * B + r]);
            argmax[r] = best.i;
        }
    return 0;
}

// kv: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] of fp32, or of halves when
// m->kv_half (the new K/V written);
// ids, positions [B]; tables [B, max_blocks]; logits [B, vocab]; argmax [B] or null: each
// row's greedy token (Best); num_threads compute it, inside an OpenMP region of at least
// team_threads. Returns 0, or -1 when B < 1 or an id, position or block is out of range
// (nothing written).
int kvd_plan_decode(const PlanModel* m, void* kv, int B, const int64_t* ids, const int64_t* positions,
                    const int64_t* tables, int max_blocks, float* logits, int64_t* argmax, int num_threads,
                    int team_threads) {
    return plan_decode(m, kv, B, ids, positions, tables, max_blocks, logits, argmax, num_threads, team_threads,
                       nullptr);
}

// kvd_plan_decode of a batch whose sequences may have KV in remote parts (PlanRemote): the
// same bits as the unsplit step where the remote partials are the unsplit kernel's. The tables
// need cover only each sequence's local chunks. Returns 0; -1 as kvd_plan_decode, or for a
// split or gather that does not fit the batch (nothing written); -2 when a hook failed (the
// step's logits and the K/V it wrote are not to be used).
int kvd_plan_decode_split(const PlanModel* m, void* kv, int B, const int64_t* ids, const int64_t* positions,
                          const int64_t* tables, int max_blocks, float* logits, int64_t* argmax, int num_threads,
                          int team_threads, const PlanRemote* remote) {
    if (!remote) return -1;
    return plan_decode(m, kv, B, ids, positions, tables, max_blocks, logits, argmax, num_threads, team_threads,
                       remote);
}

}  // extern "C"
