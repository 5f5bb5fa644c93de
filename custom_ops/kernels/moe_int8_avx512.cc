// AVX512-VNNI Int8Fp4Rows (linear_blocks.h): FP4 weight rows against int8-quantised activation rows, the rows path
// of the FP4 experts' compute="int8". Same prepared layout and codes as moe_int8.cc (the portable specification):
// the quantisation is bit for bit numerics/int8_blocks.h; the fp32 combination of the block sums is reassociated
// (FMA, one horizontal sum per output).
//
// Per 64 columns of a weight row: one 32-byte load, the low and high nibbles (even and odd columns) side by side in
// one zmm, and one VPSHUFB from the 16-entry table 2 e2m1 + 12 gives the 64 unsigned weight bytes; each activation
// row then takes one VPDPBUSD (64 products, its starting value removing the +12), a conversion and an FMA by
// (activation scale x weight scale) per lane. Against the bf16 route (VPMOVZXBD, shift, VPTERNLOGD, VPERMW per 32
// codes, then a VDPBF16PS per activation row) that is a quarter of the decoding work per code and twice the
// products per instruction.
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"
#include "custom_ops/numerics/int8_blocks.h"

namespace dsv4 {
namespace avx512 {
namespace {

constexpr int64_t kMaxRows = 8;            // activation rows per pass over a weight row
constexpr int64_t kPrefetchCodes = 1024;   // bytes of FP4 codes ahead

// 32 bf16 values at p as two fp32 vectors (columns 0-15, 16-31).
inline void LoadBf16x32(const uint16_t* p, __m512* lo, __m512* hi) {
  const __m512i w = _mm512_loadu_si512(p);
  *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
  *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
}

// One block's codes: even columns (16 bytes) and odd columns; returns the scale (numerics/int8_blocks.h).
inline float QuantizeBlock(__m512 lo, __m512 hi, __m128i* even, __m128i* odd) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  // |v| as integers order like the floats, NaN above infinity: the max is NaN whenever a value is.
  const __m512i a = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(lo), abs_mask),
                                     _mm512_and_si512(_mm512_castps_si512(hi), abs_mask));
  const uint32_t bits = _mm512_reduce_max_epu32(a);
  float amax;
  std::memcpy(&amax, &bits, sizeof amax);
  float scale, inv;
  Int8BlockScale(amax, &scale, &inv);
  if (inv == 0.0f) {  // all zero, or a non-finite value (the scale is NaN): every code 0
    *even = *odd = _mm_setzero_si128();
    return scale;
  }
  const __m512i even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd_idx = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 m = _mm512_set1_ps(inv);
  // VCVTPS2DQ rounds half to even (the default MXCSR mode), as nearbyint in the reference
  *even = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(lo, even_idx, hi), m)));
  *odd = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(lo, odd_idx, hi), m)));
  return scale;
}

void Prepare(const uint16_t* x, int64_t ldx, const int64_t* index, int64_t m, int64_t cols, void* dst) {
  const size_t row_bytes = Int8RowBytes(cols);
  const __m512i ones = _mm512_set1_epi8(1), minus12 = _mm512_set1_epi32(-12);
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* src = x + (index != nullptr ? index[i] : i) * ldx;
    uint8_t* out = static_cast<uint8_t*>(dst) + static_cast<size_t>(i) * row_bytes;
    for (int64_t c0 = 0; c0 < cols; c0 += 64) {
      __m512 lo, hi;
      __m128i e0, o0, e1 = _mm_setzero_si128(), o1 = _mm_setzero_si128();
      LoadBf16x32(src + c0, &lo, &hi);
      const float s0 = QuantizeBlock(lo, hi, &e0, &o0);
      float s1 = 0.0f;
      if (c0 + 32 < cols) {
        LoadBf16x32(src + c0 + 32, &lo, &hi);
        s1 = QuantizeBlock(lo, hi, &e1, &o1);
      }
      __m512i codes = _mm512_castsi128_si512(e0);
      codes = _mm512_inserti32x4(codes, e1, 1);
      codes = _mm512_inserti32x4(codes, o0, 2);
      codes = _mm512_inserti32x4(codes, o1, 3);
      uint8_t* chunk = out + (c0 / 64) * kInt8ChunkBytes;
      _mm512_storeu_si512(chunk, codes);
      // sum of the 4 codes of each lane (VPDPBUSD against bytes of 1), times -12
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, codes);
      _mm512_storeu_si512(chunk + 64, _mm512_mullo_epi32(sums, minus12));
      _mm512_storeu_ps(chunk + 128, _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(s0 * 0.5f), _mm512_set1_ps(s1 * 0.5f)));
    }
  }
}

// R activation rows (prepared, row_bytes apart) against weight row n.
template <int R>
void RowDot(const uint8_t* xp, size_t row_bytes, const WeightView& w, int64_t n, float* out, int64_t ld) {
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + n * (w.cols / 2);
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale) + n * (w.cols / kFp4Block);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m512 acc[R];
  DSV4_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < w.cols; c0 += 64) {
    const bool full = c0 + 64 <= w.cols;
    const uint8_t* src = codes + c0 / 2;
    _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchCodes, _MM_HINT_T0);
    const __m256i raw = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                             : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    const __m512i wq = _mm512_shuffle_epi8(lut, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    const float w0 = E8M0ToF32(scales[c0 / kFp4Block]), w1 = full ? E8M0ToF32(scales[c0 / kFp4Block + 1]) : 0.0f;
    const __m512 ws = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(w0), _mm512_set1_ps(w1));
    const uint8_t* chunk = xp + (c0 / 64) * kInt8ChunkBytes;
    DSV4_UNROLL
    for (int r = 0; r < R; ++r) {
      const uint8_t* a = chunk + r * row_bytes;
      const __m512i isum = _mm512_dpbusd_epi32(_mm512_loadu_si512(a + 64), wq, _mm512_loadu_si512(a));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_loadu_ps(a + 128), ws), acc[r]);
    }
  }
  DSV4_UNROLL
  for (int r = 0; r < R; ++r) out[r * ld] = _mm512_reduce_add_ps(acc[r]);
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
        case 4: RowDot<4>(x, row_bytes, w, n, o, out.ld); break;
        case 5: RowDot<5>(x, row_bytes, w, n, o, out.ld); break;
        case 6: RowDot<6>(x, row_bytes, w, n, o, out.ld); break;
        case 7: RowDot<7>(x, row_bytes, w, n, o, out.ld); break;
        default: RowDot<8>(x, row_bytes, w, n, o, out.ld); break;
      }
    }
  }
}

}  // namespace

extern const Int8Fp4Rows kInt8Fp4Rows = {Prepare, Rows};

}  // namespace avx512
}  // namespace dsv4
