// AVX2 MoE router (moe_routing.h): vectorised scoring over 8 experts at a time and a streaming top-k selection that
// never sorts the E experts. It must match moe_routing_ref.cc: identical indices whenever the selection keys are not
// within a few ulps of each other (ties are resolved identically: lower index first), weights within fp32 rounding
// of the scalar libm-based reference. Needs AVX2 + FMA. The selection and the drivers are moe_routing_simd.inc;
// this file scores 8 experts per vector.
#include <immintrin.h>

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "custom_ops/kernels/moe_routing.h"

namespace dsv4 {
namespace avx2 {
namespace {

constexpr int kLanes = 8;

// Lane mask (all-ones lanes) for the first min(remaining, 8) lanes.
__m256i TailMask(int64_t remaining) {
  const int n = remaining >= kLanes ? kLanes : static_cast<int>(remaining);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

__m256 IsNan(__m256 x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }

// exp(x) in fp32, ~1 ulp on the normal range, correct overflow to +inf, gradual underflow to subnormals and 0;
// NaN propagates. Cody-Waite reduction by ln2, degree-6 polynomial, then 2^n applied as two exact power-of-two
// factors so that n down to -150 (subnormal results) needs no special case.
__m256 Exp(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(88.8f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);  // in [-150, 128]
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);  // n1, n2 in [-75, 64]: both 2^n1 and 2^n2 are normal floats
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 e = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
  return _mm256_blendv_ps(e, x, IsNan(x));
}

// log1p(y) for y in [0, 1]: log(u) * y / (u - 1) with u = 1 + y (exact compensation for the rounding of u), and
// log(u) for u in [1, 2] from the mantissa in [sqrt(1/2), sqrt(2)) and a degree-8 polynomial.
__m256 Log1pUnit(__m256 y) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 u = _mm256_add_ps(one, y);
  const __m256 big = _mm256_cmp_ps(u, _mm256_set1_ps(1.41421356237f), _CMP_GT_OQ);
  const __m256 m = _mm256_blendv_ps(u, _mm256_mul_ps(u, _mm256_set1_ps(0.5f)), big);
  const __m256 e = _mm256_and_ps(big, one);
  const __m256 f = _mm256_sub_ps(m, one);
  const __m256 z = _mm256_mul_ps(f, f);
  __m256 p = _mm256_set1_ps(7.0376836292e-2f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.1514610310e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.1676998740e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.2420140846e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.4249322787e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.6668057665e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.0000714765e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-2.4999993993e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(3.3333331174e-1f));
  __m256 r = _mm256_mul_ps(_mm256_mul_ps(p, f), z);
  r = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), r);
  r = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, r);
  __m256 log_u = _mm256_add_ps(f, r);
  log_u = _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), log_u);
  const __m256 corrected = _mm256_mul_ps(log_u, _mm256_div_ps(y, _mm256_sub_ps(u, one)));
  return _mm256_blendv_ps(corrected, y, _mm256_cmp_ps(u, one, _CMP_EQ_OQ));
}

// sqrt(softplus(x)); softplus(x) = x for x > 20 (torch's threshold), else max(x, 0) + log1p(exp(-|x|)).
__m256 SqrtSoftplus(__m256 x) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 abs_x = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  __m256 sp = _mm256_add_ps(_mm256_max_ps(x, zero), Log1pUnit(Exp(_mm256_sub_ps(zero, abs_x))));
  sp = _mm256_blendv_ps(sp, x, _mm256_cmp_ps(x, _mm256_set1_ps(20.0f), _CMP_GT_OQ));
  sp = _mm256_blendv_ps(sp, x, IsNan(x));
  return _mm256_sqrt_ps(sp);
}

__m256 Sigmoid(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

float ReduceMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

float ReduceAdd(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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
    const __m256i valid = TailMask(E - e);
    const __m256 v = _mm256_blendv_ps(neg_inf, _mm256_maskload_ps(x + e, valid), _mm256_castsi256_ps(valid));
    vmax = _mm256_max_ps(v, vmax);
  }
  SoftmaxRow row;
  row.max = ReduceMax(vmax);
  const __m256 m = _mm256_set1_ps(row.max);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t e = 0; e < E; e += kLanes) {
    const __m256i valid = TailMask(E - e);
    const __m256 ex = Exp(_mm256_sub_ps(_mm256_maskload_ps(x + e, valid), m));
    vsum = _mm256_add_ps(vsum, _mm256_and_ps(ex, _mm256_castsi256_ps(valid)));
  }
  row.sum = ReduceAdd(vsum);
  return row;
}

template <MoeScoreFunc F>
__m256 Score(__m256 x, const SoftmaxRow& row) {
  if (F == MoeScoreFunc::kSqrtSoftplus) return SqrtSoftplus(x);
  if (F == MoeScoreFunc::kSigmoid) return Sigmoid(x);
  return _mm256_div_ps(Exp(_mm256_sub_ps(x, _mm256_set1_ps(row.max))), _mm256_set1_ps(row.sum));
}

// Scores of the k experts ids[0..k) -> w[0..k), through the same vector code as the selection pass.
template <MoeScoreFunc F>
void GatherScores(const float* x, const int64_t* ids, int64_t k, const SoftmaxRow& row, float* w) {
  alignas(32) float buf[kLanes];
  for (int64_t i = 0; i < k; i += kLanes) {
    const int64_t n = k - i < kLanes ? k - i : kLanes;
    for (int64_t j = 0; j < kLanes; ++j) buf[j] = j < n ? x[ids[i + j]] : 0.0f;
    _mm256_maskstore_ps(w + i, TailMask(n), Score<F>(_mm256_load_ps(buf), row));
  }
}

// Keys of experts [e0, e0 + 8) into kbuf; returns the candidate lanes (see moe_routing_simd.inc).
template <MoeScoreFunc F>
unsigned ChunkKeys(const float* x, const float* bias, int64_t e0, int64_t E, const SoftmaxRow& row, bool all,
                   float threshold, float* kbuf) {
  const __m256i valid = TailMask(E - e0);
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
