// Scalar bfloat16 <-> float32 conversions: the reference semantics every ISA variant must match.
//
// bf16 is the upper half of an IEEE float32. Widening is exact (shift left by 16). Narrowing rounds to
// nearest-even on the dropped 16 bits, as PyTorch's `tensor.to(torch.bfloat16)` does; NaN stays NaN (quiet bit
// forced so that rounding can never turn a NaN payload into infinity).
#pragma once

#include <cstdint>
#include <cstring>

namespace dsv4 {
// Internal linkage on purpose: this header is included both by baseline files and by files built with AVX512/AMX
// flags. With ordinary inline linkage the linker could keep an ISA-compiled copy for every caller (SIGILL on older
// CPUs); an unnamed namespace gives every translation unit its own copy.
namespace {

inline float Bf16ToF32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even; a NaN stays a (quiet) NaN. A select rather than an early return, so loops over it
// vectorise.
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

}  // namespace
}  // namespace dsv4
