// AVX2 mHC kernels (hyper_connection.h): HcPre, HcPost and HcHead for fp32 and bf16 activations, fp32 math. They
// must match hyper_connection_ref.cc within fp32 rounding (the tests bound the difference); pre/post/comb come from
// the shared ref::HcPreWeights / ref::HcHeadWeights, so they differ from the reference only through the mixes.
// Needs AVX2 + FMA. The algorithm is hyper_connection_simd.inc on the 8-lane vector layer of simd_avx2.inc (tails
// through maskload / a bounce buffer); this file includes both and sets the blocking: token tiles of 2, 256-column
// blocks, row groups sized for the 16 ymm registers.
#include "custom_ops/kernels/isa_prelude.h"

#include <cassert>

#include "custom_ops/kernels/hyper_connection.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"

constexpr int64_t kKBlock = 256;   // columns per block: fp32 lane chains of 32 before folding into doubles
constexpr int64_t kTokenTile = 2;  // tokens sharing every fn load

// Rows per group: TB*RB accumulators + TB squares + TB x chunks + 1 weight chunk stay within the 16 ymm registers.
template <int TB>
constexpr int RowsPerGroup() {
  return TB == 1 ? 8 : 4;
}

#include "custom_ops/kernels/hyper_connection_simd.inc"

}  // namespace

const HyperConnectionKernels kHyperConnection = {&HcPreF32, &HcPreBf16, &HcPostF32,
                                                 &HcPostBf16, &HcHeadF32, &HcHeadBf16};

}  // namespace avx2
}  // namespace dsv4
