// Int8Fp4Rows (linear_blocks.h; moe_int8.cc, moe_int8_avx2.cc, moe_int8_avx512.cc): every level's prepared codes
// and scales are numerics/int8_blocks.h's at its layout's positions (special blocks included -- all zero, ties at
// .5, NaN, infinity, partial chunks and groups at the row's end), those sharing the portable layout match it byte
// for byte, and every level's rows equal an exact (double) evaluation of the int8 x FP4 products up to fp32
// reassociation (1e-5 of the output scale).
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
  bool portable_layout;
};

std::vector<Level> Levels() {
  std::vector<Level> v = {{"portable", IsaLevel::kScalar, &dsv4::portable::kInt8Fp4Rows, true}};
#if DSV4_X86_VARIANTS
  v.push_back({"avx2", IsaLevel::kAvx2, &dsv4::avx2::kInt8Fp4Rows, true});
  v.push_back({"avx512", IsaLevel::kAvx512, &dsv4::avx512::kInt8Fp4Rows, false});
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

// Where column c of a prepared row keeps its code, and where the scale / 2 of its block is (byte offsets).
struct Slot {
  size_t code, half_scale;
};
Slot PortableSlot(int64_t c) {
  const int64_t c0 = c / 64 * 64, cc = c - c0, b = cc / 32;
  const int64_t code = (cc & 1) * 32 + b * 16 + ((cc & 31) >> 1);
  return {static_cast<size_t>((c0 / 64) * dsv4::kInt8ChunkBytes + code),
          static_cast<size_t>((c0 / 64) * dsv4::kInt8ChunkBytes + 128 + 4 * (b * 4 + (code >= 32 ? 8 : 0)))};
}
// moe_int8_avx512.cc: per 256 columns, vector v lane L holds codes 4t .. 4t+3 of block L % 8, t = 2v + L / 8.
Slot Avx512Slot(int64_t c) {
  const int64_t g = c / 256, j = c % 256 / 32, k = c % 32, t = k / 4;
  const int64_t lane = j + 8 * (t % 2), v = t / 2;
  return {static_cast<size_t>(g * 384 + 64 * v + 4 * lane + k % 4), static_cast<size_t>(g * 384 + 320 + 4 * j)};
}

// Every level's prepared codes and scales are the spec's (numerics/int8_blocks.h) at the level's layout positions,
// and each code reconstructs its value within half a step; levels sharing the portable layout match it byte for
// byte (the bias words included).
void TestPrepare(const Level& level) {
  dsv4_test::RequireIsa(level.needs);
  Rng rng(41);
  for (int64_t cols : {32, 64, 96, 416, 608}) {
    const int64_t m = 7;
    const std::vector<uint16_t> x = SpecialRows(rng, m, cols + 32);  // ldx > cols
    const int64_t index[7] = {6, 0, 3, 3, 1, 5, 2};
    const size_t row_bytes = level.rows->row_bytes(cols);
    std::vector<uint8_t> got(m * row_bytes, 0xA5);
    level.rows->prepare(x.data(), cols + 32, index, m, cols, got.data());
    if (level.portable_layout) {
      std::vector<uint8_t> want(m * row_bytes, 0x5A);
      dsv4::portable::kInt8Fp4Rows.prepare(x.data(), cols + 32, index, m, cols, want.data());
      KT_CHECK(std::memcmp(got.data(), want.data(), got.size()) == 0)
          << level.name << " prepare cols=" << cols << ": bytes differ from the portable layout";
    }
    for (int64_t i = 0; i < m; ++i) {
      const uint8_t* row = got.data() + i * row_bytes;
      for (int64_t c = 0; c < cols; ++c) {
        const Slot slot = level.portable_layout ? PortableSlot(c) : Avx512Slot(c);
        const int8_t q = static_cast<int8_t>(row[slot.code]);
        float half_scale;
        std::memcpy(&half_scale, row + slot.half_scale, sizeof(float));
        float block[32];
        int8_t codes[32];
        for (int64_t k = 0; k < 32; ++k) block[k] = dsv4::Bf16ToF32(x[index[i] * (cols + 32) + c / 32 * 32 + k]);
        const float s = dsv4::QuantizeInt8Block(block, 32, codes);
        KT_CHECK(q == codes[c % 32]) << level.name << " code of row " << i << " column " << c;
        KT_CHECK((std::isnan(s) && std::isnan(half_scale)) || half_scale == s * 0.5f)
            << level.name << " scale of column " << c;
        const float v = block[c % 32];
        if (std::isfinite(s)) {
          KT_CHECK(std::fabs(static_cast<double>(q) * s - v) <= 0.5 * s * (1.0 + 1e-5))
              << "row " << i << " column " << c << ": " << v << " as " << int{q} << " x " << s;
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
      std::vector<uint8_t> xp(m * level.rows->row_bytes(cols));
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
