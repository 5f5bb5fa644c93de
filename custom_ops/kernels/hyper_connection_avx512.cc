// AVX512 mHC kernels (hyper_connection.h): HcPre, HcPost and HcHead for fp32 and bf16 activations, fp32 math. They
// must match hyper_connection_ref.cc within fp32 rounding (the tests bound the difference); pre/post/comb come from
// the shared ref::HcPreWeights / ref::HcHeadWeights, so they differ from the reference only through the mixes.
// Needs AVX512F/BW/VL/DQ (the "avx512" level); bf16 narrowing is done with integer ops rather than vcvtneps2bf16,
// which flushes subnormals and so would not match bf16.h bit for bit.
//
// Projection layout: the (2+hc)*hc rows of fn are streamed in groups of RB rows against a tile of TB tokens; every
// 16-wide chunk of a token's vec(x) is loaded once per row group and feeds RB fused multiply-adds, and the first
// row group also accumulates the sum of squares, so x is read M/RB times and fn once per token tile. Each
// (token, row) dot product accumulates lane-wise in the same order whatever TB, RB or thread split is used, so a
// token's outputs do not depend on the batch it came with.
#if defined(__GNUC__) && !defined(__clang__)  // GCC 12 flags its own _mm512_undefined_* placeholders (PR 105593)
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

#include "custom_ops/kernels/hyper_connection.h"

namespace dsv4 {
namespace avx512 {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kMaxMix = (2 + kHcMaxStreams) * kHcMaxStreams;

__mmask16 TailMask(int64_t remaining) {
  return remaining >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << remaining) - 1u);
}

// ---- loads/stores of 16 activations as fp32 (masked lanes read as 0 and are never written) ----

__m512 Load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

__m512 Load(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

void Store(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }

// Round to nearest-even on the dropped 16 bits; NaN -> quiet NaN with the same sign and top payload (bf16.h).
void Store(uint16_t* p, __mmask16 m, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __m512i quiet_nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  const __m512i out = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet_nan);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(out));
}

float InvSqrt(float x) { return 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x))); }

// ---- projection ----

// dots[t*RB + r] = dot(rows[r], x_t) and (kSumSq) sum_sq[t] = dot(x_t, x_t) for the TB tokens x_t = x + t*K.
template <int TB, int RB, bool kSumSq, class T>
void DotTile(const T* x, int64_t K, const float* const* rows, float* dots, float* sum_sq) {
  __m512 acc[TB][RB];
  __m512 sq[TB];
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    sq[t] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < K; i += kLanes) {
    const __mmask16 m = TailMask(K - i);
    __m512 xv[TB];
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) {
      xv[t] = Load(x + t * K + i, m);
      if (kSumSq) sq[t] = _mm512_fmadd_ps(xv[t], xv[t], sq[t]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512 w = _mm512_maskz_loadu_ps(m, rows[r] + i);
#pragma GCC unroll 8
      for (int t = 0; t < TB; ++t) acc[t][r] = _mm512_fmadd_ps(w, xv[t], acc[t][r]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    if (kSumSq) sum_sq[t] = _mm512_reduce_add_ps(sq[t]);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) dots[t * RB + r] = _mm512_reduce_add_ps(acc[t][r]);
  }
}

// Rows per group: TB*RB accumulators + TB squares + TB x chunks + 1 weight chunk stay within the 32 zmm registers.
template <int TB>
constexpr int RowsPerGroup() {
  return TB <= 2 ? 8 : 4;
}

// Dot products of rows [r0, r0 + RB) of fn (rows past M repeat row M-1 and are dropped) with TB tokens;
// mix[t*M + r] receives the raw dot products (not yet scaled by r); the group at r0 == 0 also fills sum_sq.
template <int TB, class T>
void ProjectRowGroup(const T* x, int64_t K, const float* fn, int64_t M, int64_t r0, float* mix, float* sum_sq) {
  constexpr int RB = RowsPerGroup<TB>();
  const float* rows[RB];
  for (int r = 0; r < RB; ++r) rows[r] = fn + (r0 + r < M ? r0 + r : M - 1) * K;
  float dots[TB * RB];
  if (r0 == 0) {
    DotTile<TB, RB, true>(x, K, rows, dots, sum_sq);
  } else {
    DotTile<TB, RB, false>(x, K, rows, dots, nullptr);
  }
  for (int t = 0; t < TB; ++t) {
    for (int r = 0; r < RB && r0 + r < M; ++r) mix[t * M + r0 + r] = dots[t * RB + r];
  }
}

template <int TB, class T>
void ProjectTile(const T* x, int64_t K, const float* fn, int64_t M, float* mix, float* sum_sq) {
  for (int64_t r0 = 0; r0 < M; r0 += RowsPerGroup<TB>()) ProjectRowGroup<TB>(x, K, fn, M, r0, mix, sum_sq);
}

// Raw mixes and sums of squares for tb (1..4) consecutive tokens.
template <class T>
void Project(const T* x, int64_t tb, int64_t K, const float* fn, int64_t M, float* mix, float* sum_sq) {
  switch (tb) {
    case 4: return ProjectTile<4>(x, K, fn, M, mix, sum_sq);
    case 3: return ProjectTile<3>(x, K, fn, M, mix, sum_sq);
    case 2: return ProjectTile<2>(x, K, fn, M, mix, sum_sq);
    default: return ProjectTile<1>(x, K, fn, M, mix, sum_sq);
  }
}

constexpr int64_t kTokenTile = 4;

// out[i] = sum_k pre[k] * x[k*d + i].
template <class T>
void Collapse(const T* x, const float* pre, int64_t hc, int64_t d, T* out) {
  for (int64_t i = 0; i < d; i += kLanes) {
    const __mmask16 m = TailMask(d - i);
    __m512 acc = _mm512_mul_ps(_mm512_set1_ps(pre[0]), Load(x + i, m));
    for (int64_t k = 1; k < hc; ++k) acc = _mm512_fmadd_ps(_mm512_set1_ps(pre[k]), Load(x + k * d + i, m), acc);
    Store(out + i, m, acc);
  }
}

// r = 1 / sqrt(mean(v^2) + eps), then mix *= r.
void ApplyRms(float sum_sq, int64_t K, float rms_eps, float* mix, int64_t rows) {
  const float r = InvSqrt(sum_sq / static_cast<float>(K) + rms_eps);
  for (int64_t m = 0; m < rows; ++m) mix[m] = mix[m] * r;
}

size_t NumChunks(const Parallel& par, int64_t items, int64_t cost_per_item) {
  int64_t chunks = items * (cost_per_item > 0 ? cost_per_item : 1) / 16384;
  const int64_t by_threads = 4 * static_cast<int64_t>(par.num_threads > 0 ? par.num_threads : 1);
  if (chunks > by_threads) chunks = by_threads;
  if (chunks > items) chunks = items;
  return static_cast<size_t>(chunks > 1 ? chunks : 1);
}

// ---- HcPre ----

template <class T>
void HcPre(const T* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
           int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, T* h, float* post, float* comb,
           const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  const int64_t K = hc * dim, M = (2 + hc) * hc;
  const auto finish = [&](int64_t n, float* mix, float sum_sq) {
    float pre[kHcMaxStreams];
    ApplyRms(sum_sq, K, rms_eps, mix, M);
    ref::HcPreWeights(mix, scale, base, hc, hc_eps, sinkhorn_iters, pre, post + n * hc, comb + n * hc * hc);
    Collapse(x + n * K, pre, hc, dim, h + n * dim);
  };

  if (num_tokens < par.num_threads) {
    // Few tokens (decode): split each token's projection over row groups instead of over tokens.
    constexpr int RB = RowsPerGroup<1>();
    const int64_t groups = (M + RB - 1) / RB;
    for (int64_t n = 0; n < num_tokens; ++n) {
      float mix[kMaxMix];
      float sum_sq = 0.0f;
      par.For(static_cast<size_t>(groups), [&](size_t g) {
        ProjectRowGroup<1>(x + n * K, K, fn, M, static_cast<int64_t>(g) * RB, mix, &sum_sq);
      });
      finish(n, mix, sum_sq);
    }
    return;
  }

  const int64_t tiles = (num_tokens + kTokenTile - 1) / kTokenTile;
  par.ForRange(static_cast<size_t>(tiles), NumChunks(par, tiles, kTokenTile * M * K), [&](size_t begin, size_t end) {
    float mix[kTokenTile * kMaxMix];
    float sum_sq[kTokenTile];
    for (size_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = static_cast<int64_t>(tile) * kTokenTile;
      const int64_t tb = num_tokens - n0 < kTokenTile ? num_tokens - n0 : kTokenTile;
      Project(x + n0 * K, tb, K, fn, M, mix, sum_sq);
      for (int64_t t = 0; t < tb; ++t) finish(n0 + t, mix + t * M, sum_sq[t]);
    }
  });
}

// ---- HcHead ----

template <class T>
void HcHead(const T* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
            int64_t dim, float rms_eps, float hc_eps, T* y, const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  const int64_t K = hc * dim, M = hc;
  const int64_t tiles = (num_tokens + kTokenTile - 1) / kTokenTile;
  par.ForRange(static_cast<size_t>(tiles), NumChunks(par, tiles, kTokenTile * M * K), [&](size_t begin, size_t end) {
    float mix[kTokenTile * kHcMaxStreams];
    float sum_sq[kTokenTile];
    float pre[kHcMaxStreams];
    for (size_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = static_cast<int64_t>(tile) * kTokenTile;
      const int64_t tb = num_tokens - n0 < kTokenTile ? num_tokens - n0 : kTokenTile;
      Project(x + n0 * K, tb, K, fn, M, mix, sum_sq);
      for (int64_t t = 0; t < tb; ++t) {
        ApplyRms(sum_sq[t], K, rms_eps, mix + t * M, M);
        ref::HcHeadWeights(mix + t * M, scale, base, hc, hc_eps, pre);
        Collapse(x + (n0 + t) * K, pre, hc, dim, y + (n0 + t) * dim);
      }
    }
  });
}

// ---- HcPost ----

// Columns [i0, i1) of one token: out[j] = post[j] * f + sum_k comb[k][j] * R[k].
template <class T>
void PostBlock(const T* f, const T* r, const float* post, const float* comb, int64_t hc, int64_t d, int64_t i0,
               int64_t i1, T* out) {
  __m512 rv[kHcMaxStreams];
  for (int64_t i = i0; i < i1; i += kLanes) {
    const __mmask16 m = TailMask(i1 - i);
    const __m512 fv = Load(f + i, m);
    for (int64_t k = 0; k < hc; ++k) rv[k] = Load(r + k * d + i, m);
    for (int64_t j = 0; j < hc; ++j) {
      __m512 acc = _mm512_mul_ps(_mm512_set1_ps(post[j]), fv);
      for (int64_t k = 0; k < hc; ++k) acc = _mm512_fmadd_ps(_mm512_set1_ps(comb[k * hc + j]), rv[k], acc);
      Store(out + j * d + i, m, acc);
    }
  }
}

template <class T>
void HcPost(const T* f, const T* residual, const float* post, const float* comb, int64_t num_tokens, int64_t hc,
            int64_t dim, T* out, const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  constexpr int64_t kBlock = 512;  // columns per work item (a multiple of 16)
  const int64_t blocks_per_token = (dim + kBlock - 1) / kBlock;
  const int64_t items = num_tokens * blocks_per_token;
  const int64_t cost = (hc + 1) * hc * (dim < kBlock ? dim : kBlock);
  par.ForRange(static_cast<size_t>(items), NumChunks(par, items, cost), [&](size_t begin, size_t end) {
    for (size_t item = begin; item < end; ++item) {
      const int64_t n = static_cast<int64_t>(item) / blocks_per_token;
      const int64_t i0 = (static_cast<int64_t>(item) % blocks_per_token) * kBlock;
      const int64_t i1 = i0 + kBlock < dim ? i0 + kBlock : dim;
      PostBlock(f + n * dim, residual + n * hc * dim, post + n * hc, comb + n * hc * hc, hc, dim, i0, i1,
                out + n * hc * dim);
    }
  });
}

void HcPreF32(const float* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
              int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, float* h, float* post, float* comb,
              const Parallel& par) {
  HcPre(x, fn, scale, base, num_tokens, hc, dim, rms_eps, hc_eps, sinkhorn_iters, h, post, comb, par);
}

void HcPreBf16(const uint16_t* x, const float* fn, const float* scale, const float* base, int64_t num_tokens,
               int64_t hc, int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, uint16_t* h, float* post,
               float* comb, const Parallel& par) {
  HcPre(x, fn, scale, base, num_tokens, hc, dim, rms_eps, hc_eps, sinkhorn_iters, h, post, comb, par);
}

void HcPostF32(const float* f, const float* residual, const float* post, const float* comb, int64_t num_tokens,
               int64_t hc, int64_t dim, float* out, const Parallel& par) {
  HcPost(f, residual, post, comb, num_tokens, hc, dim, out, par);
}

void HcPostBf16(const uint16_t* f, const uint16_t* residual, const float* post, const float* comb, int64_t num_tokens,
                int64_t hc, int64_t dim, uint16_t* out, const Parallel& par) {
  HcPost(f, residual, post, comb, num_tokens, hc, dim, out, par);
}

void HcHeadF32(const float* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
               int64_t dim, float rms_eps, float hc_eps, float* y, const Parallel& par) {
  HcHead(x, fn, scale, base, num_tokens, hc, dim, rms_eps, hc_eps, y, par);
}

void HcHeadBf16(const uint16_t* x, const float* fn, const float* scale, const float* base, int64_t num_tokens,
                int64_t hc, int64_t dim, float rms_eps, float hc_eps, uint16_t* y, const Parallel& par) {
  HcHead(x, fn, scale, base, num_tokens, hc, dim, rms_eps, hc_eps, y, par);
}

}  // namespace

const HyperConnectionKernels kHyperConnection = {&HcPreF32, &HcPreBf16, &HcPostF32,
                                                 &HcPostBf16, &HcHeadF32, &HcHeadBf16};

}  // namespace avx512
}  // namespace dsv4
