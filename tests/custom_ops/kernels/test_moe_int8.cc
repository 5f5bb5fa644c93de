// Int8Fp4Rows (linear_blocks.h; moe_int8.cc, moe_int8_avx512.cc): the prepared rows of every level are the
// portable ones byte for byte (codes, bias and scales: special blocks included -- all zero, ties at .5, NaN,
// infinity, a half chunk at the row's end), the portable codes follow numerics/int8_blocks.h and reconstruct each
// value within half a step, and every level's rows equal an exact (double) evaluation of the int8 x FP4 products up
// to fp32 reassociation (1e-5 of the output scale).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"
#include "custom_ops/numerics/int8_blocks.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::IsaLevel;
using dsv4::Int8Fp4Rows;
using dsv4_test::Rng;

struct Level {
  std::string name;
  IsaLevel needs;
  const Int8Fp4Rows* rows;
};

std::vector<Level> Levels() {
  std::vector<Level> v = {{"portable", IsaLevel::kScalar, &dsv4::portable::kInt8Fp4Rows}};
#if DSV4_X86_VARIANTS
  v.push_back({"avx2", IsaLevel::kAvx2, &dsv4::avx2::kInt8Fp4Rows});
  v.push_back({"avx512", IsaLevel::kAvx512, &dsv4::avx512::kInt8Fp4Rows});
#endif
  return v;
}

// m bf16 rows of `cols` values; row r's blocks exercise the special cases by (r + block) % 6.
std::vector<uint16_t> SpecialRows(Rng& rng, int64_t m, int64_t cols) {
  std::vector<float> x(m * cols);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < cols / 32; ++b) {
      float* v = x.data() + r * cols + b * 32;
      const float amp = std::ldexp(1.0f, static_cast<int>(rng.Index(20)) - 10);
      for (int64_t k = 0; k < 32; ++k) v[k] = amp * rng.Normal();
      switch ((r + b) % 6) {
        case 0: for (int64_t k = 0; k < 32; ++k) v[k] = 0.0f; break;                     // amax 0
        case 1: for (int64_t k = 0; k < 32; ++k) v[k] = static_cast<float>(k % 9) - 4.5f;  // ties: amax 127 below
          v[31] = 127.0f; break;
        case 2: v[7] = std::numeric_limits<float>::quiet_NaN(); break;
        case 3: v[3] = -std::numeric_limits<float>::infinity(); break;
        default: break;
      }
    }
  }
  return dsv4_test::ToBf16(x);
}

void TestPrepare(const Level& level) {
  dsv4_test::RequireIsa(level.needs);
  Rng rng(41);
  for (int64_t cols : {32, 64, 96, 416}) {
    const int64_t m = 7;
    const std::vector<uint16_t> x = SpecialRows(rng, m, cols + 32);  // ldx > cols
    const int64_t index[7] = {6, 0, 3, 3, 1, 5, 2};
    const size_t bytes = m * dsv4::Int8RowBytes(cols);
    std::vector<uint8_t> got(bytes, 0xA5), want(bytes, 0x5A);
    level.rows->prepare(x.data(), cols + 32, index, m, cols, got.data());
    dsv4::portable::kInt8Fp4Rows.prepare(x.data(), cols + 32, index, m, cols, want.data());
    KT_CHECK(std::memcmp(got.data(), want.data(), bytes) == 0) << level.name << " prepare cols=" << cols
                                                               << ": bytes differ from the portable layout";
    // the portable codes: the spec's, and within half a step of each value
    for (int64_t i = 0; i < m; ++i) {
      const uint8_t* row = want.data() + i * dsv4::Int8RowBytes(cols);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t c0 = c / 64 * 64, cc = c - c0, b = cc / 32;
        const uint8_t* chunk = row + (c0 / 64) * dsv4::kInt8ChunkBytes;
        const int64_t slot = (cc & 1) * 32 + b * 16 + ((cc & 31) >> 1);
        const int8_t q = static_cast<int8_t>(chunk[slot]);
        float half_scale;
        std::memcpy(&half_scale, chunk + 128 + 4 * (b * 4 + (slot >= 32 ? 8 : 0)), sizeof(float));
        float block[32];
        int8_t codes[32];
        for (int64_t k = 0; k < 32; ++k) block[k] = dsv4::Bf16ToF32(x[index[i] * (cols + 32) + c / 32 * 32 + k]);
        const float s = dsv4::QuantizeInt8Block(block, 32, codes);
        KT_CHECK(q == codes[c % 32]) << "portable code of row " << i << " column " << c;
        KT_CHECK((std::isnan(s) && std::isnan(half_scale)) || half_scale == s * 0.5f) << "scale of column " << c;
        const float v = block[c % 32];
        if (std::isfinite(s)) {
          KT_CHECK(std::fabs(static_cast<double>(q) * s - v) <= 0.5 * s * (1.0 + 1e-5)) << "row " << i << " column " << c << ": " << v
                                                                      << " as " << int{q} << " x " << s;
        }
      }
    }
  }
}

void TestRows(const Level& level) {
  dsv4_test::RequireIsa(level.needs);
  Rng rng(43);
  for (int64_t cols : {32, 96, 512, 16416}) {
    for (int64_t m : {1, 3, 8, 11}) {
      const int64_t n = 13;
      std::vector<float> xf(m * cols);
      for (auto& v : xf) v = rng.Normal();
      const std::vector<uint16_t> x = dsv4_test::ToBf16(xf);
      std::vector<uint8_t> codes(n * cols / 2), scales(n * cols / 32);
      for (auto& c : codes) c = static_cast<uint8_t>(rng.Index(256));
      for (auto& e : scales) e = static_cast<uint8_t>(120 + rng.Index(6));
      scales[3] = 0;  // 2^-127, a subnormal scale
      dsv4::WeightView w;
      w.format = dsv4::WeightFormat::kFp4E2M1;
      w.data = codes.data();
      w.rows = n;
      w.cols = cols;
      w.scale_format = dsv4::ScaleFormat::kE8M0;
      w.scale = scales.data();
      w.block = 32;
      std::vector<uint8_t> xp(m * dsv4::Int8RowBytes(cols));
      level.rows->prepare(x.data(), cols, nullptr, m, cols, xp.data());
      const int64_t n0 = 2, n1 = 12, ld = n1 - n0 + 3;
      std::vector<float> out(m * ld, -7.0f);
      level.rows->rows(xp.data(), m, w, n0, n1, dsv4::MatOut{out.data(), ld, false});
      // exact: sum_b s_b * 2^(e-127) * sum_k q_k * e2m1_k in double
      std::vector<float> got, want;
      for (int64_t i = 0; i < m; ++i) {
        float v[32];
        int8_t q[32];
        for (int64_t j = n0; j < n1; ++j) {
          double sum = 0.0;
          for (int64_t b = 0; b < cols / 32; ++b) {
            for (int64_t k = 0; k < 32; ++k) v[k] = dsv4::Bf16ToF32(x[i * cols + b * 32 + k]);
            const double s = dsv4::QuantizeInt8Block(v, 32, q);
            for (int64_t k = 0; k < 32; ++k) {
              sum += s * q[k] * dsv4::Fp4E2M1ToF32(dsv4::Fp4Code(codes.data() + j * cols / 2, b * 32 + k)) *
                     dsv4::E8M0ToF32(scales[j * cols / 32 + b]);
            }
          }
          want.push_back(static_cast<float>(sum));
          got.push_back(out[i * ld + j - n0]);
        }
        for (int64_t j = n1 - n0; j < ld; ++j) KT_CHECK(out[i * ld + j] == -7.0f) << "wrote past n1";
      }
      double ss = 0.0;
      for (float v2 : want) ss += static_cast<double>(v2) * v2;
      const double rms = std::sqrt(ss / static_cast<double>(want.size()));
      dsv4_test::ExpectClose(level.name + " rows cols=" + std::to_string(cols) + " m=" + std::to_string(m), got, want,
                             1e-5 * rms, 1e-5);
    }
  }
}

const bool kRegistered = [] {
  for (const Level& level : Levels()) {
    kt::Register("moe_int8_prepare_" + level.name, [level] { TestPrepare(level); });
    kt::Register("moe_int8_rows_" + level.name, [level] { TestRows(level); });
  }
  return true;
}();

}  // namespace
