// AVX512 RmsNorm / NormRope / Rope (norm_rope.h) on 16-lane vectors; the algorithm is in norm_rope_simd.inc. Results
// are within 2 fp32 ulps of norm_rope_ref.cc's (bf16: one bf16 ulp, rarely).
#if defined(__GNUC__) && !defined(__clang__)  // GCC 12 flags its own _mm512_undefined_* placeholders (PR 105593)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "custom_ops/kernels/norm_rope.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"

#include "custom_ops/kernels/norm_rope_simd.inc"

}  // namespace

const NormRopeKernels kNormRope = {&RmsNormF32, &RmsNormBf16, &NormRopeF32, &NormRopeBf16, &RopeF32, &RopeBf16};

}  // namespace avx512
}  // namespace dsv4
