// Allowed-token bitmasks applied to logits rows: every token a row's mask does not allow becomes
// -inf, rows split between OpenMP threads. Called through ctypes from kernels/token_masks.py, which
// states the contract and checks every shape; these functions trust their arguments.
//
// Bitmask layout (llguidance's and xgrammar's): a row is `words` 32-bit words, bit i of word j
// allows token 32 j + i. A word with every bit set leaves its 32 logits as they are (the common
// case inside free text); any other word is a branch-free select per logit, which the compiler
// turns into masked vector stores.

#include <math.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "variant.h"

namespace {

// Mask one row of V logits; true when the mask allows at least one token below V.
bool mask_row(float* l, int64_t V, const uint32_t* mask, int64_t words) {
    const int64_t covered = std::min<int64_t>(V, words * 32);
    uint32_t any = 0;
    int64_t j = 0;
    for (; (j + 1) * 32 <= covered; j++) {
        const uint32_t w = mask[j];
        any |= w;
        if (w == 0xFFFFFFFFu) continue;
        float* p = l + j * 32;
        for (int b = 0; b < 32; b++) p[b] = (w >> b) & 1u ? p[b] : -INFINITY;
    }
    for (int64_t i = j * 32; i < covered; i++) {     // a last, partial word
        const bool allowed = (mask[j] >> (i - j * 32)) & 1u;
        any |= allowed;
        if (!allowed) l[i] = -INFINITY;
    }
    for (int64_t i = covered; i < V; i++) l[i] = -INFINITY;   // ids past the mask: never allowed
    return any != 0;
}

}  // namespace

extern "C" {

// Which build this is (variant.h).
const char* kvd_token_masks_variant() { return KVD_VARIANT; }

// For r < R: row rows[r] of logits [*, V] fp32 (rows ld floats apart) keeps the tokens bitmask row r
// (words 32-bit words) allows and has -inf elsewhere; allowed[r] = whether any token is left.
void kvd_token_masks(float* logits, int64_t ld, int64_t V, const int64_t* rows, int64_t R,
                     const uint32_t* bitmask, int64_t words, uint8_t* allowed, int num_threads) {
    const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, R));
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t r = 0; r < R; r++)
        allowed[r] = mask_row(logits + rows[r] * ld, V, bitmask + r * words, words) ? 1 : 0;
}

}  // extern "C"
