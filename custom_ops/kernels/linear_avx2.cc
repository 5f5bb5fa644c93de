// AVX2 + FMA (+F16C) blocks of the Linear and MoE expert kernels (linear_blocks.h): the rows path and the panels
// (prefill; at the end of this file), all in fp32. Must match linear_ref.cc up to summation order (8 fp32 lanes,
// one fixed horizontal sum per output on the rows path); the weights decode to exactly the reference values, bf16
// activations are widened exactly and meet the weights rounded to bf16 as the reference does (nearest-even,
// denormals kept).
//
// Inner loop: two or four weight rows against up to four activation rows, K in the lanes, one FMA per 8 columns:
//   bf16 weight rows (read in place) are widened in registers, the even columns of a 16-column chunk by a shift and
//   the odd ones by a mask, so the activations are prepared as [8 even, 8 odd] per chunk;
//   fp32 rows (fp32 weights in place, everything else decoded four or 64 rows at a time into scratch) against
//   activations in the same column order as the decoded row.
// Decoding: FP8 E4M3 through the fp16 encoding of code * 2^-8 (exact for every code, NaN codes replaced) and
// VCVTPH2PS, times 2^8, times the scale (one rounding, as the reference; for one activation row decoded in registers
// instead, with the scale applied per block sum: DotFp8Fused); FP4 E2M1 through an 8-entry magnitude
// table times the block's scale (VPERMPS on the low 3 bits) and the sign bit, written as [8 even, 8 odd] columns
// per 16, the layout the activations then follow.
#include "custom_ops/kernels/isa_prelude.h"

#include <algorithm>
#include <type_traits>

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"

enum class RowKind { kBf16Direct, kF32Direct, kF32Decoded };

RowKind KindOf(ActType act, const WeightView& w) {
  if (w.format == WeightFormat::kBf16) return RowKind::kBf16Direct;
  if (w.format == WeightFormat::kF32 && act == ActType::kF32) return RowKind::kF32Direct;
  return RowKind::kF32Decoded;
}

// Activation layout: [8 even, 8 odd] per 16 columns for bf16 rows and decoded FP4 rows, column order otherwise.
bool EvenOdd(ActType act, const WeightView& w) {
  const RowKind kind = KindOf(act, w);
  return kind == RowKind::kBf16Direct || (kind == RowKind::kF32Decoded && w.format == WeightFormat::kFp4E2M1);
}

// Whether decoded values must be rounded to bf16 (bf16 activations and a format not exact in bf16).
bool RoundDecoded(ActType act, const WeightView& w) {
  return act == ActType::kBf16 &&
         (w.format == WeightFormat::kF32 || (w.format == WeightFormat::kFp8E4M3 && w.scale_format == ScaleFormat::kF32));
}

int64_t Pad32(int64_t c) { return (c + 31) / 32 * 32; }

float Hsum(__m256 v) {
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// 16 E4M3 codes -> code * 2^-8 as fp32 (columns 0..7, 8..15); exact, NaN codes give NaN.
void Fp8ToF32(__m128i codes, __m256* lo, __m256* hi) {
  const __m256i w = _mm256_cvtepu8_epi16(codes);
  __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F));
  h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), nan);
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// The same without the NaN fix-up, for weights known to hold no NaN codes (WeightView::fp8_finite): sign-extend the
// bytes to words, shift left by 7 and clear bit 14 (the sign's copy) gives the same fp16 bits for every other code.
void Fp8ToF32Finite(__m128i codes, __m256* lo, __m256* hi) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7),
                                     _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// Bytes ahead that the decode loops prefetch (one prefetch per 64 bytes read).
constexpr int64_t kPrefetchBytes = 2048;

// FP8 row `row`: 16 columns at a time (scale blocks are multiples of 16 columns), exact fp32 values.
template <bool kFinite, bool kRound>
void DecodeFp8Row(const WeightView& w, int64_t row, int64_t scale_row, int64_t kp, float* out) {
  const uint8_t* src = static_cast<const uint8_t*>(w.data) + row * w.cols;
  const __m256 two8 = _mm256_set1_ps(256.0f);
  int64_t k = 0;
  for (int64_t b = 0; k < w.cols; ++b) {
    const int64_t s = scale_row + b;
    const float scale = w.scale_format == ScaleFormat::kE8M0 ? E8M0ToF32(static_cast<const uint8_t*>(w.scale)[s])
                                                             : static_cast<const float*>(w.scale)[s];
    const int64_t block_end = (b + 1) * w.block < w.cols ? (b + 1) * w.block : w.cols;
    // (code * 2^-8) * (2^8 * scale) is the same single rounding as ((code * 2^-8) * 2^8) * scale while 2^8 * scale
    // is finite (scaling by 2^8 is exact): one multiply instead of two.
    const float scale256 = scale * 256.0f;
    const auto chunks = [&](auto one_mul) {
      const __m256 sv = _mm256_set1_ps(scale), sv256 = _mm256_set1_ps(scale256);
      for (; k < block_end; k += 16) {
        if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + k + kPrefetchBytes), _MM_HINT_T0);
        __m128i codes;
        if (block_end - k >= 16) {
          codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
        } else {
          alignas(16) uint8_t tail[16] = {};
          std::memcpy(tail, src + k, static_cast<size_t>(block_end - k));
          codes = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
        }
        __m256 a, c;
        if constexpr (kFinite) {
          Fp8ToF32Finite(codes, &a, &c);
        } else {
          Fp8ToF32(codes, &a, &c);
        }
        if constexpr (decltype(one_mul)::value) {
          a = _mm256_mul_ps(a, sv256);
          c = _mm256_mul_ps(c, sv256);
        } else {
          a = _mm256_mul_ps(_mm256_mul_ps(a, two8), sv);  // code * 2^-8 * 2^8 exactly, then one rounding
          c = _mm256_mul_ps(_mm256_mul_ps(c, two8), sv);
        }
        if constexpr (kRound) {
          a = VRoundBf16(a);
          c = VRoundBf16(c);
        }
        _mm256_storeu_ps(out + k, a);
        _mm256_storeu_ps(out + k + 8, c);
      }
    };
    if (scale256 - scale256 == 0.0f) {
      chunks(std::true_type{});
    } else {
      chunks(std::false_type{});
    }
  }
  for (k = (w.cols + 15) / 16 * 16; k < kp; k += 8) _mm256_storeu_ps(out + k, _mm256_setzero_ps());
}

// FP4 row `row` (whole 32-column blocks): columns as [8 even, 8 odd] per 16.
void DecodeFp4Row(const WeightView& w, int64_t row, int64_t kp, float* out) {
  const uint8_t* src = static_cast<const uint8_t*>(w.data) + row * (w.cols / 2);
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale) + row * (w.cols / kFp4Block);
  const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t k = 0; k < w.cols; k += 32) {
    if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + k / 2 + kPrefetchBytes), _MM_HINT_T0);
    const __m256 table = _mm256_mul_ps(magnitudes, _mm256_set1_ps(E8M0ToF32(scales[k / kFp4Block])));
    for (int64_t h = 0; h < 2; ++h) {  // 8 bytes = 16 codes each
      const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k / 2 + 8 * h)));
      const __m256 even = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, d),
                                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign)));
      const __m256 odd = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, _mm256_srli_epi32(d, 4)),
                                       _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 24), sign)));
      _mm256_storeu_ps(out + k + 16 * h, even);
      _mm256_storeu_ps(out + k + 16 * h + 8, odd);
    }
  }
  for (int64_t k = w.cols; k < kp; k += 8) _mm256_storeu_ps(out + k, _mm256_setzero_ps());
}

// fp32 weights (bf16 activations: rounded to bf16).
void DecodeF32Row(const WeightView& w, int64_t row, int64_t kp, float* out) {
  const float* src = static_cast<const float*>(w.data) + row * w.cols;
  for (int64_t k = 0; k < kp; k += 8) {
    const __m256 v = k < w.cols ? _mm256_maskload_ps(src + k, LaneMask(w.cols - k)) : _mm256_setzero_ps();
    _mm256_storeu_ps(out + k, VRoundBf16(v));
  }
}

// Rows [n0, n0 + rows) decoded to fp32 (kp columns, zero tail, layout as EvenOdd()).
void DecodeRows(ActType act, const WeightView& w, int64_t n0, int64_t rows, int64_t kp, float* dst) {
  const bool round = RoundDecoded(act, w);
  const int64_t block = w.block > 0 ? w.block : 1;
  int64_t row_block = n0 / block, row_in_block = n0 % block;  // FP8 scale row, advanced without divisions
  const int64_t scale_cols = (w.cols + block - 1) / block;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = n0 + r;
    float* out = dst + r * kp;
    if (row >= w.rows) {
      std::memset(out, 0, static_cast<size_t>(kp) * sizeof(float));
    } else if (w.format == WeightFormat::kFp8E4M3) {
      const int64_t scale_row = row_block * scale_cols;
      if (w.fp8_finite) {
        round ? DecodeFp8Row<true, true>(w, row, scale_row, kp, out)
              : DecodeFp8Row<true, false>(w, row, scale_row, kp, out);
      } else {
        round ? DecodeFp8Row<false, true>(w, row, scale_row, kp, out)
              : DecodeFp8Row<false, false>(w, row, scale_row, kp, out);
      }
    } else if (w.format == WeightFormat::kFp4E2M1) {
      DecodeFp4Row(w, row, kp, out);
    } else {
      DecodeF32Row(w, row, kp, out);
    }
    if (++row_in_block == block) {
      row_in_block = 0;
      ++row_block;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Inner loops: res[i][q] = sum_k x_i[k] w_q[k], R weight rows, MR activation rows.

template <int R, int MR>
void DotBf16Rows(const uint16_t* const* w, int64_t kw, const float* x, int64_t xs, float res[][4]) {
  __m256 acc[MR][R];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < R; ++q) acc[i][q] = _mm256_setzero_ps();
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < kw; k += 16) {
    __m256 we[R], wo[R];
    for (int q = 0; q < R; ++q) {
      __m256i v;
      if (k + 16 <= kw) {
        v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[q] + k));
      } else {
        alignas(32) uint16_t tail[16] = {};
        std::memcpy(tail, w[q] + k, static_cast<size_t>(kw - k) * sizeof(uint16_t));
        v = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      }
      we[q] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      wo[q] = _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask));
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 xe = _mm256_loadu_ps(x + i * xs + k), xo = _mm256_loadu_ps(x + i * xs + k + 8);
      for (int q = 0; q < R; ++q) {
        acc[i][q] = _mm256_fmadd_ps(we[q], xe, acc[i][q]);
        acc[i][q] = _mm256_fmadd_ps(wo[q], xo, acc[i][q]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < R; ++q) res[i][q] = Hsum(acc[i][q]);
}

template <int R, int MR>
void DotF32Rows(const float* const* w, int64_t kw, const float* x, int64_t xs, float res[][4]) {
  __m256 acc[MR][R];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < R; ++q) acc[i][q] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kw; k += 8) {
    __m256 a[R];
    if (k + 8 <= kw) {
      for (int q = 0; q < R; ++q) a[q] = _mm256_loadu_ps(w[q] + k);
    } else {
      const __m256i mask = LaneMask(kw - k);
      for (int q = 0; q < R; ++q) a[q] = _mm256_maskload_ps(w[q] + k, mask);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * xs + k);
      for (int q = 0; q < R; ++q) acc[i][q] = _mm256_fmadd_ps(a[q], xv, acc[i][q]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < R; ++q) res[i][q] = Hsum(acc[i][q]);
}

// Four weight rows (two passes of two when MR > 1, to stay within 16 registers).
template <class W>
void Dot(int mr, const W* const* w, int64_t kw, const float* x, int64_t xs, float res[][4]) {
  constexpr bool kBf16 = sizeof(W) == 2;
  if (mr == 1) {
    if constexpr (kBf16) {
      DotBf16Rows<4, 1>(w, kw, x, xs, res);
    } else {
      DotF32Rows<4, 1>(w, kw, x, xs, res);
    }
    return;
  }
  for (int half = 0; half < 2; ++half) {
    float part[4][4];
    const W* const* wh = w + 2 * half;
    switch (mr) {
      case 2:
        if constexpr (kBf16) DotBf16Rows<2, 2>(wh, kw, x, xs, part); else DotF32Rows<2, 2>(wh, kw, x, xs, part);
        break;
      case 3:
        if constexpr (kBf16) DotBf16Rows<2, 3>(wh, kw, x, xs, part); else DotF32Rows<2, 3>(wh, kw, x, xs, part);
        break;
      default:
        if constexpr (kBf16) DotBf16Rows<2, 4>(wh, kw, x, xs, part); else DotF32Rows<2, 4>(wh, kw, x, xs, part);
        break;
    }
    for (int i = 0; i < mr; ++i) {
      res[i][2 * half] = part[i][0];
      res[i][2 * half + 1] = part[i][1];
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode path for FP8 and one activation row: four rows decoded in registers (no scratch), the scale folded out of
// the inner loop. Each 16-column chunk's codes become code * 2^-8 (Fp8ToF32Finite) and meet the activations
// unscaled; a scale block's sum is scaled once into the total: total += (blk * 2^8) * scale (exact for E8M0 scales
// barring overflow / underflow of the block sum; one rounding per block for fp32 scales, within the tolerance of
// the reordered sum). Not for fp32 scales under bf16 activations (W must be rounded to bf16 first). Unless the
// weight is known finite (fp8_finite), a byte-wise maximum of 2 * code spots NaN codes (0xFE exactly when one
// occurs); a row holding one has its output NaN, as every product with a NaN weight is.

bool FusedFp8(ActType act, const WeightView& w, int64_t m) {
  return m == 1 && w.format == WeightFormat::kFp8E4M3 && (act == ActType::kF32 || w.scale_format == ScaleFormat::kE8M0);
}

// Bytes ahead that the fused loop prefetches on each of its four rows; past a row's end, the same offset in the row
// four rows on (the next group's; prefetches do not fault).
constexpr int64_t kPrefetchFp8 = 2048;
const char* PrefetchTarget(const uint8_t* row, int64_t at, int64_t row_bytes) {
  const int64_t t = at + kPrefetchFp8;
  return reinterpret_cast<const char*>(row + (t < row_bytes ? t : t + 3 * row_bytes));
}

template <bool kFinite>
void DotFp8Fused(const WeightView& w, const int64_t* rows, const float* x, float res[4]) {
  const int64_t kw = w.cols, scale_cols = (kw + w.block - 1) / w.block;
  const bool e8m0 = w.scale_format == ScaleFormat::kE8M0;
  const uint8_t* src[4];
  const int64_t rb0 = rows[0] / w.block;  // rows are consecutive (or repeat the last): block rb0 or the next
  int64_t scale_row[4];
  for (int q = 0; q < 4; ++q) {
    src[q] = static_cast<const uint8_t*>(w.data) + rows[q] * kw;
    scale_row[q] = (rows[q] - rb0 * w.block < w.block ? rb0 : rb0 + 1) * scale_cols;
  }
  __m256 acc[4];
  for (int q = 0; q < 4; ++q) acc[q] = _mm256_setzero_ps();
  __m128i nan_seen = _mm_setzero_si128();
  const __m256 two8 = _mm256_set1_ps(256.0f);
  for (int64_t b = 0; b < scale_cols; ++b) {
    __m256 blk[4];
    for (int q = 0; q < 4; ++q) blk[q] = _mm256_setzero_ps();
    const int64_t k1 = (b + 1) * w.block < kw ? (b + 1) * w.block : kw;
    for (int64_t k = b * w.block; k < k1; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      for (int q = 0; q < 4; ++q) {
        if ((k & 63) == 0) _mm_prefetch(PrefetchTarget(src[q], k, kw), _MM_HINT_T0);
        __m128i codes;
        if (k1 - k >= 16) {
          codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[q] + k));
        } else {
          alignas(16) uint8_t tail[16] = {};
          std::memcpy(tail, src[q] + k, static_cast<size_t>(k1 - k));
          codes = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
        }
        if constexpr (!kFinite) nan_seen = _mm_max_epu8(nan_seen, _mm_add_epi8(codes, codes));
        __m256 lo, hi;
        Fp8ToF32Finite(codes, &lo, &hi);
        blk[q] = _mm256_fmadd_ps(lo, x0, blk[q]);
        blk[q] = _mm256_fmadd_ps(hi, x1, blk[q]);
      }
    }
    for (int q = 0; q < 4; ++q) {
      const int64_t s = scale_row[q] + b;
      const float scale =
          e8m0 ? E8M0ToF32(static_cast<const uint8_t*>(w.scale)[s]) : static_cast<const float*>(w.scale)[s];
      acc[q] = _mm256_fmadd_ps(_mm256_mul_ps(blk[q], two8), _mm256_set1_ps(scale), acc[q]);
    }
  }
  for (int q = 0; q < 4; ++q) res[q] = Hsum(acc[q]);
  if constexpr (!kFinite) {
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(nan_seen, _mm_set1_epi8(static_cast<char>(0xFE)))) != 0) {
      for (int q = 0; q < 4; ++q) {
        for (int64_t k = 0; k < kw; ++k) {
          if ((src[q][k] & 0x7F) == 0x7F) {
            res[q] = __builtin_nanf("");
            break;
          }
        }
      }
    }
  }
}

void RowsFp8Fused(const float* x, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out) {
  for (int64_t r0 = n0; r0 < n1; r0 += 4) {
    int64_t rows[4];
    for (int q = 0; q < 4; ++q) rows[q] = r0 + q < n1 ? r0 + q : n1 - 1;
    float res[4];
    if (w.fp8_finite) {
      DotFp8Fused<true>(w, rows, x, res);
    } else {
      DotFp8Fused<false>(w, rows, x, res);
    }
    for (int64_t q = 0; q < 4 && r0 + q < n1; ++q) {
      const int64_t at = r0 - n0 + q;
      if (out.bf16) {
        static_cast<uint16_t*>(out.data)[at] = F32ToBf16(res[q]);
      } else {
        static_cast<float*>(out.data)[at] = res[q];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode path for FP4 and up to four activation rows: the codes are decoded in registers (no scratch write and
// read-back). Per 32-column block and weight row, one table of the eight magnitudes times the block's scale (the
// same products DecodeFp4Row stores); a code's value is VPERMPS(table, code) with the sign bit XORed in. The table
// is stored pre-XORed with (c << 28) for entry c, so that XOR with (code << 28) -- which puts the sign at bit 31 and
// the three magnitude bits on 28..30 -- both restores the entry and applies the sign: no mask is needed. Columns
// come out as [8 even, 8 odd] per 16 and are accumulated in the order DotF32Rows takes on a decoded row, so the
// results are bit-identical to the decode-to-scratch path.

bool FusedFp4(const WeightView& w, int64_t m) { return m >= 1 && m <= 4 && w.format == WeightFormat::kFp4E2M1; }

// R weight rows x MR activation rows (R * MR <= 8 accumulators).
template <int R, int MR>
void DotFp4Fused(const WeightView& w, const int64_t* rows, const float* x, int64_t xs, float res[][4]) {
  const int64_t kw = w.cols, row_bytes = kw / 2, blocks = kw / kFp4Block;
  const uint8_t* src[R];
  const uint8_t* scales[R];
  for (int q = 0; q < R; ++q) {
    src[q] = static_cast<const uint8_t*>(w.data) + rows[q] * row_bytes;
    scales[q] = static_cast<const uint8_t*>(w.scale) + rows[q] * blocks;
  }
  const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i comp = _mm256_setr_epi32(0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28);
  __m256 acc[MR][R];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < R; ++q) acc[i][q] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k = b * kFp4Block;
    for (int q = 0; q < R; ++q) {
      if ((b & 3) == 0) _mm_prefetch(PrefetchTarget(src[q], k / 2, row_bytes), _MM_HINT_T0);
      const __m256 table = _mm256_castsi256_ps(_mm256_xor_si256(
          _mm256_castps_si256(_mm256_mul_ps(magnitudes, _mm256_set1_ps(E8M0ToF32(scales[q][b])))), comp));
      for (int h = 0; h < 2; ++h) {  // 8 bytes = 16 codes: columns k + 16h .. k + 16h + 15
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src[q] + k / 2 + 8 * h)));
        const __m256i e = _mm256_srli_epi32(d, 4);
        const __m256 even = _mm256_castsi256_ps(
            _mm256_xor_si256(_mm256_castps_si256(_mm256_permutevar8x32_ps(table, d)), _mm256_slli_epi32(d, 28)));
        const __m256 odd = _mm256_castsi256_ps(
            _mm256_xor_si256(_mm256_castps_si256(_mm256_permutevar8x32_ps(table, e)), _mm256_slli_epi32(e, 28)));
        for (int i = 0; i < MR; ++i) {
          const float* xi = x + i * xs + k + 16 * h;
          acc[i][q] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xi), acc[i][q]);
          acc[i][q] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xi + 8), acc[i][q]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < R; ++q) res[i][q] = Hsum(acc[i][q]);
}

void RowsFp4Fused(const float* x, int64_t xs, int64_t m, const WeightView& w, int64_t n0, int64_t n1,
                  const MatOut& out) {
  const int64_t step = m <= 2 ? 4 : 2;
  for (int64_t r0 = n0; r0 < n1; r0 += step) {
    int64_t rows[4];
    for (int q = 0; q < 4; ++q) rows[q] = r0 + q < n1 ? r0 + q : n1 - 1;
    float res[4][4];
    switch (m) {
      case 1: DotFp4Fused<4, 1>(w, rows, x, xs, res); break;
      case 2: DotFp4Fused<4, 2>(w, rows, x, xs, res); break;
      case 3: DotFp4Fused<2, 3>(w, rows, x, xs, res); break;
      default: DotFp4Fused<2, 4>(w, rows, x, xs, res); break;
    }
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t q = 0; q < step && r0 + q < n1; ++q) {
        const int64_t at = i * out.ld + r0 - n0 + q;
        if (out.bf16) {
          static_cast<uint16_t*>(out.data)[at] = F32ToBf16(res[i][q]);
        } else {
          static_cast<float*>(out.data)[at] = res[i][q];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// LinearBlocks.

bool RowsSupported(ActType, const WeightView& w) {
  return w.format != WeightFormat::kFp8E4M3 || (w.block > 0 && w.block % 16 == 0);
}

size_t RowBytes(ActType, const WeightView& w) { return static_cast<size_t>(Pad32(w.cols)) * sizeof(float); }

void PrepareRows(ActType act, const WeightView& w, const void* x, int64_t ldx, const int64_t* index, int64_t m,
                 void* dst) {
  const int64_t kw = w.cols, kp = Pad32(kw);
  const bool even_odd = EvenOdd(act, w);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t src = index != nullptr ? index[i] : i;
    float* out = static_cast<float*>(dst) + i * kp;
    for (int64_t k = 0; k < kp; ++k) {
      float v = 0.0f;
      if (k < kw) {
        v = act == ActType::kF32 ? static_cast<const float*>(x)[src * ldx + k]
                                 : Bf16ToF32(static_cast<const uint16_t*>(x)[src * ldx + k]);
      }
      const int64_t c = k % 16;
      const int64_t at = even_odd ? k - c + (c % 2) * 8 + c / 2 : k;
      out[at] = v;
    }
  }
}

int64_t RowBlock(int64_t m) { return m <= 4 ? 4 : 64; }

size_t RowsScratch(ActType act, const WeightView& w, int64_t m) {
  if (KindOf(act, w) != RowKind::kF32Decoded || FusedFp8(act, w, m) || FusedFp4(w, m)) return 0;
  return static_cast<size_t>(RowBlock(m) * Pad32(w.cols)) * sizeof(float);
}

template <class W>
void RowsBlock(const W* base, int64_t stride, int64_t rows, int64_t kw, const float* x, int64_t xs, int64_t m,
               const MatOut& out, int64_t col0) {
  for (int64_t m0 = 0; m0 < m; m0 += 4) {
    const int mr = static_cast<int>(m - m0 < 4 ? m - m0 : 4);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const W* w[4];
      for (int q = 0; q < 4; ++q) w[q] = base + (r0 + q < rows ? r0 + q : rows - 1) * stride;
      float res[4][4];
      Dot(mr, w, kw, x + m0 * xs, xs, res);
      const int64_t cols = rows - r0 < 4 ? rows - r0 : 4;
      for (int i = 0; i < mr; ++i) {
        for (int64_t q = 0; q < cols; ++q) {
          const int64_t at = (m0 + i) * out.ld + col0 + r0 + q;
          if (out.bf16) {
            static_cast<uint16_t*>(out.data)[at] = F32ToBf16(res[i][q]);
          } else {
            static_cast<float*>(out.data)[at] = res[i][q];
          }
        }
      }
    }
  }
}

void Rows(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
          void* scratch) {
  const RowKind kind = KindOf(act, w);
  const int64_t kw = w.cols, kp = Pad32(kw), block = RowBlock(m);
  const float* x = static_cast<const float*>(xp);
  if (FusedFp8(act, w, m)) {
    RowsFp8Fused(x, w, n0, n1, out);
    return;
  }
  if (FusedFp4(w, m)) {
    RowsFp4Fused(x, kp, m, w, n0, n1, out);
    return;
  }
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t rows = n1 - b0 < block ? n1 - b0 : block;
    switch (kind) {
      case RowKind::kBf16Direct:
        RowsBlock(static_cast<const uint16_t*>(w.data) + b0 * kw, kw, rows, kw, x, kp, m, out, b0 - n0);
        break;
      case RowKind::kF32Direct:
        RowsBlock(static_cast<const float*>(w.data) + b0 * kw, kw, rows, kw, x, kp, m, out, b0 - n0);
        break;
      case RowKind::kF32Decoded:
        DecodeRows(act, w, b0, rows, kp, static_cast<float*>(scratch));
        RowsBlock(static_cast<const float*>(scratch), kp, rows, kp, x, kp, m, out, b0 - n0);
        break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Panel path (the level's tiles slot: prefill, many activation rows): the AVX512 level's panels (linear_avx512.cc)
// on 8 lanes. Activations are prepared K-major in 8-token blocks ([Kp][8] fp32, columns in order); each group of 8
// weight rows is decoded once into fp32 scratch in column order (whole rows, the values the rows path decodes: FP4
// rows put back from [8 even, 8 odd] order, bf16 rows widened) and meets every token panel of up to three blocks.
// The microkernel keeps 4 rows x 3 blocks = 12 accumulators over the whole row: each output is one FMA chain over
// the columns in order, so results do not depend on how rows or tokens are grouped, nor on the thread split.

constexpr int64_t kPanelGroup = 8;  // weight rows decoded at a time (the task unit)

int64_t PanelBlocks8(int64_t m) { return (m + 7) / 8; }

// Rows [n0, n0 + kPanelGroup) as fp32 in column order (kp columns, zero tails, zero rows past w.rows).
void DecodePanelGroup(ActType act, const WeightView& w, int64_t n0, int64_t kp, float* dst) {
  if (KindOf(act, w) == RowKind::kF32Direct) {  // fp32 weights meet fp32 activations as stored
    for (int64_t r = 0; r < kPanelGroup; ++r) {
      const bool row_live = n0 + r < w.rows;
      const float* src = row_live ? static_cast<const float*>(w.data) + (n0 + r) * w.cols : nullptr;
      for (int64_t k = 0; k < kp; k += 8) {
        _mm256_storeu_ps(dst + r * kp + k, row_live && k < w.cols ? _mm256_maskload_ps(src + k, LaneMask(w.cols - k))
                                                                  : _mm256_setzero_ps());
      }
    }
    return;
  }
  if (w.format != WeightFormat::kBf16) {
    DecodeRows(act, w, n0, kPanelGroup, kp, dst);
    if (EvenOdd(act, w)) {  // FP4: [8 even, 8 odd] per 16 columns -> column order
      for (int64_t i = 0; i < kPanelGroup * kp; i += 16) {
        const __m256 e = _mm256_loadu_ps(dst + i), o = _mm256_loadu_ps(dst + i + 8);
        const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);  // per 128-bit lane
        _mm256_storeu_ps(dst + i, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(dst + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
      }
    }
    return;
  }
  for (int64_t r = 0; r < kPanelGroup; ++r) {
    const int64_t row = n0 + r;
    float* out = dst + r * kp;
    if (row >= w.rows) {
      std::memset(out, 0, static_cast<size_t>(kp) * sizeof(float));
      continue;
    }
    const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * w.cols;
    for (int64_t c = 0; c < kp; c += 8) {
      __m128i v;
      if (w.cols - c >= 8) {
        v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
      } else {
        alignas(16) uint16_t tail[8] = {};
        for (int64_t i = 0; i < w.cols - c; ++i) tail[i] = src[c + i];
        v = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
      }
      _mm256_storeu_ps(out + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
    }
  }
}

// res[r][8 j + t] = sum over k < kp of w[r][k] * x_j[k][t] for 4 weight rows (kp floats apart) and NB token blocks
// (x_j = x + j * xs, [kp][8]).
template <int NB>
void PanelKernel(const float* w, int64_t kp, const float* x, int64_t xs, float res[4][24]) {
  __m256 acc[4][NB];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    __m256 xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = _mm256_loadu_ps(x + j * xs + k * 8);
    for (int r = 0; r < 4; ++r) {
      const __m256 b = _mm256_broadcast_ss(w + r * kp + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(b, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < NB; ++j) _mm256_storeu_ps(res[r] + 8 * j, acc[r][j]);
}

bool PanelsSupported(ActType act, const WeightView& w) { return RowsSupported(act, w); }

size_t PanelXBytes(ActType, int64_t m, int64_t kw) {
  return static_cast<size_t>(PanelBlocks8(m) * Pad32(kw) * 8) * sizeof(float);
}

// The drivers hand out 16-row blocks: two 8-token blocks each.
int64_t PanelBlocksFn(ActType, int64_t m) { return (m + 15) / 16; }

void PreparePanels(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                   int64_t block_begin, int64_t block_end, void* dst) {
  const int64_t kp = Pad32(kw);
  for (int64_t bb = 2 * block_begin; bb < 2 * block_end && bb * 8 < m; ++bb) {
    float* out = static_cast<float*>(dst) + bb * kp * 8;
    std::memset(out, 0, static_cast<size_t>(kp * 8) * sizeof(float));
    for (int64_t t = 0; t < 8 && bb * 8 + t < m; ++t) {
      const int64_t tok = bb * 8 + t, src = index != nullptr ? index[tok] : tok;
      if (act == ActType::kF32) {
        const float* in = static_cast<const float*>(x) + src * ldx;
        for (int64_t k = 0; k < kw; ++k) out[k * 8 + t] = in[k];
      } else {
        const uint16_t* in = static_cast<const uint16_t*>(x) + src * ldx;
        for (int64_t k = 0; k < kw; ++k) out[k * 8 + t] = Bf16ToF32(in[k]);
      }
    }
  }
}

size_t PanelScratch(ActType, const WeightView& w, int64_t) {
  return static_cast<size_t>(kPanelGroup * Pad32(w.cols)) * sizeof(float);
}

void Panels(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
            void* scratch) {
  const int64_t kp = Pad32(w.cols), blocks = PanelBlocks8(m), xs = kp * 8;
  const int64_t panels = (blocks + 2) / 3;  // up to three blocks each, as even as possible
  const float* x = static_cast<const float*>(xp);
  float* wdec = static_cast<float*>(scratch);
  for (int64_t g0 = n0; g0 < n1; g0 += kPanelGroup) {
    const int64_t rows = std::min(kPanelGroup, n1 - g0);
    DecodePanelGroup(act, w, g0, kp, wdec);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t q0 = blocks * p / panels, nb = blocks * (p + 1) / panels - q0;
      for (int64_t r4 = 0; r4 < rows; r4 += 4) {
        float res[4][24];
        const float* xb = x + q0 * xs;
        if (nb == 1) PanelKernel<1>(wdec + r4 * kp, kp, xb, xs, res);
        else if (nb == 2) PanelKernel<2>(wdec + r4 * kp, kp, xb, xs, res);
        else PanelKernel<3>(wdec + r4 * kp, kp, xb, xs, res);
        for (int64_t q = 0; q < 4 && r4 + q < rows; ++q) {
          for (int64_t t = 0; t < nb * 8 && q0 * 8 + t < m; ++t) {
            const int64_t at = (q0 * 8 + t) * out.ld + (g0 - n0) + r4 + q;
            if (out.bf16) {
              static_cast<uint16_t*>(out.data)[at] = F32ToBf16(res[q][t]);
            } else {
              static_cast<float*>(out.data)[at] = res[q][t];
            }
          }
        }
      }
    }
  }
}

// Rows -> panels crossover, from single-core GFLOP/s of 512 x 4096 FP4 and bf16 weights (in L2 / L3), either
// activation type: the rows path is ahead up to 12 rows (1.1-1.3x), panels lead from 16 (FP4 1.15x, bf16 even) and
// reach 1.2x (bf16) - 1.37x (FP4) at 48, 0.87 of the ymm FMA peak.
constexpr int64_t kPanelMinRowsF32 = 16, kPanelMinRowsBf16 = 16;

#include "custom_ops/kernels/moe_act_simd.inc"

}  // namespace

extern const LinearBlocks kLinearBlocks = {
    "avx2",        RowsSupported, RowBytes,     PrepareRows, RowsScratch, Rows, PanelsSupported, PanelXBytes,
    PanelBlocksFn, PreparePanels, PanelScratch, Panels,      {kPanelMinRowsF32, kPanelMinRowsBf16}, kPanelGroup,
    MoeSwiGlu,     MoeAccumulate,
};

}  // namespace avx2
}  // namespace dsv4
