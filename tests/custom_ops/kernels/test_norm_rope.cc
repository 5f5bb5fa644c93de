// RmsNorm / NormRope / Rope kernels: every accelerated variant this CPU supports against the scalar reference, fp32
// and bf16, serial and on 3 threads: odd widths (vector tails), rope widths that are and are not multiples of the
// vector, no rope, the whole row rotated, with and without a norm weight, rows of a batch at different positions,
// the inverse rotation.
//
// The variants do the reference's arithmetic in the same order except that the double sum of squares is summed in
// another order (it can round to a neighbouring float) and that the compiler may fuse a rotation's product and sum
// into one FMA: fp32 outputs within 2 ulps of the row's largest value, bf16 outputs within one bf16 ulp with at most
// 1% of them differing at all.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "custom_ops/kernels/norm_rope.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::IsaLevel;
using dsv4::NormRopeKernels;
using dsv4::RopeDims;
using dsv4_test::Rng;

const NormRopeKernels* Table(IsaLevel level) {
  switch (level) {
    case IsaLevel::kScalar: return &dsv4::ref::kNormRope;
#if DSV4_X86_VARIANTS
    case IsaLevel::kAvx2: return &dsv4::avx2::kNormRope;
    case IsaLevel::kAvx512: return &dsv4::avx512::kNormRope;
#endif
    default: return nullptr;
  }
}

constexpr float kEps = 1e-6f;

std::vector<float> Inputs(Rng& rng, size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = dsv4::Bf16ToF32(dsv4::F32ToBf16(2.0f * rng.Normal()));
  return v;
}

std::vector<float> InvFreq(int64_t half) {
  std::vector<float> f(half);
  for (int64_t i = 0; i < half; ++i) f[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / (2.0 * half)));
  return f;
}

// fp32: |got - want| <= 2 ulps of the largest |want| of the row.
void CompareF32(const std::string& what, const std::vector<float>& got, const std::vector<float>& want, int64_t row) {
  for (size_t r0 = 0; r0 < want.size(); r0 += row) {
    double peak = 0.0;
    for (int64_t i = 0; i < row; ++i) peak = std::max(peak, static_cast<double>(std::fabs(want[r0 + i])));
    dsv4_test::ExpectClose(what + " row " + std::to_string(r0 / row), got.data() + r0, want.data() + r0, row,
                           2.5e-7 * peak, 0.0);
  }
}

enum class Op { kRmsNorm, kNormRope, kRope, kRopeInverse };

std::vector<float> Run(const NormRopeKernels& k, Op op, bool bf16, const std::vector<float>& x,
                       const float* weight, const RopeDims& d, const int64_t* start_pos, const float* inv_freq,
                       const dsv4::Parallel& par) {
  const size_t n = x.size();
  const int64_t rows = d.batch * d.seq * d.heads;
  if (!bf16) {
    std::vector<float> y(n, -7.0f);
    switch (op) {
      case Op::kRmsNorm: k.rms_norm_f32(x.data(), weight, rows, d.dim, kEps, y.data(), par); break;
      case Op::kNormRope: k.norm_rope_f32(x.data(), weight, start_pos, inv_freq, d, kEps, y.data(), par); break;
      case Op::kRope: k.rope_f32(x.data(), start_pos, inv_freq, d, false, y.data(), par); break;
      case Op::kRopeInverse: k.rope_f32(x.data(), start_pos, inv_freq, d, true, y.data(), par); break;
    }
    return y;
  }
  const std::vector<uint16_t> xb = dsv4_test::ToBf16(x);
  std::vector<uint16_t> y(n, 0xdead);
  switch (op) {
    case Op::kRmsNorm: k.rms_norm_bf16(xb.data(), weight, rows, d.dim, kEps, y.data(), par); break;
    case Op::kNormRope: k.norm_rope_bf16(xb.data(), weight, start_pos, inv_freq, d, kEps, y.data(), par); break;
    case Op::kRope: k.rope_bf16(xb.data(), start_pos, inv_freq, d, false, y.data(), par); break;
    case Op::kRopeInverse: k.rope_bf16(xb.data(), start_pos, inv_freq, d, true, y.data(), par); break;
  }
  return dsv4_test::FromBf16(y);
}

void TestMatchesRef(IsaLevel level, bool bf16) {
  dsv4_test::RequireIsa(level);
  const NormRopeKernels& k = *Table(level);
  Rng rng(bf16 ? 0x4e2 : 0x4e1);
  const dsv4_test::ThreadParallel threads(3);
  struct Size {
    int64_t B, S, H, D, half;
  };
  const Size sizes[] = {{1, 1, 1, 1, 0},    {2, 3, 1, 7, 2},     {2, 5, 3, 24, 4},    {1, 4, 5, 40, 20},
                        {3, 2, 2, 130, 16}, {1, 3, 64, 512, 32}, {2, 2, 1, 512, 32},  {1, 2, 4, 128, 32},
                        {2, 1, 3, 37, 9},   {1, 65, 2, 64, 8}};
  for (const Size& s : sizes) {
    const RopeDims d{s.B, s.S, s.H, s.D, s.half};
    const std::vector<float> x = Inputs(rng, s.B * s.S * s.H * s.D);
    std::vector<float> weight(s.D);
    for (auto& w : weight) w = rng.Uniform(0.5f, 1.5f);
    std::vector<int64_t> start_pos(s.B);
    for (auto& p : start_pos) p = rng.Index(100000);
    const std::vector<float> inv_freq = InvFreq(s.half);
    const std::string shape = "B=" + std::to_string(s.B) + " S=" + std::to_string(s.S) + " H=" + std::to_string(s.H) +
                              " D=" + std::to_string(s.D) + " half=" + std::to_string(s.half);
    for (Op op : {Op::kRmsNorm, Op::kNormRope, Op::kRope, Op::kRopeInverse}) {
      for (const float* w : {static_cast<const float*>(weight.data()), static_cast<const float*>(nullptr)}) {
        if ((op == Op::kRope || op == Op::kRopeInverse) && w == nullptr) continue;
        const std::string what = shape + " op " + std::to_string(static_cast<int>(op)) + (w ? " weight" : "");
        const auto want = Run(dsv4::ref::kNormRope, op, bf16, x, w, d, start_pos.data(), inv_freq.data(),
                              dsv4::SerialParallel());
        for (const dsv4::Parallel& par : {dsv4::SerialParallel(), threads.Get()}) {
          const auto got = Run(k, op, bf16, x, w, d, start_pos.data(), inv_freq.data(), par);
          if (bf16) {
            dsv4_test::ExpectBf16Close(what, dsv4_test::ToBf16(got), dsv4_test::ToBf16(want), 0.0, 0.01);
          } else {
            CompareF32(what, got, want, s.D);
          }
        }
      }
    }
  }
}

const bool kRegistered = [] {
  for (IsaLevel level : dsv4_test::VariantLevels()) {
    const std::string isa = dsv4::IsaName(level);
    for (bool bf16 : {false, true}) {
      kt::Register(std::string("norm_rope_") + (bf16 ? "bf16_" : "f32_") + isa,
                   [level, bf16] { TestMatchesRef(level, bf16); });
    }
  }
  return true;
}();

}  // namespace
