// Scalar int8 block quantisation of activations: the reference semantics of the FP4 experts' compute="int8" mode
// (moe_experts.h; models/functional.py `quantize_int8_blocks` is the Python spec). Every ISA variant must produce
// these codes and scales bit for bit: a code that differs by one moves a product by a whole step.
//
// A row is cut into blocks of 32 values v (fp32, or bf16 widened exactly):
//   amax = max |v|                                   (NaN if any v is NaN)
//   s    = amax / 127                                 fp32 division; NaN when amax is not finite
//   q    = round_half_even(v * (127 / amax))          fp32 multiply by the fp32 quotient; q = 0 when amax is 0 or
//                                                     not finite. |q| <= 127 (amax * (127 / amax) rounds to 127)
// so v ~ q * s. With FP4 E2M1 weights the block product is an exact integer sum: 2 * e2m1 is one of
// 0, +-1, +-2, +-3, +-4, +-6, +-8, +-12, and sum_k q_k * (2 e2m1_k) fits easily in int32.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dsv4 {
// Internal linkage on purpose (as numerics/fp4.h): included by baseline and by ISA-flagged files.
namespace {

constexpr int64_t kInt8Block = 32;

// 2 * e2m1(code) as an integer (codes 8..15 are the negatives of 0..7).
inline constexpr int8_t kFp4E2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The scale and the multiplier of a block whose largest magnitude is amax (see above).
inline void Int8BlockScale(float amax, float* scale, float* inv) {
  if (!std::isfinite(amax)) {
    *scale = std::nanf("");
    *inv = 0.0f;
    return;
  }
  *scale = amax / 127.0f;
  *inv = amax > 0.0f ? 127.0f / amax : 0.0f;
}

// One value's code: nearbyint follows the default rounding mode, round-half-even (what VCVTPS2DQ does).
inline int8_t Int8Code(float v, float inv) {
  const float r = std::nearbyint(v * inv);
  return static_cast<int8_t>(r != r ? 0 : r);  // v = +-inf with inv = 0 gives NaN: code 0 (the scale is NaN)
}

// Quantises one block of n <= 32 values (the missing ones count as 0): codes into q[0, n), returns the scale.
inline float QuantizeInt8Block(const float* v, int64_t n, int8_t* q) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i]);
    if (a != a) {
      amax = a;
      break;
    }
    amax = a > amax ? a : amax;
  }
  float scale, inv;
  Int8BlockScale(amax, &scale, &inv);
  for (int64_t i = 0; i < n; ++i) q[i] = Int8Code(v[i], inv);
  return scale;
}

}  // namespace
}  // namespace dsv4
