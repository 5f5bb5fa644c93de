// AVX512 mHC kernels (hyper_connection.h): HcPre, HcPost and HcHead for fp32 and bf16 activations, fp32 math. They
// must match hyper_connection_ref.cc within fp32 rounding (the tests bound the difference); pre/post/comb come from
// the shared ref::HcPreWeights / ref::HcHeadWeights, so they differ from the reference only through the mixes.
// Needs AVX512F/BW/VL/DQ (the "avx512" level); bf16 narrowing is done with integer ops rather than vcvtneps2bf16,
// which flushes subnormals and so would not match bf16.h bit for bit. The algorithm is hyper_connection_simd.inc;
// this file is its 16-lane vector layer (masked tails) and blocking: column blocks of 512 (24 x 2 KiB of fn), token
// tiles of 4, row groups sized for the 32 zmm registers.
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
using Vec = __m512;
using Lanes = __mmask16;

Lanes TailLanes(int64_t remaining) {
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

Vec VZero() { return _mm512_setzero_ps(); }
Vec VSet1(float v) { return _mm512_set1_ps(v); }
Vec VMul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
Vec VFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
float ReduceAdd(Vec v) { return _mm512_reduce_add_ps(v); }
float InvSqrt(float x) { return 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x))); }

constexpr int64_t kKBlock = 512;   // columns per block: fp32 lane chains of 32 before folding into doubles
constexpr int64_t kTokenTile = 4;  // tokens sharing every fn load

// Rows per group: TB*RB accumulators + TB squares + TB x chunks + 1 weight chunk stay within the 32 zmm registers.
template <int TB>
constexpr int RowsPerGroup() {
  return TB <= 2 ? 8 : 4;
}

#include "custom_ops/kernels/hyper_connection_simd.inc"

}  // namespace

const HyperConnectionKernels kHyperConnection = {&HcPreF32, &HcPreBf16, &HcPostF32,
                                                 &HcPostBf16, &HcHeadF32, &HcHeadBf16};

}  // namespace avx512
}  // namespace dsv4
