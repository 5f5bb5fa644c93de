// AVX512 panels (linear_avx512.cc has the level's overview): the level's tiles slot, for prefill (many activation
// rows), tokens in the lanes; and the AMX tiles' activation layout (PrepareTileBlocks, shared with linear_amx.cc),
// whose one-part form is also the panels' bf16 activation layout.
#include "custom_ops/kernels/isa_prelude.h"

#include <algorithm>

#include "custom_ops/kernels/linear_avx512_internal.h"
#include "custom_ops/numerics/fp4.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"
#include "custom_ops/kernels/linear_common_avx512.inc"

// bf16 words 0..15 / 16..31 of v widened to fp32.
__m512 WidenLo(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16)); }
__m512 WidenHi(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
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
//   microkernel  8 weight rows x 1-3 token blocks = up to 24 accumulators; per column (pair), up to three
//                activation loads, eight weight broadcasts and 24 FMAs / dot products, operands from L1 / L2. bf16
//                weights against bf16 activations are broadcast in place. Rows go in groups of 8 only (a 6 x 4
//                form for four token blocks made groups of 24 rows the padding unit), so the driver's tasks split
//                N in multiples of 8 (kPanelTaskRows) and two threads get equal shares where N is a few blocks:
//                AMD EPYC family 0x19 model 0x11, two threads, M = 128, in-process A/B: 256 x 4096 bf16 x0.90-0.93
//                (six 48-row tasks had split 144 / 112 rows), 512 x 4096 x0.93-0.94, 1024 x 4096 x0.97-0.98, bf16
//                products 512 x 4096 x0.94; M = 16 / 64 / 256 x0.97-1.00.
// Each output is one fixed chain over the columns (kept in a per-task accumulator between column blocks), so
// results do not depend on how tokens, rows or columns are blocked, nor on the thread split. Tokens past m are
// zeros in the prepared blocks; their lanes are computed and dropped.


// kPanelRows = 48 weight rows per decoded block: linear_avx512_internal.h (the LinearBlocks table needs it).
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

// Rows per microkernel call: 8 weight rows x up to 3 token blocks (24 accumulators).
constexpr int kPanelGroupRows = 8;

// fp32 activations: c[r][16 j ..] (+)= sum over k < kc of w[r][k] * x_j[k] for 8 weight rows (kPanelLd floats
// apart) and NB token blocks (x_j = x + j * xs, [kc][16] fp32); c rows are ldc floats apart. kHalf: the last
// block holds at most 8 tokens, so it runs on 256-bit vectors (lanes 0..7; its lanes 8..15 of c are written as
// zeros). Each lane's operation sequence is the same either way; on AMD Zen 4, which runs a 512-bit FMA as two
// 256-bit halves, the half block costs half the FMA slots (the MoE experts' token counts leave such tails often).
template <int NB, bool kHalf>
void PanelKernelF32(const float* w, const float* x, int64_t xs, int64_t kc, float* c, int64_t ldc, bool first) {
  constexpr int NF = kHalf ? NB - 1 : NB;  // full 16-lane blocks
  constexpr int NR = kPanelGroupRows;
  __m512 acc[NR][NB];
  __m256 half[NR];
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < NF; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + j * 16);
    if constexpr (kHalf) half[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + NF * 16);
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m512 xv[NB];
    for (int j = 0; j < NF; ++j) xv[j] = _mm512_loadu_ps(x + j * xs + k * 16);
    __m256 xh = _mm256_setzero_ps();
    if constexpr (kHalf) xh = _mm256_loadu_ps(x + NF * xs + k * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * kPanelLd + k]);
      for (int j = 0; j < NF; ++j) acc[r][j] = _mm512_fmadd_ps(b, xv[j], acc[r][j]);
      if constexpr (kHalf) half[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(b), xh, half[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < NF; ++j) _mm512_storeu_ps(c + r * ldc + j * 16, acc[r][j]);
    if constexpr (kHalf) _mm512_storeu_ps(c + r * ldc + NF * 16, _mm512_zextps256_ps512(half[r]));
  }
}

// bf16 activations: the same with column pairs: w rows (ldw elements apart) are bf16 in column order, so
// one 32-bit broadcast is a (w[2p], w[2p + 1]) pair; x_j = x + j * xs is the tile layout of one 16-token block
// ([pair][16 tokens][2], so tokens 0..7 of a pair are its first 256 bits); kc / 2 VDPBF16PS steps. kHalf as above.
template <int NB, bool kHalf>
void PanelKernelBf16(const uint16_t* w, int64_t ldw, const uint16_t* x, int64_t xs, int64_t kc, float* c,
                     int64_t ldc, bool first) {
  constexpr int NF = kHalf ? NB - 1 : NB;
  constexpr int NR = kPanelGroupRows;
  __m512 acc[NR][NB];
  __m256 half[NR];
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < NF; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + j * 16);
    if constexpr (kHalf) half[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + NF * 16);
  }
  for (int64_t q = 0; q < kc / 2; ++q) {
    __m512bh xv[NB];
    for (int j = 0; j < NF; ++j) xv[j] = AsBh(_mm512_loadu_si512(x + j * xs + q * 32));
    __m256bh xh{};
    if constexpr (kHalf) xh = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + NF * xs + q * 32));
    for (int r = 0; r < NR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, w + r * ldw + 2 * q, sizeof pair);
      const __m512bh b = AsBh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int j = 0; j < NF; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b, xv[j]);
      if constexpr (kHalf) {
        half[r] = _mm256_dpbf16_ps(half[r], (__m256bh)_mm256_set1_epi32(static_cast<int>(pair)), xh);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < NF; ++j) _mm512_storeu_ps(c + r * ldc + j * 16, acc[r][j]);
    if constexpr (kHalf) _mm512_storeu_ps(c + r * ldc + NF * 16, _mm512_zextps256_ps512(half[r]));
  }
}

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

}  // namespace

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
    // Token panels of up to three blocks, as even as possible (4 blocks -> 2 + 2, not 3 + 1).
    const int64_t panels = (sb + 2) / 3;
    for (int64_t b0 = n0; b0 < n1; b0 += kPanelRows) {
      const int64_t rows = std::min(kPanelRows, n1 - b0);
      const int64_t grouped = (rows + kPanelGroupRows - 1) / kPanelGroupRows * kPanelGroupRows;  // zero rows pad
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
        const int64_t nr = kPanelGroupRows, calls = panels * ((rows + nr - 1) / nr);
        int64_t call = 0;
        for (int64_t p = 0; p < panels; ++p) {
          const int64_t q0 = s0 + sb * p / panels, nb = s0 + sb * (p + 1) / panels - q0;
          const bool half = q0 + nb == blocks && m - (blocks - 1) * 16 <= 8;  // the last block, 8 tokens or fewer
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
              if (nb == 1) {
                (half ? PanelKernelBf16<1, true> : PanelKernelBf16<1, false>)(wr, ldw, xb, xs, kc, c, ldc, first);
              } else if (nb == 2) {
                (half ? PanelKernelBf16<2, true> : PanelKernelBf16<2, false>)(wr, ldw, xb, xs, kc, c, ldc, first);
              } else {
                (half ? PanelKernelBf16<3, true> : PanelKernelBf16<3, false>)(wr, ldw, xb, xs, kc, c, ldc, first);
              }
            } else {
              const float* wr = wdec + r * kPanelLd;
              const float* xb = static_cast<const float*>(xp) + q0 * xs + k0 * 16;
              if (nb == 1) {
                (half ? PanelKernelF32<1, true> : PanelKernelF32<1, false>)(wr, xb, xs, kc, c, ldc, first);
              } else if (nb == 2) {
                (half ? PanelKernelF32<2, true> : PanelKernelF32<2, false>)(wr, xb, xs, kc, c, ldc, first);
              } else {
                (half ? PanelKernelF32<3, true> : PanelKernelF32<3, false>)(wr, xb, xs, kc, c, ldc, first);
              }
            }
          }
        }
      }
      StorePanelOutputs(acc, ldc, s0 * 16, std::min(m, s1 * 16), rows, out, b0 - n0);
    }
  }
}

}  // namespace avx512
}  // namespace dsv4
