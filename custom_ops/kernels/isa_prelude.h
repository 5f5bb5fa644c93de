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
