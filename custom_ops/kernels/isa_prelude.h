// The includes every ISA kernel file (*_avx2.cc, *_avx512.cc, *_amx.cc) starts with: the intrinsics (not under
// -DDSV4_AMX_EMULATION, where the AMX files build at the baseline) and what the vector layers simd_avx2.inc,
// simd_avx512.inc and simd_portable.inc expect from the including file.
#pragma once

#if !defined(DSV4_AMX_EMULATION)
// GCC 12 reports its own _mm512_undefined_* placeholders as uninitialised (GCC PR 105593); silence only that.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "custom_ops/numerics/bf16.h"

// Put before a loop over an array of vector accumulators (or its rows). Trap (GCC): such an array stays in registers
// only if every access to it has constant indices when GCC's scalar replacement runs, which is before its late
// complete unrolling; a loop over it still rolled then (the zeroing loop, a reduction) leaves the array in memory,
// and every accumulator is stored to the stack on each step of the K loop. Measured in the AVX512 4 x 4 fp32 x bf16
// rows kernel: 16 zmm stores per 32 columns, half its FMA rate in L2 (AMD EPYC family 0x19 model 0x11). Reductions
// must not take the array's address either (StoreSums reduces a copy).
#define DSV4_UNROLL _Pragma("GCC unroll 16")
