// Linear kernels: y = x W^T for dense (fp32 / bf16) weights and the checkpoint formats (FP8 E4M3 with block scales,
// packed FP4 E2M1 with 1x32 E8M0 scales), optionally block-diagonal ("grouped"). Used for every projection, the
// router gate, the LM head and DeepSeek-V4's grouped output projection wo_a (models/functional.py `linear`,
// `grouped_out_proj`; dsv4-architecture.md §5.1, §8).
//
// With G groups, Kw = cols of the weight, K = G * Kw, N = rows of the weight and N % G == 0:
//   y[m][g*N/G + n] = sum_k x[m][g*Kw + k] * W[g*N/G + n][k]          g in [0, G), n in [0, N/G), k in [0, Kw)
// (G = 1 is the plain linear.) The weight is decoded to its exact float value W (numerics/fp8.h, fp4.h):
//   dense   W[n][k] = w[n][k]                                 (bf16 widened exactly)
//   FP8     W[n][k] = e4m3(w[n][k]) * scale[n / b][k / b]     scale E8M0 or fp32, [ceil(N/b), ceil(Kw/b)]; n and k
//                                                             are the GLOBAL row and the column within the row, so
//                                                             groups work for any N/G (blocks may straddle groups)
//   FP4     W[n][k] = e2m1(code(n, k)) * e8m0(scale[n][k / 32])                         scale [N, Kw/32]
// and, for bf16 activations, rounded to bf16 (functional.linear casts the dequantised weight to x.dtype; exact for
// bf16, FP4 and FP8-with-E8M0 weights, a rounding for fp32 weights and non-power-of-two fp32 scales). Each output
// is one fp32 sum, k in increasing order from +0 (the reference order; SIMD variants may reassociate), rounded
// once to the activation type (bf16: nearest-even, numerics/bf16.h). E4M3 NaN codes decode to NaN and propagate;
// E8M0 NaN scales (0xFF) are rejected by the ops before a kernel runs (precondition here).
//
// The bf16 compute mode (slots f32bf16_*, the ops' compute="bf16"): fp32 x and y, but every product is a bf16
// product, as for bf16 activations: x rounded to bf16 (nearest-even), W rounded to bf16, fp32 sums stored
// unrounded. It is what lets the levels use VDPBF16PS and single-pass AMX-BF16 tiles on fp32 activations.
//
// Shapes (row-major, contiguous):
//   x [M, K] fp32 or bf16 (uint16_t bits), y [M, N] of the same type; W as described by a WeightView.
// Preconditions (asserted, not validated): M, N, Kw >= 0, G >= 1, N % G == 0, FP4: Kw % 32 == 0; y does not
// alias x or the weight. Kernels split rows of W across `par` and allocate their scratch before the parallel
// region (re-entrant, no state).
#pragma once

#include <cstddef>
#include <cstdint>

#include "custom_ops/platform/parallel.h"

namespace dsv4 {

enum class WeightFormat : int { kF32 = 0, kBf16 = 1, kFp8E4M3 = 2, kFp4E2M1 = 3 };
enum class ScaleFormat : int { kNone = 0, kE8M0 = 1, kF32 = 2 };

// A [rows, cols] weight matrix in one of the formats above (row-major, rows contiguous).
//   data   kF32: float[rows*cols]; kBf16: uint16_t[rows*cols]; kFp8E4M3: uint8_t[rows*cols];
//          kFp4E2M1: uint8_t[rows*cols/2] (two codes per byte, low nibble = even column)
//   scale  kFp8E4M3: [ceil(rows/block), ceil(cols/block)] E8M0 bytes or floats;
//          kFp4E2M1: [rows, cols/32] E8M0 bytes (block = 32); dense: none
struct WeightView {
  WeightFormat format = WeightFormat::kF32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  ScaleFormat scale_format = ScaleFormat::kNone;
  const void* scale = nullptr;
  int64_t block = 0;
  // kFp8E4M3 only: true promises that no code is an E4M3 NaN code (|code| == 0x7F), so the decode loops may skip
  // the NaN fix-up. Set only after scanning the whole weight (the ops do it once for constant weights); false
  // (the default) is always correct. A weight holding NaN codes must never carry true: its outputs would not be NaN.
  bool fp8_finite = false;
  // kFp8E4M3 with E8M0 scales only: true promises that every scale byte lies in [kFp8ScaledMinE, kFp8ScaledMaxE]
  // (Fp8ScalesScaledRange), so the AVX512 rows paths may put the scales into the decoded bf16 exponents
  // (linear_fused_avx512.cc, ScaledBf16). Set only after scanning all of the weight's scales (the ops do it once for
  // constant scales); false (the default) is always correct. A weight with a byte outside the range must never carry
  // true: its large codes would carry into the sign bit.
  bool fp8_scaled_range = false;
  // Batch invariance (0 = off): a call of at most this many activation rows (MoE: an expert's tokens) computes each
  // row by the operation sequence a one-row call uses, so row i's result does not depend on the other rows. The
  // levels then keep such calls off their panels / tiles (another summation order) and, for FP8, on the in-register
  // decode with the block scale folded, in groups of rows that fold (linear_fused_*.cc). Set by the ops from the
  // session (DSV4_ORT_BATCH_INVARIANT); the reference is invariant at any setting.
  int64_t invariant_rows = 0;
  // Software prefetch of bf16 / fp32 weight rows read in place by the rows path (four weight rows side by side).
  // Set by the ops from the session's plan (FamilyPlan::weight_prefetch): on where the hardware
  // prefetchers alone keep too few lines in flight (measured on an Intel Xeon), off on AMD Zen 4, whose prefetchers
  // stream those rows faster without it (and faster still one row at a time: the AVX512 rows path does that for
  // one small activation row when this is off, and prefetches whole blocks of rows two ahead for the other calls).
  // The FP8 / FP4 decode loops prefetch weight rows read side by side either way: into L1 2 KiB ahead, or with this
  // off at the AVX512 level into L2 8 KiB ahead (linear_fused_avx512.cc, kPrefetchFp8Far). Results do not depend on
  // it.
  bool prefetch = true;
};

// E8M0 scale bytes (scales 2^-117 .. 2^119) for which every nonzero FP8 E4M3 code times the scale is a normal bf16
// with the scale added to its exponent field (WeightView::fp8_scaled_range).
constexpr int kFp8ScaledMinE = 10, kFp8ScaledMaxE = 246;
// True when each of the n E8M0 scale bytes lies in [kFp8ScaledMinE, kFp8ScaledMaxE] (one pass; for load time).
bool Fp8ScalesScaledRange(const uint8_t* scale, size_t n);

// Bytes of one [rows, cols] matrix's data and of its scales (0 for dense).
size_t WeightDataBytes(const WeightView& w);
size_t WeightScaleBytes(const WeightView& w);
// The index-th of consecutive matrices laid out like `first` (an expert of a stacked [E, rows, cols] tensor, whose
// scales are stacked the same way).
WeightView WeightSlice(const WeightView& first, int64_t index);

using LinearF32Fn = void (*)(const float* x, int64_t m, const WeightView& w, int64_t groups, float* y,
                             const Parallel& par);
using LinearBf16Fn = void (*)(const uint16_t* x, int64_t m, const WeightView& w, int64_t groups, uint16_t* y,
                              const Parallel& par);

// One table per ISA level; every slot is non-null (an ISA that does not accelerate a slot points it at ref).
// Slots by activation type and weight family: `dense` takes kF32 and kBf16 weights, `fp8` kFp8E4M3 (either scale
// format), `fp4` kFp4E2M1; f32bf16_* are fp32 activations in the bf16 compute mode (above).
struct LinearKernels {
  LinearF32Fn f32_dense;
  LinearF32Fn f32_fp8;
  LinearF32Fn f32_fp4;
  LinearBf16Fn bf16_dense;
  LinearBf16Fn bf16_fp8;
  LinearBf16Fn bf16_fp4;
  LinearF32Fn f32bf16_dense;
  LinearF32Fn f32bf16_fp8;
  LinearF32Fn f32bf16_fp4;
};

namespace ref {
extern const LinearKernels kLinear;

// The reference decode: out[k] = W[row][k] for k in [0, cols), rounded to bf16 when round_bf16 (see above).
void DecodeWeightRow(const WeightView& w, int64_t row, bool round_bf16, float* out);
}  // namespace ref

}  // namespace dsv4
