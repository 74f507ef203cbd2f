// The AMX tile instructions quant_gemm.h's tile path uses, behind one small interface,
// either as the instructions (a build with -mamx-tile -mamx-int8: the "avx512amx" variant)
// or emulated in scalar code (a build with -DKVD_AMX_EMULATE: the test-only "amxemu"
// variant, which lets a host without AMX run the tile path's data layout and bookkeeping
// bit for bit; far too slow to serve). KVD_AMX is defined when either is compiled in.
//
// Semantics (Intel SDM, "Intel AMX instructions"), tile t has rows(t) rows of colsb(t) bytes:
//   configure(c)         LDTILECFG: every tile's shape from c, every tile zeroed
//   release()            TILERELEASE: the tiles back to their initial state
//   load<T>(p, stride)   row r of tile T = colsb(T) bytes at p + r * stride
//   store<T>(p, stride)  the reverse (at most 16 rows of 64 bytes, stride 64: what the
//                        compiler is told it writes)
//   zero<T>()            every byte of tile T = 0
//   dp_ss<C, A, B>()     C[m][n] += sum_{k < colsb(A)/4, i < 4} A[m][4k+i] * B[k][4n+i], int32 lanes,
//                        A and B signed bytes (TDPBSSD)
//   dp_us<C, A, B>()     the same with A's bytes unsigned (TDPBUSD)
// Every product and sum is exact in int32 for the operands quant_gemm.h gives it. A process
// must be granted the tile state by Linux before the first tile instruction (SIGILL otherwise):
// kernels/native.py asks (arch_prctl) before it lets an AMX build be chosen.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(KVD_AMX_EMULATE)
#define KVD_AMX 1
#elif defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVD_AMX 1
#include <immintrin.h>
#endif

#if defined(KVD_AMX)
namespace amx {

// The 64-byte tile configuration (palette 1) ldtilecfg reads.
struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

#if defined(KVD_AMX_EMULATE)
struct Tiles {
    uint8_t data[8][16][64];
    uint16_t colsb[8];
    uint8_t rows[8];
};
inline Tiles& tiles() {
    static thread_local Tiles t;
    return t;
}
// ldtilecfg: sets the shapes and zeroes every tile
inline void configure(const Config& c) {
    Tiles& t = tiles();
    memset(t.data, 0, sizeof t.data);
    for (int i = 0; i < 8; i++) t.colsb[i] = c.colsb[i], t.rows[i] = c.rows[i];
}
inline void release() {}
template <int T>
inline void zero() { memset(tiles().data[T], 0, sizeof tiles().data[T]); }
template <int T>
inline void load(const void* p, int64_t stride) {
    Tiles& t = tiles();
    for (int r = 0; r < t.rows[T]; r++) memcpy(t.data[T][r], (const uint8_t*)p + r * stride, t.colsb[T]);
}
template <int T>
inline void store(void* p, int64_t stride) {
    Tiles& t = tiles();
    for (int r = 0; r < t.rows[T]; r++) memcpy((uint8_t*)p + r * stride, t.data[T][r], t.colsb[T]);
}
template <int C, int A, int B, bool A_UNSIGNED>
inline void dp() {
    Tiles& t = tiles();
    for (int m = 0; m < t.rows[C]; m++)
        for (int n = 0; n < t.colsb[C] / 4; n++) {
            int32_t acc;
            memcpy(&acc, &t.data[C][m][4 * n], 4);
            for (int k = 0; k < t.colsb[A] / 4; k++)
                for (int i = 0; i < 4; i++) {
                    const int32_t a = A_UNSIGNED ? (int32_t)t.data[A][m][4 * k + i] : (int32_t)(int8_t)t.data[A][m][4 * k + i];
                    acc += a * (int32_t)(int8_t)t.data[B][k][4 * n + i];
                }
            memcpy(&t.data[C][m][4 * n], &acc, 4);
        }
}
template <int C, int A, int B>
inline void dp_ss() { dp<C, A, B, false>(); }
template <int C, int A, int B>
inline void dp_us() { dp<C, A, B, true>(); }
#else
// The tile number is an immediate, so each wrapper is its own asm (GCC's _tile_* macros need a
// literal number). The memory a tile reads or writes is named as an operand rather than with a
// "memory" clobber, which would also force every accumulator the caller keeps in registers out
// to the stack around each tile instruction: a load reads (as far as the compiler knows) up to
// LOAD_SPAN bytes from p, a store writes STORE_BYTES from p.
constexpr int64_t LOAD_SPAN = int64_t(1) << 24;
using LoadSpan = const uint8_t[LOAD_SPAN];
using StoreBytes = uint8_t[16 * 64];
inline void configure(const Config& c) { _tile_loadconfig(&c); }
inline void release() { _tile_release(); }
template <int T>
inline void zero() { __asm__ volatile("tilezero %%tmm%c0" ::"i"(T)); }
template <int T>
inline void load(const void* p, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T), "m"(*(LoadSpan*)p));
}
template <int T>
inline void store(void* p, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%1,%3,1)" : "=m"(*(StoreBytes*)p) : "r"(p), "i"(T), "r"(stride));
}
template <int C, int A, int B>
inline void dp_ss() { __asm__ volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B)); }
template <int C, int A, int B>
inline void dp_us() { __asm__ volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B)); }
#endif

}  // namespace amx
#endif
