// FP8 attention state codec (state_fp8.h). Baseline ISA; scalar on purpose: it is the specification the Python
// reference mirrors, and it runs only on the rows a call writes or reads.
#include "custom_ops/kernels/state_fp8.h"

#include <cmath>
#include <cstring>

#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp8.h"

namespace dsv4 {
namespace state_fp8 {
namespace {

int64_t ScaleBytes(int64_t no_rope) { return (no_rope / kBlock + 7) / 8 * 8; }

// max |x[i]| over [0, n); NaN as soon as one element is NaN.
float AbsMax(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (std::isnan(a) || a > m) m = a;
    if (std::isnan(m)) break;
  }
  return m;
}

// codes[i] = E4M3(x[i] / scale); scale is a power of two, so the division is exact (short of float32 underflow).
void Encode(const float* x, int64_t n, float scale, uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = EncodeE4M3(x[i] / scale);
}

template <class T>
void Put(float v, T* dst);
template <>
void Put(float v, float* dst) {
  *dst = v;
}
template <>
void Put(float v, uint16_t* dst) {
  *dst = F32ToBf16(v);  // exact: v has at most 8 significant bits here
}

template <class T>
void DecodeEntryT(const uint8_t* in, int64_t dim, int64_t rope, T* out) {
  const int64_t no_rope = dim - rope;
  const uint8_t* scales = in + no_rope + 2 * rope;
  for (int64_t blk = 0; blk < no_rope / kBlock; ++blk) {
    const float scale = E8M0ToF32(scales[blk]);
    for (int64_t i = blk * kBlock; i < (blk + 1) * kBlock; ++i) Put(Fp8E4M3ToF32(in[i]) * scale, out + i);
  }
  for (int64_t i = 0; i < rope; ++i) {
    uint16_t bits;
    std::memcpy(&bits, in + no_rope + 2 * i, sizeof bits);
    Put(Bf16ToF32(bits), out + no_rope + i);
  }
}

template <class T>
void DecodeIndexKeyT(const uint8_t* in, int64_t dim, T* out) {
  float scale;
  std::memcpy(&scale, in + dim, sizeof scale);
  for (int64_t i = 0; i < dim; ++i) Put(Fp8E4M3ToF32(in[i]) * scale, out + i);
}

}  // namespace

int64_t EntryBytes(int64_t dim, int64_t rope) {
  if (dim < 1 || rope < 0 || rope > dim || (dim - rope) % kBlock != 0) return -1;
  return (dim - rope) + 2 * rope + ScaleBytes(dim - rope);
}

int64_t IndexKeyBytes(int64_t dim) { return dim < 1 ? -1 : dim + 4; }

uint8_t EncodeE4M3(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const float a = std::fabs(v);
  if (std::isnan(a)) return static_cast<uint8_t>(sign | 0x7Fu);
  if (a >= kFp8E4M3Max) return static_cast<uint8_t>(sign | 0x7Eu);  // saturate (448 = S.1111.110)
  if (a < 0.015625f) {
    // Subnormal range [0, 2^-6): multiples of 2^-9; a * 512 is exact, nearbyint rounds half to even. A result of 8
    // is the code of 2^-6 (exponent 1, mantissa 0): the encoding is contiguous there.
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f)));
  }
  uint32_t m;
  std::memcpy(&m, &a, sizeof m);
  m += 0x7FFFFu + ((m >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even (a carry bumps the exponent)
  const uint32_t exponent = (m >> 23) - 127u + 7u, mantissa = (m >> 20) & 7u;
  return static_cast<uint8_t>(sign | (exponent << 3) | mantissa);
}

int ScaleExponent(float amax) {
  if (!std::isfinite(amax)) return 127;
  const float s = (amax > kAmaxFloor ? amax : kAmaxFloor) / kFp8E4M3Max;
  int e = 0;
  const float m = std::frexp(s, &e);  // s = m * 2^e, m in [0.5, 1)
  return m == 0.5f ? e - 1 : e;
}

void EncodeEntry(const float* x, int64_t dim, int64_t rope, uint8_t* out) {
  const int64_t no_rope = dim - rope, nb = no_rope / kBlock;
  uint8_t* scales = out + no_rope + 2 * rope;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int e = ScaleExponent(AbsMax(x + blk * kBlock, kBlock));
    scales[blk] = static_cast<uint8_t>(e + 127);
    Encode(x + blk * kBlock, kBlock, std::ldexp(1.0f, e), out + blk * kBlock);
  }
  for (int64_t i = nb; i < ScaleBytes(no_rope); ++i) scales[i] = 0;
  for (int64_t i = 0; i < rope; ++i) {
    const uint16_t bits = F32ToBf16(x[no_rope + i]);
    std::memcpy(out + no_rope + 2 * i, &bits, sizeof bits);
  }
}

void DecodeEntry(const uint8_t* in, int64_t dim, int64_t rope, float* out) { DecodeEntryT(in, dim, rope, out); }
void DecodeEntry(const uint8_t* in, int64_t dim, int64_t rope, uint16_t* out) { DecodeEntryT(in, dim, rope, out); }

void EncodeIndexKey(const float* x, int64_t dim, uint8_t* out) {
  const float scale = std::ldexp(1.0f, ScaleExponent(AbsMax(x, dim)));
  Encode(x, dim, scale, out);
  std::memcpy(out + dim, &scale, sizeof scale);
}

void DecodeIndexKey(const uint8_t* in, int64_t dim, float* out) { DecodeIndexKeyT(in, dim, out); }
void DecodeIndexKey(const uint8_t* in, int64_t dim, uint16_t* out) { DecodeIndexKeyT(in, dim, out); }

void StoreEntry(const float* e, int64_t dim, const EntryOut& out, int64_t capacity, int64_t b, int64_t i) {
  uint8_t* dst = out.data + static_cast<size_t>(b * capacity + i) * static_cast<size_t>(out.row_bytes);
  if (out.index) {
    EncodeIndexKey(e, dim, dst);
  } else {
    EncodeEntry(e, dim, out.rope, dst);
  }
}

}  // namespace state_fp8
}  // namespace dsv4
