// Log-probability summaries of logits rows: each row's log-sum-exp and its k largest logits,
// in two passes over the row and no [R, V] output, rows split between OpenMP threads. Called
// through ctypes from kernels/logprob_rows.py, which states the contract and checks every
// shape; these functions trust their arguments.
//
//   pass 1, in blocks of BLOCK logits: the block's maximum (vector max) -- which gives the
//           row's maximum m -- and, only for a block whose maximum beats the k-th largest
//           logit found so far, a scalar walk of the block inserting its logits into the top
//           list. After the first few blocks the threshold is near the top of the row, and
//           almost every block is one vector max. A NaN or +inf anywhere marks the row bad.
//   pass 2: sum of e^(l - m) (simd.h's vn_exp), each vector's lanes added into double lane
//           sums in turn, the lanes then added in order: the same bits on every build.
//
// lse = m + log(sum), in double. A row is reported bad (the caller answers it another way)
// when it holds a NaN or +inf, when every logit is -inf, or when fewer than k of its logits
// are above -inf (the top list would need -inf entries in some tie order).
//
// Ties in the top list: the smaller token index first (a later equal logit never displaces
// an earlier one).

#include <float.h>
#include <omp.h>

#include <algorithm>

#include "simd.h"

namespace {

constexpr int64_t BLOCK = 64;            // logits per block of pass 1 (a multiple of every GEMM_VW)
constexpr int MAX_TOP = 64;              // the largest k a call may ask for

struct Top {
    int n = 0;
    float v[MAX_TOP];
    int64_t i[MAX_TOP];

    // The threshold a logit must beat to enter a full list; -inf (anything finite enters) otherwise.
    float floor(int k) const { return n < k ? -INFINITY : v[k - 1]; }

    // Insert (x, at) keeping v descending and ties in index order; x > floor(k) is the caller's.
    void insert(float x, int64_t at, int k) {
        int p = n < k ? n++ : k - 1;     // a full list drops its last entry
        while (p > 0 && v[p - 1] < x) {
            v[p] = v[p - 1];
            i[p] = i[p - 1];
            p--;
        }
        v[p] = x;
        i[p] = at;
    }
};

// Pass 1: the maximum, the top list, and whether a NaN or +inf was seen.
float scan(const float* l, int64_t V, int k, Top& top, bool& bad) {
    // c - c is 0 but for NaN and +inf, where c = max(-FLT_MAX, x) (x's NaN passes, as x86's max
    // passes its second operand's): the sum of c - c over the row flags a NaN or +inf.
    const VN lo = vn_set1(-FLT_MAX);
    VN mx = vn_set1(-INFINITY), nan = vn_zero();
    float m = -INFINITY;
    int64_t b = 0;
    for (; b + BLOCK <= V; b += BLOCK) {
        VN bm = vn_load(l + b);
        const VN c0 = vn_max(lo, bm);
        nan = vn_add(nan, vn_sub(c0, c0));
        for (int64_t j = GEMM_VW; j < BLOCK; j += GEMM_VW) {
            const VN x = vn_load(l + b + j), c = vn_max(lo, x);
            nan = vn_add(nan, vn_sub(c, c));
            bm = vn_max(bm, x);
        }
        mx = vn_max(mx, bm);
        if (k == 0) continue;
        alignas(64) float lanes[GEMM_VW];
        vn_store(lanes, bm);
        float block_max = lanes[0];
        for (int j = 1; j < GEMM_VW; j++) block_max = lanes[j] > block_max ? lanes[j] : block_max;
        if (block_max > top.floor(k))
            for (int64_t j = b; j < b + BLOCK; j++)
                if (l[j] > top.floor(k)) top.insert(l[j], j, k);
    }
    alignas(64) float lanes[GEMM_VW], bads[GEMM_VW];
    vn_store(lanes, mx);
    vn_store(bads, nan);
    for (int j = 0; j < GEMM_VW; j++) {
        m = lanes[j] > m ? lanes[j] : m;
        bad |= bads[j] != 0.0f;
    }
    for (; b < V; b++) {                 // the tail
        bad |= !(l[b] < INFINITY);
        m = l[b] > m ? l[b] : m;
        if (k > 0 && l[b] > top.floor(k)) top.insert(l[b], b, k);
    }
    return m;
}

// Pass 2: sum of e^(l[i] - m), lanes in double, in an order fixed by the row.
double exp_sum_double(const float* l, int64_t V, float m) {
    const VN mv = vn_set1(m);
    double acc[SUM_LANES] = {};
    alignas(64) float e[SUM_LANES];
    int64_t i = 0;
    for (; i + SUM_LANES <= V; i += SUM_LANES) {
        for (int v = 0; v < SUM_VECS; v++) vn_store(e + v * GEMM_VW, vn_exp(vn_sub(vn_load(l + i + v * GEMM_VW), mv)));
        for (int j = 0; j < SUM_LANES; j++) acc[j] += e[j];
    }
    if (i < V) {
        alignas(64) float tail[SUM_LANES];
        for (int j = 0; j < SUM_LANES; j++) tail[j] = i + j < V ? l[i + j] - m : -INFINITY;
        for (int v = 0; v < SUM_VECS; v++) vn_store(e + v * GEMM_VW, vn_exp(vn_load(tail + v * GEMM_VW)));
        for (int j = 0; j < SUM_LANES; j++) acc[j] += e[j];
    }
    double sum = 0.0;
    for (int j = 0; j < SUM_LANES; j++) sum += acc[j];
    return sum;
}

// One row: true with lse, the top k (values as logprobs, rounded to float) when the row is good.
bool summarize_row(const float* l, int64_t V, int k, double& lse, float* top_v, int64_t* top_i) {
    Top top;
    bool bad = false;
    const float m = scan(l, V, k, top, bad);
    if (bad || !(m > -INFINITY) || top.n < k) return false;
    lse = (double)m + log(exp_sum_double(l, V, m));
    for (int j = 0; j < k; j++) {
        top_v[j] = (float)((double)top.v[j] - lse);
        top_i[j] = top.i[j];
    }
    return true;
}

}  // namespace

extern "C" {

// Which build this is (variant.h).
const char* kvd_logprob_rows_variant() { return KVD_VARIANT; }

// The most entries a row's top list may hold.
int kvd_logprob_rows_max_top() { return MAX_TOP; }

// For r < R, row rows[r] of logits [*, V] fp32 (rows ld floats apart): ok[r] = 1 and lse[r], the
// row's top k logprobs top_v[r * k ..) and their tokens top_i[r * k ..), largest first; or
// ok[r] = 0 for a bad row (its other outputs unset). 0 <= k <= MAX_TOP.
void kvd_logprob_rows(const float* logits, int64_t ld, int64_t V, const int64_t* rows, int64_t R, int k,
                      double* lse, float* top_v, int64_t* top_i, uint8_t* ok, int num_threads) {
    const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, R));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t r = 0; r < R; r++)
        ok[r] = summarize_row(logits + rows[r] * ld, V, k, lse[r], top_v + r * k, top_i + r * k) ? 1 : 0;
}

}  // extern "C"
