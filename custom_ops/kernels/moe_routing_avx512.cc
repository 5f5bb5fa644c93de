// AVX512 MoE router (moe_routing.h): vectorised scoring over 16 experts at a time and a streaming top-k selection
// that never sorts the E experts. It must match moe_routing_ref.cc: identical indices whenever the selection keys
// are not within a few ulps of each other (ties are resolved identically: lower index first), weights within fp32
// rounding of the scalar libm-based reference. Needs AVX512F (+VL/BW/DQ as compiled for the "avx512" level).
// The selection and the drivers are moe_routing_simd.inc; this file scores 16 experts per vector.
#include "custom_ops/kernels/isa_prelude.h"

#include <cassert>
#include <limits>

#include "custom_ops/kernels/moe_routing.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"

// sqrt(softplus(x)); softplus(x) = x for x > 20 (torch's threshold), else max(x, 0) + log1p(exp(-|x|)).
__m512 SqrtSoftplus(__m512 x) {
  const __m512 abs_x = _mm512_abs_ps(x);
  __m512 sp = _mm512_add_ps(_mm512_max_ps(x, _mm512_setzero_ps()), VLog1pUnit(VExpFull(_mm512_sub_ps(_mm512_setzero_ps(), abs_x))));
  sp = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(20.0f), _CMP_GT_OQ), sp, x);
  sp = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), sp, x);
  return _mm512_sqrt_ps(sp);
}

// Per-token softmax statistics (unused by the element-wise score functions).
struct SoftmaxRow {
  float max = 0.0f;
  float sum = 1.0f;
};

SoftmaxRow SoftmaxStats(const float* x, int64_t E) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t e = 0; e < E; e += kLanes) {
    vmax = _mm512_max_ps(_mm512_mask_loadu_ps(vmax, TailMask(E - e), x + e), vmax);
  }
  SoftmaxRow row;
  row.max = _mm512_reduce_max_ps(vmax);
  const __m512 m = _mm512_set1_ps(row.max);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t e = 0; e < E; e += kLanes) {
    const __mmask16 valid = TailMask(E - e);
    vsum = _mm512_mask_add_ps(vsum, valid, vsum, VExpFull(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, x + e), m)));
  }
  row.sum = _mm512_reduce_add_ps(vsum);
  return row;
}

template <MoeScoreFunc F>
__m512 Score(__m512 x, const SoftmaxRow& row) {
  if (F == MoeScoreFunc::kSqrtSoftplus) return SqrtSoftplus(x);
  if (F == MoeScoreFunc::kSigmoid) return VSigmoid(x);
  return _mm512_div_ps(VExpFull(_mm512_sub_ps(x, _mm512_set1_ps(row.max))), _mm512_set1_ps(row.sum));
}

// Scores of the k experts ids[0..k) -> w[0..k), through the same vector code as the selection pass.
template <MoeScoreFunc F>
void GatherScores(const float* x, const int64_t* ids, int64_t k, const SoftmaxRow& row, float* w) {
  alignas(64) float buf[kLanes];
  for (int64_t i = 0; i < k; i += kLanes) {
    const int64_t n = k - i < kLanes ? k - i : kLanes;
    for (int64_t j = 0; j < n; ++j) buf[j] = x[ids[i + j]];
    const __mmask16 valid = TailMask(n);
    _mm512_mask_storeu_ps(w + i, valid, Score<F>(_mm512_maskz_loadu_ps(valid, buf), row));
  }
}

// Keys of experts [e0, e0 + 16) into kbuf; returns the candidate lanes (see moe_routing_simd.inc).
template <MoeScoreFunc F>
unsigned ChunkKeys(const float* x, const float* bias, int64_t e0, int64_t E, const SoftmaxRow& row, bool all,
                   float threshold, float* kbuf) {
  const __mmask16 valid = TailMask(E - e0);
  __m512 key = Score<F>(_mm512_maskz_loadu_ps(valid, x + e0), row);
  if (bias != nullptr) key = _mm512_add_ps(key, _mm512_maskz_loadu_ps(valid, bias + e0));
  key = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(key, key, _CMP_UNORD_Q), key,
                             _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
  _mm512_store_ps(kbuf, key);
  return all ? valid : _mm512_mask_cmp_ps_mask(valid, key, _mm512_set1_ps(threshold), _CMP_GT_OQ);
}

#include "custom_ops/kernels/moe_routing_simd.inc"

}  // namespace

const MoeRoutingKernels kMoeRouting = {&MoeTopkRoute, &MoeFixedRoute};

}  // namespace avx512
}  // namespace dsv4
