// Normalisation and rotary kernels of the attention input side: RmsNorm, NormRope (the q / kv preparation) and Rope
// (the indexer q).
//
// Spec: models/functional.py `rms_norm`, `q_norm_rope`, `kv_norm_rope`, `apply_rope` (RoPE math: kernels/rope.h).
// Per vector v of n channels (float32 math; T = float32 or bfloat16 storage):
//   RmsNorm   y = weight * (v * r),  r = 1 / sqrt(sum(v^2) / n + eps)        (no weight: y = v * r)
//   NormRope  u = RoundTo<T>(RmsNorm(v)); then RoPE on the last rd channels of u at the token's position
//             (the rounding between the stages is the spec's cast of the norm output to x.dtype)
//   Rope      RoPE on the last rd channels of v at the token's position (inverse: rotation by -angle)
// Token (b, s) sits at position start_pos[b] + s; every head of a token uses the same angles.
// The sum of squares accumulates in double, so the reference is within float32 rounding of the exact value.
//
// Shapes (row-major, contiguous; H = product of the dimensions between S and D, 1 for kv):
//   RmsNorm   x [rows, n], weight [n] fp32 or nullptr                           -> y [rows, n]
//   NormRope  x [B, S, H, D], weight [D] fp32 or nullptr, start_pos [B], inv_freq [half] -> y [B, S, H, D]
//   Rope      x [B, S, H, D], start_pos [B], inv_freq [half]                    -> y [B, S, H, D]
// Preconditions (validated by the op glue): n, D >= 1; 2*half <= D; start_pos >= 0; y does not alias x.
#pragma once

#include <cstdint>

#include "custom_ops/platform/parallel.h"

namespace dsv4 {

struct RopeDims {
  int64_t batch, seq, heads, dim, half;
};

using RmsNormF32Fn = void (*)(const float* x, const float* weight, int64_t rows, int64_t n, float eps, float* y,
                              const Parallel& par);
using RmsNormBf16Fn = void (*)(const uint16_t* x, const float* weight, int64_t rows, int64_t n, float eps, uint16_t* y,
                               const Parallel& par);
using NormRopeF32Fn = void (*)(const float* x, const float* weight, const int64_t* start_pos, const float* inv_freq,
                               const RopeDims& dims, float eps, float* y, const Parallel& par);
using NormRopeBf16Fn = void (*)(const uint16_t* x, const float* weight, const int64_t* start_pos,
                                const float* inv_freq, const RopeDims& dims, float eps, uint16_t* y,
                                const Parallel& par);
using RopeF32Fn = void (*)(const float* x, const int64_t* start_pos, const float* inv_freq, const RopeDims& dims,
                           bool inverse, float* y, const Parallel& par);
using RopeBf16Fn = void (*)(const uint16_t* x, const int64_t* start_pos, const float* inv_freq, const RopeDims& dims,
                            bool inverse, uint16_t* y, const Parallel& par);

// One table per ISA level; every slot is non-null.
struct NormRopeKernels {
  RmsNormF32Fn rms_norm_f32;
  RmsNormBf16Fn rms_norm_bf16;
  NormRopeF32Fn norm_rope_f32;
  NormRopeBf16Fn norm_rope_bf16;
  RopeF32Fn rope_f32;
  RopeBf16Fn rope_bf16;
};

namespace ref {
extern const NormRopeKernels kNormRope;

// r = 1 / sqrt(mean(v^2) + eps) of one vector (shared with the Compressor's entry norm).
float RmsScale(const float* v, int64_t n, float eps);
}  // namespace ref

namespace avx2 {
extern const NormRopeKernels kNormRope;
}  // namespace avx2

namespace avx512 {
extern const NormRopeKernels kNormRope;
}  // namespace avx512

}  // namespace dsv4
