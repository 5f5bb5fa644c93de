// AVX512-VNNI Int8Fp4Rows (linear_blocks.h): FP4 weight rows against int8-quantised activation rows, the rows path
// of the FP4 experts' compute="int8". The codes are those of numerics/int8_blocks.h bit for bit; the layout is this
// level's own, built so that every int32 lane sums one block:
//
// Per group of 8 blocks (256 columns; the last group of a row may have fewer, the rest zero) 384 bytes:
//   4 x 64 int8 codes   vector v, lane L (4 bytes) = codes 4t .. 4t+3 of block L % 8 with t = 2v + L / 8, so the
//                       four VPDPBUSD of a group leave lanes L and L + 8 holding halves of block L % 8's sum;
//   16 int32            -12 x the sum of lane L's 16 codes (the weights enter VPDPBUSD as 2 e2m1 + 12);
//   16 fp32             the block scale / 2 of lane L's block.
// Per group and pair of rows that is four VPDPBUSD (256 products), one conversion, one multiply of the two scale
// vectors and one FMA: the scaling, which the 64-column layout of the other levels pays per 64 products, is paid
// once per 256. The weights reach that lane order from the checkpoint's bytes with one VPERMT2W per two vectors
// (the 2-byte words of 4 codes, gathered across the group's blocks), a nibble split, one VPSHUFB per 64 codes from
// the table 2 e2m1 + 12, and byte unpacks that put each word's 4 codes in one lane in column order. The fp32
// combination of the block sums is reassociated (FMA, one horizontal sum per output).
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/int8_blocks.h"

namespace dsv4 {
namespace avx512 {
namespace {

constexpr int64_t kGroupCols = 256, kGroupBytes = 384;
constexpr int64_t kMaxRows = 8;           // activation rows per pass over a weight row
constexpr int64_t kPrefetchCodes = 1024;  // bytes of FP4 codes ahead

size_t RowBytes(int64_t cols) { return static_cast<size_t>((cols + kGroupCols - 1) / kGroupCols * kGroupBytes); }

// 32 bf16 values at p as two fp32 vectors (columns 0-15, 16-31).
inline void LoadBf16x32(const uint16_t* p, __m512* lo, __m512* hi) {
  const __m512i w = _mm512_loadu_si512(p);
  *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
  *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
}

// One block's 32 codes in column order; returns the scale (numerics/int8_blocks.h).
inline float QuantizeBlock(__m512 lo, __m512 hi, __m256i* codes) {
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
    *codes = _mm256_setzero_si256();
    return scale;
  }
  const __m512 m = _mm512_set1_ps(inv);
  // VCVTPS2DQ rounds half to even (the default MXCSR mode), as nearbyint in the reference
  const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, m)));
  const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, m)));
  *codes = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
  return scale;
}

void Prepare(const uint16_t* x, int64_t ldx, const int64_t* index, int64_t m, int64_t cols, void* dst) {
  const size_t row_bytes = RowBytes(cols);
  const int64_t blocks = cols / kInt8Block;
  const __m512i ones = _mm512_set1_epi8(1), minus12 = _mm512_set1_epi32(-12);
  // lane L of vector v <- dword 8 (L % 8 % 4) + 2v + L / 8 of the pair of code vectors holding block L % 8
  __m512i idx[4];
  for (int v = 0; v < 4; ++v) {
    alignas(64) int32_t d[16];
    for (int lane = 0; lane < 16; ++lane) d[lane] = 8 * (lane % 8 % 4) + 2 * v + lane / 8;
    idx[v] = _mm512_load_si512(d);
  }
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* src = x + (index != nullptr ? index[i] : i) * ldx;
    uint8_t* out = static_cast<uint8_t*>(dst) + static_cast<size_t>(i) * row_bytes;
    for (int64_t g = 0; g * 8 < blocks; ++g) {
      const int64_t nb = blocks - g * 8 < 8 ? blocks - g * 8 : 8;
      __m512i q[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      alignas(32) float s[8] = {};
      for (int64_t j = 0; j < nb; ++j) {
        __m512 lo, hi;
        __m256i codes;
        LoadBf16x32(src + (g * 8 + j) * kInt8Block, &lo, &hi);
        s[j] = QuantizeBlock(lo, hi, &codes) * 0.5f;
        q[j / 2] = j % 2 == 0 ? _mm512_inserti64x4(q[j / 2], codes, 0) : _mm512_inserti64x4(q[j / 2], codes, 1);
      }
      uint8_t* group = out + g * kGroupBytes;
      __m512i sums = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        const __m512i d = _mm512_mask_blend_epi32(0xF0F0, _mm512_permutex2var_epi32(q[0], idx[v], q[1]),
                                                  _mm512_permutex2var_epi32(q[2], idx[v], q[3]));
        _mm512_storeu_si512(group + 64 * v, d);
        sums = _mm512_dpbusd_epi32(sums, ones, d);
      }
      _mm512_storeu_si512(group + 256, _mm512_mullo_epi32(sums, minus12));
      _mm512_storeu_ps(group + 320, _mm512_broadcast_f32x8(_mm256_load_ps(s)));
    }
  }
}

// Word indices of the two VPERMT2W of a group: output u, word i -> the word (block j, t) = 8j + t of the group's
// 128 code bytes that lane L of vector v = 2u + i / 16 needs, with L the dword that word i becomes after the byte
// unpacks (words 0-3 -> lanes 0-3, 8-11 -> 4-7, 4-7 -> 8-11, 12-15 -> 12-15 of each 16).
struct WordIndex {
  __m512i u[2];
  WordIndex() {
    static constexpr int kLaneOfWord[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    for (int h = 0; h < 2; ++h) {
      alignas(64) int16_t w[32];
      for (int i = 0; i < 32; ++i) {
        const int v = 2 * h + i / 16, lane = kLaneOfWord[i % 16];
        w[i] = static_cast<int16_t>(8 * (lane % 8) + 2 * v + lane / 8);
      }
      u[h] = _mm512_load_si512(w);
    }
  }
};

// R activation rows (prepared, row_bytes apart) against weight row n.
template <int R>
void RowDot(const uint8_t* xp, size_t row_bytes, const WeightView& w, int64_t n, const WordIndex& wi, float* out,
            int64_t ld) {
  const int64_t blocks = w.cols / kFp4Block;
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + n * (w.cols / 2);
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale) + n * blocks;
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  DSV4_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g * 8 < blocks; ++g) {
    const int64_t nb = blocks - g * 8 < 8 ? blocks - g * 8 : 8;
    const uint8_t* src = codes + g * 128;
    _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchCodes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchCodes + 64, _MM_HINT_T0);
    __m512i z0, z1, e8;
    if (nb == 8) {
      z0 = _mm512_loadu_si512(src);
      z1 = _mm512_loadu_si512(src + 64);
      e8 = _mm512_cvtepu8_epi32(_mm_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + g * 8))));
    } else {  // the row's last blocks: nothing past them is read
      const int64_t b0 = nb < 4 ? nb : 4;
      z0 = _mm512_maskz_loadu_epi8(b0 == 4 ? ~__mmask64{0} : (__mmask64{1} << (16 * b0)) - 1, src);
      z1 = _mm512_maskz_loadu_epi8(nb > 4 ? (__mmask64{1} << (16 * (nb - 4))) - 1 : 0, src + 64);
      const __m128i e = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << nb) - 1), scales + g * 8);
      e8 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(e, e));
    }
    // 2^(e - 127) per lane (e = 0: 2^-127, subnormal); absent blocks meet zero codes and scales
    const __m512 ws = _mm512_castsi512_ps(_mm512_mask_mov_epi32(
        _mm512_slli_epi32(e8, 23), _mm512_cmpeq_epi32_mask(e8, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000)));
    __m512i wq[4];
    DSV4_UNROLL
    for (int h = 0; h < 2; ++h) {
      const __m512i p = _mm512_permutex2var_epi16(z0, wi.u[h], z1);
      const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(p, nibble));
      const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble));
      const __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
      wq[2 * h] = _mm512_shuffle_i64x2(a, b, 0x44);      // a's and b's 128-bit lanes 0, 1
      wq[2 * h + 1] = _mm512_shuffle_i64x2(a, b, 0xEE);  // lanes 2, 3
    }
    const uint8_t* group = xp + g * kGroupBytes;
    DSV4_UNROLL
    for (int r = 0; r < R; ++r) {
      const uint8_t* a = group + r * row_bytes;
      __m512i isum = _mm512_dpbusd_epi32(_mm512_loadu_si512(a + 256), wq[0], _mm512_loadu_si512(a));
      isum = _mm512_dpbusd_epi32(isum, wq[1], _mm512_loadu_si512(a + 64));
      isum = _mm512_dpbusd_epi32(isum, wq[2], _mm512_loadu_si512(a + 128));
      isum = _mm512_dpbusd_epi32(isum, wq[3], _mm512_loadu_si512(a + 192));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_loadu_ps(a + 320), ws), acc[r]);
    }
  }
  DSV4_UNROLL
  for (int r = 0; r < R; ++r) out[r * ld] = _mm512_reduce_add_ps(acc[r]);
}

void Rows(const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out) {
  static const WordIndex wi;
  const size_t row_bytes = RowBytes(w.cols);
  float* y = static_cast<float*>(out.data);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t i0 = 0; i0 < m; i0 += kMaxRows) {
      const uint8_t* x = static_cast<const uint8_t*>(xp) + static_cast<size_t>(i0) * row_bytes;
      float* o = y + i0 * out.ld + (n - n0);
      switch (m - i0 < kMaxRows ? m - i0 : kMaxRows) {
        case 1: RowDot<1>(x, row_bytes, w, n, wi, o, out.ld); break;
        case 2: RowDot<2>(x, row_bytes, w, n, wi, o, out.ld); break;
        case 3: RowDot<3>(x, row_bytes, w, n, wi, o, out.ld); break;
        case 4: RowDot<4>(x, row_bytes, w, n, wi, o, out.ld); break;
        case 5: RowDot<5>(x, row_bytes, w, n, wi, o, out.ld); break;
        case 6: RowDot<6>(x, row_bytes, w, n, wi, o, out.ld); break;
        case 7: RowDot<7>(x, row_bytes, w, n, wi, o, out.ld); break;
        default: RowDot<8>(x, row_bytes, w, n, wi, o, out.ld); break;
      }
    }
  }
}

}  // namespace

extern const Int8Fp4Rows kInt8Fp4Rows = {RowBytes, Prepare, Rows};

}  // namespace avx512
}  // namespace dsv4
