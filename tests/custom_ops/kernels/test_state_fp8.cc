// FP8 state codec (kernels/state_fp8.h): E4M3 encoding against the decoding table (every finite code round-trips,
// midpoints between neighbours round to the even code, saturation, NaN), the power-of-two scale rule, layout sizes,
// and encode -> decode of whole entries and index keys (exact values within half an E4M3 step). The Python tests
// (tests/custom_ops/ops/test_fp8_state_ops.py) check the same bytes against the PyTorch reference and ml_dtypes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "custom_ops/kernels/state_fp8.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp8.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

namespace sf = dsv4::state_fp8;
using dsv4_test::Rng;

KT_TEST(state_fp8_e4m3_codes_round_trip_and_ties) {
  for (unsigned c = 0; c < 0x7F; ++c) {  // every finite non-negative code, and its negative
    const float v = dsv4::Fp8E4M3ToF32(static_cast<uint8_t>(c));
    KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(v)), c);
    KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(-v)), c | 0x80u);
    if (c + 1 < 0x7F) {
      const float next = dsv4::Fp8E4M3ToF32(static_cast<uint8_t>(c + 1));
      const float mid = 0.5f * (v + next);  // exact: both have 4 significant bits
      const unsigned even = (c % 2 == 0) ? c : c + 1;
      KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(mid)), even) << "midpoint of codes " << c << ", " << c + 1;
      KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(std::nextafter(mid, 0.0f))), c);
      KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(std::nextafter(mid, 1e9f))), c + 1);
    }
  }
  KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(448.0f)), 0x7Eu);
  KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(470.0f)), 0x7Eu);  // RNE would give 480 (NaN in E4M3FN)
  KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(-1e30f)), 0xFEu);
  KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(std::numeric_limits<float>::infinity())), 0x7Eu);
  KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(std::numeric_limits<float>::quiet_NaN()) & 0x7Fu), 0x7Fu);
  KT_CHECK_EQ(static_cast<unsigned>(sf::EncodeE4M3(1e-30f)), 0u);
}

KT_TEST(state_fp8_scale_rule_and_sizes) {
  KT_CHECK_EQ(sf::ScaleExponent(0.0f), -22);               // floor 1e-4 / 448 = 0.94 * 2^-22
  KT_CHECK_EQ(sf::ScaleExponent(448.0f), 0);                // exactly 448 * 2^0
  KT_CHECK_EQ(sf::ScaleExponent(std::nextafter(448.0f, 1e9f)), 1);
  KT_CHECK_EQ(sf::ScaleExponent(448.0f * 1024.0f), 10);
  KT_CHECK_EQ(sf::ScaleExponent(std::numeric_limits<float>::infinity()), 127);
  KT_CHECK_EQ(sf::ScaleExponent(std::numeric_limits<float>::quiet_NaN()), 127);
  KT_CHECK_EQ(sf::EntryBytes(512, 64), 584);
  KT_CHECK_EQ(sf::EntryBytes(128, 64), 200);
  KT_CHECK_EQ(sf::EntryBytes(130, 64), -1);
  KT_CHECK_EQ(sf::IndexKeyBytes(128), 132);
}

KT_TEST(state_fp8_entry_and_key_round_trip) {
  Rng rng(7);
  const int64_t D = 512, rd = 64, cI = 128;
  std::vector<float> x(D), y(D), yk(cI);
  std::vector<uint16_t> yb(D);
  std::vector<uint8_t> row(sf::EntryBytes(D, rd)), key(sf::IndexKeyBytes(cI));
  for (int rep = 0; rep < 20; ++rep) {
    const float mag = std::pow(10.0f, rng.Uniform(-6.0f, 6.0f));
    for (auto& v : x) v = mag * rng.Normal();
    if (rep == 0) std::fill(x.begin(), x.begin() + 64, 0.0f);  // a zero block
    sf::EncodeEntry(x.data(), D, rd, row.data());
    sf::DecodeEntry(row.data(), D, rd, y.data());
    sf::DecodeEntry(row.data(), D, rd, yb.data());
    for (int64_t blk = 0; blk < (D - rd) / 64; ++blk) {
      const float scale = std::ldexp(1.0f, row[D + rd + blk] - 127);
      for (int64_t i = blk * 64; i < (blk + 1) * 64; ++i) {
        KT_CHECK(std::fabs(y[i] - x[i]) <= std::fmax(std::fabs(x[i]) * 0.0625f, scale * 0x1p-10f) * 1.000001f)
            << "channel " << i << ": " << x[i] << " -> " << y[i];
      }
    }
    for (int64_t i = 0; i < D; ++i) KT_CHECK_EQ(dsv4::Bf16ToF32(yb[i]), y[i]);  // exact in bf16 as well
    for (int64_t i = D - rd; i < D; ++i) KT_CHECK_EQ(y[i], dsv4::Bf16ToF32(dsv4::F32ToBf16(x[i])));
    for (int64_t i = D + rd + (D - rd) / 64; i < static_cast<int64_t>(row.size()); ++i) KT_CHECK_EQ(row[i], 0);
    sf::EncodeIndexKey(x.data(), cI, key.data());
    sf::DecodeIndexKey(key.data(), cI, yk.data());
    float scale;
    std::memcpy(&scale, key.data() + cI, sizeof scale);
    for (int64_t i = 0; i < cI; ++i) {
      KT_CHECK(std::fabs(yk[i] - x[i]) <= std::fmax(std::fabs(x[i]) * 0.0625f, scale * 0x1p-10f) * 1.000001f);
    }
  }
}

}  // namespace
