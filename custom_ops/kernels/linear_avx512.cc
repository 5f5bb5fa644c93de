// AVX512 (F/BW/VL/DQ + AVX512-BF16) blocks of the Linear and MoE expert kernels (linear_blocks.h): the rows path
// for every weight format and both activation types, plus the vectorised weight decoding and activation layout
// that the AMX tiles (linear_amx.cc) use. Must match linear_ref.cc up to summation order: per output, fp32
// accumulation in 16 lanes (bf16 activations: VDPBF16PS pairs) over K in 32-column steps, then one fixed
// horizontal sum; weights decode to exactly the reference values (bf16 activations: the same values rounded to
// bf16 by VCVTNE2PS2BF16, which also flushes denormal weights to zero, as VDPBF16PS does with any denormal input).
//
// Inner loop: four weight rows against up to four activation rows (16 fp32 accumulators), K in the lanes:
//   bf16 activations   one VDPBF16PS per (weight row, activation row) per 32 columns; activations as stored.
//   fp32 activations   bf16 weight rows are widened in registers: the even columns of a 32-column chunk by a
//                      16-bit shift, the odd ones by a mask, so the activations are prepared as [16 even columns,
//                      16 odd columns] per chunk and each chunk takes two FMAs; fp32 weight rows take one FMA per
//                      16 columns against activations as stored.
// bf16 and fp32 weights are read in place. Other rows are decoded into scratch first, four at a time when there
// are at most four activation rows (the decode path: each weight byte read once, the scratch stays in L1/L2) and
// 64 at a time otherwise (decoded once, reused for every group of four activation rows):
//   FP8 E4M3  32 codes -> 32 words; (int16)(code << 8) >> 1 with bit 14 cleared is the fp16 encoding of
//             code * 2^-8 for every code including subnormals (E4M3 and fp16 subnormals line up); the NaN codes
//             are replaced by an fp16 NaN. VCVTPH2PS widens exactly, VSCALEFPS applies 2^(e - 127 + 8) for an
//             E8M0 scale byte e (exact, as the reference's multiply by a power of two) or 2^8 followed by a
//             multiply for fp32 scales (one rounding, as the reference). Needs scale blocks that are multiples
//             of 32 columns, so a 32-column chunk has one scale. The in-register decode path (DotFp8) reaches the
//             same words in fewer operations, applies the scale once per block sum where that is exact enough
//             (folding), and finds NaN codes with a separate byte test that weights known finite skip.
//   FP4 E2M1  one 32-value block per 16 bytes: the block's 16 possible bf16 values (a compile-time table per
//             scale byte: every FP4 value times every E8M0 scale is exact in bf16, denormals included), then VPERMW
//             with word indices (low nibble, high nibble) per byte yields the 32 values in column order.
// fp32 activations meet FP4 rows as bf16 (exact) and FP8 rows as fp32 (an FP8 value times a small scale can be a
// denormal that bf16 cannot hold).
// Horizontal sums, decoding and stores do not depend on how rows are grouped, so results are independent of the
// task split.
#include "custom_ops/kernels/isa_prelude.h"

#include <algorithm>

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/fp4.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"

enum class RowKind { kBf16Direct, kF32Direct, kBf16Decoded, kF32Decoded };

RowKind KindOf(ActType act, const WeightView& w) {
  if (w.format == WeightFormat::kBf16) return RowKind::kBf16Direct;
  if (act == ActType::kBf16) return RowKind::kBf16Decoded;
  if (w.format == WeightFormat::kF32) return RowKind::kF32Direct;
  // fp32 activations need the exact value: FP4 values are exact in bf16 (denormals included: at most two
  // significant bits), FP8 values (four bits, times any scale) are not always once they are denormal.
  if (w.format == WeightFormat::kFp4E2M1) return RowKind::kBf16Decoded;
  return RowKind::kF32Decoded;
}

bool Bf16Rows(RowKind kind) { return kind == RowKind::kBf16Direct || kind == RowKind::kBf16Decoded; }

// fp32 activations against bf16 rows use the [even, odd] chunk layout.
bool EvenOddLayout(ActType act, RowKind kind) { return act == ActType::kF32 && Bf16Rows(kind); }

int64_t Pad32(int64_t c) { return (c + 31) / 32 * 32; }

__mmask32 Mask32(int64_t n) {
  return n >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1u << n) - 1u);
}

__m512bh AsBh(__m512i v) { return reinterpret_cast<__m512bh>(v); }
__m512i AsSi(__m512bh v) { return reinterpret_cast<__m512i>(v); }

// Fixed-order horizontal sum (the same for every accumulator, so results do not depend on register blocking).
float Hsum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// bf16 words 0..15 / 16..31 of v widened to fp32.
__m512 WidenLo(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16)); }
__m512 WidenHi(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

// [even, odd] order of the 32 fp32 values lo (columns 0..15), hi (16..31).
void EvenOdd(__m512 lo, __m512 hi, __m512* even, __m512* odd) {
  *even = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), hi);
  *odd = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), hi);
}

// ---------------------------------------------------------------------------------------------------------------
// Weight decoding.

// 32 E4M3 codes -> code * 2^-8 as fp32, columns 0..15 in lo and 16..31 in hi (exact; NaN codes give NaN).
void Fp8ToF32(__m256i codes, __m512* lo, __m512* hi) {
  const __m512i w = _mm512_cvtepu8_epi16(codes);
  __m512i h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 1), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(w, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7F));
  h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7E00));
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// Bytes ahead of the current position that the decode loops prefetch (one prefetch per 64 bytes read): the
// hardware prefetchers alone keep too few lines in flight for one sequential stream.
constexpr int64_t kPrefetchBytes = 2048;
// The in-register decode loops read four rows at once, each prefetching this far ahead on its own row and, past the
// row's end, on the row the next group reads (PrefetchTarget). 2 KiB measured best there (weights streamed from
// DRAM, one and two cores; 512 bytes lost up to 25%, most on short rows: 512-byte FP4 / 1 KiB FP8 rows).
constexpr int64_t kPrefetchFp4 = 2048;
constexpr int64_t kPrefetchFp8 = 2048;

// What those loops prefetch: `ahead` bytes past offset `at` of a row of `row_bytes` bytes, where the loop reads four
// consecutive rows side by side. Past the row's end that is the same offset in the row four rows on (the row the
// next group reads; the next row is already being read). Prefetches do not fault, so the address may lie past the
// matrix.
const char* PrefetchTarget(const uint8_t* row, int64_t at, int64_t row_bytes, int64_t ahead) {
  const int64_t t = at + ahead;
  return reinterpret_cast<const char*>(row + (t < row_bytes ? t : t + 3 * row_bytes));
}

// 32 FP8 codes -> exact fp32 W values (columns 0..15, 16..31) for a chunk with scale vector sv (see ForFp8Row).
void ScaleFp8Chunk(__m256i codes, bool e8m0, __m512 sv, __m512* lo, __m512* hi) {
  __m512 a, b;
  Fp8ToF32(codes, &a, &b);
  if (e8m0) {
    *lo = _mm512_scalef_ps(a, sv);
    *hi = _mm512_scalef_ps(b, sv);
  } else {
    const __m512 e8 = _mm512_set1_ps(8.0f);
    *lo = _mm512_mul_ps(_mm512_scalef_ps(a, e8), sv);
    *hi = _mm512_mul_ps(_mm512_scalef_ps(b, e8), sv);
  }
}

// Position of FP8 rows in the scale grid, advanced row by row without divisions.
struct Fp8Rows {
  const WeightView& w;
  int64_t scale_cols, first_block;  // scale columns; block of column k0
  int64_t row_block, row_in_block;  // block row of the current row, its index inside the block
  Fp8Rows(const WeightView& view, int64_t row, int64_t k0)
      : w(view), scale_cols((view.cols + view.block - 1) / view.block), first_block(k0 / view.block),
        row_block(row / view.block), row_in_block(row % view.block) {}
  void Next() {
    if (++row_in_block == w.block) {
      row_in_block = 0;
      ++row_block;
    }
  }
};

// The view an Fp8Rows cursor walks: the weight itself when it is FP8, else a placeholder with a valid block size
// (the cursor is then never used). Fp8Rows keeps a reference to its view: bind the result to a named variable.
WeightView Fp8CursorView(const WeightView& w) {
  return w.format == WeightFormat::kFp8E4M3
             ? w
             : WeightView{WeightFormat::kFp8E4M3, nullptr, 0, 0, ScaleFormat::kNone, nullptr, 32};
}

// Calls emit(c, lo, hi) with the exact fp32 values of FP8 row `row` (at cursor position `pos`), columns
// k0 + c .. k0 + c + 31, for c = 0, 32, .. < kc (k0, kc multiples of 32; columns at or past w.cols read as 0).
// One scale per 32 columns: the block is a multiple of 32.
template <class Emit>
void ForFp8Row(const Fp8Rows& pos, int64_t row, int64_t k0, int64_t kc, Emit emit) {
  const WeightView& w = pos.w;
  const uint8_t* src = static_cast<const uint8_t*>(w.data) + row * w.cols;
  const int64_t scale_row = pos.row_block * pos.scale_cols;
  const bool e8m0 = w.scale_format == ScaleFormat::kE8M0;
  const int64_t end = k0 + kc, data_end = w.cols < end ? w.cols : end;
  int64_t k = k0;
  for (int64_t b = pos.first_block; k < data_end; ++b) {
    const int64_t block_end = (b + 1) * w.block < data_end ? (b + 1) * w.block : data_end;
    // E8M0 byte e: 2^(e - 127) times the 2^8 the fp16 route leaves out; fp32: 2^8, then the scale.
    const __m512 sv =
        e8m0 ? _mm512_set1_ps(static_cast<float>(static_cast<int>(static_cast<const uint8_t*>(w.scale)[scale_row + b]) - 119))
             : _mm512_set1_ps(static_cast<const float*>(w.scale)[scale_row + b]);
    __m512 lo, hi;
    for (; k + 32 <= block_end; k += 32) {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + k + kPrefetchBytes), _MM_HINT_T0);
      ScaleFp8Chunk(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)), e8m0, sv, &lo, &hi);
      emit(k - k0, lo, hi);
    }
    if (k < block_end) {  // the row's last, partial chunk
      ScaleFp8Chunk(_mm256_maskz_loadu_epi8(Mask32(block_end - k), src + k), e8m0, sv, &lo, &hi);
      emit(k - k0, lo, hi);
      k += 32;
    }
  }
  for (; k < end; k += 32) emit(k - k0, _mm512_setzero_ps(), _mm512_setzero_ps());
}

// bf16 bits of FP4 value `code` times 2^(e - 127), exact (the product has at most two significant bits, so even
// denormal results are exact; overflow gives infinity, as the fp32 product in the reference does).
constexpr uint16_t Fp4Bf16(int e, int code) {
  // magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as m * 2^p with m in {1, 1.5}
  constexpr int kP[8] = {0, -1, 0, 0, 1, 1, 2, 2};
  constexpr bool kHalf[8] = {false, false, false, true, false, true, false, true};
  const uint16_t sign = (code & 8) ? 0x8000 : 0;
  const int c = code & 7;
  if (c == 0) return sign;
  const int biased = kP[c] + e;  // bf16 exponent field of the result
  if (biased >= 255) return static_cast<uint16_t>(sign | 0x7F80);
  if (biased >= 1) return static_cast<uint16_t>(sign | (biased << 7) | (kHalf[c] ? 0x40 : 0));
  // denormal: mantissa m * 2^(biased + 6) in units of 2^-133
  const int shift = biased + 6;
  const int mant = kHalf[c] ? (3 << shift) >> 1 : (1 << shift);
  return static_cast<uint16_t>(sign | mant);
}

struct Fp4Tables {
  uint16_t value[256][16];  // [scale byte][code]
};

constexpr Fp4Tables MakeFp4Tables() {
  Fp4Tables t{};
  for (int e = 0; e < 256; ++e)
    for (int c = 0; c < 16; ++c) t.value[e][c] = Fp4Bf16(e, c);
  return t;
}

// Constant data (8 KiB, built at compile time): the 16 bf16 values of every scale byte.
constexpr Fp4Tables kFp4Tables = MakeFp4Tables();

struct Fp4F32Tables {
  uint32_t bits[256][16];  // fp32 bits of the same values
};

constexpr Fp4F32Tables MakeFp4F32Tables() {
  Fp4F32Tables t{};
  for (int e = 0; e < 256; ++e)
    for (int c = 0; c < 16; ++c) t.bits[e][c] = static_cast<uint32_t>(kFp4Tables.value[e][c]) << 16;
  return t;
}

// 16 KiB; in practice a checkpoint uses a handful of scale bytes, so few rows of it are ever touched.
constexpr Fp4F32Tables kFp4F32Tables = MakeFp4F32Tables();

// One FP4 block (16 bytes, 32 values) with E8M0 scale byte e -> its exact fp32 values, [even, odd] columns.
void Fp4BlockF32(const uint8_t* src, uint8_t e, __m512* even, __m512* odd) {
  const __m512 lut = _mm512_castsi512_ps(_mm512_loadu_si512(kFp4F32Tables.bits[e]));
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  *even = _mm512_permutexvar_ps(d, lut);  // VPERMPS reads the low 4 bits: the low nibble
  *odd = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut);
}

// One FP4 block (16 bytes, 32 values) with E8M0 scale byte e -> 32 bf16 in column order.
__m512i DecodeFp4Block(const uint8_t* src, uint8_t e) {
  const __m512i lut = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kFp4Tables.value[e])));
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  // word indices: low word = low nibble (even column), high word = high nibble (odd column); VPERMW reads 5 bits.
  const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0xF), 0xE4);
  return _mm512_permutexvar_epi16(idx, lut);
}

}  // namespace

void DecodeRowsBf16(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, uint16_t* dst,
                    int64_t ld) {
  const WeightView fp8_view = Fp8CursorView(w);
  Fp8Rows fp8(fp8_view, n0, k0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = n0 + r;
    uint16_t* out = dst + r * ld;
    if (row >= w.rows) {
      std::memset(out, 0, static_cast<size_t>(kc) * sizeof(uint16_t));
      continue;
    }
    switch (w.format) {
      case WeightFormat::kBf16: {
        const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * w.cols;
        for (int64_t c = 0; c < kc; c += 32) {
          const int64_t k = k0 + c, valid = w.cols - k;
          _mm_prefetch(reinterpret_cast<const char*>(src + k) + kPrefetchBytes, _MM_HINT_T0);
          _mm512_storeu_si512(out + c, valid >= 32 ? _mm512_loadu_si512(src + k)
                                                   : _mm512_maskz_loadu_epi16(Mask32(valid > 0 ? valid : 0), src + k));
        }
        break;
      }
      case WeightFormat::kF32: {
        const float* src = static_cast<const float*>(w.data) + row * w.cols;
        for (int64_t c = 0; c < kc; c += 32) {
          const int64_t k = k0 + c, valid = w.cols - k;
          _mm_prefetch(reinterpret_cast<const char*>(src + k) + kPrefetchBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(src + k) + kPrefetchBytes + 64, _MM_HINT_T0);
          const __m512 lo = _mm512_maskz_loadu_ps(TailMask(valid > 0 ? valid : 0), src + k);
          const __m512 hi = _mm512_maskz_loadu_ps(TailMask(valid > 16 ? valid - 16 : 0), src + k + 16);
          _mm512_storeu_si512(out + c, AsSi(_mm512_cvtne2ps_pbh(hi, lo)));
        }
        break;
      }
      case WeightFormat::kFp8E4M3:
        ForFp8Row(fp8, row, k0, kc, [&](int64_t c, __m512 lo, __m512 hi) {
          _mm512_storeu_si512(out + c, AsSi(_mm512_cvtne2ps_pbh(hi, lo)));
        });
        fp8.Next();
        break;
      case WeightFormat::kFp4E2M1: {
        // whole 32-column blocks (FP4 rows are), four per prefetched 64 source bytes
        const uint8_t* src = static_cast<const uint8_t*>(w.data) + row * (w.cols / 2) + k0 / 2;
        const uint8_t* scale = static_cast<const uint8_t*>(w.scale) + row * (w.cols / kFp4Block) + k0 / kFp4Block;
        const int64_t blocks = (w.cols - k0 < kc ? (w.cols - k0 > 0 ? w.cols - k0 : 0) : kc) / 32;
        int64_t b = 0;
        for (; b + 4 <= blocks; b += 4) {
          _mm_prefetch(reinterpret_cast<const char*>(src + b * 16) + kPrefetchBytes, _MM_HINT_T0);
          const __m512i v0 = DecodeFp4Block(src + b * 16, scale[b]);
          const __m512i v1 = DecodeFp4Block(src + b * 16 + 16, scale[b + 1]);
          const __m512i v2 = DecodeFp4Block(src + b * 16 + 32, scale[b + 2]);
          const __m512i v3 = DecodeFp4Block(src + b * 16 + 48, scale[b + 3]);
          _mm512_storeu_si512(out + b * 32, v0);
          _mm512_storeu_si512(out + b * 32 + 32, v1);
          _mm512_storeu_si512(out + b * 32 + 64, v2);
          _mm512_storeu_si512(out + b * 32 + 96, v3);
        }
        for (; b < blocks; ++b) _mm512_storeu_si512(out + b * 32, DecodeFp4Block(src + b * 16, scale[b]));
        for (int64_t c = blocks * 32; c < kc; c += 32) _mm512_storeu_si512(out + c, _mm512_setzero_si512());
        break;
      }
    }
  }
}

namespace {

// FP8 rows for fp32 activations: rows [n0, n0 + rows) as exact fp32 values, kp columns (zero tail).
void DecodeRowsF32(const WeightView& w, int64_t n0, int64_t rows, int64_t kp, float* dst) {
  Fp8Rows fp8(w, n0, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = n0 + r;
    float* out = dst + r * kp;
    if (row >= w.rows) {
      std::memset(out, 0, static_cast<size_t>(kp) * sizeof(float));
      continue;
    }
    ForFp8Row(fp8, row, 0, kp, [&](int64_t c, __m512 lo, __m512 hi) {
      _mm512_storeu_ps(out + c, lo);
      _mm512_storeu_ps(out + c + 16, hi);
    });
    fp8.Next();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Inner loops: res[i][q] = sum_k x_i[k] * w_q[k] for 4 weight rows and MR activation rows.

template <int MR>
void DotBf16(const uint16_t* const* w, int64_t kw, const uint16_t* x, int64_t xs, float res[][4]) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= kw; k += 32) {
    __m512bh a[4];
    for (int q = 0; q < 4; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(w[q] + k) + kPrefetchBytes, _MM_HINT_T0);
      a[q] = AsBh(_mm512_loadu_si512(w[q] + k));
    }
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = AsBh(_mm512_loadu_si512(x + i * xs + k));
      for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], a[q], xv);
    }
  }
  if (k < kw) {
    const __mmask32 mask = Mask32(kw - k);
    __m512bh a[4];
    for (int q = 0; q < 4; ++q) a[q] = AsBh(_mm512_maskz_loadu_epi16(mask, w[q] + k));
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = AsBh(_mm512_loadu_si512(x + i * xs + k));
      for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], a[q], xv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) res[i][q] = Hsum(acc[i][q]);
}

// fp32 activations in [even, odd] chunk layout against bf16 rows.
template <int MR>
void DotF32Bf16(const uint16_t* const* w, int64_t kw, const float* x, int64_t xs, float res[][4]) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < kw; k += 32) {
    const __mmask32 mask = Mask32(kw - k);
    __m512 we[4], wo[4];
    for (int q = 0; q < 4; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(w[q] + k) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i v = _mm512_maskz_loadu_epi16(mask, w[q] + k);
      we[q] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[q] = _mm512_castsi512_ps(_mm512_and_si512(v, odd_mask));
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 xe = _mm512_loadu_ps(x + i * xs + k), xo = _mm512_loadu_ps(x + i * xs + k + 16);
      for (int q = 0; q < 4; ++q) {
        acc[i][q] = _mm512_fmadd_ps(we[q], xe, acc[i][q]);
        acc[i][q] = _mm512_fmadd_ps(wo[q], xo, acc[i][q]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) res[i][q] = Hsum(acc[i][q]);
}

// fp32 activations against fp32 rows (both in column order).
template <int MR>
void DotF32(const float* const* w, int64_t kw, const float* x, int64_t xs, float res[][4]) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kw; k += 16) {
    const __mmask16 mask = TailMask(kw - k);
    __m512 a[4];
    for (int q = 0; q < 4; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(w[q] + k) + kPrefetchBytes, _MM_HINT_T0);
      a[q] = _mm512_maskz_loadu_ps(mask, w[q] + k);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * xs + k);
      for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_fmadd_ps(a[q], xv, acc[i][q]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) res[i][q] = Hsum(acc[i][q]);
}

template <class W, class X>
void Dot(int mr, const W* const* w, int64_t kw, const X* x, int64_t xs, float res[][4]) {
  if constexpr (sizeof(W) == 2 && sizeof(X) == 2) {
    switch (mr) {
      case 1: DotBf16<1>(w, kw, x, xs, res); break;
      case 2: DotBf16<2>(w, kw, x, xs, res); break;
      case 3: DotBf16<3>(w, kw, x, xs, res); break;
      default: DotBf16<4>(w, kw, x, xs, res); break;
    }
  } else if constexpr (sizeof(W) == 2) {
    switch (mr) {
      case 1: DotF32Bf16<1>(w, kw, x, xs, res); break;
      case 2: DotF32Bf16<2>(w, kw, x, xs, res); break;
      case 3: DotF32Bf16<3>(w, kw, x, xs, res); break;
      default: DotF32Bf16<4>(w, kw, x, xs, res); break;
    }
  } else {
    switch (mr) {
      case 1: DotF32<1>(w, kw, x, xs, res); break;
      case 2: DotF32<2>(w, kw, x, xs, res); break;
      case 3: DotF32<3>(w, kw, x, xs, res); break;
      default: DotF32<4>(w, kw, x, xs, res); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// LinearBlocks: rows path.

bool RowsSupported(ActType, const WeightView& w) {
  return w.format != WeightFormat::kFp8E4M3 || (w.block > 0 && w.block % 32 == 0);
}

size_t RowBytes(ActType act, const WeightView& w) {
  return static_cast<size_t>(Pad32(w.cols)) * (act == ActType::kF32 ? sizeof(float) : sizeof(uint16_t));
}

void PrepareRows(ActType act, const WeightView& w, const void* x, int64_t ldx, const int64_t* index, int64_t m,
                 void* dst) {
  const int64_t kw = w.cols, kp = Pad32(kw);
  const bool even_odd = EvenOddLayout(act, KindOf(act, w));
  for (int64_t i = 0; i < m; ++i) {
    const int64_t src = index != nullptr ? index[i] : i;
    if (act == ActType::kBf16) {
      const uint16_t* in = static_cast<const uint16_t*>(x) + src * ldx;
      uint16_t* out = static_cast<uint16_t*>(dst) + i * kp;
      std::memcpy(out, in, static_cast<size_t>(kw) * sizeof(uint16_t));
      std::memset(out + kw, 0, static_cast<size_t>(kp - kw) * sizeof(uint16_t));
      continue;
    }
    const float* in = static_cast<const float*>(x) + src * ldx;
    float* out = static_cast<float*>(dst) + i * kp;
    if (!even_odd) {
      std::memcpy(out, in, static_cast<size_t>(kw) * sizeof(float));
      std::memset(out + kw, 0, static_cast<size_t>(kp - kw) * sizeof(float));
      continue;
    }
    for (int64_t k = 0; k < kp; k += 32) {
      const int64_t valid = kw - k;
      const __m512 a = _mm512_maskz_loadu_ps(TailMask(valid > 0 ? valid : 0), in + k);
      const __m512 b = _mm512_maskz_loadu_ps(TailMask(valid > 16 ? valid - 16 : 0), in + k + 16);
      __m512 even, odd;
      EvenOdd(a, b, &even, &odd);
      _mm512_storeu_ps(out + k, even);
      _mm512_storeu_ps(out + k + 16, odd);
    }
  }
}

// Weight rows decoded per block: 4 for the decode path, 64 when several groups of activation rows reuse them.
int64_t RowBlock(int64_t m) { return m <= 16 ? 4 : 64; }

bool FusedDecode(const WeightView& w, int64_t m);

size_t RowsScratch(ActType act, const WeightView& w, int64_t m) {
  const RowKind kind = KindOf(act, w);
  if (kind == RowKind::kBf16Direct || kind == RowKind::kF32Direct || FusedDecode(w, m)) return 0;
  const size_t elem = kind == RowKind::kF32Decoded ? sizeof(float) : sizeof(uint16_t);
  return static_cast<size_t>(RowBlock(m) * Pad32(w.cols)) * elem;
}

void StoreResults(const MatOut& out, int64_t m0, int64_t mr, int64_t col0, int64_t cols, const float res[][4]) {
  for (int64_t i = 0; i < mr; ++i) {
    for (int64_t q = 0; q < cols; ++q) {
      const int64_t at = (m0 + i) * out.ld + col0 + q;
      if (out.bf16) {
        static_cast<uint16_t*>(out.data)[at] = F32ToBf16(res[i][q]);
      } else {
        static_cast<float*>(out.data)[at] = res[i][q];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode path (at most four activation rows): FP8 / FP4 rows decoded in registers inside the inner loop, four
// weight rows at a time, with the same per-accumulator operation sequence as the loops above.

// Four FP4 rows; column chunk c (32 values) of row q.
struct Fp4Rows {
  const uint8_t* src[4];
  const uint8_t* scale[4];
  int64_t row_bytes;
  // natural-order bf16
  __m512i Bf16(int q, int64_t c) const { return DecodeFp4Block(src[q] + c * 16, scale[q][c]); }
  // [even, odd] columns as exact fp32
  void F32(int q, int64_t c, __m512* even, __m512* odd) const { Fp4BlockF32(src[q] + c * 16, scale[q][c], even, odd); }
};

template <int MR>
void DotFp4Bf16(const Fp4Rows& w, int64_t kw, const uint16_t* x, int64_t xs, float res[][4]) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < kw / 32; ++c) {
    __m512bh a[4];
    for (int q = 0; q < 4; ++q) {
      if ((c & 3) == 0) _mm_prefetch(PrefetchTarget(w.src[q], c * 16, w.row_bytes, kPrefetchFp4), _MM_HINT_T0);
      a[q] = AsBh(w.Bf16(q, c));
    }
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = AsBh(_mm512_loadu_si512(x + i * xs + c * 32));
      for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], a[q], xv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) res[i][q] = Hsum(acc[i][q]);
}

// fp32 activations in [even, odd] layout; same sequence as DotF32Bf16 (even FMA, then odd FMA, per chunk).
template <int MR>
void DotFp4F32(const Fp4Rows& w, int64_t kw, const float* x, int64_t xs, float res[][4]) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < kw / 32; ++c) {
    __m512 we[4], wo[4];
    for (int q = 0; q < 4; ++q) {
      if ((c & 3) == 0) _mm_prefetch(PrefetchTarget(w.src[q], c * 16, w.row_bytes, kPrefetchFp4), _MM_HINT_T0);
      w.F32(q, c, &we[q], &wo[q]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 xe = _mm512_loadu_ps(x + i * xs + c * 32), xo = _mm512_loadu_ps(x + i * xs + c * 32 + 16);
      for (int q = 0; q < 4; ++q) {
        acc[i][q] = _mm512_fmadd_ps(we[q], xe, acc[i][q]);
        acc[i][q] = _mm512_fmadd_ps(wo[q], xo, acc[i][q]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) res[i][q] = Hsum(acc[i][q]);
}

// E8M0 byte e -> e - 127 + 8 as a float: the VSCALEFPS exponent that turns code * 2^-8 into code * 2^(e - 127).
struct ScalefExponents {
  float e[256];
};
constexpr ScalefExponents MakeScalefExponents() {
  ScalefExponents t{};
  for (int e = 0; e < 256; ++e) t.e[e] = static_cast<float>(e - 119);
  return t;
}
constexpr ScalefExponents kScalefExponent = MakeScalefExponents();

// 32 E4M3 codes -> the fp16 bits of code * 2^-8 (see Fp8ToF32) in three operations: sign-extend the bytes to
// words, shift left by 7 (sign to bit 15, exponent and mantissa to bits 13..7) and clear bit 14 (a copy of the
// sign). A NaN code comes out as +-1.875 (a finite value): callers either know there is none (fp8_finite) or test
// for them separately (Fp8NanBytes).
__m512i Fp8ToF16Bits(__m256i codes) {
  return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), 7),
                          _mm512_set1_epi16(static_cast<short>(0xBFFF)));
}

// Running NaN-code detector for the decode loop: the per-byte maximum of 2 * code (mod 256) reaches 0xFE exactly
// when some code has all seven low bits set (0x7F, 0xFF).
__m256i Fp8NanBytes(__m256i seen, __m256i codes) { return _mm256_max_epu8(seen, _mm256_add_epi8(codes, codes)); }
bool Fp8SawNan(__m256i seen) {
  return _mm256_movemask_epi8(_mm256_cmpeq_epi8(seen, _mm256_set1_epi8(static_cast<char>(0xFE)))) != 0;
}
bool Fp8RowHasNan(const uint8_t* row, int64_t cols) {
  for (int64_t k = 0; k < cols; ++k)
    if ((row[k] & 0x7F) == 0x7F) return true;
  return false;
}

// R FP8 rows (scale blocks are multiples of 32 columns: the loop runs over blocks, then 32-column chunks).
// Codes become fp16 bits of code * 2^-8 (Fp8ToF16Bits) and fp32 by VCVTPH2PS. Then either
//   kFold   the block's products are accumulated unscaled and the block sum is scaled once into the total:
//           E8M0: total += blk * 2^(e - 127 + 8) by VSCALEFPS (exact, as scaling each product would be, barring
//           overflow / underflow of the block sum itself); fp32 scales (fp32 activations only): total +=
//           (blk * 2^8) * scale, one rounding per block instead of one per weight (within the tolerance of the
//           reordered sum);
//   else    each chunk is scaled to the exact W values (as ScaleFp8Chunk) before the products.
// bf16 activations need W rounded to bf16: values are converted by VCVTNE2PS2BF16 and meet VDPBF16PS; folding is
// exact there only for E8M0 scales (code * 2^-8 is exact in bf16), so fp32 scales take the unfolded route.
// Unless the weight is known finite, the codes also feed a NaN detector; a row holding a NaN code has all its
// outputs NaN (every product with a NaN weight is NaN), which the end of the row applies.
template <int MR, bool kBf16Act, bool kFold, bool kFinite>
void DotFp8(const WeightView& w, const int64_t* rows, const void* xv, int64_t xs, float res[][4]) {
  const int64_t kw = w.cols, scale_cols = (kw + w.block - 1) / w.block;
  const bool e8m0 = w.scale_format == ScaleFormat::kE8M0;
  const uint8_t* src[4];
  int64_t scale_row[4];
  // rows[0] <= rows[q] < rows[0] + 4 <= rows[0] + block: row block rb0 or the next (one division per group)
  const int64_t rb0 = rows[0] / w.block;
  for (int q = 0; q < 4; ++q) {
    src[q] = static_cast<const uint8_t*>(w.data) + rows[q] * kw;
    scale_row[q] = (rows[q] - rb0 * w.block < w.block ? rb0 : rb0 + 1) * scale_cols;
  }
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
  __m256i nan_seen = _mm256_setzero_si256();
  const __m512 e8 = _mm512_set1_ps(8.0f);
  for (int64_t b = 0; b < scale_cols; ++b) {
    // E8M0 byte e: the exponent e - 127 + 8 for VSCALEFPS (the 2^8 the fp16 route leaves out); fp32: the scale.
    __m512 sv[4];
    for (int q = 0; q < 4; ++q) {  // broadcasts from memory (no conversion in the loop)
      sv[q] = e8m0 ? _mm512_set1_ps(kScalefExponent.e[static_cast<const uint8_t*>(w.scale)[scale_row[q] + b]])
                   : _mm512_set1_ps(static_cast<const float*>(w.scale)[scale_row[q] + b]);
    }
    __m512 blk[MR][4];
    if constexpr (kFold) {
      for (int i = 0; i < MR; ++i)
        for (int q = 0; q < 4; ++q) blk[i][q] = _mm512_setzero_ps();
    }
    __m512(&sum)[MR][4] = *(kFold ? &blk : &acc);  // where the chunk products go
    const int64_t k1 = (b + 1) * w.block < kw ? (b + 1) * w.block : kw;
    for (int64_t k = b * w.block; k < k1; k += 32) {
      const int64_t valid = k1 - k;
      __m512 lo[4], hi[4];
      for (int q = 0; q < 4; ++q) {
        if ((k & 63) == 0) _mm_prefetch(PrefetchTarget(src[q], k, kw, kPrefetchFp8), _MM_HINT_T0);
        const __m256i codes = valid >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[q] + k))
                                          : _mm256_maskz_loadu_epi8(Mask32(valid), src[q] + k);
        if constexpr (!kFinite) nan_seen = Fp8NanBytes(nan_seen, codes);
        const __m512i h = Fp8ToF16Bits(codes);
        lo[q] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        hi[q] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        if constexpr (!kFold) {
          if (e8m0) {
            lo[q] = _mm512_scalef_ps(lo[q], sv[q]);
            hi[q] = _mm512_scalef_ps(hi[q], sv[q]);
          } else {
            lo[q] = _mm512_mul_ps(_mm512_scalef_ps(lo[q], e8), sv[q]);
            hi[q] = _mm512_mul_ps(_mm512_scalef_ps(hi[q], e8), sv[q]);
          }
        }
      }
      if constexpr (kBf16Act) {
        const uint16_t* x = static_cast<const uint16_t*>(xv);
        __m512bh a[4];
        for (int q = 0; q < 4; ++q) a[q] = _mm512_cvtne2ps_pbh(hi[q], lo[q]);
        for (int i = 0; i < MR; ++i) {
          const __m512bh xb = AsBh(_mm512_loadu_si512(x + i * xs + k));
          for (int q = 0; q < 4; ++q) sum[i][q] = _mm512_dpbf16_ps(sum[i][q], a[q], xb);
        }
      } else {
        const float* x = static_cast<const float*>(xv);
        for (int i = 0; i < MR; ++i) {
          const __m512 x0 = _mm512_loadu_ps(x + i * xs + k), x1 = _mm512_loadu_ps(x + i * xs + k + 16);
          for (int q = 0; q < 4; ++q) {
            sum[i][q] = _mm512_fmadd_ps(lo[q], x0, sum[i][q]);
            sum[i][q] = _mm512_fmadd_ps(hi[q], x1, sum[i][q]);
          }
        }
      }
    }
    if constexpr (kFold) {
      for (int i = 0; i < MR; ++i) {
        for (int q = 0; q < 4; ++q) {
          acc[i][q] = e8m0 ? _mm512_add_ps(acc[i][q], _mm512_scalef_ps(blk[i][q], sv[q]))
                           : _mm512_fmadd_ps(_mm512_scalef_ps(blk[i][q], e8), sv[q], acc[i][q]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) res[i][q] = Hsum(acc[i][q]);
  if constexpr (!kFinite) {
    if (Fp8SawNan(nan_seen)) {
      for (int q = 0; q < 4; ++q) {
        if (!Fp8RowHasNan(src[q], kw)) continue;
        for (int i = 0; i < MR; ++i) res[i][q] = __builtin_nanf("");
      }
    }
  }
}

template <int MR, bool kBf16Act, bool kFold>
void DotFp8Finite(const WeightView& w, const int64_t* rows, const void* x, int64_t xs, float res[][4]) {
  if (w.fp8_finite) {
    DotFp8<MR, kBf16Act, kFold, true>(w, rows, x, xs, res);
  } else {
    DotFp8<MR, kBf16Act, kFold, false>(w, rows, x, xs, res);
  }
}

// Four FP8 rows against MR activation rows. Folded (fp32 activations, or E8M0 scales) for up to two activation rows,
// where the block and total accumulators fit the registers; three or four rows scale each chunk instead (measured
// faster than folding two weight rows at a time).
template <int MR, bool kBf16Act>
void DotFp8Rows(const WeightView& w, const int64_t* rows, const void* x, int64_t xs, float res[][4]) {
  if (MR <= 2 && (!kBf16Act || w.scale_format == ScaleFormat::kE8M0)) {
    DotFp8Finite<MR, kBf16Act, MR <= 2>(w, rows, x, xs, res);
  } else {
    DotFp8Finite<MR, kBf16Act, false>(w, rows, x, xs, res);
  }
}

template <int MR>
void DotFused(ActType act, const WeightView& w, const int64_t* rows, const void* x, int64_t xs, float res[][4]) {
  if (w.format == WeightFormat::kFp4E2M1) {
    Fp4Rows src;
    src.row_bytes = w.cols / 2;
    for (int q = 0; q < 4; ++q) {
      src.src[q] = static_cast<const uint8_t*>(w.data) + rows[q] * (w.cols / 2);
      src.scale[q] = static_cast<const uint8_t*>(w.scale) + rows[q] * (w.cols / kFp4Block);
    }
    if (act == ActType::kBf16) {
      DotFp4Bf16<MR>(src, w.cols, static_cast<const uint16_t*>(x), xs, res);
    } else {
      DotFp4F32<MR>(src, w.cols, static_cast<const float*>(x), xs, res);
    }
  } else if (act == ActType::kBf16) {
    DotFp8Rows<MR, true>(w, rows, x, xs, res);
  } else {
    DotFp8Rows<MR, false>(w, rows, x, xs, res);
  }
}

// True when rows() decodes in registers (the decode path of FP8 / FP4 weights).
bool FusedDecode(const WeightView& w, int64_t m) {
  return m <= 4 && (w.format == WeightFormat::kFp4E2M1 || w.format == WeightFormat::kFp8E4M3);
}

void RowsFused(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out) {
  const int64_t kp = Pad32(w.cols);
  const int mr = static_cast<int>(m);
  for (int64_t r0 = n0; r0 < n1; r0 += 4) {
    int64_t rows[4];
    for (int q = 0; q < 4; ++q) rows[q] = r0 + q < n1 ? r0 + q : n1 - 1;
    float res[4][4];
    switch (mr) {
      case 1: DotFused<1>(act, w, rows, xp, kp, res); break;
      case 2: DotFused<2>(act, w, rows, xp, kp, res); break;
      case 3: DotFused<3>(act, w, rows, xp, kp, res); break;
      default: DotFused<4>(act, w, rows, xp, kp, res); break;
    }
    StoreResults(out, 0, m, r0 - n0, n1 - r0 < 4 ? n1 - r0 : 4, res);
  }
}

template <class W, class X>
void RowsBlock(const W* base, int64_t stride, int64_t rows, int64_t kw, const X* x, int64_t xs, int64_t m,
               const MatOut& out, int64_t col0) {
  for (int64_t m0 = 0; m0 < m; m0 += 4) {
    const int mr = static_cast<int>(m - m0 < 4 ? m - m0 : 4);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const W* w[4];
      for (int q = 0; q < 4; ++q) w[q] = base + (r0 + q < rows ? r0 + q : rows - 1) * stride;
      float res[4][4];
      Dot(mr, w, kw, x + m0 * xs, xs, res);
      StoreResults(out, m0, mr, col0 + r0, rows - r0 < 4 ? rows - r0 : 4, res);
    }
  }
}

void Rows(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
          void* scratch) {
  if (FusedDecode(w, m)) {
    RowsFused(act, xp, m, w, n0, n1, out);
    return;
  }
  const RowKind kind = KindOf(act, w);
  const int64_t kw = w.cols, kp = Pad32(kw), block = RowBlock(m);
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t rows = n1 - b0 < block ? n1 - b0 : block;
    const int64_t col0 = b0 - n0;
    switch (kind) {
      case RowKind::kBf16Direct:
      case RowKind::kBf16Decoded: {
        const uint16_t* base;
        int64_t stride;
        if (kind == RowKind::kBf16Direct) {
          base = static_cast<const uint16_t*>(w.data) + b0 * kw;
          stride = kw;
        } else {
          DecodeRowsBf16(w, b0, rows, 0, kp, static_cast<uint16_t*>(scratch), kp);
          base = static_cast<const uint16_t*>(scratch);
          stride = kp;
        }
        if (act == ActType::kBf16) {
          RowsBlock(base, stride, rows, kw, static_cast<const uint16_t*>(xp), kp, m, out, col0);
        } else {
          RowsBlock(base, stride, rows, kw, static_cast<const float*>(xp), kp, m, out, col0);
        }
        break;
      }
      case RowKind::kF32Direct:
        RowsBlock(static_cast<const float*>(w.data) + b0 * kw, kw, rows, kw, static_cast<const float*>(xp), kp, m,
                  out, col0);
        break;
      case RowKind::kF32Decoded:
        DecodeRowsF32(w, b0, rows, kp, static_cast<float*>(scratch));
        RowsBlock(static_cast<const float*>(scratch), kp, rows, kw, static_cast<const float*>(xp), kp, m, out, col0);
        break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Tile activation layout (portable::PrepareTileBlocks is the specification).

// x (32 fp32 in lo, hi) = hi + mid + lo as three bf16 vectors (SplitBf16x3 semantics).
void Split3(__m512 x0, __m512 x1, __m512i parts[3]) {
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  const __mmask16 f0 = _mm512_cmp_ps_mask(_mm512_abs_ps(x0), inf, _CMP_LT_OQ);
  const __mmask16 f1 = _mm512_cmp_ps_mask(_mm512_abs_ps(x1), inf, _CMP_LT_OQ);
  const __m512i h = AsSi(_mm512_cvtne2ps_pbh(x1, x0));
  const __m512 r0 = _mm512_maskz_sub_ps(f0, x0, WidenLo(h)), r1 = _mm512_maskz_sub_ps(f1, x1, WidenHi(h));
  const __m512i m = AsSi(_mm512_cvtne2ps_pbh(r1, r0));
  const __m512 s0 = _mm512_sub_ps(r0, WidenLo(m)), s1 = _mm512_sub_ps(r1, WidenHi(m));
  parts[0] = h;
  parts[1] = m;
  parts[2] = AsSi(_mm512_cvtne2ps_pbh(s1, s0));
}

}  // namespace

void PrepareTileBlocks(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                       int64_t block_begin, int64_t block_end, void* dst) {
  const TileLayout l = TileLayoutOf(act, m);
  const int64_t steps = Pad32(kw) / 32;
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t b = block_begin; b < block_end; ++b) {
    // tile row vl of this block: activation row and (folded) part
    const void* row[16];
    int part_of[16];
    int rows = 0;
    for (int vl = 0; vl < 16 && b * 16 + vl < l.rows; ++vl, ++rows) {
      const int64_t v = b * 16 + vl, t = l.folded ? v % m : v, src = index != nullptr ? index[t] : t;
      part_of[vl] = l.folded ? static_cast<int>(v / m) : 0;
      row[vl] = act == ActType::kF32 ? static_cast<const void*>(static_cast<const float*>(x) + src * ldx)
                                     : static_cast<const void*>(static_cast<const uint16_t*>(x) + src * ldx);
    }
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k = s * 32, valid = kw - k;
      __m512i r[3][16];
      for (int vl = 0; vl < 16; ++vl) {
        if (vl >= rows) {
          for (int64_t p = 0; p < l.parts; ++p) r[p][vl] = _mm512_setzero_si512();
          continue;
        }
        if (act == ActType::kBf16) {
          r[0][vl] = _mm512_maskz_loadu_epi16(Mask32(valid), static_cast<const uint16_t*>(row[vl]) + k);
        } else {
          const float* in = static_cast<const float*>(row[vl]) + k;
          const __m512 lo = _mm512_maskz_loadu_ps(TailMask(valid), in);
          const __m512 hi = _mm512_maskz_loadu_ps(TailMask(valid > 16 ? valid - 16 : 0), in + 16);
          __m512i p3[3];
          Split3(lo, hi, p3);
          if (l.folded) {
            r[0][vl] = p3[part_of[vl]];
          } else {
            for (int p = 0; p < 3; ++p) r[p][vl] = p3[p];
          }
        }
      }
      for (int64_t p = 0; p < l.parts; ++p) {
        Transpose16(r[p]);
        uint16_t* tile = out + ((p * l.blocks + b) * steps + s) * 512;
        for (int q = 0; q < 16; ++q) _mm512_storeu_si512(tile + q * 32, r[p][q]);
      }
    }
  }
}

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Panel path (this level's tiles slot: prefill, many activation rows), tokens in the lanes.
//
// The rows path keeps K in the lanes, so every FMA needs a weight vector and an activation vector, and at 4 x 4
// register blocking with the operands in L2 it stays well under the FMA peak. Here the activations are prepared
// K-major, 16 tokens per block, and weights are broadcast:
//   fp32 act     blocks of [Kp][16] fp32, the columns of each 32-column chunk in [even, odd] order; the weight rows
//                decoded per kPanelRows x kPanelK block into fp32 scratch in the same order, exact (FP4 / bf16 come
//                out in that order directly: the nibble split, the shift / mask widening; FP8 and fp32 rows are
//                permuted into it). One FMA per (row, token block, column).
//   bf16 act     the AMX tile layout of one part ([pair][16 tokens][2] bf16, PrepareTileBlocks); weight rows
//                decoded to bf16 in column order (DecodeRowsBf16: rounded as linear.h specifies), so a 32-bit
//                broadcast is a column pair and one VDPBF16PS covers two columns.
//   microkernel  8 weight rows x 1-3 token blocks or 6 rows x 4 blocks = up to 24 accumulators; per column
//                (pair), up to four activation loads, eight or six weight broadcasts and 24 FMAs / dot products,
//                operands from L1 / L2. bf16 weights against bf16 activations are broadcast in place.
// Each output is one fixed chain over the columns (kept in a per-task accumulator between column blocks), so
// results do not depend on how tokens, rows or columns are blocked, nor on the thread split. Tokens past m are
// zeros in the prepared blocks; their lanes are computed and dropped.

constexpr int64_t kPanelRows = 48;   // weight rows decoded per block (groups of 8 and of 6)
constexpr int64_t kPanelK = 512;     // columns decoded per block (48 x 512 fp32 = 96 KiB, in L2)
constexpr int64_t kPanelLd = kPanelK + 16;  // decoded fp32 row stride (floats): rows 2 KiB apart would share L1 sets
constexpr int64_t kPanelLdBf16 = kPanelK + 32;  // decoded bf16 row stride (elements)
constexpr int64_t kPanelXBytes = 768 << 10;  // activation columns per pass (fp32: 24 token blocks, bf16: 48)

int64_t PanelBlocks(int64_t m) { return (m + 15) / 16; }

// 32 bf16 words -> their fp32 values, [even, odd].
void WidenEvenOdd(__m512i v, float* dst) {
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  _mm512_storeu_ps(dst + 16, _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
}

// fp32 activations: weight rows [n0, n0 + rows) x columns [k0, k0 + kc) (multiples of 32) -> their exact fp32
// values in [even, odd] order, rows of dst kPanelLd floats apart; rows past w.rows and columns past w.cols are zeros.
void DecodePanelRows(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, float* dst) {
  const WeightView fp8_view = Fp8CursorView(w);
  Fp8Rows fp8(fp8_view, n0, k0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = n0 + r;
    float* out = dst + r * kPanelLd;
    if (row >= w.rows) {
      std::memset(out, 0, static_cast<size_t>(kc) * sizeof(float));
      continue;
    }
    switch (w.format) {
      case WeightFormat::kFp4E2M1: {  // whole 32-column blocks
        const uint8_t* src = static_cast<const uint8_t*>(w.data) + row * (w.cols / 2) + k0 / 2;
        const uint8_t* scale = static_cast<const uint8_t*>(w.scale) + row * (w.cols / kFp4Block) + k0 / kFp4Block;
        const int64_t blocks = std::min(kc, std::max<int64_t>(0, w.cols - k0)) / 32;
        for (int64_t b = 0; b < blocks; ++b) {
          if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + b * 16) + kPrefetchBytes, _MM_HINT_T0);
          __m512 even, odd;
          Fp4BlockF32(src + b * 16, scale[b], &even, &odd);
          _mm512_storeu_ps(out + b * 32, even);
          _mm512_storeu_ps(out + b * 32 + 16, odd);
        }
        std::memset(out + blocks * 32, 0, static_cast<size_t>(kc - blocks * 32) * sizeof(float));
        break;
      }
      case WeightFormat::kBf16: {
        const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * w.cols;
        for (int64_t c = 0; c < kc; c += 32) {
          const int64_t k = k0 + c, valid = w.cols - k;
          _mm_prefetch(reinterpret_cast<const char*>(src + k) + kPrefetchBytes, _MM_HINT_T0);
          WidenEvenOdd(valid >= 32 ? _mm512_loadu_si512(src + k)
                                   : _mm512_maskz_loadu_epi16(Mask32(valid > 0 ? valid : 0), src + k),
                       out + c);
        }
        break;
      }
      case WeightFormat::kFp8E4M3:
        ForFp8Row(fp8, row, k0, kc, [&](int64_t c, __m512 lo, __m512 hi) {
          __m512 even, odd;
          EvenOdd(lo, hi, &even, &odd);
          _mm512_storeu_ps(out + c, even);
          _mm512_storeu_ps(out + c + 16, odd);
        });
        fp8.Next();
        break;
      case WeightFormat::kF32: {
        const float* src = static_cast<const float*>(w.data) + row * w.cols;
        for (int64_t c = 0; c < kc; c += 32) {
          const int64_t k = k0 + c, valid = w.cols - k;
          const __m512 lo = _mm512_maskz_loadu_ps(TailMask(valid > 0 ? valid : 0), src + k);
          const __m512 hi = _mm512_maskz_loadu_ps(TailMask(valid > 16 ? valid - 16 : 0), src + k + 16);
          __m512 even, odd;
          EvenOdd(lo, hi, &even, &odd);
          _mm512_storeu_ps(out + c, even);
          _mm512_storeu_ps(out + c + 16, odd);
        }
        break;
      }
    }
  }
}

// fp32 activations: c[r][16 j ..] (+)= sum over k < kc of w[r][k] * x_j[k] for 8 weight rows (kPanelLd floats
// apart) and NB token blocks (x_j = x + j * xs, [kc][16] fp32); c rows are ldc floats apart.
template <int NB, int NR>
void PanelKernelF32(const float* w, const float* x, int64_t xs, int64_t kc, float* c, int64_t ldc, bool first) {
  __m512 acc[NR][NB];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + j * 16);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = _mm512_loadu_ps(x + j * xs + k * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * kPanelLd + k]);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(b, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(c + r * ldc + j * 16, acc[r][j]);
}

// bf16 activations: the same with column pairs: w rows (ldw elements apart) are bf16 in column order, so
// one 32-bit broadcast is a (w[2p], w[2p + 1]) pair; x_j = x + j * xs is the tile layout of one 16-token block
// ([pair][16 tokens][2]); kc / 2 VDPBF16PS steps.
template <int NB, int NR>
void PanelKernelBf16(const uint16_t* w, int64_t ldw, const uint16_t* x, int64_t xs, int64_t kc, float* c,
                     int64_t ldc, bool first) {
  __m512 acc[NR][NB];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + j * 16);
  for (int64_t q = 0; q < kc / 2; ++q) {
    __m512bh xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = AsBh(_mm512_loadu_si512(x + j * xs + q * 32));
    for (int r = 0; r < NR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, w + r * ldw + 2 * q, sizeof pair);
      const __m512bh b = AsBh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b, xv[j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(c + r * ldc + j * 16, acc[r][j]);
}

// Rows per microkernel call for a panel of nb token blocks: 8 x up to 3, 6 x 4 (24 accumulators either way).
int64_t PanelGroupRows(int64_t nb) { return nb == 4 ? 6 : 8; }

// Prefetches the source bytes of weight rows [n0, n0 + rows) x columns [k0, k0 + kc), the next block
// the panels decode. A block's rows are short pieces of long rows (1 KiB of a bf16 row for 512 columns), which
// neither the decode loops' run-ahead nor the hardware prefetchers cover: issued one block ahead, the loads
// overlap the current block's arithmetic instead of stalling the decode at DRAM latency.
void PrefetchPanelRows(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc) {
  const int64_t end = std::min(w.cols, k0 + kc);
  if (end <= k0) return;
  // bytes per column, as a shift of a doubled count (FP4: half a byte)
  const int64_t twice = w.format == WeightFormat::kF32 ? 8 : w.format == WeightFormat::kBf16 ? 4
                        : w.format == WeightFormat::kFp8E4M3 ? 2 : 1;
  const int64_t row_bytes = w.cols * twice / 2, lo = k0 * twice / 2, hi = end * twice / 2;
  for (int64_t r = n0; r < std::min(w.rows, n0 + rows); ++r) {  // rows <= 0: nothing
    const char* row = static_cast<const char*>(w.data) + r * row_bytes;
    for (int64_t b = lo & ~int64_t{63}; b < hi; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    if (w.format == WeightFormat::kFp4E2M1) {
      _mm_prefetch(static_cast<const char*>(w.scale) + r * (w.cols / kFp4Block) + k0 / kFp4Block, _MM_HINT_T0);
    }
  }
}

bool PanelsSupported(ActType act, const WeightView& w) { return RowsSupported(act, w); }

// fp32: PanelBlocks(m) blocks of [Kp][16] fp32; bf16: the tile layout (TileXBytes, one part).
size_t PanelXBytes(ActType act, int64_t m, int64_t kw) {
  if (act == ActType::kBf16) return TileXBytes(act, m, kw);
  return static_cast<size_t>(PanelBlocks(m) * Pad32(kw) * 16) * sizeof(float);
}

int64_t PanelBlocksFn(ActType, int64_t m) { return PanelBlocks(m); }

void PreparePanels(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                   int64_t block_begin, int64_t block_end, void* dst) {
  if (act == ActType::kBf16) {  // TileLayoutOf(kBf16, m) has the same 16-token blocks
    PrepareTileBlocks(act, x, ldx, index, m, kw, block_begin, block_end, dst);
    return;
  }
  const int64_t kp = Pad32(kw);
  for (int64_t b = block_begin; b < block_end; ++b) {
    const float* row[16];
    int rows = 0;
    for (; rows < 16 && b * 16 + rows < m; ++rows) {
      const int64_t t = b * 16 + rows;
      row[rows] = static_cast<const float*>(x) + (index != nullptr ? index[t] : t) * ldx;
    }
    float* out = static_cast<float*>(dst) + b * kp * 16;
    for (int64_t k = 0; k < kp; k += 32) {
      const int64_t valid = kw - k;
      __m512i even[16], odd[16];  // token i's [even, odd] columns of this chunk; transposed below
      for (int i = 0; i < 16; ++i) {
        if (i >= rows) {
          even[i] = odd[i] = _mm512_setzero_si512();
          continue;
        }
        const __m512 lo = _mm512_maskz_loadu_ps(TailMask(valid), row[i] + k);
        const __m512 hi = _mm512_maskz_loadu_ps(TailMask(valid > 16 ? valid - 16 : 0), row[i] + k + 16);
        __m512 e, o;
        EvenOdd(lo, hi, &e, &o);
        even[i] = _mm512_castps_si512(e);
        odd[i] = _mm512_castps_si512(o);
      }
      Transpose16(even);
      Transpose16(odd);
      for (int q = 0; q < 16; ++q) {
        _mm512_storeu_si512(out + (k + q) * 16, even[q]);
        _mm512_storeu_si512(out + (k + 16 + q) * 16, odd[q]);
      }
    }
  }
}

// Decoded weight block (the fp32 one is the larger) + accumulators for kPanelRows rows x every token.
size_t PanelScratch(ActType, const WeightView&, int64_t m) {
  return static_cast<size_t>(kPanelRows * kPanelLd + kPanelRows * PanelBlocks(m) * 16) * sizeof(float);
}

// out[t][col0 + r] = acc[r][t] for tokens [t0, t1) and rows [0, rows), fp32 or rounded to bf16 (nearest even, NaN
// kept, as F32ToBf16), 16 x 16 at a time through a register transpose. acc holds kPanelRows rows of ldc floats.
void StorePanelOutputs(const float* acc, int64_t ldc, int64_t t0, int64_t t1, int64_t rows, const MatOut& out,
                       int64_t col0) {
  for (int64_t t = t0; t < t1; t += 16) {
    for (int64_t r = 0; r < rows; r += 16) {
      __m512i v[16];
      for (int q = 0; q < 16; ++q) v[q] = _mm512_loadu_si512(acc + (r + q) * ldc + t);
      Transpose16(v);  // v[q] = token t + q, rows r .. r + 15
      const __mmask16 mask = TailMask(rows - r);
      for (int q = 0; q < 16 && t + q < t1; ++q) {
        const int64_t at = (t + q) * out.ld + col0 + r;
        if (out.bf16) {
          const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(VRoundBf16(_mm512_castsi512_ps(v[q]))), 16);
          _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.data) + at, mask, _mm512_cvtepi32_epi16(bits));
        } else {
          _mm512_mask_storeu_ps(static_cast<float*>(out.data) + at, mask, _mm512_castsi512_ps(v[q]));
        }
      }
    }
  }
}

void Panels(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
            void* scratch) {
  const bool bf16 = act == ActType::kBf16;
  const int64_t kp = Pad32(w.cols), blocks = PanelBlocks(m), ldc = blocks * 16;
  const int64_t xs = kp * 16;  // elements per token block, either layout
  float* wdec = static_cast<float*>(scratch);
  uint16_t* wdec16 = static_cast<uint16_t*>(scratch);
  float* acc = wdec + kPanelRows * kPanelLd;
  // Token blocks per pass over the weight rows: their kPanelK columns of activations (at most kPanelXBytes) stay in
  // L2 while every weight block meets them; more tokens take more passes, each decoding the weights again.
  const int64_t max_pass_blocks = kPanelXBytes / (kPanelK * 16 * (bf16 ? 2 : 4));
  const int64_t passes = (blocks + max_pass_blocks - 1) / max_pass_blocks;
  for (int64_t pass = 0; pass < passes; ++pass) {  // passes of equal size (64 blocks -> 32 + 32, not 48 + 16)
    const int64_t s0 = blocks * pass / passes, s1 = blocks * (pass + 1) / passes, sb = s1 - s0;
    // Token panels of up to four blocks, as even as possible (5 blocks -> 2 + 3, not 4 + 1).
    const int64_t panels = (sb + 3) / 4;
    for (int64_t b0 = n0; b0 < n1; b0 += kPanelRows) {
      const int64_t rows = std::min(kPanelRows, n1 - b0);
      const int64_t grouped = (rows + 23) / 24 * 24;  // zero rows pad the last group of 6 or 8
      // bf16 weights meet bf16 activations as stored when every row of every group and every column of every
      // 32-column step is the matrix's own (a copy into scratch measured ~10% of the time at M = 256).
      const bool inplace = bf16 && w.format == WeightFormat::kBf16 && grouped == rows && w.cols % 32 == 0;
      if (b0 == n0) PrefetchPanelRows(w, b0, rows, 0, kPanelK);
      for (int64_t k0 = 0; k0 < kp; k0 += kPanelK) {
        const int64_t kc = std::min(kPanelK, kp - k0);
        // The next block (none past the last: the next pass starts with a demand-loaded block), prefetched a few
        // rows per microkernel call below, so that the requests trickle out instead of overflowing the miss queue.
        int64_t next_b = -1, next_k = 0;
        if (k0 + kPanelK < kp) {
          next_b = b0;
          next_k = k0 + kPanelK;
        } else if (b0 + kPanelRows < n1) {
          next_b = b0 + kPanelRows;
        }
        if (inplace) {  // bf16 weights against bf16 activations: read in place, nothing to decode
        } else if (bf16) {
          DecodeRowsBf16(w, b0, rows, k0, kc, wdec16, kPanelLdBf16);  // rounded to bf16, as linear.h specifies
          for (int64_t r = rows; r < grouped; ++r)
            std::memset(wdec16 + r * kPanelLdBf16, 0, static_cast<size_t>(kc) * sizeof(uint16_t));
        } else {
          DecodePanelRows(w, b0, rows, k0, kc, wdec);
          for (int64_t r = rows; r < grouped; ++r)
            std::memset(wdec + r * kPanelLd, 0, static_cast<size_t>(kc) * sizeof(float));
        }
        int64_t calls = 0;
        for (int64_t p = 0; p < panels; ++p) {
          const int64_t nr = PanelGroupRows(s0 + sb * (p + 1) / panels - (s0 + sb * p / panels));
          calls += (rows + nr - 1) / nr;
        }
        int64_t call = 0;
        for (int64_t p = 0; p < panels; ++p) {
          const int64_t q0 = s0 + sb * p / panels, nb = s0 + sb * (p + 1) / panels - q0, nr = PanelGroupRows(nb);
          for (int64_t r = 0; r < rows; r += nr, ++call) {
            if (next_b >= 0) {
              const int64_t p0 = kPanelRows * call / calls, p1 = kPanelRows * (call + 1) / calls;
              PrefetchPanelRows(w, next_b + p0, std::min(p1, n1 - next_b) - p0, next_k, kPanelK);
            }
            float* c = acc + r * ldc + q0 * 16;
            const bool first = k0 == 0;
            if (bf16) {
              const uint16_t* wr = inplace ? static_cast<const uint16_t*>(w.data) + (b0 + r) * w.cols + k0
                                           : wdec16 + r * kPanelLdBf16;
              const int64_t ldw = inplace ? w.cols : kPanelLdBf16;
              const uint16_t* xb = static_cast<const uint16_t*>(xp) + q0 * xs + k0 * 16;
              if (nb == 1) PanelKernelBf16<1, 8>(wr, ldw, xb, xs, kc, c, ldc, first);
              else if (nb == 2) PanelKernelBf16<2, 8>(wr, ldw, xb, xs, kc, c, ldc, first);
              else if (nb == 3) PanelKernelBf16<3, 8>(wr, ldw, xb, xs, kc, c, ldc, first);
              else PanelKernelBf16<4, 6>(wr, ldw, xb, xs, kc, c, ldc, first);
            } else {
              const float* wr = wdec + r * kPanelLd;
              const float* xb = static_cast<const float*>(xp) + q0 * xs + k0 * 16;
              if (nb == 1) PanelKernelF32<1, 8>(wr, xb, xs, kc, c, ldc, first);
              else if (nb == 2) PanelKernelF32<2, 8>(wr, xb, xs, kc, c, ldc, first);
              else if (nb == 3) PanelKernelF32<3, 8>(wr, xb, xs, kc, c, ldc, first);
              else PanelKernelF32<4, 6>(wr, xb, xs, kc, c, ldc, first);
            }
          }
        }
      }
      StorePanelOutputs(acc, ldc, s0 * 16, std::min(m, s1 * 16), rows, out, b0 - n0);
    }
  }
}

// Rows -> panels crossover, from single-core GFLOP/s of 512 x 4096 FP4 and bf16 weights (in L2 / L3) at M = 5 ... 96
// on an AVX512-BF16 CPU without AMX: fp32 activations, panels 0.6x the rows path at M = 8, even at 12, 1.2x at 16
// (one full token block), 1.6x from 32; bf16 activations, rows 1.05x ahead at 16, panels 1.2x at 24 and 1.6x
// from 32 (a single VDPBF16PS block wastes more of each broadcast).
constexpr int64_t kPanelMinRowsF32 = 16, kPanelMinRowsBf16 = 24;

#include "custom_ops/kernels/moe_act_simd.inc"

}  // namespace

void MoeSwiGluRow(ActType act, float* g, const float* u, int64_t n, float limit, float scale, void* dst) {
  MoeSwiGlu(act, g, u, n, limit, scale, dst);
}
void MoeAccumulateRow(ActType act, const float* src, int64_t n, float* dst) { MoeAccumulate(act, src, n, dst); }

extern const LinearBlocks kLinearBlocks = {
    "avx512",      RowsSupported, RowBytes,     PrepareRows, RowsScratch, Rows, PanelsSupported, PanelXBytes,
    PanelBlocksFn, PreparePanels, PanelScratch, Panels,      {kPanelMinRowsF32, kPanelMinRowsBf16}, kPanelRows,
    MoeSwiGluRow,  MoeAccumulateRow,
};

}  // namespace avx512
}  // namespace dsv4
