// KVD_VARIANT: the name of the build this translation unit is compiled as, from the
// compiler's target macros, spelled as kernels/quant_linear.py's VARIANTS keys. Every
// library reports it (kvd_*_variant) and Python refuses a library whose name differs
// from the build it asked for, so this is the one place the names are derived.
#pragma once

#if defined(KVD_AMX_EMULATE)
#define KVD_VARIANT "amxemu"
#elif defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVD_VARIANT "avx512amx"
#elif defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVD_VARIANT "avx512vnni"
#elif defined(__AVX512F__)
#define KVD_VARIANT "avx512"
#elif defined(__AVX2__)
#define KVD_VARIANT "avx2"
#else
#define KVD_VARIANT "portable"
#endif
