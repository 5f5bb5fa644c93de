// AVX512 decode path (linear_avx512.cc has the level's overview): the rows path's FP8 / FP4 weights against at most
// four activation rows (FusedDecode), decoded in registers inside the inner loop (RowsFused), four weight rows at a
// time, with the same per-accumulator operation sequence as the scratch-decoded loops of linear_rows_avx512.cc (FP4
// rows up to sixteen activation rows, in groups of four: Fp4Groups).
// Each weight byte is read once and nothing is written back: FP8 moves half and FP4 a quarter of the bytes of bf16.
// FP8 rows with E8M0 scales against bf16 activations go this way for more activation rows too (batch invariance,
// up to eight rows, or up to sixteen when their scales go into the exponent: ScaledBf16); there the four weight rows
// are decoded once into a small scratch that every group of four activation rows reads (FusedScratch,
// DecodeFp8Bf16Rows), with the in-register loop's accumulator sequence.
#include <type_traits>

#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_avx512_internal.h"
#include "custom_ops/numerics/fp4.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"
#include "custom_ops/kernels/linear_common_avx512.inc"

// The in-register decode loops read four rows at once, each prefetching this far ahead on its own row and, past the
// row's end, on the row the next group reads (PrefetchTarget). 2 KiB measured best there (weights streamed from
// DRAM, one and two cores; 512 bytes lost up to 25%, most on short rows: 512-byte FP4 / 1 KiB FP8 rows).
constexpr int64_t kPrefetchFp4 = 2048;
constexpr int64_t kPrefetchFp8 = 2048;

// FP8 rows read side by side (DotFp8Quads, DotFp8), where the plan leaves rows to the hardware prefetchers (AMD Zen
// 4), prefetch 8 KiB ahead into L2 instead (T1). One core streaming FP8 rows from DRAM through the quad route's
// decode (standalone, 512 MiB): no prefetch 17.7-17.8 GB/s, T0 1-16 KiB ahead 8.7-11.5 (worse than none), T1 4 / 8 /
// 16 KiB 15.6-17.2 / 20.0-22.7 / 21.1-22.7, against 26-27 GB/s for a plain read; a single core's loads alone keep
// too few lines in flight for this loop's rate. Bf16 products side by side, two cores, in-process A/B, us: Flash
// wo_b 4096 x 8192 M = 1 1330-1438 -> 1173-1216, 1024 x 4096 M = 2 200-232 -> 157-207, 2048 x 2048 M = 4 258-274 ->
// 185-203; M = 8 and one weight row at a time (no software prefetch there) unchanged, as are fp32 rows on the fp16
// route (M = 3 / 4, decode-bound). FP4 rows (always side by side) take it too: LinearFp4 M = 1 fp32 4096 x 4096 436
// -> 359 us, 2048 x 1024 85 -> 73, bf16 4096 x 4096 436 -> 306; M = 2 515 -> 446; M = 4 unchanged; MoeExpertsFp4 of a
// bench-preset decode step (one token / four) 1183 -> 1049 / 4808 -> 4038 us, Flash shapes 4498 -> 4263. On the plan
// that prefetches (an Intel Xeon) they keep kPrefetchFp8 / kPrefetchFp4 into L1.
constexpr int64_t kPrefetchFp8Far = 8192;

// What those loops prefetch: `ahead` bytes past offset `at` of a row of `row_bytes` bytes, where the loop reads four
// consecutive rows side by side. Past the row's end that is the same offset in the row four rows on (the row the
// next group reads; the next row is already being read). Prefetches do not fault, so the address may lie past the
// matrix.
const char* PrefetchTarget(const uint8_t* row, int64_t at, int64_t row_bytes, int64_t ahead, int64_t side = 4) {
  const int64_t t = at + ahead;
  return reinterpret_cast<const char*>(row + (t < row_bytes ? t : t + (side - 1) * row_bytes));
}

// The decode loops' prefetch of one row read side by side with side - 1 others: kPrefetchFp8Far ahead into L2 where
// far (the plan's weight prefetch off), else `near` ahead into L1.
inline __attribute__((always_inline)) void PrefetchRow(const uint8_t* row, int64_t at, int64_t row_bytes, int64_t near,
                                                       int64_t side, bool far) {
  if (far) {
    _mm_prefetch(PrefetchTarget(row, at, row_bytes, kPrefetchFp8Far, side), _MM_HINT_T1);
  } else {
    _mm_prefetch(PrefetchTarget(row, at, row_bytes, near, side), _MM_HINT_T0);
  }
}

// Four FP4 rows; column chunk c (32 values) of row q.
struct Fp4Rows {
  const uint8_t* src[4];
  const uint8_t* scale[4];
  int64_t row_bytes;
  bool far = false;  // prefetch kPrefetchFp8Far into L2 (the plan's weight prefetch off) instead of kPrefetchFp4
  // natural-order bf16
  __m512i Bf16(int q, int64_t c) const { return DecodeFp4Block(src[q] + c * 16, scale[q][c]); }
  // [even, odd] columns as exact fp32
  void F32(int q, int64_t c, __m512* even, __m512* odd) const { Fp4BlockF32(src[q] + c * 16, scale[q][c], even, odd); }
};

template <int MR>
void DotFp4Bf16(const Fp4Rows& w, int64_t kw, const uint16_t* x, int64_t xs, float res[][4]) {
  __m512 acc[MR][4];
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < kw / 32; ++c) {
    __m512bh a[4];
    DSV4_UNROLL for (int q = 0; q < 4; ++q) {
      if ((c & 3) == 0) PrefetchRow(w.src[q], c * 16, w.row_bytes, kPrefetchFp4, 4, w.far);
      a[q] = AsBh(w.Bf16(q, c));
    }
    DSV4_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512bh xv = AsBh(_mm512_loadu_si512(x + i * xs + c * 32));
      DSV4_UNROLL for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], a[q], xv);
    }
  }
  StoreSums<MR, 4>(acc, res, 0);
}

// fp32 activations in [even, odd] layout; same sequence as DotF32Bf16 (even FMA, then odd FMA, per chunk).
template <int MR>
void DotFp4F32(const Fp4Rows& w, int64_t kw, const float* x, int64_t xs, float res[][4]) {
  __m512 acc[MR][4];
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < kw / 32; ++c) {
    __m512 we[4], wo[4];
    DSV4_UNROLL for (int q = 0; q < 4; ++q) {
      if ((c & 3) == 0) PrefetchRow(w.src[q], c * 16, w.row_bytes, kPrefetchFp4, 4, w.far);
      w.F32(q, c, &we[q], &wo[q]);
    }
    DSV4_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 xe = _mm512_loadu_ps(x + i * xs + c * 32), xo = _mm512_loadu_ps(x + i * xs + c * 32 + 16);
      DSV4_UNROLL for (int q = 0; q < 4; ++q) {
        acc[i][q] = _mm512_fmadd_ps(we[q], xe, acc[i][q]);
        acc[i][q] = _mm512_fmadd_ps(wo[q], xo, acc[i][q]);
      }
    }
  }
  StoreSums<MR, 4>(acc, res, 0);
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

// 64 E4M3 codes as 16 dwords of four -> four vectors of code * 2^-120 as fp32, v[j] lane l holding code 4l + j
// (the quad route: DotFp8Quads). Exact: exponent and mantissa land at fp32's bits 26..20 and the sign at 31 once
// bits 30..27 are cleared; E4M3 subnormals land on fp32 subnormals. Word-wise arithmetic shifts by 4 place each
// word's high code there in its own word (t: codes 4l + 3 and 4l + 1, u: after a word shift by 8, 4l + 2 and 4l),
// a dword shift by 16 moves the low words up, and one AND per vector keeps the code's bits: nine operations per 64
// codes, none crossing 128-bit lanes. The sign-extension route this replaced (VPMOVSXBD per 16 codes, then a shift
// and an AND) and the fp16 route (VPMOVSXBW, VCVTPH2PS) cross lanes, which on AMD Zen 4 limits them to about half
// the rate: one core, codes in L1, four accumulators, TSC cycles per 64 codes 14.0-15.1 (sign extension), 9.9-10.6
// (fp16), 5.9-6.2 (this). NaN codes come out finite; the activations carry the other 2^112 (QuadActivations).
inline __attribute__((always_inline)) void Fp8QuadsToF32Scaled(__m512i d, __m512* v0, __m512* v1, __m512* v2,
                                                                __m512* v3) {
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
  const __m512i t = _mm512_srai_epi16(d, 4), u = _mm512_srai_epi16(_mm512_slli_epi16(d, 8), 4);
  *v0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(u, 16), keep));
  *v1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(t, 16), keep));
  *v2 = _mm512_castsi512_ps(_mm512_and_si512(u, keep));
  *v3 = _mm512_castsi512_ps(_mm512_and_si512(t, keep));
}

// 32 E4M3 codes -> their exact values as bf16 (no 2^-8 factor: bf16 has the exponent range): the sign-extended
// word shifted left by 4 puts the exponent and mantissa at bf16's bits 10..4, the bias goes from 7 to 127 by adding
// 120 << 7, and the sign is bit 15 of the sign-extended word. Subnormal codes (exponent field 0: mantissa * 2^-9,
// and 0) would get an implicit 1 that way; they come from a table instead (VPERMW reads the low 5 bits of the word,
// which are the mantissa there). Six operations, no lane-crossing conversion: on AMD Zen 4 the fp16 route (two
// VCVTPH2PS, then VCVTNE2PS2BF16 for bf16 products) was the decode loop's limit. NaN codes come out finite, as
// with Fp8ToF16Bits.
struct Fp8Bf16Subnormals {
  uint16_t bits[32];
};
constexpr Fp8Bf16Subnormals MakeFp8Bf16Subnormals() {
  Fp8Bf16Subnormals t{};
  // m * 2^-9 for m = 1..7: the leading bit of m sets the exponent, the bits below it the mantissa
  for (int m = 1; m < 8; ++m) {
    int top = m >= 4 ? 2 : m >= 2 ? 1 : 0;
    const int frac = (m - (1 << top)) << (7 - top);  // mantissa bits below the leading one, at bf16's 7 bits
    t.bits[m] = static_cast<uint16_t>(((127 - 9 + top) << 7) | frac);
  }
  return t;
}
constexpr Fp8Bf16Subnormals kFp8Bf16Subnormals = MakeFp8Bf16Subnormals();

// Fp8ToBf16 with the exponent bias and the subnormal table of a block (Fp8Bf16Block): the same operations.
__m512i Fp8ToBf16With(__m256i codes, __m512i bias, __m512i subnormals) {
  const __m512i w = _mm512_cvtepi8_epi16(codes);
  __m512i v = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07F0)), bias);
  const __mmask32 sub = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x0078));
  v = _mm512_mask_permutexvar_epi16(v, sub, w, subnormals);
  return _mm512_ternarylogic_epi32(v, w, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);  // v | (w & sign)
}

__m512i Fp8ToBf16(__m256i codes) {
  return Fp8ToBf16With(codes, _mm512_set1_epi16(120 << 7), _mm512_loadu_si512(kFp8Bf16Subnormals.bits));
}

// Scaled decoding (ScaledBf16): the codes of a block with E8M0 scale byte e become the bf16 bits of
// code * 2^(e - 127) by the same operations as Fp8ToBf16, with e - 127 added to the exponent: to the bias for normal
// codes and to the table entries of the subnormal ones (entry 0, the zero code, stays 0). Exact for e in
// [kFp8ScaledMinE, kFp8ScaledMaxE] (linear.h): every nonzero code then lands on a normal bf16 (exponent field
// 1..254), the value the reference's bf16 rounding of code * scale gives.
struct Fp8Bf16Block {
  __m512i bias, subnormals;
  explicit Fp8Bf16Block(int e) {
    const __m512i shift = _mm512_set1_epi16(static_cast<short>((e - 127) * 128));  // e - 127 at the exponent field
    bias = _mm512_set1_epi16(static_cast<short>((e - 7) * 128));  // (120 + e - 127) at the exponent field
    const __m512i base = _mm512_loadu_si512(kFp8Bf16Subnormals.bits);
    subnormals = _mm512_mask_add_epi16(base, 0xFE, base, shift);
  }
};

// Running NaN-code detector for the decode loop: the per-byte maximum of 2 * code (mod 256) reaches 0xFE exactly
// when some code has all seven low bits set (0x7F, 0xFF).
__m256i Fp8NanBytes(__m256i seen, __m256i codes) { return _mm256_max_epu8(seen, _mm256_add_epi8(codes, codes)); }
bool Fp8SawNan(__m256i seen) {
  return _mm256_movemask_epi8(_mm256_cmpeq_epi8(seen, _mm256_set1_epi8(static_cast<char>(0xFE)))) != 0;
}
// The same for 64 codes at a time (the quad route).
__m512i Fp8NanBytes(__m512i seen, __m512i codes) { return _mm512_max_epu8(seen, _mm512_add_epi8(codes, codes)); }
bool Fp8SawNan(__m512i seen) { return _mm512_cmpeq_epi8_mask(seen, _mm512_set1_epi8(static_cast<char>(0xFE))) != 0; }
bool Fp8RowHasNan(const uint8_t* row, int64_t cols) {
  for (int64_t k = 0; k < cols; ++k)
    if ((row[k] & 0x7F) == 0x7F) return true;
  return false;
}

// The NQ FP8 rows a decode loop reads side by side (DotFp8, DotFp8Quads): each row's codes and the start of its row
// of scale blocks. rows[0] <= rows[q] < rows[0] + NQ <= rows[0] + block: row block rb0 or the next (one division per
// group).
struct Fp8Group {
  const uint8_t* src[4];
  int64_t scale_row[4];
  Fp8Group(const WeightView& w, const int64_t* rows, int nq, int64_t scale_cols) {
    const int64_t rb0 = rows[0] / w.block;
    for (int q = 0; q < nq; ++q) {
      src[q] = static_cast<const uint8_t*>(w.data) + rows[q] * w.cols;
      scale_row[q] = (rows[q] - rb0 * w.block < w.block ? rb0 : rb0 + 1) * scale_cols;
    }
  }
  uint8_t ScaleByte(const WeightView& w, int q, int64_t b) const {
    return static_cast<const uint8_t*>(w.scale)[scale_row[q] + b];
  }
  // Row q's scale for block b, broadcast: E8M0 as the VSCALEFPS exponent e - 127 + 8 - e8m0_less, fp32 as it is.
  __m512 Scale(const WeightView& w, int q, int64_t b, float e8m0_less) const {
    return w.scale_format == ScaleFormat::kE8M0
               ? _mm512_set1_ps(kScalefExponent.e[ScaleByte(w, q, b)] - e8m0_less)
               : _mm512_set1_ps(static_cast<const float*>(w.scale)[scale_row[q] + b]);
  }
  // A NaN code seen (nan): every output of a row holding one is NaN (any product with a NaN weight is).
  template <int MR, int NQ>
  void MarkNanRows(bool nan, int64_t cols, float res[][4], int q0) const {
    if (!nan) return;
    for (int q = 0; q < NQ; ++q) {
      if (!Fp8RowHasNan(src[q], cols)) continue;
      for (int i = 0; i < MR; ++i) res[i][q0 + q] = __builtin_nanf("");
    }
  }
};

// R FP8 rows (scale blocks are multiples of 32 columns: the loop runs over blocks, then 32-column chunks).
// Codes become fp16 bits of code * 2^-8 (Fp8ToF16Bits) and fp32 by VCVTPH2PS (folded fp32 products where the
// activations allow take the quad route instead: DotFp8Quads). Then either
//   kFold   the block's products are accumulated unscaled and the block sum is scaled once into the total
//           (with kScaledBf16, bf16 products of ScaledBf16 weights: no block sums, the codes carry the scale in
//           their exponent, Fp8Bf16Block, and the products go straight into the total):
//           E8M0: total += blk * 2^(e - 127 + 8) by VSCALEFPS (exact, as scaling each product would be, barring
//           overflow / underflow of the block sum itself); fp32 scales (fp32 activations only): total +=
//           (blk * 2^8) * scale, one rounding per block instead of one per weight (within the tolerance of the
//           reordered sum);
//   else    each chunk is scaled to the exact W values (as ScaleFp8Chunk) before the products.
// bf16 activations need W rounded to bf16: values are converted by VCVTNE2PS2BF16 and meet VDPBF16PS; folding is
// exact there only for E8M0 scales (code * 2^-8 is exact in bf16), so fp32 scales take the unfolded route.
// Unless the weight is known finite, the codes also feed a NaN detector; a row holding a NaN code has all its
// outputs NaN (every product with a NaN weight is NaN), which the end of the row applies.
// NQ weight rows side by side (4, or 1 for one row at a time: see DotFp8Rows); results go to res[i][q0 + q]. Each
// accumulator's operation sequence does not depend on NQ, so neither do the results.
template <int MR, int NQ, bool kBf16Act, bool kFold, bool kFinite, bool kScaledBf16 = false>
void DotFp8(const WeightView& w, const int64_t* rows, const void* xv, int64_t xs, float res[][4], int q0) {
  static_assert(!kScaledBf16 || (kFold && kBf16Act), "scaled decoding: the direct bf16 route only");
  const int64_t kw = w.cols, scale_cols = (kw + w.block - 1) / w.block;
  const bool e8m0 = w.scale_format == ScaleFormat::kE8M0;
  const Fp8Group g(w, rows, NQ, scale_cols);
  __m512 acc[MR][4];
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) acc[i][q] = _mm512_setzero_ps();
  __m256i nan_seen = _mm256_setzero_si256();
  const __m512 e8 = _mm512_set1_ps(8.0f);
  const bool far = !w.prefetch;  // the plan's prefetch off (AMD Zen 4): far into L2, see kPrefetchFp8Far
  // bf16 products folded (E8M0 scales only, FoldsFp8): the codes go to bf16 directly (Fp8ToBf16), exact values,
  // so the block sum is scaled by 2^(e - 127)
  constexpr bool kDirectBf16 = kBf16Act && kFold;
  // kScaledBf16 (ScaledBf16): the codes go to bf16 with the block's scale in their exponent (Fp8Bf16Block), and
  // the products meet the total directly: no block sums.
  constexpr bool kBlockSums = kFold && !kScaledBf16;
  for (int64_t b = 0; b < scale_cols; ++b) {
    // E8M0 byte e: the exponent e - 127 + 8 for VSCALEFPS (the 2^8 the fp16 route leaves out; e - 127 on the direct
    // bf16 route); fp32: the scale.
    __m512 sv[4];
    // broadcasts from memory (no conversion in the loop)
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) sv[q] = g.Scale(w, q, b, kDirectBf16 ? 8.0f : 0.0f);
    __m512i bias[4], subnormals[4];
    if constexpr (kScaledBf16) {
      DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
        const Fp8Bf16Block blkdec(g.ScaleByte(w, q, b));
        bias[q] = blkdec.bias;
        subnormals[q] = blkdec.subnormals;
      }
    }
    __m512 blk[MR][4];
    if constexpr (kBlockSums) {
      DSV4_UNROLL for (int i = 0; i < MR; ++i)
        DSV4_UNROLL for (int q = 0; q < NQ; ++q) blk[i][q] = _mm512_setzero_ps();
    }
    __m512(&sum)[MR][4] = *(kBlockSums ? &blk : &acc);  // where the chunk products go
    const int64_t k1 = (b + 1) * w.block < kw ? (b + 1) * w.block : kw;
    for (int64_t k = b * w.block; k < k1; k += 32) {
      const int64_t valid = k1 - k;
      __m512 lo[4], hi[4];
      __m512bh direct[4];
      DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
        // one row at a time: the hardware prefetchers alone (as fast or faster)
        if (NQ > 1 && (k & 63) == 0) PrefetchRow(g.src[q], k, kw, kPrefetchFp8, NQ, far);
        const __m256i codes = valid >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.src[q] + k))
                                          : _mm256_maskz_loadu_epi8(Mask32(valid), g.src[q] + k);
        if constexpr (!kFinite) nan_seen = Fp8NanBytes(nan_seen, codes);
        if constexpr (kScaledBf16) {
          direct[q] = AsBh(Fp8ToBf16With(codes, bias[q], subnormals[q]));
          continue;
        } else if constexpr (kDirectBf16) {
          direct[q] = AsBh(Fp8ToBf16(codes));
          continue;
        }
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
        DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
          if constexpr (kDirectBf16) {
            a[q] = direct[q];
          } else {
            a[q] = _mm512_cvtne2ps_pbh(hi[q], lo[q]);
          }
        }
        DSV4_UNROLL for (int i = 0; i < MR; ++i) {
          const __m512bh xb = AsBh(_mm512_loadu_si512(x + i * xs + k));
          DSV4_UNROLL for (int q = 0; q < NQ; ++q) sum[i][q] = _mm512_dpbf16_ps(sum[i][q], a[q], xb);
        }
      } else {
        const float* x = static_cast<const float*>(xv);
        DSV4_UNROLL for (int i = 0; i < MR; ++i) {
          const __m512 x0 = _mm512_loadu_ps(x + i * xs + k), x1 = _mm512_loadu_ps(x + i * xs + k + 16);
          DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
            sum[i][q] = _mm512_fmadd_ps(lo[q], x0, sum[i][q]);
            sum[i][q] = _mm512_fmadd_ps(hi[q], x1, sum[i][q]);
          }
        }
      }
    }
    if constexpr (kBlockSums) {
      DSV4_UNROLL for (int i = 0; i < MR; ++i) {
        DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
          acc[i][q] = e8m0 ? _mm512_add_ps(acc[i][q], _mm512_scalef_ps(blk[i][q], sv[q]))
                           : _mm512_fmadd_ps(_mm512_scalef_ps(blk[i][q], e8), sv[q], acc[i][q]);
        }
      }
    }
  }
  StoreSums<MR, NQ>(acc, res, q0);
  if constexpr (!kFinite) g.MarkNanRows<MR, NQ>(Fp8SawNan(nan_seen), kw, res, q0);
}

template <int MR, int NQ, bool kBf16Act, bool kFold, bool kScaledBf16 = false>
void DotFp8Finite(const WeightView& w, const int64_t* rows, const void* x, int64_t xs, float res[][4], int q0) {
  if (w.fp8_finite) {
    DotFp8<MR, NQ, kBf16Act, kFold, true, kScaledBf16>(w, rows, x, xs, res, q0);
  } else {
    DotFp8<MR, NQ, kBf16Act, kFold, false, kScaledBf16>(w, rows, x, xs, res, q0);
  }
}

// The quad route of folded fp32 products: NQ FP8 rows (scale blocks multiples of 64 columns: QuadRoute) against MR
// activation rows given by QuadActivations (each 64-column chunk reordered to the lanes of Fp8QuadsToF32Scaled, times
// 2^112, rows Pad64(cols) apart). Per activation row, weight row and scale block, two chains: pa sums the products of
// codes 4l and 4l + 2 of every chunk, pb those of 4l + 1 and 4l + 3 (in that order: two independent FMA chains per
// weight row); the block sum pa + pb is scaled into the total as DotFp8's fold does (E8M0:
// VSCALEFPS by e - 127 + 8; fp32 scales: times 2^8, times the scale). The sequence does not depend on NQ or MR.
// NaN codes make the row's outputs NaN, as in DotFp8. kFar: the plan's weight prefetch off (PrefetchRow).
// Whole chunks take one 512-bit load and no per-chunk test; only a row's last, partial chunk is masked. Against two
// 256-bit loads per chunk with the mask test and the prefetch choice inside the loop (AMD EPYC family 0x19 model
// 0x11, M = 1, both builds in one process alternating, median of 10 rounds): weights in L3, one core, 4096 x 1024
// 218 -> 197 us; from DRAM, two cores, 32768 x 512 541 -> 515, 2048 x 4096 237 -> 218. (A standalone loop streaming
// FP8 rows from DRAM with no software prefetch had run faster with two 256-bit loads; with this loop's prefetch it
// does not.)
template <int MR, int NQ, bool kFinite, bool kFar>
void DotFp8Quads(const WeightView& w, const int64_t* rows, const float* x, int64_t xs, float res[][4], int q0) {
  const int64_t kw = w.cols, scale_cols = (kw + w.block - 1) / w.block;
  const bool e8m0 = w.scale_format == ScaleFormat::kE8M0;
  const Fp8Group g(w, rows, NQ, scale_cols);
  __m512 acc[MR][4];
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) acc[i][q] = _mm512_setzero_ps();
  __m512i nan_seen = _mm512_setzero_si512();
  const __m512 e8 = _mm512_set1_ps(8.0f);
  __m512 pa[MR][4], pb[MR][4];
  // One 64-column chunk at column k of every weight row: whole (full is std::true_type: no mask) or the row's last,
  // partial one (valid codes).
  auto chunk = [&](auto full, int64_t k, int64_t valid) {
    // the chunk's activations in registers for every weight row (as FMA memory operands each row would load them
    // again: a 512-bit load takes both of Zen 4's load pipes for a cycle)
    __m512 xr[MR][4];
    DSV4_UNROLL for (int i = 0; i < MR; ++i)
      DSV4_UNROLL for (int j = 0; j < 4; ++j) xr[i][j] = _mm512_loadu_ps(x + i * xs + k + 16 * j);
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
      PrefetchRow(g.src[q], k, kw, kPrefetchFp8, NQ, kFar);
      __m512i codes;
      if constexpr (decltype(full)::value) {
        codes = _mm512_loadu_si512(g.src[q] + k);
      } else {
        codes = _mm512_maskz_loadu_epi8((1ull << valid) - 1, g.src[q] + k);
      }
      if constexpr (!kFinite) nan_seen = Fp8NanBytes(nan_seen, codes);
      __m512 v0, v1, v2, v3;
      Fp8QuadsToF32Scaled(codes, &v0, &v1, &v2, &v3);
      DSV4_UNROLL for (int i = 0; i < MR; ++i) {
        pa[i][q] = _mm512_fmadd_ps(v0, xr[i][0], pa[i][q]);
        pb[i][q] = _mm512_fmadd_ps(v1, xr[i][1], pb[i][q]);
        pa[i][q] = _mm512_fmadd_ps(v2, xr[i][2], pa[i][q]);
        pb[i][q] = _mm512_fmadd_ps(v3, xr[i][3], pb[i][q]);
      }
    }
  };
  for (int64_t b = 0; b < scale_cols; ++b) {
    __m512 sv[4];
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) sv[q] = g.Scale(w, q, b, 0.0f);
    DSV4_UNROLL for (int i = 0; i < MR; ++i) {
      DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
        pa[i][q] = _mm512_setzero_ps();
        pb[i][q] = _mm512_setzero_ps();
      }
    }
    const int64_t k1 = (b + 1) * w.block < kw ? (b + 1) * w.block : kw;
    int64_t k = b * w.block;
    for (; k + 64 <= k1; k += 64) chunk(std::true_type{}, k, 64);
    if (k < k1) chunk(std::false_type{}, k, k1 - k);  // 1..63 codes: the row ends inside this chunk
    DSV4_UNROLL for (int i = 0; i < MR; ++i) {
      DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
        const __m512 blk = _mm512_add_ps(pa[i][q], pb[i][q]);
        acc[i][q] = e8m0 ? _mm512_add_ps(acc[i][q], _mm512_scalef_ps(blk, sv[q]))
                         : _mm512_fmadd_ps(_mm512_scalef_ps(blk, e8), sv[q], acc[i][q]);
      }
    }
  }
  StoreSums<MR, NQ>(acc, res, q0);
  if constexpr (!kFinite) g.MarkNanRows<MR, NQ>(Fp8SawNan(nan_seen), kw, res, q0);
}

// Weights the quad route can read: FP8 with scale blocks of whole 64-column chunks (the released checkpoints' 128).
bool QuadRoute(const WeightView& w) {
  return w.format == WeightFormat::kFp8E4M3 && w.block > 0 && w.block % 64 == 0;
}

int64_t Pad64(int64_t c) { return (c + 63) / 64 * 64; }

// Four FP8 rows against one or two activation rows on the quad route, side by side: four weight rows against one
// activation row, two against two (the registers hold 2 x 2 x 2 block sums, four totals and the chunk's eight
// activation vectors). Reading one weight row at a time, as the fp16 route does for short rows on AMD Zen 4,
// measured slower here once the rows side by side prefetch far ahead (kPrefetchFp8Far).
template <int MR>
void DotFp8QuadGroups(const WeightView& w, const int64_t* rows, const float* x, int64_t xs, float res[][4]) {
  constexpr int NQ = MR == 1 ? 4 : 2;
  const bool far = !w.prefetch;  // the plan's prefetch off (AMD Zen 4): far into L2, see kPrefetchFp8Far
  for (int q = 0; q < 4; q += NQ) {
    if (w.fp8_finite) {
      if (far) {
        DotFp8Quads<MR, NQ, true, true>(w, rows + q, x, xs, res, q);
      } else {
        DotFp8Quads<MR, NQ, true, false>(w, rows + q, x, xs, res, q);
      }
    } else if (far) {
      DotFp8Quads<MR, NQ, false, true>(w, rows + q, x, xs, res, q);
    } else {
      DotFp8Quads<MR, NQ, false, false>(w, rows + q, x, xs, res, q);
    }
  }
}

// FP8 rows whose block scale the decode loop folds out for up to two activation rows: fp32 activations, or E8M0
// scales (exact in bf16 only then).
bool FoldsFp8(ActType act, const WeightView& w) {
  return w.format == WeightFormat::kFp8E4M3 && (act == ActType::kF32 || w.scale_format == ScaleFormat::kE8M0);
}

// bf16 products with E8M0 scales: the codes go straight to bf16 (Fp8ToBf16) and every activation row count up to
// eight folds (four per inner call: FusedBf16Groups above four), with one accumulator sequence for all of them (so a
// row sums alike whatever runs beside it).
bool FoldsAllRows(ActType act, const WeightView& w) {
  return act == ActType::kBf16 && w.format == WeightFormat::kFp8E4M3 && w.scale_format == ScaleFormat::kE8M0;
}

// FoldsAllRows weights known to have every scale byte in [kFp8ScaledMinE, kFp8ScaledMaxE] (scales 2^-117 .. 2^119;
// WeightView::fp8_scaled_range, scanned once by the ops) decode with the scale in the exponent (Fp8Bf16Block) and sum
// without block sums: each product is bf16(code * scale) * x, as on the scratch path (DecodeRowsBf16 + DotBf16), which
// then gives the same bits. The fold's block sums cost the 16-row loop an add and a scale per accumulator and block
// beside four VDPBF16PS (the FMA pipes' other work), and kept it to two weight rows per group (block sums and totals of
// four rows do not fit the registers); a 4 x 4 group with the totals in memory measured no faster. AMD EPYC family 0x19
// model 0x11, one core, 16 batch-invariant bf16 rows, bench-preset shapes 4096 x 512 / 1024 x 2048 (in L3): 0.60-0.88 /
// 0.60-0.76 ms -> 0.48 / 0.48 (the decode is 0.11 of it); the bench preset's 16-row batch-invariant bf16 decode step,
// two builds interleaved in one process: 123.7 -> 114.5 ms (per-round ratio 0.90-0.95); one row unchanged (27.9 / 28.3
// ms, noise). The whole weight decides, so a row sums the same way in every call and task split.
bool ScaledBf16(ActType act, const WeightView& w) {
  return FoldsAllRows(act, w) && w.block > 0 && w.fp8_scaled_range;
}

// Largest MR x cols activation block (bf16 or fp32) that one-row-at-a-time reading (below) keeps to; past it the weight
// stream pushes the activations out of L1 and each 32 codes wait on an L2 read.
constexpr int64_t kFp8OneRowXBytes = 8192;

// One fp32 activation row against FP8 rows that fold but cannot take the quad route (activations out of its range,
// MXCSR.DAZ set, scale blocks not of whole 64-column chunks): read one weight row at a time on the fp16 route where
// the plan leaves rows to the hardware prefetchers and the row fits kFp8OneRowXBytes (K <= 2048).
bool Fp32OneRow(const WeightView& w) {
  return FoldsFp8(ActType::kF32, w) && !w.prefetch && w.cols * static_cast<int64_t>(sizeof(float)) <= kFp8OneRowXBytes;
}

// Four FP8 rows against MR activation rows. How the weight rows are walked does not change any accumulator's
// operation sequence, only the speed:
//   bf16 products, E8M0 (FoldsAllRows): folded for every MR. Where the plan leaves the rows to the hardware
//     prefetchers (WeightView::prefetch off: AMD Zen 4) one or two activation rows read the four weight rows one
//     after the other (one sequential stream) while the activations fit kFp8OneRowXBytes; otherwise four rows side
//     by side (MR <= 2) or two (MR 3-4, where four would need 2 x 16 accumulators), with software prefetch.
//     AMD EPYC family 0x19 model 0x11, two cores, weights from DRAM, median of interleaved runs:
//       Flash wq_a 1024 x 4096, M = 1: 27-31 GB/s one row at a time against 20-22 side by side;
//       M = 2 (16 KiB of activations): side by side 190 us, one row at a time 265 us;
//       Flash wo_b 4096 x 8192, M = 1: side by side 1170-1260 us, one row at a time 1540-1600 us;
//       M = 3 / 4 against the chunk-scaled loop this replaced (fp16 route, four rows): Flash wq_a 195-205 / 225-260
//       us against 330-390 / 320-415, Flash wo_b 1430-1580 / 1570-1600 against 1950-2380 / 2300-2365; one row at a
//       time there was slower again (bench-preset wq_b 8192 x 512, M = 4: 1460 us against 1020).
//   fp32 products: folded for up to two activation rows, where the block and total accumulators fit the registers;
//     three or four scale each chunk instead, which sums in another order: batch invariance (RowsFused) keeps fp32
//     activations to groups of two. Activation rows that QuadActivations accepts take the quad route
//     (DotFp8QuadGroups), the others the fp16 route (one weight row at a time where Fp32OneRow, else four side by
//     side); RowsFused decides per activation row, so a row takes the same route alone and in a batch.
//     The quad route against the routes it replaced (the fp16 route side by side, and the sign-extension integer
//     route reading one weight row at a time for one or two rows at K <= 2048 / 1024), AMD EPYC family 0x19 model
//     0x11, two cores, weights from DRAM, both builds in one process alternating, median of 14 rounds, us: M = 1
//     Flash wq_a 1024 x 4096 247 -> 181, wo_b 4096 x 8192 1476 -> 1195, wq_b 8192 x 1024 372 -> 332; bench preset
//     32768 x 512 860 -> 779, 2048 x 4096 437 -> 337, 2048 x 2048 209 -> 192, 512 x 2048 76 -> 72, 8192 x 512 237
//     -> 209; M = 2: 1024 x 4096 264 -> 214, 32768 x 512 831 -> 764, 2048 x 2048 239 -> 176. With the weights in L3
//     (1024 x 4096, M = 1) 191 -> 145-149. The quad decode without the far prefetch was no faster from DRAM than
//     the routes it replaced (x0.96-1.15): from DRAM those loops wait on memory, not on the decode.
//   FP4 rows (linear rows, 16 bytes per product) keep four side by side too: one accumulator chain per row is
//     latency-bound there, and two rows at a time measured slower (bench-preset expert shapes 1024 x 2048 and 2048 x
//     1024, one fp32 row: 84 / 79 us four side by side against 123 / 127 two).
template <int MR, bool kBf16Act, bool kScaledBf16 = false>
void DotFp8Bf16Groups(const WeightView& w, const int64_t* rows, const void* x, int64_t xs, float res[][4]) {
  if (MR <= 2 && !w.prefetch && MR * w.cols * static_cast<int64_t>(sizeof(uint16_t)) <= kFp8OneRowXBytes) {
    for (int q = 0; q < 4; ++q) DotFp8Finite<MR, 1, kBf16Act, true, kScaledBf16>(w, rows + q, x, xs, res, q);
  } else if (MR <= 2) {
    DotFp8Finite<MR, 4, kBf16Act, true, kScaledBf16>(w, rows, x, xs, res, 0);
  } else {
    for (int q = 0; q < 4; q += 2) DotFp8Finite<MR, 2, kBf16Act, true, kScaledBf16>(w, rows + q, x, xs, res, q);
  }
}

template <int MR, bool kBf16Act>
void DotFp8Rows(const WeightView& w, const int64_t* rows, const void* x, int64_t xs, float res[][4], bool fold,
                const float* x_quad, bool scaled) {
  const ActType act = kBf16Act ? ActType::kBf16 : ActType::kF32;
  if (kBf16Act && fold && FoldsAllRows(act, w)) {
    if (scaled) {
      if constexpr (kBf16Act) DotFp8Bf16Groups<MR, true, true>(w, rows, x, xs, res);
    } else {
      DotFp8Bf16Groups<MR, kBf16Act>(w, rows, x, xs, res);
    }
  } else if (!kBf16Act && MR <= 2 && fold && x_quad != nullptr) {
    if constexpr (!kBf16Act && MR <= 2) DotFp8QuadGroups<MR>(w, rows, x_quad, Pad64(w.cols), res);
  } else if (!kBf16Act && MR == 1 && fold && Fp32OneRow(w)) {
    for (int q = 0; q < 4; ++q) DotFp8Finite<MR, 1, false, true>(w, rows + q, x, xs, res, q);
  } else if (MR <= 2 && fold && FoldsFp8(act, w)) {
    DotFp8Finite<MR, 4, kBf16Act, MR <= 2>(w, rows, x, xs, res, 0);
  } else {
    DotFp8Finite<MR, 4, kBf16Act, false>(w, rows, x, xs, res, 0);
  }
}

// FP8 rows with bf16 products and E8M0 scales (FoldsAllRows) against more than four activation rows: the four
// weight rows of a group are decoded once, to the exact bf16 bits the in-register loop makes (Fp8ToBf16), into
// dec (4 rows of kp columns, zero past w.cols), and every group of activation rows reads them from L1 / L2. The
// in-register loop decoded them again for each group of four activation rows: at 16 rows, four decodes of every
// code (about seven operations per 32 codes, two of them lane-crossing) for sixteen VDPBF16PS. Returns the mask
// of rows holding a NaN code (their outputs are NaN, as DotFp8 makes them).
// scaled (ScaledBf16): the rows decode with their scales (Fp8Bf16Block), for DotDecodedScaled.
int DecodeFp8Bf16Rows(const WeightView& w, const int64_t* rows, int64_t kp, uint16_t* dec, bool scaled) {
  const int64_t kw = w.cols, scale_cols = (kw + w.block - 1) / w.block;
  int nan_rows = 0;
  for (int q = 0; q < 4; ++q) {
    const uint8_t* src = static_cast<const uint8_t*>(w.data) + rows[q] * kw;
    const uint8_t* scale = static_cast<const uint8_t*>(w.scale) + (rows[q] / w.block) * scale_cols;
    uint16_t* out = dec + q * kp;
    __m256i nan_seen = _mm256_setzero_si256();
    Fp8Bf16Block blk(127);  // scale 1: Fp8ToBf16
    int64_t block_end = 0, b = 0;  // the current scale block ends at block_end
    for (int64_t k = 0; k < kp; k += 32) {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + k) + kPrefetchFp8, _MM_HINT_T0);
      if (scaled && k == block_end && k < kw) {
        blk = Fp8Bf16Block(scale[b++]);
        block_end += w.block;
      }
      const int64_t valid = kw - k;
      const __m256i codes = valid >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k))
                                        : _mm256_maskz_loadu_epi8(Mask32(valid > 0 ? valid : 0), src + k);
      if (!w.fp8_finite) nan_seen = Fp8NanBytes(nan_seen, codes);
      _mm512_storeu_si512(out + k, Fp8ToBf16With(codes, blk.bias, blk.subnormals));
    }
    if (!w.fp8_finite && Fp8SawNan(nan_seen) && Fp8RowHasNan(src, kw)) nan_rows |= 1 << q;
  }
  return nan_rows;
}

// MR activation rows (bf16, rows xs apart) against NQ weight rows decoded by DecodeFp8Bf16Rows (dec[q]), E8M0
// scale rows scale[q]: the accumulator sequence of DotFp8<MR, NQ, bf16, fold> (per scale block, the chunks'
// VDPBF16PS into a block sum, then acc += block sum * 2^(e - 127)), so every row sums as it does alone.
template <int MR, int NQ>
void DotFp8Decoded(const uint16_t* const* dec, const uint8_t* const* scale, int64_t kw, int64_t block,
                   const uint16_t* x, int64_t xs, __m512 (&sums)[MR][4], int q0) {
  const int64_t scale_cols = (kw + block - 1) / block;
  __m512 acc[MR][4];
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t b = 0; b < scale_cols; ++b) {
    __m512 blk[MR][NQ];
    DSV4_UNROLL for (int i = 0; i < MR; ++i)
      DSV4_UNROLL for (int q = 0; q < NQ; ++q) blk[i][q] = _mm512_setzero_ps();
    const int64_t k1 = (b + 1) * block < kw ? (b + 1) * block : kw;
    for (int64_t k = b * block; k < k1; k += 32) {
      __m512bh a[NQ];
      DSV4_UNROLL for (int q = 0; q < NQ; ++q) a[q] = AsBh(_mm512_loadu_si512(dec[q] + k));
      DSV4_UNROLL for (int i = 0; i < MR; ++i) {
        const __m512bh xb = AsBh(_mm512_loadu_si512(x + i * xs + k));
        DSV4_UNROLL for (int q = 0; q < NQ; ++q) blk[i][q] = _mm512_dpbf16_ps(blk[i][q], a[q], xb);
      }
    }
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
      const __m512 sv = _mm512_set1_ps(kScalefExponent.e[scale[q][b]] - 8.0f);
      DSV4_UNROLL for (int i = 0; i < MR; ++i) acc[i][q] = _mm512_add_ps(acc[i][q], _mm512_scalef_ps(blk[i][q], sv));
    }
  }
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) sums[i][q0 + q] = acc[i][q];
}

// MR activation rows against the four rows DecodeFp8Bf16Rows decoded with their scales: the scratch path's loop
// (DotBf16, no prefetch: the rows are in L1), whose products go straight into the totals in the order of
// DotFp8<.., kScaledBf16> (one VDPBF16PS per 32 columns, columns in order), so a row sums as it does alone.
template <int MR>
void DotDecodedScaled(const uint16_t* const* dec, int64_t kp, const uint16_t* x, int64_t xs, float res[][4]) {
  Ahead none;
  DotBf16<MR, 4>(dec, kp, x, xs, false, none, res, 0);
}

// The four decoded rows against mr (1..4) activation rows: two weight rows per inner call (16 accumulators), the
// four sums of each activation row reduced together (Hsum4: same results as one at a time, half the operations).
template <int MR>
void DotDecodedGroup(const uint16_t* const* dec, const uint8_t* const* scale, const WeightView& w, const uint16_t* x,
                     int64_t xs, float res[][4]) {
  __m512 sums[MR][4];
  DotFp8Decoded<MR, 2>(dec, scale, w.cols, w.block, x, xs, sums, 0);
  DotFp8Decoded<MR, 2>(dec + 2, scale + 2, w.cols, w.block, x, xs, sums, 2);
  StoreSums<MR, 4>(sums, res, 0);
}

// fold: whether the group may take the folded FP8 loop (off: every group sums as the scratch path).
template <int MR>
void DotFused(ActType act, const WeightView& w, const int64_t* rows, const void* x, int64_t xs, float res[][4],
              bool fold, const float* x_quad, bool scaled) {
  if (w.format == WeightFormat::kFp4E2M1) {
    Fp4Rows src;
    src.row_bytes = w.cols / 2;
    src.far = !w.prefetch;
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
    DotFp8Rows<MR, true>(w, rows, x, xs, res, fold, nullptr, scaled);
  } else {
    DotFp8Rows<MR, false>(w, rows, x, xs, res, fold, x_quad, false);
  }
}

// One fp32 activation row (kp floats, zero past the weight's columns) for the quad route: out[c * 64 + 16 j + l] =
// x[c * 64 + 4 l + j] * 2^112 for every 64-column chunk c (the lane order of Fp8QuadsToF32Scaled), Pad64(kp) floats,
// zero past kp. True when that is exact: every |x| < 2^15 (nothing overflows; NaN and infinity fail the test). The
// caller also requires MXCSR.DAZ clear (the route's E4M3 subnormals are fp32 subnormals); false leaves the row to
// the fp16 route. The same products as the fp16 route's (code * 2^-8) * x, summed in another order (DotFp8Quads).
bool QuadActivations(const float* x, int64_t kp, float* out) {
  const __m512 limit = _mm512_set1_ps(32768.0f), up = _mm512_set1_ps(0x1p112f);
  // lanes 0..7 take x[4 l + j] from the chunk's first 32 floats, lanes 8..15 x[4 (l - 8) + j] from the last 32
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  __mmask16 bad = 0;
  for (int64_t c = 0; c < kp; c += 64) {
    __m512 a[4];
    for (int n = 0; n < 4; ++n) {
      const int64_t valid = kp - c - 16 * n;
      a[n] = _mm512_maskz_loadu_ps(TailMask(valid > 0 ? valid : 0), x + c + 16 * n);
      bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(a[n]), limit, _CMP_NLT_UQ);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512i ij = _mm512_add_epi32(idx, _mm512_set1_epi32(j));
      const __m512 lo = _mm512_permutex2var_ps(a[0], ij, a[1]), hi = _mm512_permutex2var_ps(a[2], ij, a[3]);
      _mm512_storeu_ps(out + c + 16 * j, _mm512_mul_ps(_mm512_mask_mov_ps(lo, 0xFF00, hi), up));
    }
  }
  return bad == 0;
}

}  // namespace

// Folded FP8 rows under batch invariance (WeightView::invariant_rows): the in-register decode for every call of
// up to that many rows, in groups that fold (two activation rows, four with FoldsAllRows), so that each row sums as
// it does alone.
bool InvariantFold(ActType act, const WeightView& w, int64_t m) { return m <= w.invariant_rows && FoldsFp8(act, w); }

// FP8 rows against five to eight fp32 activation rows where the plan leaves the rows to the hardware prefetchers
// (AMD Zen 4): the in-register decode in two groups of four (RowsFused; the second group reads the four weight rows
// from L1 / L2) instead of decoding them into fp32 scratch. AMD EPYC family 0x19 model 0x11, bench preset, 8-row
// fp32 decode, interleaved builds: LinearFp8 wq_b 28-30 ms -> 16-17 ms, wo_a 14-15 -> 8-11, the step 163-171 ms ->
// 126-133; 5 and 6 rows: wq_b 18.6-19 ms -> 12-16. At 16 rows it gained nothing. Not measured on Intel, which
// keeps the scratch path. (bf16 products: FusedBf16Groups.)
bool FusedFp32Groups(ActType act, const WeightView& w, int64_t m) {
  return act == ActType::kF32 && w.format == WeightFormat::kFp8E4M3 && !w.prefetch && m <= 8;
}

// FP8 rows with bf16 products and E8M0 scales (FoldsAllRows) against five to eight activation rows: the folded
// in-register decode in two groups of four (the second group reads the four weight rows from L1 / L2) instead of
// decoding the rows into bf16 scratch by the fp16 route; every row sums as it does alone. AMD EPYC family 0x19 model
// 0x11, two cores, bench-preset shapes, weights from DRAM, interleaved medians, 5 / 8 rows: wo_a (8 groups of
// 256 x 4096) 918 / 1020 us -> 729 / 967, wo_b 2048 x 2048 409 / 470 -> 359 / 416, wq_a 512 x 2048 116 / 132 ->
// 101 / 126, wq_b 8192 x 512 equal (1586 / 1927 -> 1574 / 1908); one pass of all eight rows against one weight row
// at a time was slower (wq_b, 8 rows: 2740); at 12 and 16 rows the scratch path stays faster (wo_b 16 rows: 646
// against 833). Not measured on Intel, where it runs too (the results must not depend on the plan's prefetch).
bool FusedBf16Groups(ActType act, const WeightView& w, int64_t m) { return FoldsAllRows(act, w) && m <= 8; }

// ScaledBf16 weights against nine to sixteen activation rows outside batch invariance: the rows decoded once with
// their scales (DecodeFp8Bf16Rows) instead of the scratch path, whose fp16 route decodes more slowly to the same
// bits (the products and their order are the scratch path's). AMD EPYC family 0x19 model 0x11, one core, bench-preset
// shapes in L3: 16 rows 4096 x 512 0.60 -> 0.48-0.51 ms, 1024 x 2048 0.59 -> 0.48-0.49; 12 rows 4096 x 512 0.51 ->
// 0.39.
bool ScaledGroups(ActType act, const WeightView& w, int64_t m) { return m <= 16 && ScaledBf16(act, w); }

// FP4 rows against five to sixteen activation rows: the in-register decode in groups of four (each group decodes
// the four weight rows again from L1) instead of decoding them into bf16 scratch; the same products in the same
// order (FP4 has no fold), bit for bit. The decode costs four operations per 32 codes against four VDPBF16PS (four
// FMA pairs for fp32 activations), less than the scratch path's stores and reloads. AMD EPYC family 0x19 model
// 0x11, one core, weights in L3, scratch -> groups: bench-preset expert w1 / w3 (1024 x 2048), bf16 activations
// 5 / 8 / 16 rows 0.174 / 0.222 / 0.421 ms -> 0.157 / 0.198 / 0.388, fp32 0.280 / 0.393 / 0.727 -> 0.227 / 0.303 /
// 0.612; w2 (2048 x 1024), 8 / 16 rows, bf16 0.281 / 0.468 -> 0.208 / 0.415, fp32 0.411 / 0.744 -> 0.337 / 0.628.
// Whole bench-preset decode steps (two builds interleaved in one process, outputs bit for bit equal): 16
// batch-invariant bf16 rows 115.9 -> 113.6 ms, 8 fp32 rows 109.2 -> 108.2 (most experts get at most four rows).
bool Fp4Groups(const WeightView& w, int64_t m) { return w.format == WeightFormat::kFp4E2M1 && m <= 16; }

// True when rows() decodes in registers (the decode path of FP8 / FP4 weights).
bool FusedDecode(ActType act, const WeightView& w, int64_t m) {
  if (w.format != WeightFormat::kFp4E2M1 && w.format != WeightFormat::kFp8E4M3) return false;
  return m <= 4 || InvariantFold(act, w, m) || FusedFp32Groups(act, w, m) || FusedBf16Groups(act, w, m) ||
         ScaledGroups(act, w, m) || Fp4Groups(w, m);
}

// Where decoding once (DecodeFp8Bf16Rows) pays: more than eight activation rows, or more than four against rows of
// at most 2048 columns (four decoded rows, 16 KiB, stay in L1 beside the activations); rows longer than
// kDecodedMaxCols keep the in-register groups. Same-process A/B, AMD EPYC family 0x19 model 0x11, two threads, bf16
// products, E8M0 128 x 128 scales, ms, in-register groups -> decoded once: 16 rows, batch-invariant: 32768 x 512
// 3.40 -> 2.58, 2048 x 4096 1.71 -> 1.51, 2048 x 2048 0.76 -> 0.60, 512 x 2048 0.22 -> 0.18, 8 groups of 1024 x
// 4096 5.95 -> 6.06 (outputs bit for bit equal); 8 rows: 32768 x 512 2.18 -> 1.87, 2048 x 2048 0.49 -> 0.46, but
// 8 x 1024 x 4096 3.01 -> 3.83 and 2048 x 4096 0.91 -> 0.94 (32 KiB of decoded rows leave L1), which stay in
// registers. Decoding in segments of 2048 columns (accumulators carried in scratch) was slower on every shape.
constexpr int64_t kDecodedMaxCols = 8192;

namespace {

bool DecodesOnce(ActType act, const WeightView& w, int64_t m) {
  const int64_t kp = Pad32(w.cols);
  return FoldsAllRows(act, w) && m > 4 && kp <= kDecodedMaxCols && (m > 8 || kp <= 2048);
}

// Calls whose activation rows RowsFused reorders for the quad route: fp32 activations against QuadRoute weights,
// folded in groups of at most two (one or two rows, or pairs under batch invariance).
bool QuadCall(ActType act, const WeightView& w, int64_t m) {
  return act == ActType::kF32 && QuadRoute(w) && FoldsFp8(act, w) && (m <= 2 || InvariantFold(act, w, m));
}

}  // namespace

size_t FusedScratch(ActType act, const WeightView& w, int64_t m) {
  if (DecodesOnce(act, w, m)) return static_cast<size_t>(4 * Pad32(w.cols)) * sizeof(uint16_t);
  // the reordered rows, then a byte per row: whether it takes the quad route
  if (QuadCall(act, w, m)) return static_cast<size_t>(m * Pad64(w.cols)) * sizeof(float) + static_cast<size_t>(m);
  return 0;
}

void RowsFused(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
               void* scratch) {
  const int64_t kp = Pad32(w.cols);
  const size_t row_bytes = static_cast<size_t>(kp) * (act == ActType::kF32 ? sizeof(float) : sizeof(uint16_t));
  // Activation rows per inner call: all (at most four), two under batch invariance where only two fold, four for
  // FusedFp32Groups and FusedBf16Groups. The group loop is inside the weight-row loop, so four weight rows stay in
  // L1 / L2 while every group reads them.
  const int64_t group = InvariantFold(act, w, m) && m > 2 && !FoldsAllRows(act, w) ? 2 : m > 4 ? 4 : m;
  // FusedFp32Groups stands in for the scratch path: no folded group, so every output sums as it would there and
  // the result does not depend on the plan's prefetch setting (bit for bit). FusedBf16Groups folds, on every plan.
  // ScaledGroups: no fold either (ScaledBf16 sums without block sums), only the FoldsAllRows branch of DotFp8Rows.
  const bool fold = m <= 4 || InvariantFold(act, w, m) || FusedBf16Groups(act, w, m) || ScaledGroups(act, w, m);
  // The quad route's activations (QuadCall): every row reordered and scaled into scratch, and whether it may take
  // the route. Made per task, not once per call: MXCSR.DAZ, which decides whether the route is exact, belongs to
  // the thread that runs the products (m x Pad64(cols) floats: a few hundred cycles per row). Decided per row, so a
  // row takes the same route alone and in a batch.
  const int64_t kq = Pad64(w.cols);
  float* xq = nullptr;
  const uint8_t* quad_ok = nullptr;
  if (QuadCall(act, w, m)) {
    xq = static_cast<float*>(scratch);
    uint8_t* ok = reinterpret_cast<uint8_t*>(xq + m * kq);
    const bool daz = (_mm_getcsr() & 0x40) != 0;
    for (int64_t i = 0; i < m; ++i)
      ok[i] = !daz && QuadActivations(static_cast<const float*>(xp) + i * kp, kp, xq + i * kq) ? 1 : 0;
    quad_ok = ok;
  }
  // DecodesOnce: the four weight rows decoded once for every group of activation rows (DecodeFp8Bf16Rows).
  uint16_t* dec = DecodesOnce(act, w, m) ? static_cast<uint16_t*>(scratch) : nullptr;
  const bool scaled = ScaledBf16(act, w);
  for (int64_t r0 = n0; r0 < n1; r0 += 4) {
    int64_t rows[4];
    for (int q = 0; q < 4; ++q) rows[q] = r0 + q < n1 ? r0 + q : n1 - 1;
    if (dec != nullptr) {
      const int nan_rows = DecodeFp8Bf16Rows(w, rows, kp, dec, scaled);
      const uint16_t* dec_rows[4] = {dec, dec + kp, dec + 2 * kp, dec + 3 * kp};
      const int64_t scale_cols = (w.cols + w.block - 1) / w.block;
      const uint8_t* scale[4];
      for (int q = 0; q < 4; ++q) scale[q] = static_cast<const uint8_t*>(w.scale) + (rows[q] / w.block) * scale_cols;
      for (int64_t i0 = 0; i0 < m; i0 += 4) {
        const int mr = static_cast<int>(m - i0 < 4 ? m - i0 : 4);
        const uint16_t* x = static_cast<const uint16_t*>(xp) + i0 * kp;
        float res[4][4];
        if (scaled) {
          switch (mr) {
            case 1: DotDecodedScaled<1>(dec_rows, kp, x, kp, res); break;
            case 2: DotDecodedScaled<2>(dec_rows, kp, x, kp, res); break;
            case 3: DotDecodedScaled<3>(dec_rows, kp, x, kp, res); break;
            default: DotDecodedScaled<4>(dec_rows, kp, x, kp, res); break;
          }
        } else {
          switch (mr) {
            case 1: DotDecodedGroup<1>(dec_rows, scale, w, x, kp, res); break;
            case 2: DotDecodedGroup<2>(dec_rows, scale, w, x, kp, res); break;
            case 3: DotDecodedGroup<3>(dec_rows, scale, w, x, kp, res); break;
            default: DotDecodedGroup<4>(dec_rows, scale, w, x, kp, res); break;
          }
        }
        for (int q = 0; q < 4; ++q)
          if (nan_rows & (1 << q))
            for (int i = 0; i < mr; ++i) res[i][q] = __builtin_nanf("");
        StoreResults(out, i0, mr, r0 - n0, n1 - r0 < 4 ? n1 - r0 : 4, res);
      }
      continue;
    }
    for (int64_t i0 = 0; i0 < m; i0 += group) {
      const int mr = static_cast<int>(m - i0 < group ? m - i0 : group);
      const void* x = static_cast<const uint8_t*>(xp) + static_cast<size_t>(i0) * row_bytes;
      float res[4][4];
      const float* xsc = nullptr;
      if (xq != nullptr) {  // groups of at most two rows here
        if (mr == 2 && quad_ok[i0] != quad_ok[i0 + 1]) {  // one row on each route: each as it runs alone
          float second[1][4];
          DotFused<1>(act, w, rows, x, kp, res, fold, quad_ok[i0] ? xq + i0 * kq : nullptr, scaled);
          DotFused<1>(act, w, rows, static_cast<const uint8_t*>(x) + row_bytes, kp, second, fold,
                      quad_ok[i0 + 1] ? xq + (i0 + 1) * kq : nullptr, scaled);
          for (int q = 0; q < 4; ++q) res[1][q] = second[0][q];
          StoreResults(out, i0, mr, r0 - n0, n1 - r0 < 4 ? n1 - r0 : 4, res);
          continue;
        }
        if (quad_ok[i0]) xsc = xq + i0 * kq;
      }
      switch (mr) {
        case 1: DotFused<1>(act, w, rows, x, kp, res, fold, xsc, scaled); break;
        case 2: DotFused<2>(act, w, rows, x, kp, res, fold, xsc, scaled); break;
        case 3: DotFused<3>(act, w, rows, x, kp, res, fold, nullptr, scaled); break;
        default: DotFused<4>(act, w, rows, x, kp, res, fold, nullptr, scaled); break;
      }
      StoreResults(out, i0, mr, r0 - n0, n1 - r0 < 4 ? n1 - r0 : 4, res);
    }
  }
}

}  // namespace avx512
}  // namespace dsv4
