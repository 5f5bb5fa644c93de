// AVX512 rows path (linear_avx512.cc has the level's overview): LinearBlocks::rows for every weight format and both
// activation types, K in the lanes, and the decoding of weight rows into scratch (DecodeRowsBf16, shared with the
// panels and the AMX tiles). Must match linear_ref.cc up to summation order: per output, fp32 accumulation in 16
// lanes (bf16 activations: VDPBF16PS pairs) over K in 32-column steps, then one fixed horizontal sum.
//
// Inner loop: four weight rows against up to four activation rows (16 fp32 accumulators), K in the lanes:
//   bf16 activations   one VDPBF16PS per (weight row, activation row) per 32 columns; activations as stored.
//   fp32 activations   bf16 weight rows are widened in registers: the even columns of a 32-column chunk by a
//                      16-bit shift, the odd ones by a mask, so the activations are prepared as [16 even columns,
//                      16 odd columns] per chunk and each chunk takes two FMAs; fp32 weight rows take one FMA per
//                      16 columns against activations as stored.
// bf16 and fp32 weights are read in place (where the plan turns the per-row software prefetch off: one bf16 row at a
// time against one small activation row, else side by side with a prefetch of the block two ahead). Other rows are
// decoded into scratch first, four at a time up to sixteen activation rows (each weight byte read once, the
// scratch stays in L1/L2) and 64 at a time otherwise (decoded once, reused for every group of four activation rows);
// rows read in place go in blocks of 32 against 5-16 activation rows (RowBlock); the FP8 / FP4 decoding is
// described in linear_common_avx512.inc. FP8 / FP4
// weights against at most four activation rows take the in-register decode path instead (linear_fused_avx512.cc).
// fp32 activations meet FP4 rows as bf16 (exact) and FP8 rows as fp32 (an FP8 value times a small scale can be a
// denormal that bf16 cannot hold).
// Horizontal sums, decoding and stores do not depend on how rows are grouped, so results are independent of the
// task split.
#include <type_traits>

#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_avx512_internal.h"
#include "custom_ops/numerics/fp4.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"
#include "custom_ops/kernels/linear_common_avx512.inc"

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

// Weight rows per block: decoded rows 4 for the decode path, 64 when several groups of activation rows reuse them.
// Rows read in place go 32 at a time against 5-16 activation rows: each group of four activation rows then meets
// eight groups of four weight rows while its activations sit in L1 (with blocks of four, every 4 x 4 product read
// the group's activations from L2 again), and the block-ahead prefetch (Ahead) requests 32 rows at once. AMD EPYC
// family 0x19 model 0x11, two threads, bench-preset head 129280 x 2048 bf16 from DRAM, both block sizes alternated
// in one session, 4 -> 32 rows: bf16 activations M = 5 / 8 / 12 / 16 17.5 / 18.3 / 23.6 / 30.6 ms -> 14.5 / 14.2 /
// 21.2 / 26.4 (16 rows in blocks of 16: 27.4, of 64: 26.8); fp32 activations M = 8 / 16 23.6 / 46.1 -> 22.6 / 45.6
// (those are FMA-bound); 1024 x 4096, 4096 x 4096 and 256 x 2048 unchanged. In the 16-row batch-invariant bf16
// decode step (profiled, two builds alternated) the Linear nodes went 30.3-31.5 -> 28.8-29.5 ms. Not measured on
// Intel.
int64_t RowBlock(RowKind kind, int64_t m) {
  const bool direct = kind == RowKind::kBf16Direct || kind == RowKind::kF32Direct;
  return m > 16 ? 64 : direct && m > 4 ? 32 : 4;
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
// Inner loops: res[i][q0 + q] = sum_k x_i[k] * w_q[k] for NQ weight rows (4, or 1: single below) and MR
// activation rows; an accumulator's operation sequence does not depend on NQ. bf16 activations against bf16 rows:
// DotBf16 (with Ahead, linear_common_avx512.inc).

// fp32 activations in [even, odd] chunk layout against bf16 rows.
template <int MR, int NQ>
void DotF32Bf16(const uint16_t* const* w, int64_t kw, const float* x, int64_t xs, bool prefetch, Ahead& ahead,
                float res[][4], int q0) {
  __m512 acc[MR][4];
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) acc[i][q] = _mm512_setzero_ps();
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // Whole 32-column chunks (full: std::true_type) unmasked, the partial last one masked (the same operations on the
  // same values; DotFp8Quads' chunk does the same). AMD EPYC
  // family 0x19 model 0x11, two cores, M = 1, in-process A/B against a mask per chunk: bench-preset head 129280 x
  // 2048 from DRAM x0.93 while the machine read 45 GB/s, x1.00 at 34 GB/s (the one-row loop binds only above about
  // 40 GB/s); 1024 x 4096 in L3 x0.95, from DRAM x0.92.
  const auto chunk = [&](auto full, int64_t k, __mmask32 mask) {
    __m512 we[4], wo[4];
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w[q] + k) + kPrefetchBytes, _MM_HINT_T0);
      __m512i v;
      if constexpr (decltype(full)::value) {
        v = _mm512_loadu_si512(w[q] + k);
      } else {
        v = _mm512_maskz_loadu_epi16(mask, w[q] + k);
      }
      we[q] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[q] = _mm512_castsi512_ps(_mm512_and_si512(v, odd_mask));
    }
    ahead.Step();
    DSV4_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 xe = _mm512_loadu_ps(x + i * xs + k), xo = _mm512_loadu_ps(x + i * xs + k + 16);
      DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
        acc[i][q] = _mm512_fmadd_ps(we[q], xe, acc[i][q]);
        acc[i][q] = _mm512_fmadd_ps(wo[q], xo, acc[i][q]);
      }
    }
  };
  int64_t k = 0;
  for (; k + 32 <= kw; k += 32) chunk(std::true_type{}, k, 0);
  if (k < kw) chunk(std::false_type{}, k, Mask32(kw - k));
  StoreSums<MR, NQ>(acc, res, q0);
}

// fp32 activations against fp32 rows (both in column order).
template <int MR, int NQ>
void DotF32(const float* const* w, int64_t kw, const float* x, int64_t xs, bool prefetch, Ahead& ahead, float res[][4],
            int q0) {
  __m512 acc[MR][4];
  DSV4_UNROLL for (int i = 0; i < MR; ++i)
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kw; k += 16) {
    const __mmask16 mask = TailMask(kw - k);
    __m512 a[4];
    DSV4_UNROLL for (int q = 0; q < NQ; ++q) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w[q] + k) + kPrefetchBytes, _MM_HINT_T0);
      a[q] = _mm512_maskz_loadu_ps(mask, w[q] + k);
    }
    ahead.Step();
    DSV4_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * xs + k);
      DSV4_UNROLL for (int q = 0; q < NQ; ++q) acc[i][q] = _mm512_fmadd_ps(a[q], xv, acc[i][q]);
    }
  }
  StoreSums<MR, NQ>(acc, res, q0);
}

// NQ weight rows (4, or 1) against mr activation rows; results to res[i][q0 + q].
template <int NQ, class W, class X>
void Dot(int mr, const W* const* w, int64_t kw, const X* x, int64_t xs, bool pf, Ahead& ah, float res[][4],
         int q0) {
  if constexpr (sizeof(W) == 2 && sizeof(X) == 2) {
    switch (mr) {
      case 1: DotBf16<1, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      case 2: DotBf16<2, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      case 3: DotBf16<3, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      default: DotBf16<4, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
    }
  } else if constexpr (sizeof(W) == 2) {
    switch (mr) {
      case 1: DotF32Bf16<1, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      case 2: DotF32Bf16<2, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      case 3: DotF32Bf16<3, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      default: DotF32Bf16<4, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
    }
  } else {
    switch (mr) {
      case 1: DotF32<1, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      case 2: DotF32<2, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      case 3: DotF32<3, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
      default: DotF32<4, NQ>(w, kw, x, xs, pf, ah, res, q0); break;
    }
  }
}

// Largest activation block (bytes) for which weight rows read in place go one at a time (single).
constexpr int64_t kOneRowXBytes = 16384;

// single: the same products one weight row at a time (Dot<1>: one sequential stream of weights), each row's
// accumulators running exactly the sequence Dot<4> runs for them (results bit-identical). Taken for one activation
// row where weight rows read in place get no software prefetch (the plan's setting on AMD Zen 4) and the row fits
// kOneRowXBytes: there one stream with the activations in L1 beats four rows side by side. With more rows, four side
// by side with the block-ahead prefetch (Ahead) are faster. AMD EPYC family 0x19 model 0x11, two cores, bench-preset
// head 129280 x 2048 bf16 from DRAM, median of interleaved runs, one at a time against side by side with Ahead:
// fp32 activations M = 1 / 2: 16.5 / 20.8 ms against 17.0 / 16.9; bf16 activations M = 1 / 2 / 3 / 4: 16.2 / 17.0 /
// 17.5 / 23.8 against 17.0 / 16.8 / 17.2 / 17.1 (Flash head slice 16384 x 4096, fp32 M = 1: 5.4 against 4.7 ms, but
// the bench preset's shape decides here).
template <class W, class X>
void RowsBlock(const W* base, int64_t stride, int64_t rows, int64_t kw, const X* x, int64_t xs, int64_t m,
               const MatOut& out, int64_t col0, bool prefetch, bool single, Ahead ahead) {
  for (int64_t m0 = 0; m0 < m; m0 += 4) {
    const int mr = static_cast<int>(m - m0 < 4 ? m - m0 : 4);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const W* w[4];
      for (int q = 0; q < 4; ++q) w[q] = base + (r0 + q < rows ? r0 + q : rows - 1) * stride;
      float res[4][4];
      if (single) {
        for (int q = 0; q < 4; ++q) Dot<1>(mr, w + q, kw, x + m0 * xs, xs, false, ahead, res, q);
      } else {
        Dot<4>(mr, w, kw, x + m0 * xs, xs, prefetch, ahead, res, 0);
      }
      StoreResults(out, m0, mr, col0 + r0, rows - r0 < 4 ? rows - r0 : 4, res);
    }
  }
}

}  // namespace

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

size_t RowsScratch(ActType act, const WeightView& w, int64_t m) {
  const RowKind kind = KindOf(act, w);
  if (FusedDecode(act, w, m)) return FusedScratch(act, w, m);
  if (kind == RowKind::kBf16Direct || kind == RowKind::kF32Direct) return 0;
  const size_t elem = kind == RowKind::kF32Decoded ? sizeof(float) : sizeof(uint16_t);
  return static_cast<size_t>(RowBlock(kind, m) * Pad32(w.cols)) * elem;
}

void Rows(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
          void* scratch) {
  if (FusedDecode(act, w, m)) {
    RowsFused(act, xp, m, w, n0, n1, out, scratch);
    return;
  }
  const RowKind kind = KindOf(act, w);
  const int64_t kw = w.cols, kp = Pad32(kw), block = RowBlock(kind, m);
  // One weight row at a time (single) or, for every other call reading weights in place with the per-row prefetch
  // off, side by side with the block-ahead prefetch (Ahead).
  const bool direct = kind == RowKind::kBf16Direct || kind == RowKind::kF32Direct;
  const int64_t xelem = act == ActType::kF32 ? sizeof(float) : sizeof(uint16_t);
  const bool single = kind == RowKind::kBf16Direct && !w.prefetch && m == 1 && kw * xelem <= kOneRowXBytes;
  const bool block_ahead = direct && !w.prefetch && !single;
  const size_t welem = kind == RowKind::kF32Direct ? sizeof(float) : sizeof(uint16_t);
  const int64_t step = kind == RowKind::kF32Direct ? 16 : 32;  // columns per k step of the dot products
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t rows = n1 - b0 < block ? n1 - b0 : block;
    const int64_t col0 = b0 - n0;
    Ahead ahead;
    if (block_ahead) {  // rows [b0 + 2 block, b0 + 3 block) of this task, spread over every k step of this block
      const int64_t a0 = b0 + 2 * block < n1 ? b0 + 2 * block : n1, a1 = b0 + 3 * block < n1 ? b0 + 3 * block : n1;
      const char* data = static_cast<const char*>(w.data);
      ahead.next = data + static_cast<size_t>(a0 * kw) * welem;
      ahead.end = data + static_cast<size_t>(a1 * kw) * welem;
      const int64_t lines = (ahead.end - ahead.next + 63) / 64;
      const int64_t steps = ((m + 3) / 4) * ((rows + 3) / 4) * ((kw + step - 1) / step);
      ahead.per = static_cast<int>((lines + steps - 1) / steps);
    }
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
        // rows decoded into scratch are in L1 / L2: only weights read in place are prefetched
        const bool prefetch = kind == RowKind::kBf16Direct && w.prefetch;
        if (act == ActType::kBf16) {
          RowsBlock(base, stride, rows, kw, static_cast<const uint16_t*>(xp), kp, m, out, col0, prefetch, single,
                    ahead);
        } else {
          RowsBlock(base, stride, rows, kw, static_cast<const float*>(xp), kp, m, out, col0, prefetch, single,
                    ahead);
        }
        break;
      }
      case RowKind::kF32Direct:
        RowsBlock(static_cast<const float*>(w.data) + b0 * kw, kw, rows, kw, static_cast<const float*>(xp), kp, m,
                  out, col0, w.prefetch, false, ahead);
        break;
      case RowKind::kF32Decoded:
        DecodeRowsF32(w, b0, rows, kp, static_cast<float*>(scratch));
        RowsBlock(static_cast<const float*>(scratch), kp, rows, kw, static_cast<const float*>(xp), kp, m, out, col0,
                  false, false, Ahead{});
        break;
    }
  }
}

}  // namespace avx512
}  // namespace dsv4
