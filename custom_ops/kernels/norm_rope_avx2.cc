// AVX2 RmsNorm / NormRope / Rope (norm_rope.h) on 8-lane vectors; the algorithm is in norm_rope_simd.inc. Results
// are within 2 fp32 ulps of norm_rope_ref.cc's (bf16: one bf16 ulp, rarely).
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/norm_rope.h"
#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"

#include "custom_ops/kernels/norm_rope_simd.inc"

}  // namespace

const NormRopeKernels kNormRope = {&RmsNormF32, &RmsNormBf16, &NormRopeF32, &NormRopeBf16, &RopeF32, &RopeBf16};

}  // namespace avx2
}  // namespace dsv4
