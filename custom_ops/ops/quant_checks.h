// Validation shared by the ops that take quantised weights (linear_op.cc, moe_experts_op.cc): scale shapes, FP4
// row widths, and scale values (E8M0 0xFF is the NaN code; fp32 scales must be finite). Errors name the input and
// the offending index.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "numerics/fp4.h"
#include "numerics/fp8.h"
#include "ops/kernel_api.h"

namespace dsv4::glue {

// Number of blocks of size b (>= 1) covering a (>= 0); no intermediate overflows, whatever a and b.
inline int64_t BlockCount(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// The FP8 block size handed to the kernels for a [rows, cols] weight. A block_size beyond any real dimension
// (2^31) covers the whole weight in one block, as one of max(rows, cols) does: the same scale indices, while the
// kernels' own block arithmetic (ceil(cols / b), ...) cannot overflow for any block_size a model gives.
inline int64_t KernelBlock(int64_t block_size, int64_t rows, int64_t cols) {
  constexpr int64_t kLargestBlock = int64_t{1} << 31;
  if (block_size <= kLargestBlock) return block_size;
  return rows > cols ? (rows > 1 ? rows : 1) : (cols > 1 ? cols : 1);
}

// "[i, j, ...]" of flat index `flat` in a row-major tensor of `shape`.
inline std::string IndexString(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return ShapeString(index);
}

inline void ExpectScaleShape(const InputView& scale, const std::vector<int64_t>& want, const std::string& rule) {
  if (scale.shape != want) {
    Fail("input '", scale.name, "' must have shape ", ShapeString(want), " (", rule, "), got ",
         ShapeString(scale.shape));
  }
}

// FP4 rows carry one E8M0 scale per 32 values.
inline void CheckFp4Width(const InputView& weight, int64_t values, const char* what) {
  if (values % kFp4Block != 0) {
    Fail("input '", weight.name, "' (shape ", ShapeString(weight.shape), ") packs ", what, "=", values,
         " values per row (2 per byte); FP4 weights need a multiple of ", kFp4Block, " (one E8M0 scale per ",
         kFp4Block, " values)");
  }
}

// True when no byte of an FP8 E4M3 weight is a NaN code (|code| == 0x7F): the kernels' fp8_finite promise
// (kernels/linear.h). Reads every byte once, eight at a time: with t = b & 0x7F, t + 1 sets bit 7 only for 0x7F
// and never carries into the next byte.
inline bool Fp8CodesFinite(const InputView& weight) {
  const uint8_t* p = weight.as<uint8_t>();
  const int64_t n = weight.numel;
  int64_t i = 0;
  uint64_t hits = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, sizeof v);
    hits |= ((v & 0x7F7F7F7F7F7F7F7Full) + 0x0101010101010101ull) & 0x8080808080808080ull;
  }
  for (; i < n; ++i) hits |= (p[i] & 0x7F) == 0x7F ? 1u : 0u;
  return hits == 0;
}

// Scale entries [begin, end) (flat) must be valid: E8M0 bytes other than 0xFF, or finite floats.
inline void CheckScaleValues(const InputView& scale, int64_t begin, int64_t end) {
  if (scale.dtype == kUint8) {
    const uint8_t* s = scale.as<uint8_t>();
    for (int64_t i = begin; i < end; ++i) {
      if (s[i] == kE8M0Nan) {
        Fail("input '", scale.name, "' holds the E8M0 NaN code 0xFF at ", IndexString(scale.shape, i));
      }
    }
  } else {
    const float* s = scale.as<float>();
    for (int64_t i = begin; i < end; ++i) {
      if (!std::isfinite(s[i])) {
        Fail("input '", scale.name, "' holds a non-finite scale ", s[i], " at ", IndexString(scale.shape, i));
      }
    }
  }
}

}  // namespace dsv4::glue
