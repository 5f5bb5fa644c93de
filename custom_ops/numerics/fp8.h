// Scalar FP8 E4M3FN and E8M0 decoding: the reference semantics every ISA variant must match (models/quant.py is the
// Python spec; both decoders are exact).
//
// E4M3FN byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities. Exponent 0 is subnormal
// (m * 2^-9); S.1111.111 (0x7F, 0xFF) is NaN, decoded as a quiet NaN (not an error: it propagates through the
// products it enters). Largest finite magnitude 448.
// E8M0 byte b (ue8m0, float8_e8m0fnu): 2^(b - 127), b = 0 gives 2^-127 (a float32 subnormal); b = 0xFF is NaN,
// which the ops reject before any kernel runs (kE8M0Nan).
//
// The 256-entry E4M3 table is constant data built at compile time, so SIMD variants can gather from it as well.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace dsv4 {
// Internal linkage on purpose: this header is included both by baseline files and by files built with AVX512/AMX
// flags. With ordinary inline linkage the linker could keep an ISA-compiled copy for every caller (SIGILL on older
// CPUs); an unnamed namespace gives every translation unit its own copy.
namespace {

namespace fp8_detail {

constexpr float Pow2(int e) {
  float r = 1.0f;
  for (; e > 0; --e) r *= 2.0f;
  for (; e < 0; ++e) r *= 0.5f;  // exact down to 2^-149
  return r;
}

constexpr float DecodeE4M3(unsigned b) {
  const unsigned exponent = (b >> 3) & 0xFu, mantissa = b & 0x7u;
  if (exponent == 0xFu && mantissa == 0x7u) return std::numeric_limits<float>::quiet_NaN();
  const float magnitude = exponent == 0 ? static_cast<float>(mantissa) * Pow2(-9)
                                        : static_cast<float>(8u + mantissa) * Pow2(static_cast<int>(exponent) - 10);
  return (b & 0x80u) ? -magnitude : magnitude;
}

struct E4M3Table {
  float value[256];
};

constexpr E4M3Table MakeE4M3Table() {
  E4M3Table t{};
  for (unsigned b = 0; b < 256; ++b) t.value[b] = DecodeE4M3(b);
  return t;
}

}  // namespace fp8_detail

// kFp8E4M3Table.value[b] = the float value of E4M3FN byte b (NaN for 0x7F / 0xFF).
inline constexpr fp8_detail::E4M3Table kFp8E4M3Table = fp8_detail::MakeE4M3Table();

constexpr float kFp8E4M3Max = 448.0f;
constexpr uint8_t kE8M0Nan = 0xFF;

inline float Fp8E4M3ToF32(uint8_t b) { return kFp8E4M3Table.value[b]; }

// 2^(b - 127) for b in [0, 254]; quiet NaN for 0xFF.
inline float E8M0ToF32(uint8_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 23;  // exponent field b: 2^(b-127) for 1 <= b <= 254
  if (b == 0) bits = 0x00400000u;                   // 2^-127, subnormal
  if (b == kE8M0Nan) bits = 0x7fc00000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace
}  // namespace dsv4
