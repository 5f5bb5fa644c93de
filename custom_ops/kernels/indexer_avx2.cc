// AVX2 Indexer (indexer.h): fp32 scoring on 8-lane vectors for fp32 and bf16 inputs (bf16 keys widened a block at
// a time), the weighted relu head sum in registers, and the radix top-k of topk_select.h. The algorithm is in
// indexer_simd.inc. Scores match indexer_ref.cc within fp32 summation-order rounding (the reference sums the dots in
// double), so the selected indices equal the reference's wherever the scores are not closer than that.
#include "custom_ops/kernels/isa_prelude.h"

#include <cstdlib>

#include "custom_ops/kernels/indexer.h"
#include "custom_ops/kernels/topk_select.h"
#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"

constexpr int kIdxSlabs = 2;
constexpr int kIdxKeys = 5;
constexpr int64_t kIdxKeyBlock = 40;

#include "custom_ops/kernels/indexer_simd.inc"

void TopKF32(const float* q, const float* weights, const float* keys, const int64_t* start_pos,
             const IndexerDims& dims, int64_t* indices, const Parallel& par) {
  IdxTopK(q, weights, keys, start_pos, dims, indices, par);
}

void TopKBf16(const uint16_t* q, const float* weights, const uint16_t* keys, const int64_t* start_pos,
              const IndexerDims& dims, int64_t* indices, const Parallel& par) {
  IdxTopK(q, weights, keys, start_pos, dims, indices, par);
}

}  // namespace

const IndexerKernels kIndexer = {&TopKF32, &TopKBf16};

}  // namespace avx2
}  // namespace dsv4
