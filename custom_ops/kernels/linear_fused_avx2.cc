// AVX2 decode paths (linear_avx2.cc has the level's overview): FP8 weights against one activation row and FP4
// weights against up to four, decoded in registers inside the inner loop (no scratch write and read-back), four
// weight rows at a time; the rows path (linear_rows_avx2.cc) hands these cases over.
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_avx2_internal.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"
#include "custom_ops/kernels/linear_common_avx2.inc"

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Decode path for FP8 and one activation row (under batch invariance, each of up to WeightView::invariant_rows
// rows in turn): four rows decoded in registers (no scratch), the scale folded out of the inner loop. Each
// 16-column chunk's codes become code * 2^-8 (Fp8ToF32Finite) and meet the activations unscaled; a scale block's
// sum is scaled once into the total: total += (blk * 2^8) * scale (exact for E8M0 scales barring overflow /
// underflow of the block sum; one rounding per block for fp32 scales, within the tolerance of the reordered sum). Not for fp32 scales under bf16 activations (W must be rounded to bf16 first). Unless the
// weight is known finite (fp8_finite), a byte-wise maximum of 2 * code spots NaN codes (0xFE exactly when one
// occurs); a row holding one has its output NaN, as every product with a NaN weight is.

bool FusedFp8(ActType act, const WeightView& w, int64_t m) {
  return (m == 1 || m <= w.invariant_rows) && w.format == WeightFormat::kFp8E4M3 &&
         (act == ActType::kF32 || w.scale_format == ScaleFormat::kE8M0);
}

namespace {

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
  DSV4_UNROLL for (int q = 0; q < 4; ++q) acc[q] = _mm256_setzero_ps();
  __m128i nan_seen = _mm_setzero_si128();
  const __m256 two8 = _mm256_set1_ps(256.0f);
  for (int64_t b = 0; b < scale_cols; ++b) {
    __m256 blk[4];
    DSV4_UNROLL for (int q = 0; q < 4; ++q) blk[q] = _mm256_setzero_ps();
    const int64_t k1 = (b + 1) * w.block < kw ? (b + 1) * w.block : kw;
    for (int64_t k = b * w.block; k < k1; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      DSV4_UNROLL for (int q = 0; q < 4; ++q) {
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
    DSV4_UNROLL for (int q = 0; q < 4; ++q) {
      const int64_t s = scale_row[q] + b;
      const float scale =
          e8m0 ? E8M0ToF32(static_cast<const uint8_t*>(w.scale)[s]) : static_cast<const float*>(w.scale)[s];
      acc[q] = _mm256_fmadd_ps(_mm256_mul_ps(blk[q], two8), _mm256_set1_ps(scale), acc[q]);
    }
  }
  DSV4_UNROLL for (int q = 0; q < 4; ++q) res[q] = Hsum(acc[q]);
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

}  // namespace

void RowsFp8Fused(const float* x, int64_t xs, int64_t m, const WeightView& w, int64_t n0, int64_t n1,
                  const MatOut& out) {
  for (int64_t r0 = n0; r0 < n1; r0 += 4) {
    int64_t rows[4];
    for (int q = 0; q < 4; ++q) rows[q] = r0 + q < n1 ? r0 + q : n1 - 1;
    for (int64_t i = 0; i < m; ++i) {  // each activation row on its own: the four weight rows stay in L1 / L2
      float res[4];
      if (w.fp8_finite) {
        DotFp8Fused<true>(w, rows, x + i * xs, res);
      } else {
        DotFp8Fused<false>(w, rows, x + i * xs, res);
      }
      for (int64_t q = 0; q < 4 && r0 + q < n1; ++q) {
        const int64_t at = i * out.ld + r0 - n0 + q;
        if (out.bf16) {
          static_cast<uint16_t*>(out.data)[at] = F32ToBf16(res[q]);
        } else {
          static_cast<float*>(out.data)[at] = res[q];
        }
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

namespace {

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
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < R; ++q) acc[i][q] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k = b * kFp4Block;
    DSV4_UNROLL for (int q = 0; q < R; ++q) {
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
        DSV4_UNROLL for (int i = 0; i < MR; ++i) {
          const float* xi = x + i * xs + k + 16 * h;
          acc[i][q] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xi), acc[i][q]);
          acc[i][q] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xi + 8), acc[i][q]);
        }
      }
    }
  }
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < R; ++q) res[i][q] = Hsum(acc[i][q]);
}

}  // namespace

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

}  // namespace avx2
}  // namespace dsv4
