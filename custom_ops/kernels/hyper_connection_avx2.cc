// AVX2 mHC kernels (hyper_connection.h): HcPre, HcPost and HcHead for fp32 and bf16 activations, fp32 math. They
// must match hyper_connection_ref.cc within fp32 rounding (the tests bound the difference); pre/post/comb come from
// the shared ref::HcPreWeights / ref::HcHeadWeights, so they differ from the reference only through the mixes.
// Needs AVX2 + FMA. Same structure as hyper_connection_avx512.cc (which documents the projection layout), with
// 8-wide vectors, token tiles of 2, 256-column blocks and row groups sized for the 16 ymm registers.
#include <immintrin.h>

#include <cassert>
#include <cstddef>
#include <cstdint>

#include "custom_ops/kernels/hyper_connection.h"

namespace dsv4 {
namespace avx2 {
namespace {

constexpr int kLanes = 8;
constexpr int64_t kMaxMix = (2 + kHcMaxStreams) * kHcMaxStreams;

__m256i TailMask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// ---- loads/stores of n (1..8) activations as fp32 (lanes >= n read as 0 and are never written) ----

__m256 Load(const float* p, int n) {
  return n == kLanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, TailMask(n));
}

__m256 Load(const uint16_t* p, int n) {
  __m128i h;
  if (n == kLanes) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t buf[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; ++i) buf[i] = p[i];
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

void Store(float* p, int n, __m256 v) {
  if (n == kLanes) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, TailMask(n), v);
  }
}

// Round to nearest-even on the dropped 16 bits; NaN -> quiet NaN with the same sign and top payload (bf16.h).
void Store(uint16_t* p, int n, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i out32 = _mm256_blendv_epi8(rounded, quiet_nan, nan);  // every lane in [0, 0xffff]
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out32, out32), 0xd8);
  const __m128i out = _mm256_castsi256_si128(packed);
  if (n == kLanes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
  } else {
    alignas(16) uint16_t buf[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), out);
    for (int i = 0; i < n; ++i) p[i] = buf[i];
  }
}

float ReduceAdd(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

float InvSqrt(float x) { return 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x))); }

// ---- projection ----

constexpr int64_t kKBlock = 256;        // columns per block: fp32 lane chains of 32 before folding into doubles
constexpr int64_t kTokenTile = 2;       // tokens sharing every fn load
constexpr int64_t kChunkTokens = 16;    // tokens sharing every fn block while it sits in L2
constexpr int64_t kChunkScratch = 512;  // doubles of per-chunk totals on the stack (tokens per chunk * M <= this)

template <int TB, int RB, bool kSumSq, class T>
void DotStep(const T* x, int64_t K, const float* const* rows, int64_t i, int n, __m256 (&a)[TB][RB],
             __m256 (&sq)[TB]) {
  __m256 xv[TB];
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    xv[t] = Load(x + t * K + i, n);
    if (kSumSq) sq[t] = _mm256_fmadd_ps(xv[t], xv[t], sq[t]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __m256 w = Load(rows[r] + i, n);
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) a[t][r] = _mm256_fmadd_ps(w, xv[t], a[t][r]);
  }
}

// Over columns [k0, k1) of the TB tokens x_t = x + t*K: acc[t*ld + r] += dot(rows[r], x_t) and, with kSumSq,
// sum_sq[t] += dot(x_t, x_t). fp32 lane accumulators within the block, double totals across blocks.
template <int TB, int RB, bool kSumSq, class T>
void DotBlock(const T* x, int64_t K, const float* const* rows, int64_t k0, int64_t k1, double* acc, int64_t ld,
              double* sum_sq) {
  __m256 a[TB][RB];
  __m256 sq[TB];
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    sq[t] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) a[t][r] = _mm256_setzero_ps();
  }
  int64_t i = k0;
  for (; i + kLanes <= k1; i += kLanes) DotStep<TB, RB, kSumSq>(x, K, rows, i, kLanes, a, sq);
  if (i < k1) DotStep<TB, RB, kSumSq>(x, K, rows, i, static_cast<int>(k1 - i), a, sq);
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    if (kSumSq) sum_sq[t] += ReduceAdd(sq[t]);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[t * ld + r] += ReduceAdd(a[t][r]);
  }
}

// Rows per group: TB*RB accumulators + TB squares + TB x chunks + 1 weight chunk stay within the 16 ymm registers.
template <int TB>
constexpr int RowsPerGroup() {
  return TB == 1 ? 8 : 4;
}

// Rows [r0, r0 + RB) of fn, columns [k0, k1), TB tokens: acc[t*M + r] += partial dot product (rows past M repeat
// row M-1 and are dropped); the group at r0 == 0 also adds the sums of squares to sum_sq[t].
template <int TB, class T>
void ProjectBlock(const T* x, int64_t K, const float* fn, int64_t M, int64_t r0, int64_t k0, int64_t k1, double* acc,
                  double* sum_sq) {
  constexpr int RB = RowsPerGroup<TB>();
  const float* rows[RB];
  for (int r = 0; r < RB; ++r) rows[r] = fn + (r0 + r < M ? r0 + r : M - 1) * K;
  double part[TB * RB] = {};
  if (r0 == 0) {
    DotBlock<TB, RB, true>(x, K, rows, k0, k1, part, RB, sum_sq);
  } else {
    DotBlock<TB, RB, false>(x, K, rows, k0, k1, part, RB, nullptr);
  }
  for (int t = 0; t < TB; ++t) {
    for (int r = 0; r < RB && r0 + r < M; ++r) acc[t * M + r0 + r] += part[t * RB + r];
  }
}

template <int TB, class T>
void ProjectTileBlock(const T* x, int64_t K, const float* fn, int64_t M, int64_t k0, int64_t k1, double* acc,
                      double* sum_sq) {
  for (int64_t r0 = 0; r0 < M; r0 += RowsPerGroup<TB>()) ProjectBlock<TB>(x, K, fn, M, r0, k0, k1, acc, sum_sq);
}

// Tokens per chunk for N tokens: enough chunks for every thread, at most kChunkTokens, fitting the scratch.
int64_t ChunkTokens(int64_t N, int64_t M, int num_threads) {
  const int64_t threads = num_threads > 1 ? num_threads : 1;
  int64_t n = (N + threads - 1) / threads;
  n = (n + kTokenTile - 1) / kTokenTile * kTokenTile;
  if (n > kChunkTokens) n = kChunkTokens;
  if (n > kChunkScratch / M) n = kChunkScratch / M;
  return n > 1 ? n : 1;
}

// Raw mixes (dot products, not yet scaled by r) [n, M] and sums of squares [n] of n consecutive tokens
// (n * M <= kChunkScratch). Column blocks outermost, so a block of fn is reused by every token of the chunk.
template <class T>
void ProjectChunk(const T* x, int64_t n, int64_t K, const float* fn, int64_t M, float* mix, float* sum_sq) {
  double acc[kChunkScratch];
  double ss[kChunkScratch];
  for (int64_t i = 0; i < n * M; ++i) acc[i] = 0.0;
  for (int64_t t = 0; t < n; ++t) ss[t] = 0.0;
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = k0 + kKBlock < K ? k0 + kKBlock : K;
    for (int64_t t0 = 0; t0 < n; t0 += kTokenTile) {
      const T* xt = x + t0 * K;
      double* at = acc + t0 * M;
      if (n - t0 >= 2) {
        ProjectTileBlock<2>(xt, K, fn, M, k0, k1, at, ss + t0);
      } else {
        ProjectTileBlock<1>(xt, K, fn, M, k0, k1, at, ss + t0);
      }
    }
  }
  for (int64_t i = 0; i < n * M; ++i) mix[i] = static_cast<float>(acc[i]);
  for (int64_t t = 0; t < n; ++t) sum_sq[t] = static_cast<float>(ss[t]);
}

// One token, its row groups split over tasks (for calls with fewer tokens than threads). Same arithmetic as
// ProjectChunk, so a token's mixes do not depend on the path.
template <class T>
void ProjectOneTokenParallel(const T* x, int64_t K, const float* fn, int64_t M, float* mix, float* sum_sq,
                             const Parallel& par) {
  constexpr int RB = RowsPerGroup<1>();
  const int64_t groups = (M + RB - 1) / RB;
  par.For(static_cast<size_t>(groups), [&](size_t g) {
    const int64_t r0 = static_cast<int64_t>(g) * RB;
    const int64_t r1 = r0 + RB < M ? r0 + RB : M;
    double acc[kMaxMix];
    double ss = 0.0;
    for (int64_t r = r0; r < r1; ++r) acc[r] = 0.0;
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
      ProjectBlock<1>(x, K, fn, M, r0, k0, k0 + kKBlock < K ? k0 + kKBlock : K, acc, &ss);
    }
    for (int64_t r = r0; r < r1; ++r) mix[r] = static_cast<float>(acc[r]);
    if (r0 == 0) *sum_sq = static_cast<float>(ss);
  });
}

// out[i] = sum_k pre[k] * x[k*d + i].
template <class T>
void Collapse(const T* x, const float* pre, int64_t hc, int64_t d, T* out) {
  for (int64_t i = 0; i < d; i += kLanes) {
    const int n = d - i < kLanes ? static_cast<int>(d - i) : kLanes;
    __m256 acc = _mm256_mul_ps(_mm256_set1_ps(pre[0]), Load(x + i, n));
    for (int64_t k = 1; k < hc; ++k) acc = _mm256_fmadd_ps(_mm256_set1_ps(pre[k]), Load(x + k * d + i, n), acc);
    Store(out + i, n, acc);
  }
}

// r = 1 / sqrt(mean(v^2) + eps), then mix *= r.
void ApplyRms(float sum_sq, int64_t K, float rms_eps, float* mix, int64_t rows) {
  const float r = InvSqrt(sum_sq / static_cast<float>(K) + rms_eps);
  for (int64_t m = 0; m < rows; ++m) mix[m] = mix[m] * r;
}

// ---- HcPre / HcHead ----

// Shared driver: mixes for every token (M projection rows), then finish(n, mix, sum_sq) per token.
template <class T, class Finish>
void ProjectAll(const T* x, const float* fn, int64_t num_tokens, int64_t K, int64_t M, const Parallel& par,
                const Finish& finish) {
  if (num_tokens < par.num_threads) {
    // Few tokens (decode): split each token's rows over the threads instead.
    for (int64_t n = 0; n < num_tokens; ++n) {
      float mix[kMaxMix];
      float sum_sq = 0.0f;
      ProjectOneTokenParallel(x + n * K, K, fn, M, mix, &sum_sq, par);
      finish(n, mix, sum_sq);
    }
    return;
  }
  const int64_t chunk = ChunkTokens(num_tokens, M, par.num_threads);
  const int64_t chunks = (num_tokens + chunk - 1) / chunk;
  par.For(static_cast<size_t>(chunks), [&](size_t c) {
    const int64_t n0 = static_cast<int64_t>(c) * chunk;
    const int64_t n = num_tokens - n0 < chunk ? num_tokens - n0 : chunk;
    float mix[kChunkScratch];
    float sum_sq[kChunkScratch];
    ProjectChunk(x + n0 * K, n, K, fn, M, mix, sum_sq);
    for (int64_t t = 0; t < n; ++t) finish(n0 + t, mix + t * M, sum_sq[t]);
  });
}

template <class T>
void HcPre(const T* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
           int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, T* h, float* post, float* comb,
           const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  const int64_t K = hc * dim, M = (2 + hc) * hc;
  ProjectAll(x, fn, num_tokens, K, M, par, [&](int64_t n, float* mix, float sum_sq) {
    float pre[kHcMaxStreams];
    ApplyRms(sum_sq, K, rms_eps, mix, M);
    ref::HcPreWeights(mix, scale, base, hc, hc_eps, sinkhorn_iters, pre, post + n * hc, comb + n * hc * hc);
    Collapse(x + n * K, pre, hc, dim, h + n * dim);
  });
}

template <class T>
void HcHead(const T* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
            int64_t dim, float rms_eps, float hc_eps, T* y, const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  const int64_t K = hc * dim;
  ProjectAll(x, fn, num_tokens, K, hc, par, [&](int64_t n, float* mix, float sum_sq) {
    float pre[kHcMaxStreams];
    ApplyRms(sum_sq, K, rms_eps, mix, hc);
    ref::HcHeadWeights(mix, scale, base, hc, hc_eps, pre);
    Collapse(x + n * K, pre, hc, dim, y + n * dim);
  });
}

// ---- HcPost ----

size_t NumChunks(const Parallel& par, int64_t items, int64_t cost_per_item) {
  int64_t chunks = items * (cost_per_item > 0 ? cost_per_item : 1) / 16384;
  const int64_t by_threads = 4 * static_cast<int64_t>(par.num_threads > 0 ? par.num_threads : 1);
  if (chunks > by_threads) chunks = by_threads;
  if (chunks > items) chunks = items;
  return static_cast<size_t>(chunks > 1 ? chunks : 1);
}

// Columns [i0, i1) of one token: out[j] = post[j] * f + sum_k comb[k][j] * R[k].
template <class T>
void PostBlock(const T* f, const T* r, const float* post, const float* comb, int64_t hc, int64_t d, int64_t i0,
               int64_t i1, T* out) {
  __m256 rv[kHcMaxStreams];
  for (int64_t i = i0; i < i1; i += kLanes) {
    const int n = i1 - i < kLanes ? static_cast<int>(i1 - i) : kLanes;
    const __m256 fv = Load(f + i, n);
    for (int64_t k = 0; k < hc; ++k) rv[k] = Load(r + k * d + i, n);
    for (int64_t j = 0; j < hc; ++j) {
      __m256 acc = _mm256_mul_ps(_mm256_set1_ps(post[j]), fv);
      for (int64_t k = 0; k < hc; ++k) acc = _mm256_fmadd_ps(_mm256_set1_ps(comb[k * hc + j]), rv[k], acc);
      Store(out + j * d + i, n, acc);
    }
  }
}

template <class T>
void HcPost(const T* f, const T* residual, const float* post, const float* comb, int64_t num_tokens, int64_t hc,
            int64_t dim, T* out, const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  constexpr int64_t kBlock = 512;  // columns per work item (a multiple of 8)
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

}  // namespace avx2
}  // namespace dsv4
