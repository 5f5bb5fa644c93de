// AVX512 mHC kernels (hyper_connection.h): HcPre, HcPost and HcHead for fp32 and bf16 activations, fp32 math. They
// must match hyper_connection_ref.cc within fp32 rounding (the tests bound the difference); pre/post/comb come from
// the shared ref::HcPreWeights / ref::HcHeadWeights, so they differ from the reference only through the mixes.
// Needs AVX512F/BW/VL/DQ (the "avx512" level); bf16 narrowing is done with integer ops rather than vcvtneps2bf16,
// which flushes subnormals and so would not match bf16.h bit for bit.
//
// Projection layout: the (2+hc)*hc rows of fn (M) are dot products of length K = hc*d with every token. Tokens
// are taken in chunks of up to 16 and columns in blocks of 512; for each column block the chunk's tokens are
// visited in tiles of TB (<= 4) and the rows in groups of RB, so every 16-wide chunk of x feeds RB fused
// multiply-adds, every fn chunk feeds TB, and a 512-column block of fn (24 x 2 KiB) is reused from L2 by the whole
// token chunk. The first row group also accumulates the sum of squares. Within a block each (token, row) pair has
// its own 16-lane fp32 accumulator; block results are folded into double totals, which keeps fp32 chains short
// (32 terms) and the order of every sum independent of TB, RB, the chunking and the thread split: a token's
// outputs do not depend on the batch it came with or on the number of threads.
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

constexpr int64_t kKBlock = 512;        // columns per block: fp32 lane chains of 32 before folding into doubles
constexpr int64_t kTokenTile = 4;       // tokens sharing every fn load
constexpr int64_t kChunkTokens = 16;    // tokens sharing every fn block while it sits in L2
constexpr int64_t kChunkScratch = 512;  // doubles of per-chunk totals on the stack (tokens per chunk * M <= this)

// Over columns [k0, k1) of the TB tokens x_t = x + t*K: acc[t*ld + r] += dot(rows[r], x_t) and, with kSumSq,
// sum_sq[t] += dot(x_t, x_t). fp32 lane accumulators within the block, double totals across blocks.
template <int TB, int RB, bool kSumSq, class T>
void DotBlock(const T* x, int64_t K, const float* const* rows, int64_t k0, int64_t k1, double* acc, int64_t ld,
              double* sum_sq) {
  __m512 a[TB][RB];
  __m512 sq[TB];
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    sq[t] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) a[t][r] = _mm512_setzero_ps();
  }
  for (int64_t i = k0; i < k1; i += kLanes) {
    const __mmask16 m = TailMask(k1 - i);
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
      for (int t = 0; t < TB; ++t) a[t][r] = _mm512_fmadd_ps(w, xv[t], a[t][r]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) {
    if (kSumSq) sum_sq[t] += _mm512_reduce_add_ps(sq[t]);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[t * ld + r] += _mm512_reduce_add_ps(a[t][r]);
  }
}

// Rows per group: TB*RB accumulators + TB squares + TB x chunks + 1 weight chunk stay within the 32 zmm registers.
template <int TB>
constexpr int RowsPerGroup() {
  return TB <= 2 ? 8 : 4;
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
  double ss[kChunkTokens];
  for (int64_t i = 0; i < n * M; ++i) acc[i] = 0.0;
  for (int64_t t = 0; t < n; ++t) ss[t] = 0.0;
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = k0 + kKBlock < K ? k0 + kKBlock : K;
    for (int64_t t0 = 0; t0 < n; t0 += kTokenTile) {
      const T* xt = x + t0 * K;
      double* at = acc + t0 * M;
      switch (n - t0 < kTokenTile ? n - t0 : kTokenTile) {
        case 4: ProjectTileBlock<4>(xt, K, fn, M, k0, k1, at, ss + t0); break;
        case 3: ProjectTileBlock<3>(xt, K, fn, M, k0, k1, at, ss + t0); break;
        case 2: ProjectTileBlock<2>(xt, K, fn, M, k0, k1, at, ss + t0); break;
        default: ProjectTileBlock<1>(xt, K, fn, M, k0, k1, at, ss + t0); break;
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
    float sum_sq[kChunkTokens];
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
