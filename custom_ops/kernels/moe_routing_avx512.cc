// AVX512 MoE router (moe_routing.h): vectorised scoring over 16 experts at a time and a streaming top-k selection
// that never sorts the E experts. It must match moe_routing_ref.cc: identical indices whenever the selection keys
// are not within a few ulps of each other (ties are resolved identically: lower index first), weights within fp32
// rounding of the scalar libm-based reference. Needs AVX512F (+VL/BW/DQ as compiled for the "avx512" level).
// The selection and the drivers are moe_routing_simd.inc; this file scores 16 experts per vector.
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

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "custom_ops/kernels/moe_routing.h"

namespace dsv4 {
namespace avx512 {
namespace {

constexpr int kLanes = 16;

__mmask16 TailMask(int64_t remaining) {
  return remaining >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << remaining) - 1u);
}

// exp(x) in fp32, ~1 ulp on the normal range, correct overflow to +inf, gradual underflow to subnormals and 0;
// NaN propagates. Cody-Waite reduction by ln2, degree-6 polynomial, vscalefps for the 2^n scaling.
__m512 Exp(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.8f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512 e = _mm512_scalef_ps(y, n);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), e, x);
}

// log1p(y) for y in [0, 1]: log(u) * y / (u - 1) with u = 1 + y (exact compensation for the rounding of u), and
// log(u) for u in [1, 2] from the mantissa in [sqrt(1/2), sqrt(2)) and a degree-8 polynomial.
__m512 Log1pUnit(__m512 y) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 u = _mm512_add_ps(one, y);
  const __mmask16 big = _mm512_cmp_ps_mask(u, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
  const __m512 m = _mm512_mask_mul_ps(u, big, u, _mm512_set1_ps(0.5f));
  const __m512 e = _mm512_maskz_mov_ps(big, one);
  const __m512 f = _mm512_sub_ps(m, one);
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.1514610310e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.1676998740e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.2420140846e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.4249322787e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.6668057665e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.0000714765e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-2.4999993993e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(3.3333331174e-1f));
  __m512 r = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
  r = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), r);
  r = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, r);
  __m512 log_u = _mm512_add_ps(f, r);
  log_u = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), log_u);
  const __m512 corrected = _mm512_mul_ps(log_u, _mm512_div_ps(y, _mm512_sub_ps(u, one)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, one, _CMP_EQ_OQ), corrected, y);
}

// sqrt(softplus(x)); softplus(x) = x for x > 20 (torch's threshold), else max(x, 0) + log1p(exp(-|x|)).
__m512 SqrtSoftplus(__m512 x) {
  const __m512 abs_x = _mm512_abs_ps(x);
  __m512 sp = _mm512_add_ps(_mm512_max_ps(x, _mm512_setzero_ps()), Log1pUnit(Exp(_mm512_sub_ps(_mm512_setzero_ps(), abs_x))));
  sp = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(20.0f), _CMP_GT_OQ), sp, x);
  sp = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), sp, x);
  return _mm512_sqrt_ps(sp);
}

__m512 Sigmoid(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, Exp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
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
    vsum = _mm512_mask_add_ps(vsum, valid, vsum, Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, x + e), m)));
  }
  row.sum = _mm512_reduce_add_ps(vsum);
  return row;
}

template <MoeScoreFunc F>
__m512 Score(__m512 x, const SoftmaxRow& row) {
  if (F == MoeScoreFunc::kSqrtSoftplus) return SqrtSoftplus(x);
  if (F == MoeScoreFunc::kSigmoid) return Sigmoid(x);
  return _mm512_div_ps(Exp(_mm512_sub_ps(x, _mm512_set1_ps(row.max))), _mm512_set1_ps(row.sum));
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
