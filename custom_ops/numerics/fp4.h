// Scalar FP4 E2M1 decoding: the reference semantics every ISA variant must match (models/quant.py is the Python
// spec; decoding is exact).
//
// A 4-bit code: bit 3 = sign, then 2 exponent bits and 1 mantissa bit; the eight magnitudes are
// 0, 0.5, 1, 1.5, 2, 3, 4, 6 (no NaN, no infinity). The checkpoints pack two codes per byte along the input
// dimension, the LOW nibble holding the even index: value j of a row is (byte[j / 2] >> (4 * (j % 2))) & 0xF.
// Routed experts carry one E8M0 scale per 1 x 32 block of a row (numerics/fp8.h decodes E8M0):
// W[i][j] = e2m1(code[i][j]) * 2^(scale[i][j / 32] - 127).
#pragma once

#include <cstdint>

namespace dsv4 {
// Internal linkage on purpose: this header is included both by baseline files and by files built with AVX512/AMX
// flags. With ordinary inline linkage the linker could keep an ISA-compiled copy for every caller (SIGILL on older
// CPUs); an unnamed namespace gives every translation unit its own copy.
namespace {

constexpr int64_t kFp4Block = 32;
constexpr float kFp4E2M1Max = 6.0f;

// Code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0).
inline constexpr float kFp4E2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float Fp4E2M1ToF32(uint8_t code) { return kFp4E2M1Values[code & 0xFu]; }

// The code of value j of a packed row (low nibble = even j).
inline uint8_t Fp4Code(const uint8_t* packed_row, int64_t j) {
  return static_cast<uint8_t>((packed_row[j >> 1] >> ((j & 1) * 4)) & 0xFu);
}

}  // namespace
}  // namespace dsv4
