// Portable Int8Fp4Rows (linear_blocks.h): the prepared-row layout written and read in plain C++, the specification
// the AVX2 and AVX512 versions follow byte for byte. Baseline ISA.
#include <cstring>

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"
#include "custom_ops/numerics/int8_blocks.h"

namespace dsv4 {

size_t Int8RowBytes(int64_t cols) { return static_cast<size_t>((cols + 63) / 64 * kInt8ChunkBytes); }

namespace portable {
namespace {

#include "custom_ops/kernels/moe_int8_prepare.inc"

// The 64 weight bytes of a chunk in code order (2 e2m1 + 12), and the per-lane weight scales 2^(e - 127).
void DecodeChunk(const uint8_t* codes, const uint8_t* scales, int64_t c0, int64_t cols, uint8_t* wq, float* ws) {
  for (int64_t c = 0; c < 64; ++c) {
    const int64_t col = c0 + c;
    wq[CodeSlot(c)] = static_cast<uint8_t>(col < cols ? kFp4E2M1Doubled[Fp4Code(codes, col)] + 12 : 12);
  }
  for (int64_t lane = 0; lane < 16; ++lane) {
    const int64_t b = c0 / kFp4Block + ((lane >> 2) & 1);
    ws[lane] = b < cols / kFp4Block ? E8M0ToF32(scales[b]) : 0.0f;
  }
}

void Rows(const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out) {
  const size_t row_bytes = Int8RowBytes(w.cols);
  uint8_t wq[64];
  float ws[16];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* codes = static_cast<const uint8_t*>(w.data) + n * (w.cols / 2);
    const uint8_t* scales = static_cast<const uint8_t*>(w.scale) + n * (w.cols / kFp4Block);
    float acc[16 * 64];  // up to 64 activation rows per pass, 16 lanes each
    for (int64_t i0 = 0; i0 < m; i0 += 64) {
      const int64_t rows = m - i0 < 64 ? m - i0 : 64;
      std::memset(acc, 0, sizeof(acc));
      for (int64_t c0 = 0; c0 < w.cols; c0 += 64) {
        DecodeChunk(codes, scales, c0, w.cols, wq, ws);
        for (int64_t i = 0; i < rows; ++i) {
          const uint8_t* chunk = static_cast<const uint8_t*>(xp) + static_cast<size_t>(i0 + i) * row_bytes +
                                 (c0 / 64) * kInt8ChunkBytes;
          const int8_t* q = reinterpret_cast<const int8_t*>(chunk);
          int32_t bias[16];
          float sx[16];
          std::memcpy(bias, chunk + 64, sizeof(bias));
          std::memcpy(sx, chunk + 128, sizeof(sx));
          for (int64_t lane = 0; lane < 16; ++lane) {
            int32_t isum = bias[lane];
            for (int64_t j = 0; j < 4; ++j) isum += static_cast<int32_t>(wq[lane * 4 + j]) * q[lane * 4 + j];
            acc[i * 16 + lane] += static_cast<float>(isum) * (sx[lane] * ws[lane]);
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        float sum = 0.0f;
        for (int64_t lane = 0; lane < 16; ++lane) sum += acc[i * 16 + lane];
        static_cast<float*>(out.data)[(i0 + i) * out.ld + (n - n0)] = sum;
      }
    }
  }
}

}  // namespace

extern const Int8Fp4Rows kInt8Fp4Rows = {Int8RowBytes, Prepare, Rows};

}  // namespace portable
}  // namespace dsv4
