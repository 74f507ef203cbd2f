// Row-local ops of a decoder layer in fp32 (engine/model/llama.py's LAYER_STEPS), one row or
// head at a time: the decode-plan executor runs them per row of a step (plan_decode.cpp), the
// prefill through row_ops.cpp for every row of a prompt. Each output depends on its own row
// alone, in a fixed order, so a row gets the same bits in any batch, with any thread count,
// on every build (simd.h's vectors: the same operations per element).
#pragma once

#include <math.h>
#include <stdint.h>

#include "quant_blocks.h"
#include "simd.h"

namespace {

// HF LlamaRMSNorm in fp32, as rms_norm() in llama.py: the mean of squares in a fixed order.
void rms_norm_row(const float* x, const float* w, int64_t D, float eps, float* out) {
    V16 acc = vzero();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) { V16 v = vload(x + d); acc = vfma(v, v, acc); }
    float ss = vsum(acc);
    for (; d < D; d++) ss = fmaf(x[d], x[d], ss);
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    for (d = 0; d < D; d++) out[d] = w[d] * (x[d] * inv);
}

// apply_rope: x * cos + swap_halves(x) * signed_sin, rounding after each op as torch does.
void rope_head(const float* x, const float* cos, const float* sin, int hd, float* out) {
    const int half = hd / 2;
    for (int d = 0; d < hd; d++) {
        const float a = x[d] * cos[d];
        const float b = x[d < half ? d + half : d - half] * sin[d];
        out[d] = a + b;
    }
}

// y[i] = silu(x[i]) * u[i], silu(x) = x * sigmoid(x) with sigmoid from e = e^-|x| (vn_exp
// takes x <= 0): 1 / (1 + e) for x >= 0, e / (1 + e) below; GEMM_VW lanes at a time, the
// same operations per element on every build and for every n.
void silu_mul_row(const float* x, const float* u, int64_t n, float* y) {
    int64_t i = 0;
    const VN one = vn_set1(1.0f), zero = vn_zero();
    for (; i + GEMM_VW <= n; i += GEMM_VW) {
        const VN v = vn_load(x + i);
        const VN e = vn_exp(vn_sub(zero, vn_max(v, vn_sub(zero, v))));       // e^-|v|
        const VN sig = vn_div(vn_select_ge0(v, one, e), vn_add(one, e));
        vn_store(y + i, vn_mul(vn_mul(v, sig), vn_load(u + i)));
    }
    for (; i < n; i++) {                        // the same operations, one element at a time
        float v[GEMM_VW] = {0}, e[GEMM_VW];
        v[0] = x[i] >= 0.0f ? -x[i] : x[i];
        vn_store(e, vn_exp(vn_load(v)));
        const float sig = (x[i] >= 0.0f ? 1.0f : e[0]) / (1.0f + e[0]);
        y[i] = (x[i] * sig) * u[i];
    }
}

// GELU's tanh approximation times u: y[i] = gelu(x[i]) * u[i], gelu(x) = 0.5 x (1 + tanh(z / 2)) =
// x * sigmoid(z) with z = 2 sqrt(2 / pi) (x + 0.044715 x^3) and sigmoid as silu_mul_row's (no
// tanh, whose 1 + tanh would cancel for negative x). GEMM_VW lanes at a time, the tail padded
// to a vector: the same operations per element on every build and for every n.
inline VN gelu_lanes(VN x) {
    const VN one = vn_set1(1.0f), zero = vn_zero();
    const VN cube = vn_mul(vn_mul(x, x), x);
    const VN z = vn_mul(vn_fma(vn_set1(0.044715f), cube, x), vn_set1(1.5957691216057308f));
    const VN e = vn_exp(vn_sub(zero, vn_max(z, vn_sub(zero, z))));       // e^-|z|
    return vn_mul(x, vn_div(vn_select_ge0(z, one, e), vn_add(one, e)));
}

void gelu_mul_row(const float* x, const float* u, int64_t n, float* y) {
    int64_t i = 0;
    for (; i + GEMM_VW <= n; i += GEMM_VW) vn_store(y + i, vn_mul(gelu_lanes(vn_load(x + i)), vn_load(u + i)));
    if (i < n) {
        alignas(64) float xs[GEMM_VW] = {0}, us[GEMM_VW] = {0};
        for (int64_t j = 0; i + j < n; j++) xs[j] = x[i + j], us[j] = u[i + j];
        vn_store(xs, vn_mul(gelu_lanes(vn_load(xs)), vn_load(us)));
        for (int64_t j = 0; i + j < n; j++) y[i + j] = xs[j];
    }
}

}  // namespace
