// GGUF block-quantized matmul building blocks, shared by quant_matmul.cpp (the
// standalone matmul) and plan_decode.cpp (the decode-step executor). Each .so is
// one translation unit that includes this once; the arithmetic contract is in
// quant_matmul.cpp's header comment.
#pragma once

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "quant_blocks.h"
#include "simd.h"

namespace {

// [begin, end): part `part` of `parts` of n rows (threads split output rows, never k)
inline void split(int64_t n, int parts, int part, int64_t* begin, int64_t* end) {
    *begin = n * part / parts;
    *end = n * (part + 1) / parts;
}

// ------------------------------------------------------------------ few rows of x
// R rows of x (R <= 3) against NR rows of W, blocks decoded once for all R.
template <int F, int R, int NR>
inline void rows_small(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t ldx,
                       float* y, int64_t ldy) {
    V16 acc[R][NR];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NR; c++) acc[r][c] = vzero();
    for (int64_t b = 0; b < nb; b++) {
        for (int c = 0; c < NR; c++) {
            V16 lo, hi;
#if defined(__AVX2__) || defined(__AVX512F__)
            // 1 KiB ahead in the row: streaming from DRAM, one core read 6.5-6.7 GB/s with it
            // and 4.2-6.4 without (Zen 3, a shared host); a hint, so no effect on the result
            _mm_prefetch((const char*)(w + c * row_bytes + b * block_bytes(F)) + 1024, _MM_HINT_T0);
#endif
            dequant_block<F>(w + c * row_bytes + b * block_bytes(F), &lo, &hi);
            for (int r = 0; r < R; r++) {
                acc[r][c] = vfma(vload(x + r * ldx + b * QK), lo, acc[r][c]);
                acc[r][c] = vfma(vload(x + r * ldx + b * QK + 16), hi, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NR; c++) y[r * ldy + c] = vsum(acc[r][c]);
}

// Dequantized W rows, [rows][K] fp32 (the values dequant_block gives).
template <int F>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t rows, float* out) {
    const int64_t K = nb * QK;
    for (int64_t n = 0; n < rows; n++)
        for (int64_t b = 0; b < nb; b++) {
            V16 lo, hi;
            dequant_block<F>(w + n * row_bytes + b * block_bytes(F), &lo, &hi);
            vstore(out + n * K + b * QK, lo);
            vstore(out + n * K + b * QK + 16, hi);
        }
}

// ------------------------------------------------------------------ a decode batch of x rows
// M rows of x in groups of 3 (the most rows_small keeps in registers: 3 x 2 accumulators
// plus a block's weights fill AVX2's 16 registers), a remainder of 1 made 2 + 2. W is read
// once, two rows at a time (as fast as 3 or 4 in cache, faster streaming from DRAM), and each group runs over those two rows before the next pair:
// a block is dequantized once per group, and the pair stays in L1 for every group, so a
// matrix larger than the caches (the LM head) streams from memory once whatever M is.
// Per row this costs the group's FMAs plus a third of a dequantization, against a whole one
// at M = 1 (Zen 3, one thread, a whole SmolLM2 decode step at context 256: 4 sequences in 43 ms
// against 66-70 for the dequantized tile this replaced, 6 in 57 against 110-124). Same per-output order
// as every path.
template <int F, int NR>
inline void groups_pass(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t M, int64_t ldx,
                        float* y, int64_t ldy) {
    if (M == 1) return rows_small<F, 1, NR>(w, row_bytes, nb, x, ldx, y, ldy);
    int64_t threes = M / 3, m = 0;
    if (M % 3 == 1) threes -= 1;
    for (int64_t g = 0; g < threes; g++, m += 3)
        rows_small<F, 3, NR>(w, row_bytes, nb, x + m * ldx, ldx, y + m * ldy, ldy);
    for (; m < M; m += 2) rows_small<F, 2, NR>(w, row_bytes, nb, x + m * ldx, ldx, y + m * ldy, ldy);
}

template <int F>
void range_grouped(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, const float* x,
                   int64_t M, int64_t ldx, float* y, int64_t ldy) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) groups_pass<F, 2>(w + n * row_bytes, row_bytes, nb, x, M, ldx, y + n, ldy);
    if (n < n1) groups_pass<F, 1>(w + n * row_bytes, row_bytes, nb, x, M, ldx, y + n, ldy);
}

// ------------------------------------------------------------------ many rows of x: packed GEMM
// The same per-output arithmetic as above, rearranged so a register tile reuses
// every load (GotoBLAS-style; here MR rows of x by NR rows of W per step).
//
// An output's 16 lane accumulators are 16 independent fma chains: lane j runs
// over chunk c = 0, 1, ..., K/16 - 1 taking x[16c + j] * w[16c + j]. Nothing
// forces the 16 lanes of ONE output into one register; instead, for one lane j
// at a time, a register holds that lane's accumulator for VW different outputs
// n (an outer product: broadcast x[m, 16c + j], multiply by a vector of
// w[n.., 16c + j]). Each scalar chain sees the same fmas in the same order,
// so after the 16 lane passes the partial sums are bit for bit the lanes of
// the few-rows path, and the same fixed tree finishes them:
//
//     xpack (one MR-row block of x)   [j = 0..15][c = 0..C-1][MR]     C = K/16
//     wpack (one NR-row panel of W)   [j = 0..15][c = 0..C-1][NR]
//     lane pass j:  acc[r][n] = fma(xpack[j][c][r], wpack[j][c][n], acc[r][n])  for c = 0..C-1
//     part[j][r][n] = acc;  y[r][n] = tree(part[0..15][r][n])   (vsum's tree)
//
// Both packs are read front to back, so a lane pass streams them. Rows of x
// past M and rows of W past N are zero padding whose results are dropped.
constexpr int64_t GEMM_TILE_FLOATS = 48 * 1024;   // one packed tile of W: 192 KiB, stays in L2

inline int64_t gemm_tile_rows(int64_t K) {
    const int64_t t = GEMM_TILE_FLOATS / K / GEMM_NR * GEMM_NR;
    return t > GEMM_NR ? t : GEMM_NR;
}

// rows m0..m0+MR of x (rows >= M zero) -> xpack [16][C][MR]
inline void pack_x(const float* x, int64_t ldx, int64_t M, int64_t m0, int64_t K, float* xp) {
    const int64_t C = K / 16;
    for (int r = 0; r < GEMM_MR; r++) {
        const int64_t m = m0 + r;
        if (m >= M) {
            for (int64_t i = 0; i < K; i++) xp[i * GEMM_MR + r] = 0.0f;
            continue;
        }
        const float* row = x + m * ldx;
        for (int64_t c = 0; c < C; c++)
            for (int j = 0; j < 16; j++) xp[(j * C + c) * GEMM_MR + r] = row[c * 16 + j];
    }
}

#if defined(__AVX2__) || defined(__AVX512F__)
// r[i] = column i of the 8 x 8 block whose rows are r[0..8) (AVX2's unpack/shuffle/permute)
inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// rows n0..n0+NR of W (rows >= n1 zero) -> wpack [16][C][NR]: eight rows at a time, one
// block of each dequantized, then transposed 8 x 8 into place (a copy: no arithmetic)
template <int F>
void pack_w(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, float* wp, float*) {
    const int64_t C = nb * 2;
    alignas(64) float blk[8][QK];
    for (int r0 = 0; r0 < GEMM_NR; r0 += 8)
        for (int64_t b = 0; b < nb; b++) {
            for (int i = 0; i < 8; i++) {
                if (n0 + r0 + i >= n1) {
                    for (int e = 0; e < QK; e++) blk[i][e] = 0.0f;
                    continue;
                }
                V16 lo, hi;
                dequant_block<F>(w + (n0 + r0 + i) * row_bytes + b * block_bytes(F), &lo, &hi);
                vstore(blk[i], lo);
                vstore(blk[i] + 16, hi);
            }
            for (int e0 = 0; e0 < QK; e0 += 8) {        // elements e0..e0+8: chunk 2b + e0/16, lanes e0%16..
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_load_ps(blk[i] + e0);
                transpose8(r);
                const int64_t c = 2 * b + e0 / 16;
                for (int jj = 0; jj < 8; jj++)
                    _mm256_storeu_ps(wp + ((e0 % 16 + jj) * C + c) * GEMM_NR + r0, r[jj]);
            }
        }
}
#else
// rows n0..n0+NR of W (rows >= n1 zero) -> wpack [16][C][NR]; `row` holds K floats
template <int F>
void pack_w(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, float* wp, float* row) {
    const int64_t K = nb * QK, C = K / 16;
    for (int r = 0; r < GEMM_NR; r++) {
        if (n0 + r >= n1) {
            for (int64_t i = 0; i < K; i++) wp[i * GEMM_NR + r] = 0.0f;
            continue;
        }
        dequant_rows<F>(w + (n0 + r) * row_bytes, row_bytes, nb, 1, row);
        for (int64_t c = 0; c < C; c++)
            for (int j = 0; j < 16; j++) wp[(j * C + c) * GEMM_NR + r] = row[c * 16 + j];
    }
}
#endif

// y[r][n] for the MR x NR block of xpack and wpack (rows < mr, columns < nr written).
inline void gemm_block(const float* xp, const float* wp, int64_t C, float* y, int64_t ldy, int mr, int nr) {
    alignas(64) float part[16][GEMM_MR * GEMM_NR];
    for (int j = 0; j < 16; j++)                    // lane pass j
        outer_tile<false, true>(xp + j * C * GEMM_MR, 0, wp + j * C * GEMM_NR, GEMM_NR, C, part[j], GEMM_NR);
    // vsum's tree, elementwise over the block: (j + j+8) -> (j + j+4) -> (j + j+2) -> (0 + 1)
    for (int half = 8; half >= 1; half /= 2)
        for (int j = 0; j < half; j++)
            for (int i = 0; i < GEMM_MR * GEMM_NR; i++) part[j][i] = part[j][i] + part[j + half][i];
    for (int r = 0; r < mr; r++)
        for (int n = 0; n < nr; n++) y[r * ldy + n] = part[0][r * GEMM_NR + n];
}

// 64-byte aligned: a 32-byte load from a 16-byte-aligned pack crosses a cache line every
// other time (K is a multiple of 32, so every offset from here keeps the alignment)
inline float* align64(float* p) { return (float*)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

inline int64_t gemm_rows_padded(int64_t M) { return (M + GEMM_MR - 1) / GEMM_MR * GEMM_MR; }

// Floats of scratch gemm_packed needs: one tile of W packed, one dequantized row, alignment.
inline int64_t gemm_tile_scratch_floats(int64_t K) { return gemm_tile_rows(K) * K + K + 16; }

// Floats of scratch gemm_range needs: every MR-block of x packed, and gemm_packed's.
inline int64_t gemm_scratch_floats(int64_t M, int64_t K) {
    return gemm_rows_padded(M) * K + gemm_tile_scratch_floats(K);
}

// Rows [n0, n1) of W against all M rows of x, x already packed (xp: pack_x of every
// MR-block, 64-byte aligned): tile by tile of W, every MR-row block of x against every
// NR-row panel of the tile. `buf` holds gemm_tile_scratch_floats(K) floats.
template <int F>
void gemm_packed(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, const float* xp,
                 int64_t M, float* y, int64_t ldy, float* buf) {
    const int64_t K = nb * QK, C = K / 16, tile = gemm_tile_rows(K);
    float* wp = align64(buf);
    float* row = wp + tile * K;
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
        const int64_t t1 = n1 - t0 < tile ? n1 : t0 + tile;
        for (int64_t p = t0; p < t1; p += GEMM_NR) pack_w<F>(w, row_bytes, nb, p, t1, wp + (p - t0) * K, row);
        for (int64_t m = 0; m < M; m += GEMM_MR) {
            const int mr = M - m < GEMM_MR ? (int)(M - m) : GEMM_MR;
            for (int64_t p = t0; p < t1; p += GEMM_NR)
                gemm_block(xp + m * K, wp + (p - t0) * K, C, y + m * ldy + p, ldy, mr,
                           t1 - p < GEMM_NR ? (int)(t1 - p) : GEMM_NR);
        }
    }
}

// The same for one thread that packs x itself; `buf` holds gemm_scratch_floats(M, K) floats.
template <int F>
void gemm_range(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, const float* x,
                int64_t M, int64_t ldx, float* y, int64_t ldy, float* buf) {
    const int64_t K = nb * QK;
    float* xp = align64(buf);
    for (int64_t m = 0; m < M; m += GEMM_MR) pack_x(x, ldx, M, m, K, xp + m * K);
    gemm_packed<F>(w, row_bytes, nb, n0, n1, xp, M, y, ldy, xp + gemm_rows_padded(M) * K);
}

// M >= GEMM_M: the packed GEMM. Below, range_grouped: a whole SmolLM2 decode step on one
// Zen 3 thread took 9.4-10 ms per sequence at 10-14 rows against 9.8-13 for the GEMM, and
// the GEMM pulls ahead from 16 (8.3-8.7 ms per sequence at 24-32 against 9.7-10.6).
constexpr int64_t GEMM_M = 16;

// Floats of scratch one thread's matmul_range needs for M rows of x and depth K.
inline int64_t matmul_scratch_floats(int64_t M, int64_t K) { return M < GEMM_M ? 0 : gemm_scratch_floats(M, K); }

// Rows [n0, n1) of W (format F, [N, K]) against all M rows of x: one thread's share.
// `buf` holds matmul_scratch_floats(M, K) floats.
template <int F>
void matmul_range(const uint8_t* w, int64_t K, int64_t n0, int64_t n1, const float* x, int64_t M,
                  int64_t ldx, float* y, int64_t ldy, float* buf) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(F);
    if (n0 >= n1) return;
    if (M < GEMM_M) range_grouped<F>(w, row_bytes, nb, n0, n1, x, M, ldx, y, ldy);
    else gemm_range<F>(w, row_bytes, nb, n0, n1, x, M, ldx, y, ldy, buf);
}

// The same for a format known only at run time (false: unknown format).
inline bool matmul_range(int format, const uint8_t* w, int64_t K, int64_t n0, int64_t n1, const float* x,
                         int64_t M, int64_t ldx, float* y, int64_t ldy, float* buf) {
    switch (format) {
        case Q4_0: matmul_range<Q4_0>(w, K, n0, n1, x, M, ldx, y, ldy, buf); return true;
        case Q4_1: matmul_range<Q4_1>(w, K, n0, n1, x, M, ldx, y, ldy, buf); return true;
        case Q8_0: matmul_range<Q8_0>(w, K, n0, n1, x, M, ldx, y, ldy, buf); return true;
        default: return false;
    }
}

// out[t, :] = row ids[t] of W (format F, [N, K]) dequantized; ids already checked.
template <int F>
void gather_rows(const uint8_t* w, int64_t K, const int64_t* ids, int64_t T, float* out) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(F);
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b++) {
            V16 lo, hi;
            dequant_block<F>(w + ids[t] * row_bytes + b * block_bytes(F), &lo, &hi);
            vstore(out + t * K + b * QK, lo);
            vstore(out + t * K + b * QK + 16, hi);
        }
}

inline bool gather_rows_any(int format, const uint8_t* w, int64_t K, const int64_t* ids, int64_t T, float* out) {
    switch (format) {
        case Q4_0: gather_rows<Q4_0>(w, K, ids, T, out); return true;
        case Q4_1: gather_rows<Q4_1>(w, K, ids, T, out); return true;
        case Q8_0: gather_rows<Q8_0>(w, K, ids, T, out); return true;
        default: return false;
    }
}

}  // namespace
