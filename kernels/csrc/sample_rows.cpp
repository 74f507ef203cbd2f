// Random sampling of logits rows: temperature, top-k, top-p and one inverse-CDF draw per row,
// rows split between OpenMP threads. Called through ctypes from kernels/sampler.py, which
// states the contract (engine/sampling.py's definitions) and checks every shape; these
// functions trust their arguments.
//
// A row's token depends on its logits, its parameters and its uniform number alone, and has
// the same bits on every build: e^x is simd.h's vn_exp (the same operations per lane), every
// sum runs in double, in scalar code, in an order fixed by the row.
//
// No sort of the vocabulary. Top-k and top-p need the largest logits in order: the tokens
// near the row's maximum (CUT_*) are counted into bins of 1/8 nat of weight, and only the bins
// the filters end in are sorted (logit descending, index ascending). A row those tokens cannot
// decide (fewer than k of them, or less than top_p of the weight) takes more, at last all.

#include <float.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

constexpr int BINS_PER_NAT = 8;
constexpr int NUM_BINS = 64 * BINS_PER_NAT + 1;     // the last holds weights below e^-64 of the max
// Candidates: logits within CUT_BASE * max(T, 1) * CUT_STEP^i of the maximum, at the first
// level i whose tokens can decide the row (count_above, mass_above), widened while they cannot;
// every token past the last level.
constexpr int CUT_LEVELS = 8;
constexpr float CUT_BASE = 2.0f, CUT_STEP = 1.5f;
constexpr int64_t BLOCK = 64;                        // tokens per block sum of a dense draw

struct Scratch {
    std::vector<float> w;               // weights: of every token (dense), or of cand (filtered)
    std::vector<float> cl;              // the candidates' logits
    std::vector<int32_t> cand;          // candidate tokens, in index order
    std::vector<int32_t> order;         // candidate positions grouped by bin
    std::vector<uint16_t> bin;          // each candidate's bin
    std::vector<uint8_t> keep;          // each candidate kept by the filters
    double mass[NUM_BINS];              // each bin's weight, summed in index order
    std::vector<double> block;          // block sums of a dense draw
    int32_t start[NUM_BINS + 1];        // bin b: order[start[b] .. start[b + 1])
    bool sorted[NUM_BINS];
};

// The row's maximum logit; false when a logit is NaN or +inf, or every one is -inf. vn_max
// (first, then second operand) passes a NaN second operand on, as x86's max does: c = max(-FLT_MAX,
// v) is v but for -inf, and c - c is 0 but for NaN and +inf.
bool row_max(const float* l, int64_t V, float& m) {
    const VN lo = vn_set1(-FLT_MAX);
    VN mx = lo, nan = vn_zero();
    int64_t i = 0;
    for (; i + GEMM_VW <= V; i += GEMM_VW) {
        const VN c = vn_max(lo, vn_load(l + i));
        mx = vn_max(mx, c);
        nan = vn_add(nan, vn_sub(c, c));
    }
    float lanes[GEMM_VW], bad[GEMM_VW];
    vn_store(lanes, mx);
    vn_store(bad, nan);
    m = -INFINITY;
    bool any_bad = false;
    for (int j = 0; j < GEMM_VW; j++) {
        any_bad |= bad[j] != 0.0f;
        m = lanes[j] > m ? lanes[j] : m;
    }
    for (; i < V; i++) {
        any_bad |= !(l[i] < INFINITY);
        m = l[i] > m ? l[i] : m;
    }
    if (m == -FLT_MAX) {                                // every logit -inf, or the maximum is -FLT_MAX
        bool any_finite = false;
        for (i = 0; i < V && !any_finite; i++) any_finite = l[i] > -INFINITY;
        if (!any_finite) m = -INFINITY;
    }
    return !any_bad && m > -INFINITY;
}

// w[i] = e^((l[i] - m) / T) for i < n, rounding after the subtraction and the division: the
// same bits for a token whether its row is filtered or not.
void weights(const float* l, int64_t n, float m, float T, float* w) {
    const VN mv = vn_set1(m), tv = vn_set1(T), zero = vn_zero();
    int64_t i = 0;
    for (; i + GEMM_VW <= n; i += GEMM_VW)
        vn_store(w + i, vn_exp(vn_sub(zero, vn_div(vn_sub(mv, vn_load(l + i)), tv))));
    if (i < n) {                        // the same operations on a padded vector
        float t[GEMM_VW];
        for (int j = 0; j < GEMM_VW; j++) t[j] = i + j < n ? l[i + j] : -INFINITY;
        vn_store(t, vn_exp(vn_sub(zero, vn_div(vn_sub(mv, vn_load(t)), tv))));
        for (int j = 0; i + j < n; j++) w[i + j] = t[j];
    }
}

// w[0..n) summed in double: 8 lane sums (lane j adds w[j], w[j + 8], ... in turn), then a
// fixed tree over the lanes.
double sum_weights(const float* w, int64_t n) {
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += (double)w[i + j];
    for (int j = 0; i + j < n; j++) lane[j] += (double)w[i + j];
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// Inverse CDF over w[0..V) in index order: block sums of BLOCK tokens, the block whose running
// sum passes u * total, then its tokens one by one. The token, or -1 when nothing weighs.
int64_t draw_dense(const float* w, int64_t V, double u, Scratch& s) {
    const int64_t nb = (V + BLOCK - 1) / BLOCK;
    s.block.resize(nb);
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        s.block[b] = sum_weights(w + b * BLOCK, std::min(BLOCK, V - b * BLOCK));
        total += s.block[b];
    }
    if (!(total > 0.0)) return -1;
    const double target = u * total;
    double run = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        if (run + s.block[b] <= target) {
            run += s.block[b];
            continue;
        }
        int64_t pick = -1;
        for (int64_t t = b * BLOCK, e = std::min(V, t + BLOCK); t < e; t++) {
            if (w[t] == 0.0f) continue;
            pick = t;                   // the last of weight > 0, should rounding not pass target
            run += (double)w[t];
            if (run > target) break;
        }
        return pick;
    }
    for (int64_t t = V - 1; t >= 0; t--)               // target rounded up to the total
        if (w[t] > 0.0f) return t;
    return -1;
}

// The candidates: tokens of logit >= lcut, in index order (s.cand), their logits (s.cl) and
// weights (s.w), counted into bins by weight (s.order, s.start; no bin sorted yet). Tokens of
// logit >= lcut are a prefix of the row's order, whatever lcut.
void gather(const float* l, int64_t V, float m, float T, float lcut, Scratch& s) {
    s.cand.resize(V);
    int64_t n = 0;
    for (int64_t i0 = 0; i0 < V; i0 += 16) {             // 16 at a time: most hold none
        const int64_t e = std::min<int64_t>(V, i0 + 16);
        int any = 0;
        for (int64_t i = i0; i < e; i++) any |= l[i] >= lcut;
        if (!any) continue;
        for (int64_t i = i0; i < e; i++)
            if (l[i] >= lcut) s.cand[n++] = (int32_t)i;
    }
    s.cand.resize(n);
    s.cl.resize(n);
    s.w.resize(n);
    s.bin.resize(n);
    s.order.resize(n);
    for (int64_t j = 0; j < n; j++) s.cl[j] = l[s.cand[j]];
    weights(s.cl.data(), n, m, T, s.w.data());
    int32_t count[NUM_BINS + 1] = {0};
    std::fill(s.mass, s.mass + NUM_BINS, 0.0);
    for (int64_t j = 0; j < n; j++) {
        const float d = (m - s.cl[j]) / T * (float)BINS_PER_NAT;     // >= 0: m is the maximum
        const int b = d < (float)(NUM_BINS - 1) ? (int)d : NUM_BINS - 1;
        s.bin[j] = (uint16_t)b;
        count[b + 1]++;
        s.mass[b] += (double)s.w[j];
    }
    s.start[0] = 0;
    for (int b = 0; b < NUM_BINS; b++) s.start[b + 1] = s.start[b] + count[b + 1];
    int32_t next[NUM_BINS];
    std::copy(s.start, s.start + NUM_BINS, next);
    for (int64_t j = 0; j < n; j++) s.order[next[s.bin[j]]++] = (int32_t)j;
    std::fill(s.sorted, s.sorted + NUM_BINS, false);
}

// Bin b's candidates by logit descending, index ascending (a bin's tokens are in index order).
void sort_bin(int b, Scratch& s) {
    if (s.sorted[b]) return;
    const float* cl = s.cl.data();
    std::stable_sort(s.order.begin() + s.start[b], s.order.begin() + s.start[b + 1],
                     [cl](int32_t x, int32_t y) { return cl[x] > cl[y]; });
    s.sorted[b] = true;
}

// The filters over the candidates: s.keep[j] for each kept one; false when the candidates
// cannot decide (fewer than k of them, or top_p's weight not reached among them).
//
// top-k keeps every token of logit >= the k-th's. top-p walks the row's order over the top-k
// kept tokens and keeps each whose preceding weight is at most top_p * total; ``total`` is the
// top-k kept weight (given where there is no top-k: the whole row's). Weights are summed per
// bin in index order (s.mass) for bins the walk passes whole, token by token in the row's order
// within the bins it sorts (the k-th's and the nucleus's last).
bool select(int64_t k, double top_p, double total, Scratch& s) {
    const int64_t n = (int64_t)s.cand.size();
    const float* cl = s.cl.data();
    const float* w = s.w.data();
    const int32_t* order = s.order.data();
    s.keep.assign(n, 0);
    int kb = NUM_BINS;                                  // the k-th's bin: the last top-k reaches
    int32_t kend = 0;                                   // past the k-th's ties in the sorted bin kb
    if (k > 0) {
        if (n < k) return false;
        int64_t above = 0;
        for (kb = 0; above + (s.start[kb + 1] - s.start[kb]) < k; kb++) above += s.start[kb + 1] - s.start[kb];
        sort_bin(kb, s);
        kend = s.start[kb] + (int32_t)(k - above);
        const float tau_k = cl[order[kend - 1]];
        while (kend < s.start[kb + 1] && cl[order[kend]] == tau_k) kend++;   // ties: one bin
        if (top_p >= 1.0) {
            for (int32_t q = 0; q < kend; q++) s.keep[order[q]] = 1;       // bins < kb, then kb's head
            return true;
        }
        total = 0.0;
        for (int b = 0; b < kb; b++) total += s.mass[b];
        for (int32_t q = s.start[kb]; q < kend; q++) total += (double)w[order[q]];
    }
    const double limit = top_p * total;
    double before = 0.0;
    for (int b = 0; b < NUM_BINS && b <= kb; b++) {
        if (b < kb && before + s.mass[b] <= limit) {    // the whole bin stays, and the walk goes on
            for (int32_t q = s.start[b]; q < s.start[b + 1]; q++) s.keep[order[q]] = 1;
            before += s.mass[b];
            continue;
        }
        sort_bin(b, s);
        for (int32_t q = s.start[b], e = b == kb ? kend : s.start[b + 1]; q < e; q++) {
            if (before > limit) return true;
            s.keep[order[q]] = 1;
            before += (double)w[order[q]];
        }
    }
    return k > 0;                                       // top-p alone: the candidates ran out
}

// Tokens of logit >= c.
int64_t count_above(const float* l, int64_t V, float c) {
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) n += l[i] >= c;
    return n;
}

// Their weight, roughly (float lanes: it only picks a level).
double mass_above(const float* l, const float* w, int64_t V, float c) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= V; i += 16)
        for (int j = 0; j < 16; j++) lane[j] += l[i + j] >= c ? w[i + j] : 0.0f;
    double sum = 0.0;
    for (int j = 0; j < 16; j++) sum += lane[j];
    for (; i < V; i++) sum += l[i] >= c ? w[i] : 0.0f;
    return sum;
}

// One row (see kernels/sampler.py): the token, or -1 when no token has a finite weight (a NaN
// or +inf logit, or every logit -inf).
int64_t sample_row(const float* l, int64_t V, float T, int64_t top_k, double top_p, double u, Scratch& s) {
    float m;
    if (!row_max(l, V, m)) return -1;
    const int64_t k = top_k > 0 && top_k < V ? top_k : 0;
    double total = 0.0;                                 // top_p's base without top-k: every token's weight
    if (k == 0) {                                       // every token's weight (top-k weighs its candidates)
        s.w.resize(V);
        weights(l, V, m, T, s.w.data());
        if (top_p >= 1.0) return draw_dense(s.w.data(), V, u, s);
        for (int64_t b = 0; b < V; b += BLOCK) total += sum_weights(s.w.data() + b, std::min(BLOCK, V - b));
    }
    // the first level whose tokens hold k of them, or top_p of the weight, then wider as needed
    float cut = m - CUT_BASE * std::max(T, 1.0f);
    int level = 0;
    for (; level < CUT_LEVELS; level++, cut = m - (m - cut) * CUT_STEP)
        if (k > 0 ? count_above(l, V, cut) >= k : mass_above(l, s.w.data(), V, cut) >= top_p * total) break;
    for (;; level++, cut = m - (m - cut) * CUT_STEP) {
        if (level >= CUT_LEVELS) cut = -INFINITY;      // every token
        gather(l, V, m, T, cut, s);
        if (select(k, top_p, total, s) || level >= CUT_LEVELS) break;
    }
    // the draw: the kept candidates in index order, their weights summed in turn
    const int64_t n = (int64_t)s.cand.size();
    const float* w = s.w.data();
    const uint8_t* keep = s.keep.data();
    double sum = 0.0;
    for (int64_t j = 0; j < n; j++) sum += keep[j] ? (double)w[j] : 0.0;
    if (!(sum > 0.0)) return -1;
    const double target = u * sum;
    double run = 0.0;
    int64_t pick = -1;
    for (int64_t j = 0; j < n; j++) {
        if (!keep[j] || w[j] == 0.0f) continue;
        pick = s.cand[j];               // the last of weight > 0, should rounding not pass target
        run += (double)w[j];
        if (run > target) break;
    }
    return pick;
}

}  // namespace

extern "C" {

// Which build this is (variant.h).
const char* kvd_sample_rows_variant() { return KVD_VARIANT; }

// out[r] = sample_row(logits row rows[r]) for r < R: logits [*, V] fp32, rows ld floats apart;
// params[3r .. 3r + 3) = temperature (> 0), top_p (in (0, 1]; 1: off) and u (in [0, 1)), top_k[r]
// (<= 0 or >= V: off). out[r] = -1 for a row without a finite weight.
void kvd_sample_rows(const float* logits, int64_t ld, int64_t V, const int64_t* rows, int64_t R,
                     const double* params, const int64_t* top_k, int64_t* out, int num_threads) {
    const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, R));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t r = 0; r < R; r++) {
        static thread_local Scratch s;  // OpenMP's threads persist: buffers grown once
        out[r] = sample_row(logits + rows[r] * ld, V, (float)params[3 * r], top_k[r], params[3 * r + 1],
                            params[3 * r + 2], s);
    }
}

}  // extern "C"
