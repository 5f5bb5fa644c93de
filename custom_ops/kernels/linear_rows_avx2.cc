// AVX2 rows path (linear_avx2.cc has the level's overview): LinearBlocks::rows, K in the lanes, all in fp32, and
// the decoding of weight rows into fp32 scratch (DecodeRows, shared with the panels). FP8 against one activation
// row and FP4 against up to four go to the in-register decode paths (linear_fused_avx2.cc).
//
// Inner loop: two or four weight rows against up to four activation rows, K in the lanes, one FMA per 8 columns:
//   bf16 weight rows (read in place) are widened in registers, the even columns of a 16-column chunk by a shift and
//   the odd ones by a mask, so the activations are prepared as [8 even, 8 odd] per chunk;
//   fp32 rows (fp32 weights in place, everything else decoded four or 64 rows at a time into scratch) against
//   activations in the same column order as the decoded row.
// Decoding: FP8 E4M3 through the fp16 encoding of code * 2^-8 (exact for every code, NaN codes replaced) and
// VCVTPH2PS, times 2^8, times the scale (one rounding, as the reference; for one activation row decoded in registers
// instead, with the scale applied per block sum: DotFp8Fused, linear_fused_avx2.cc); FP4 E2M1 through an 8-entry
// magnitude table times the block's scale (VPERMPS on the low 3 bits) and the sign bit, written as [8 even, 8 odd]
// columns per 16, the layout the activations then follow.
#include "custom_ops/kernels/isa_prelude.h"

#include <type_traits>

#include "custom_ops/kernels/linear_avx2_internal.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"
#include "custom_ops/kernels/linear_common_avx2.inc"

// Whether decoded values must be rounded to bf16 (bf16 activations and a format not exact in bf16).
bool RoundDecoded(ActType act, const WeightView& w) {
  return act == ActType::kBf16 &&
         (w.format == WeightFormat::kF32 || (w.format == WeightFormat::kFp8E4M3 && w.scale_format == ScaleFormat::kF32));
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

}  // namespace

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

namespace {

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

int64_t RowBlock(int64_t m) { return m <= 4 ? 4 : 64; }

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

}  // namespace

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

size_t RowsScratch(ActType act, const WeightView& w, int64_t m) {
  if (KindOf(act, w) != RowKind::kF32Decoded || FusedFp8(act, w, m) || FusedFp4(w, m)) return 0;
  return static_cast<size_t>(RowBlock(m) * Pad32(w.cols)) * sizeof(float);
}

void Rows(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
          void* scratch) {
  const RowKind kind = KindOf(act, w);
  const int64_t kw = w.cols, kp = Pad32(kw), block = RowBlock(m);
  const float* x = static_cast<const float*>(xp);
  if (FusedFp8(act, w, m)) {
    RowsFp8Fused(x, kp, m, w, n0, n1, out);
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

}  // namespace avx2
}  // namespace dsv4
