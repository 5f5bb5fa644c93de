// AVX2 MoE router (moe_routing.h): vectorised scoring over 8 experts at a time and a streaming top-k selection that
// never sorts the E experts. It must match moe_routing_ref.cc: identical indices whenever the selection keys are not
// within a few ulps of each other (ties are resolved identically: lower index first), weights within fp32 rounding
// of the scalar libm-based reference. Needs AVX2 + FMA. Same structure as moe_routing_avx512.cc, which documents the
// selection scheme.
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

void NormaliseAndScale(float* w, int64_t k, bool norm_topk_prob, float routed_scaling_factor) {
  if (norm_topk_prob) {
    float sum = 0.0f;
    for (int64_t i = 0; i < k; ++i) sum += w[i];
    const float denom = sum + 1e-20f;
    for (int64_t i = 0; i < k; ++i) w[i] = w[i] / denom;
  }
  for (int64_t i = 0; i < k; ++i) w[i] = w[i] * routed_scaling_factor;
}

// Index of the lowest set bit of a non-zero mask.
int LowestSetBit(unsigned v) {
#if defined(_MSC_VER) && !defined(__clang__)
  unsigned long i;
  _BitScanForward(&i, v);
  return static_cast<int>(i);
#else
  return __builtin_ctz(v);
#endif
}

// Inserts (key, e) into the rank-ordered keys/idx[0..held); when held == k the last entry falls out (the caller
// guarantees key > keys[k-1] then). Returns the new count.
int64_t Insert(float* keys, int64_t* idx, int64_t held, int64_t k, float key, int64_t e) {
  int64_t p = held < k ? held : k - 1;
  while (p > 0 && keys[p - 1] < key) {
    keys[p] = keys[p - 1];
    idx[p] = idx[p - 1];
    --p;
  }
  keys[p] = key;
  idx[p] = e;
  return held < k ? held + 1 : held;
}

template <MoeScoreFunc F>
void TopkToken(const float* x, const float* bias, int64_t E, int64_t k, bool norm, float scale, float* w,
               int64_t* idx) {
  if (k == 0) return;
  const SoftmaxRow row = F == MoeScoreFunc::kSoftmax ? SoftmaxStats(x, E) : SoftmaxRow{};
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(32) float kbuf[kLanes];
  float* keys = w;  // keys live in the weight row until the end
  int64_t held = 0;
  float threshold = -std::numeric_limits<float>::infinity();  // keys[k-1] once held == k
  for (int64_t e0 = 0; e0 < E; e0 += kLanes) {
    const __m256i valid = TailMask(E - e0);
    __m256 key = Score<F>(_mm256_maskload_ps(x + e0, valid), row);
    if (bias != nullptr) key = _mm256_add_ps(key, _mm256_maskload_ps(bias + e0, valid));
    key = _mm256_blendv_ps(key, neg_inf, IsNan(key));
    const unsigned valid_bits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(valid)));
    unsigned cand = held < k ? valid_bits
                             : valid_bits & static_cast<unsigned>(_mm256_movemask_ps(
                                                _mm256_cmp_ps(key, _mm256_set1_ps(threshold), _CMP_GT_OQ)));
    if (cand == 0) continue;
    _mm256_store_ps(kbuf, key);
    while (cand != 0) {
      const int lane = LowestSetBit(cand);
      cand &= cand - 1;
      if (held < k || kbuf[lane] > threshold) {
        held = Insert(keys, idx, held, k, kbuf[lane], e0 + lane);
        if (held == k) threshold = keys[k - 1];
      }
    }
  }
  GatherScores<F>(x, idx, k, row, w);
  NormaliseAndScale(w, k, norm, scale);
}

template <MoeScoreFunc F>
void FixedToken(const float* x, const int64_t* ids, int64_t E, int64_t k, bool norm, float scale, float* w) {
  const SoftmaxRow row = F == MoeScoreFunc::kSoftmax ? SoftmaxStats(x, E) : SoftmaxRow{};
  GatherScores<F>(x, ids, k, row, w);
  NormaliseAndScale(w, k, norm, scale);
}

// Roughly 16k element-operations per task and at most 4 tasks per thread.
size_t NumChunks(const Parallel& par, int64_t items, int64_t cost_per_item) {
  int64_t chunks = items * (cost_per_item > 0 ? cost_per_item : 1) / 16384;
  const int64_t by_threads = 4 * static_cast<int64_t>(par.num_threads > 0 ? par.num_threads : 1);
  if (chunks > by_threads) chunks = by_threads;
  if (chunks > items) chunks = items;
  return static_cast<size_t>(chunks > 1 ? chunks : 1);
}

template <MoeScoreFunc F>
void TopkRows(const float* logits, const float* bias, int64_t T, int64_t E, int64_t k, bool norm, float scale,
              float* weights, int64_t* indices, const Parallel& par) {
  par.ForRange(static_cast<size_t>(T), NumChunks(par, T, 4 * E), [&](size_t begin, size_t end) {
    for (size_t t = begin; t < end; ++t) {
      TopkToken<F>(logits + t * E, bias, E, k, norm, scale, weights + t * k, indices + t * k);
    }
  });
}

template <MoeScoreFunc F>
void FixedRows(const float* logits, const int64_t* ids, int64_t T, int64_t E, int64_t k, bool norm, float scale,
               float* weights, const Parallel& par) {
  const int64_t cost = F == MoeScoreFunc::kSoftmax ? 2 * E : 4 * k;
  par.ForRange(static_cast<size_t>(T), NumChunks(par, T, cost), [&](size_t begin, size_t end) {
    for (size_t t = begin; t < end; ++t) FixedToken<F>(logits + t * E, ids + t * k, E, k, norm, scale, weights + t * k);
  });
}

void MoeTopkRoute(const float* logits, const float* bias, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                  MoeScoreFunc score_func, bool norm_topk_prob, float routed_scaling_factor, float* weights,
                  int64_t* indices, const Parallel& par) {
  assert(num_experts >= 1 && top_k >= 0 && top_k <= num_experts && num_tokens >= 0);
  switch (score_func) {
    case MoeScoreFunc::kSqrtSoftplus:
      return TopkRows<MoeScoreFunc::kSqrtSoftplus>(logits, bias, num_tokens, num_experts, top_k, norm_topk_prob,
                                                   routed_scaling_factor, weights, indices, par);
    case MoeScoreFunc::kSigmoid:
      return TopkRows<MoeScoreFunc::kSigmoid>(logits, bias, num_tokens, num_experts, top_k, norm_topk_prob,
                                              routed_scaling_factor, weights, indices, par);
    case MoeScoreFunc::kSoftmax:
      return TopkRows<MoeScoreFunc::kSoftmax>(logits, bias, num_tokens, num_experts, top_k, norm_topk_prob,
                                              routed_scaling_factor, weights, indices, par);
  }
}

void MoeFixedRoute(const float* logits, const int64_t* expert_ids, int64_t num_tokens, int64_t num_experts,
                   int64_t top_k, MoeScoreFunc score_func, bool norm_topk_prob, float routed_scaling_factor,
                   float* weights, const Parallel& par) {
  assert(num_experts >= 1 && top_k >= 0 && num_tokens >= 0);
  switch (score_func) {
    case MoeScoreFunc::kSqrtSoftplus:
      return FixedRows<MoeScoreFunc::kSqrtSoftplus>(logits, expert_ids, num_tokens, num_experts, top_k,
                                                    norm_topk_prob, routed_scaling_factor, weights, par);
    case MoeScoreFunc::kSigmoid:
      return FixedRows<MoeScoreFunc::kSigmoid>(logits, expert_ids, num_tokens, num_experts, top_k, norm_topk_prob,
                                               routed_scaling_factor, weights, par);
    case MoeScoreFunc::kSoftmax:
      return FixedRows<MoeScoreFunc::kSoftmax>(logits, expert_ids, num_tokens, num_experts, top_k, norm_topk_prob,
                                               routed_scaling_factor, weights, par);
  }
}

}  // namespace

const MoeRoutingKernels kMoeRouting = {&MoeTopkRoute, &MoeFixedRoute};

}  // namespace avx2
}  // namespace dsv4
