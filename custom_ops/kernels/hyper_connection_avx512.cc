// AVX512 mHC kernels (hyper_connection.h): HcPre, HcPost and HcHead for fp32 and bf16 activations, fp32 math. They
// must match hyper_connection_ref.cc within fp32 rounding (the tests bound the difference); pre/post/comb come from
// the shared ref::HcPreWeights / ref::HcHeadWeights, so they differ from the reference only through the mixes.
// Needs AVX512F/BW/VL/DQ (the "avx512" level). The algorithm is hyper_connection_simd.inc on the 16-lane vector
// layer of simd_avx512.inc (masked tails; its bf16 narrowing uses integer ops rather than vcvtneps2bf16, which
// flushes subnormals and so would not match bf16.h bit for bit); this file includes both and sets the blocking:
// column blocks of 512 (24 x 2 KiB of fn), token tiles of 4, row groups sized for the 32 zmm registers.
#include "custom_ops/kernels/isa_prelude.h"

#include <cassert>

#include "custom_ops/kernels/hyper_connection.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"

constexpr int64_t kKBlock = 512;   // columns per block: fp32 lane chains of 32 before folding into doubles
constexpr int64_t kTokenTile = 4;  // tokens sharing every fn load

// Rows per group: TB*RB accumulators + TB squares + TB x chunks + 1 weight chunk stay within the 32 zmm registers.
template <int TB>
constexpr int RowsPerGroup() {
  return TB <= 2 ? 8 : 4;
}

#include "custom_ops/kernels/hyper_connection_simd.inc"

}  // namespace

const HyperConnectionKernels kHyperConnection = {&HcPreF32, &HcPreBf16, &HcPostF32,
                                                 &HcPostBf16, &HcHeadF32, &HcHeadBf16};

}  // namespace avx512
}  // namespace dsv4
