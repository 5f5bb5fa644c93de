// AVX2 mHC kernels (hyper_connection.h): HcPre, HcPost and HcHead for fp32 and bf16 activations, fp32 math. They
// must match hyper_connection_ref.cc within fp32 rounding (the tests bound the difference); pre/post/comb come from
// the shared ref::HcPreWeights / ref::HcHeadWeights, so they differ from the reference only through the mixes.
// Needs AVX2 + FMA. The algorithm is hyper_connection_simd.inc; this file is its 8-lane vector layer (tails through
// maskload / a bounce buffer) and blocking: token tiles of 2, 256-column blocks, row groups sized for the 16 ymm
// registers.
#include <immintrin.h>

#include <cassert>
#include <cstddef>
#include <cstdint>

#include "custom_ops/kernels/hyper_connection.h"

namespace dsv4 {
namespace avx2 {
namespace {

constexpr int kLanes = 8;
using Vec = __m256;
using Lanes = int;  // active lanes, 1..8

Lanes TailLanes(int64_t remaining) { return remaining >= kLanes ? kLanes : static_cast<int>(remaining); }

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

Vec VZero() { return _mm256_setzero_ps(); }
Vec VSet1(float v) { return _mm256_set1_ps(v); }
Vec VMul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
Vec VFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
float InvSqrt(float x) { return 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x))); }

constexpr int64_t kKBlock = 256;   // columns per block: fp32 lane chains of 32 before folding into doubles
constexpr int64_t kTokenTile = 2;  // tokens sharing every fn load

// Rows per group: TB*RB accumulators + TB squares + TB x chunks + 1 weight chunk stay within the 16 ymm registers.
template <int TB>
constexpr int RowsPerGroup() {
  return TB == 1 ? 8 : 4;
}

#include "custom_ops/kernels/hyper_connection_simd.inc"

}  // namespace

const HyperConnectionKernels kHyperConnection = {&HcPreF32, &HcPreBf16, &HcPostF32,
                                                 &HcPostBf16, &HcHeadF32, &HcHeadBf16};

}  // namespace avx2
}  // namespace dsv4
