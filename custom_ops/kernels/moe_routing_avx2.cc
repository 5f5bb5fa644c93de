// AVX2 MoE router (moe_routing.h): vectorised scoring over 8 experts at a time and a streaming top-k selection that
// never sorts the E experts. It must match moe_routing_ref.cc: identical indices whenever the selection keys are not
// within a few ulps of each other (ties are resolved identically: lower index first), weights within fp32 rounding
// of the scalar libm-based reference. Needs AVX2 + FMA. The selection and the drivers are moe_routing_simd.inc;
// this file scores 8 experts per vector.
#include "custom_ops/kernels/isa_prelude.h"

#include <cassert>
#include <limits>

#include "custom_ops/kernels/moe_routing.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"

__m256 IsNan(__m256 x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }

// sqrt(softplus(x)); softplus(x) = x for x > 20 (torch's threshold), else max(x, 0) + log1p(exp(-|x|)).
__m256 SqrtSoftplus(__m256 x) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 abs_x = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  __m256 sp = _mm256_add_ps(_mm256_max_ps(x, zero), VLog1pUnit(VExpFull(_mm256_sub_ps(zero, abs_x))));
  sp = _mm256_blendv_ps(sp, x, _mm256_cmp_ps(x, _mm256_set1_ps(20.0f), _CMP_GT_OQ));
  sp = _mm256_blendv_ps(sp, x, IsNan(x));
  return _mm256_sqrt_ps(sp);
}

float ReduceMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Per-token softmax statistics (unused by the element-wise score functions).
struct SoftmaxRow {
  float max = 0.0f;
  float sum = 1.0f;
};

SoftmaxRow SoftmaxStats(const float* x, int64_t E) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vmax = neg_inf;
  for (int64_t e = 0; e < E; e += kLanes) {
    const __m256i valid = LaneMask(E - e);
    const __m256 v = _mm256_blendv_ps(neg_inf, _mm256_maskload_ps(x + e, valid), _mm256_castsi256_ps(valid));
    vmax = _mm256_max_ps(v, vmax);
  }
  SoftmaxRow row;
  row.max = ReduceMax(vmax);
  const __m256 m = _mm256_set1_ps(row.max);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t e = 0; e < E; e += kLanes) {
    const __m256i valid = LaneMask(E - e);
    const __m256 ex = VExpFull(_mm256_sub_ps(_mm256_maskload_ps(x + e, valid), m));
    vsum = _mm256_add_ps(vsum, _mm256_and_ps(ex, _mm256_castsi256_ps(valid)));
  }
  row.sum = VSum(vsum);
  return row;
}

template <MoeScoreFunc F>
__m256 Score(__m256 x, const SoftmaxRow& row) {
  if (F == MoeScoreFunc::kSqrtSoftplus) return SqrtSoftplus(x);
  if (F == MoeScoreFunc::kSigmoid) return VSigmoid(x);
  return _mm256_div_ps(VExpFull(_mm256_sub_ps(x, _mm256_set1_ps(row.max))), _mm256_set1_ps(row.sum));
}

// Scores of the k experts ids[0..k) -> w[0..k), through the same vector code as the selection pass.
template <MoeScoreFunc F>
void GatherScores(const float* x, const int64_t* ids, int64_t k, const SoftmaxRow& row, float* w) {
  alignas(32) float buf[kLanes];
  for (int64_t i = 0; i < k; i += kLanes) {
    const int64_t n = k - i < kLanes ? k - i : kLanes;
    for (int64_t j = 0; j < kLanes; ++j) buf[j] = j < n ? x[ids[i + j]] : 0.0f;
    _mm256_maskstore_ps(w + i, LaneMask(n), Score<F>(_mm256_load_ps(buf), row));
  }
}

// Keys of experts [e0, e0 + 8) into kbuf; returns the candidate lanes (see moe_routing_simd.inc).
template <MoeScoreFunc F>
unsigned ChunkKeys(const float* x, const float* bias, int64_t e0, int64_t E, const SoftmaxRow& row, bool all,
                   float threshold, float* kbuf) {
  const __m256i valid = LaneMask(E - e0);
  __m256 key = Score<F>(_mm256_maskload_ps(x + e0, valid), row);
  if (bias != nullptr) key = _mm256_add_ps(key, _mm256_maskload_ps(bias + e0, valid));
  key = _mm256_blendv_ps(key, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), IsNan(key));
  _mm256_store_ps(kbuf, key);
  const unsigned valid_bits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(valid)));
  return all ? valid_bits
             : valid_bits & static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(key, _mm256_set1_ps(threshold),
                                                                                  _CMP_GT_OQ)));
}

#include "custom_ops/kernels/moe_routing_simd.inc"

}  // namespace

const MoeRoutingKernels kMoeRouting = {&MoeTopkRoute, &MoeFixedRoute};

}  // namespace avx2
}  // namespace dsv4
