// Interleaved ("GPT-J") rotary position embedding, the one definition every kernel family uses (NormRope, Rope,
// the Compressor's entries and SparseAttention's inverse rotation of the output).
//
// Spec: models/functional.py `rope_cos_sin` and `apply_rope`. The last rd = 2*half channels of a vector form pairs
// (2i, 2i+1), i in [0, half); pair i is rotated by
//   angle_i = float32(position) * inv_freq[i]        (product rounded to float32, then cos/sin in float32)
//   (x0, x1) -> (x0*cos - x1*sin, x1*cos + x0*sin)    inverse: sin negated (rotation by -angle)
// Channels before the last rd are not touched. All math is float32.
//
// Header-only and ISA-neutral: included by reference files (built at the baseline). A SIMD variant keeps its own
// copy of the rotation inside its ISA namespace but must produce the same cos/sin.
#pragma once

#include <cmath>
#include <cstdint>

namespace dsv4 {

// cos_out[i], sin_out[i] for i in [0, half) at `position`.
inline void RopeCosSin(int64_t position, const float* inv_freq, int64_t half, float* cos_out, float* sin_out) {
  const float pos = static_cast<float>(position);
  for (int64_t i = 0; i < half; ++i) {
    const float angle = pos * inv_freq[i];
    cos_out[i] = std::cos(angle);
    sin_out[i] = std::sin(angle);
  }
}

// Rotates v[0, 2*half) in place: pair i = (v[2i], v[2i+1]) by angle_i, or by -angle_i when `inverse`.
inline void RopeRotate(float* v, const float* cos, const float* sin, int64_t half, bool inverse) {
  for (int64_t i = 0; i < half; ++i) {
    const float c = cos[i], s = inverse ? -sin[i] : sin[i];
    const float x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = x0 * c - x1 * s;
    v[2 * i + 1] = x1 * c + x0 * s;
  }
}

}  // namespace dsv4
