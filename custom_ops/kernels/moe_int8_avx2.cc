// AVX2 Int8Fp4Rows (linear_blocks.h): the FP4 experts' compute="int8" rows path without VNNI. The prepare is the
// portable one (moe_int8_prepare.inc) built with this level's flags; the rows follow moe_int8_avx512.cc with
// 256-bit halves: per 64 columns the low nibbles (even columns) and the high nibbles (odd columns) each take one
// VPSHUFB from the table 2 e2m1 + 12, and each activation row takes VPMADDUBSW (unsigned weight bytes times signed
// codes, pairs summed in int16: at most 2 x 24 x 127, no saturation) and VPMADDWD against ones per half, plus the
// layout's -12 x sum(codes) start value, a conversion and an FMA by the two scales per lane. Block sums are exact;
// the fp32 combination is reassociated (8 lanes, one horizontal sum per output).
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"
#include "custom_ops/numerics/int8_blocks.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/moe_int8_prepare.inc"

constexpr int64_t kMaxRows = 4;           // activation rows per pass over a weight row
constexpr int64_t kPrefetchCodes = 1024;  // bytes of FP4 codes ahead

inline float HorizontalSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int R>
void RowDot(const uint8_t* xp, size_t row_bytes, const WeightView& w, int64_t n, float* out, int64_t ld) {
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + n * (w.cols / 2);
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale) + n * (w.cols / kFp4Block);
  const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,  //
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  DSV4_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < w.cols; c0 += 64) {
    const bool full = c0 + 64 <= w.cols;
    const uint8_t* src = codes + c0 / 2;
    _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchCodes, _MM_HINT_T0);
    const __m256i raw = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                             : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    // even columns [b0 | b1] and odd columns [b0 | b1], as the prepared codes' two halves
    const __m256i even = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, nibble));
    const __m256i odd = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble));
    const float w0 = E8M0ToF32(scales[c0 / kFp4Block]), w1 = full ? E8M0ToF32(scales[c0 / kFp4Block + 1]) : 0.0f;
    const __m256 ws = _mm256_setr_ps(w0, w0, w0, w0, w1, w1, w1, w1);  // lanes 0-3: b0, 4-7: b1 (both halves)
    const uint8_t* chunk = xp + (c0 / 64) * kInt8ChunkBytes;
    DSV4_UNROLL
    for (int r = 0; r < R; ++r) {
      const uint8_t* a = chunk + r * row_bytes;
      const __m256i qe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
      const __m256i qo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32));
      const __m256i se = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(even, qe), ones),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 64)));
      const __m256i so = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(odd, qo), ones),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 96)));
      const float* sx = reinterpret_cast<const float*>(a + 128);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(se), _mm256_mul_ps(_mm256_loadu_ps(sx), ws), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(so), _mm256_mul_ps(_mm256_loadu_ps(sx + 8), ws), acc[r]);
    }
  }
  DSV4_UNROLL
  for (int r = 0; r < R; ++r) out[r * ld] = HorizontalSum(acc[r]);
}

void Rows(const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out) {
  const size_t row_bytes = Int8RowBytes(w.cols);
  float* y = static_cast<float*>(out.data);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t i0 = 0; i0 < m; i0 += kMaxRows) {
      const uint8_t* x = static_cast<const uint8_t*>(xp) + static_cast<size_t>(i0) * row_bytes;
      float* o = y + i0 * out.ld + (n - n0);
      switch (m - i0 < kMaxRows ? m - i0 : kMaxRows) {
        case 1: RowDot<1>(x, row_bytes, w, n, o, out.ld); break;
        case 2: RowDot<2>(x, row_bytes, w, n, o, out.ld); break;
        case 3: RowDot<3>(x, row_bytes, w, n, o, out.ld); break;
        default: RowDot<4>(x, row_bytes, w, n, o, out.ld); break;
      }
    }
  }
}

}  // namespace

extern const Int8Fp4Rows kInt8Fp4Rows = {Int8RowBytes, Prepare, Rows};

}  // namespace avx2
}  // namespace dsv4
