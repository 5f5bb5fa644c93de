// Linear kernels (kernels/linear.h, linear_blocks.h): every accelerated variant against the scalar reference
// (linear_ref.cc) for every weight format (fp32, bf16, FP8 with E8M0 and fp32 scales, FP4), both activation types,
// M in {1, 2, 3, 4, 5, 8, 16, 17, 69}, odd N / Kw (tails of the 16/32-column steps and of the 4-row and 64-row
// blocks), groups, and FP8 scale blocks of 32 and 128 (and 16, which the levels hand to the reference).
//
// Variants: the avx2 / avx512 / amx tables as dispatched (AVX512 panels / AMX tiles above the level's crossover),
// the AVX2 / AVX512 panels for every M (avx2_panels, avx512_panels), the AMX tiles for every M on real hardware (amx_tiles), and the
// same tiles on the portable tile emulation (amx_emu, any CPU).
//
// Tolerances. Every variant decodes the weights to the reference's values and differs only in summation order
// (and, on the bf16 paths, in flushing denormal inputs, which these data avoid), so for fp32 outputs
//   |got - want| <= 2 (K' + 2) 2^-24 sum_k |x_k W_k| + 1e-30
// with K' = 3 Kw for the three-part AMX products of fp32 activations (Kw otherwise). bf16 outputs are rounded once
// from such fp32 values: within the same bound plus one bf16 ulp (at most 2^-7 relative). NaN must match NaN. Results must
// not depend on the thread count (bitwise), and the real AMX tiles must equal the emulated ones bitwise.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "custom_ops/kernels/linear.h"
#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::ActType;
using dsv4::IsaLevel;
using dsv4::ScaleFormat;
using dsv4::WeightFormat;
using dsv4::WeightView;
using dsv4_test::Rng;

enum class Fmt { kF32, kBf16, kFp8E8m0, kFp8F32, kFp4 };
const char* FmtName(Fmt f) {
  switch (f) {
    case Fmt::kF32: return "f32";
    case Fmt::kBf16: return "bf16";
    case Fmt::kFp8E8m0: return "fp8_e8m0";
    case Fmt::kFp8F32: return "fp8_f32";
    case Fmt::kFp4: return "fp4";
  }
  return "?";
}
constexpr Fmt kFormats[] = {Fmt::kF32, Fmt::kBf16, Fmt::kFp8E8m0, Fmt::kFp8F32, Fmt::kFp4};

// A weight in one format with its storage.
struct Weight {
  std::vector<uint8_t> data, scale;
  WeightView view;
};

// Random [rows, cols] weight of unit-ish magnitude / sqrt(cols). FP8 codes avoid NaN unless nan_codes.
Weight MakeWeight(Rng& rng, Fmt fmt, int64_t rows, int64_t cols, int64_t block, bool nan_codes = false) {
  Weight w;
  WeightView& v = w.view;
  v.rows = rows;
  v.cols = cols;
  const float amp = 1.0f / std::sqrt(static_cast<float>(cols > 0 ? cols : 1));
  switch (fmt) {
    case Fmt::kF32: {
      v.format = WeightFormat::kF32;
      w.data.resize(rows * cols * sizeof(float));
      float* d = reinterpret_cast<float*>(w.data.data());
      for (int64_t i = 0; i < rows * cols; ++i) d[i] = amp * rng.Normal();
      break;
    }
    case Fmt::kBf16: {
      v.format = WeightFormat::kBf16;
      w.data.resize(rows * cols * sizeof(uint16_t));
      uint16_t* d = reinterpret_cast<uint16_t*>(w.data.data());
      for (int64_t i = 0; i < rows * cols; ++i) d[i] = dsv4::F32ToBf16(amp * rng.Normal());
      break;
    }
    case Fmt::kFp8E8m0:
    case Fmt::kFp8F32: {
      v.format = WeightFormat::kFp8E4M3;
      v.block = block;
      w.data.resize(rows * cols);
      for (auto& c : w.data) {
        c = static_cast<uint8_t>(rng.Index(256));
        if (!nan_codes && (c & 0x7F) == 0x7F) c ^= 0x01;
      }
      const int64_t sr = (rows + block - 1) / block, sc = (cols + block - 1) / block;
      if (fmt == Fmt::kFp8E8m0) {
        v.scale_format = ScaleFormat::kE8M0;
        w.scale.resize(sr * sc);
        for (auto& s : w.scale) s = static_cast<uint8_t>(112 + rng.Index(8));  // 2^-15 .. 2^-8
      } else {
        v.scale_format = ScaleFormat::kF32;
        w.scale.resize(sr * sc * sizeof(float));
        float* s = reinterpret_cast<float*>(w.scale.data());
        for (int64_t i = 0; i < sr * sc; ++i) s[i] = amp / 64.0f * rng.Uniform(0.5f, 2.0f);
      }
      break;
    }
    case Fmt::kFp4: {
      v.format = WeightFormat::kFp4E2M1;
      v.block = dsv4::kFp4Block;
      v.scale_format = ScaleFormat::kE8M0;
      w.data.resize(rows * cols / 2);
      for (auto& c : w.data) c = static_cast<uint8_t>(rng.Index(256));
      w.scale.resize(rows * (cols / 32));
      for (auto& s : w.scale) s = static_cast<uint8_t>(119 + rng.Index(6));
      break;
    }
  }
  v.data = w.data.data();
  v.scale = w.scale.empty() ? nullptr : w.scale.data();
  return w;
}

// A variant: runs Linear (slot semantics) for activation type act.
struct Variant {
  std::string name;
  IsaLevel needs;
  double parts;  // activation parts per product for fp32 activations (1, or 3 on the AMX tiles)
  std::function<void(ActType, const void*, int64_t, const WeightView&, int64_t, void*, const dsv4::Parallel&)> run;
};

dsv4::LinearBlocks AllTiles(const dsv4::LinearBlocks& b) {
  dsv4::LinearBlocks t = b;
  t.tile_min_rows[0] = t.tile_min_rows[1] = 1;
  t.tile_min_rows_in_place[0] = t.tile_min_rows_in_place[1] = 0;
  return t;
}

void RunTable(const dsv4::LinearKernels& k, ActType act, const void* x, int64_t m, const WeightView& w,
              int64_t groups, void* y, const dsv4::Parallel& par) {
  const bool fp8 = w.format == WeightFormat::kFp8E4M3, fp4 = w.format == WeightFormat::kFp4E2M1;
  if (act == ActType::kF32) {
    (fp8 ? k.f32_fp8 : fp4 ? k.f32_fp4 : k.f32_dense)(static_cast<const float*>(x), m, w, groups,
                                                       static_cast<float*>(y), par);
  } else {
    (fp8 ? k.bf16_fp8 : fp4 ? k.bf16_fp4 : k.bf16_dense)(static_cast<const uint16_t*>(x), m, w, groups,
                                                         static_cast<uint16_t*>(y), par);
  }
}

std::vector<Variant> Variants() {
  std::vector<Variant> v;
#if DSV4_X86_VARIANTS
  v.push_back({"avx2", IsaLevel::kAvx2, 1, [](ActType a, const void* x, int64_t m, const WeightView& w, int64_t g,
                                              void* y, const dsv4::Parallel& p) { RunTable(dsv4::avx2::kLinear, a, x, m, w, g, y, p); }});
  v.push_back({"avx512", IsaLevel::kAvx512, 1, [](ActType a, const void* x, int64_t m, const WeightView& w, int64_t g,
                                                  void* y, const dsv4::Parallel& p) { RunTable(dsv4::avx512::kLinear, a, x, m, w, g, y, p); }});
  v.push_back({"avx2_panels", IsaLevel::kAvx2, 1, [](ActType a, const void* x, int64_t m, const WeightView& w,
                                                     int64_t g, void* y, const dsv4::Parallel& p) {
                 static const dsv4::LinearBlocks b = AllTiles(dsv4::avx2::kLinearBlocks);
                 dsv4::RunLinear(b, a, x, m, w, g, y, p);
               }});
  v.push_back({"avx512_panels", IsaLevel::kAvx512, 1, [](ActType a, const void* x, int64_t m, const WeightView& w,
                                                         int64_t g, void* y, const dsv4::Parallel& p) {
                 static const dsv4::LinearBlocks b = AllTiles(dsv4::avx512::kLinearBlocks);
                 dsv4::RunLinear(b, a, x, m, w, g, y, p);
               }});
  v.push_back({"amx", IsaLevel::kAmx, 3, [](ActType a, const void* x, int64_t m, const WeightView& w, int64_t g,
                                            void* y, const dsv4::Parallel& p) { RunTable(dsv4::amx::kLinear, a, x, m, w, g, y, p); }});
  v.push_back({"amx_tiles", IsaLevel::kAmx, 3, [](ActType a, const void* x, int64_t m, const WeightView& w, int64_t g,
                                                  void* y, const dsv4::Parallel& p) {
                 static const dsv4::LinearBlocks b = AllTiles(dsv4::amx::kLinearBlocks);
                 dsv4::RunLinear(b, a, x, m, w, g, y, p);
               }});
#endif
#if DSV4_HAVE_AMX_EMULATION
  v.push_back({"amx_emu", IsaLevel::kScalar, 3, [](ActType a, const void* x, int64_t m, const WeightView& w, int64_t g,
                                                   void* y, const dsv4::Parallel& p) {
                 dsv4::RunLinear(dsv4::amx_emu::kLinearBlocks, a, x, m, w, g, y, p);
               }});
#endif
  return v;
}

struct Problem {
  ActType act;
  int64_t m, groups;
  Weight w;
  std::vector<float> x32;     // fp32 activations (act kF32)
  std::vector<uint16_t> x16;  // bf16 activations (act kBf16)
  // Run sets w.view.fp8_scaled_range as the ops do for constant scales (a scan); false keeps the view's own value
  bool scan_scales = true;
  const void* x() const { return act == ActType::kF32 ? static_cast<const void*>(x32.data()) : x16.data(); }
};

Problem MakeProblem(Rng& rng, ActType act, Fmt fmt, int64_t m, int64_t n, int64_t kw, int64_t groups, int64_t block,
                    bool nan_codes = false) {
  Problem p{act, m, groups, MakeWeight(rng, fmt, n, kw, block, nan_codes), {}, {}};
  const int64_t k = groups * kw;
  p.x32.resize(m * k);
  for (auto& v : p.x32) v = rng.Normal();
  if (act == ActType::kBf16) p.x16 = dsv4_test::ToBf16(p.x32);
  return p;
}

// Output as fp32 values (bf16 widened).
std::vector<float> Run(const std::function<void(ActType, const void*, int64_t, const WeightView&, int64_t, void*,
                                                const dsv4::Parallel&)>& f,
                       const Problem& p, const dsv4::Parallel& par) {
  const int64_t n = p.w.view.rows;
  WeightView w = p.w.view;
  if (p.scan_scales) dsv4_test::SetScaledRangeAsOps(w);
  if (p.act == ActType::kF32) {
    std::vector<float> y(p.m * n, -7.0f);
    f(p.act, p.x(), p.m, w, p.groups, y.data(), par);
    return y;
  }
  std::vector<uint16_t> y(p.m * n, 0xBEEF);
  f(p.act, p.x(), p.m, w, p.groups, y.data(), par);
  return dsv4_test::FromBf16(y);
}

std::vector<float> Reference(const Problem& p) {
  return Run([](ActType a, const void* x, int64_t m, const WeightView& w, int64_t g, void* y,
                const dsv4::Parallel& par) { RunTable(dsv4::ref::kLinear, a, x, m, w, g, y, par); },
             p, dsv4::SerialParallel());
}

// sum_k |x_k W_k| per output, with W as the reference decodes it.
std::vector<double> AbsSums(const Problem& p) {
  const WeightView& w = p.w.view;
  const int64_t n = w.rows, kw = w.cols, per_group = n / p.groups;
  std::vector<double> out(p.m * n);
  std::vector<float> row(kw > 0 ? kw : 1);
  for (int64_t j = 0; j < n; ++j) {
    dsv4::ref::DecodeWeightRow(w, j, p.act == ActType::kBf16, row.data());
    const int64_t g = j / per_group;
    for (int64_t i = 0; i < p.m; ++i) {
      double s = 0.0;
      for (int64_t c = 0; c < kw; ++c) {
        const float xv = p.act == ActType::kF32 ? p.x32[i * p.groups * kw + g * kw + c]
                                                : dsv4::Bf16ToF32(p.x16[i * p.groups * kw + g * kw + c]);
        s += std::fabs(static_cast<double>(xv) * row[c]);
      }
      out[i * n + j] = s;
    }
  }
  return out;
}

void ExpectMatches(const std::string& what, const Problem& p, const std::vector<float>& got,
                   const std::vector<float>& want, double parts) {
  KT_CHECK_EQ(got.size(), want.size()) << what;
  if (got.size() != want.size()) return;
  const std::vector<double> sums = AbsSums(p);
  const double kterms = parts * static_cast<double>(p.w.view.cols) + 2.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    if (std::isnan(g) || std::isnan(w)) {
      KT_CHECK(std::isnan(g) && std::isnan(w)) << what << "[" << i << "]: got " << g << ", want " << w;
      continue;
    }
    double tol = 2.0 * kterms * std::ldexp(sums[i], -24) + 1e-30;
    if (p.act == ActType::kBf16) tol += std::ldexp(std::fabs(w), -7) + std::ldexp(tol, -7);
    KT_CHECK(std::fabs(g - w) <= tol) << what << "[" << i << "] (row " << i / p.w.view.rows << ", col "
                                      << i % p.w.view.rows << "): got " << g << ", want " << w << ", tol " << tol;
  }
}

std::string Describe(const Problem& p, Fmt fmt) {
  return std::string(p.act == ActType::kF32 ? "f32" : "bf16") + " x " + FmtName(fmt) + " M=" + std::to_string(p.m) +
         " N=" + std::to_string(p.w.view.rows) + " Kw=" + std::to_string(p.w.view.cols) +
         " G=" + std::to_string(p.groups) +
         (p.w.view.format == WeightFormat::kFp8E4M3 ? " block=" + std::to_string(p.w.view.block) : "");
}

// The shape sweep of one variant, one activation type and one format.
void TestShapes(const Variant& v, ActType act, Fmt fmt) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(1234 + static_cast<int>(fmt) * 17 + static_cast<int>(act));
  const dsv4_test::ThreadParallel threads(3);
  const bool fp4 = fmt == Fmt::kFp4, fp8 = fmt == Fmt::kFp8E8m0 || fmt == Fmt::kFp8F32;
  struct Shape {
    int64_t n, kw, groups, block;
  };
  std::vector<Shape> shapes = {{37, fp4 ? 96 : 70, 1, 32}, {130, fp4 ? 320 : 300, 1, 128}, {5, fp4 ? 32 : 7, 1, 32},
                               {96, 64, 3, 32}, {67, fp4 ? 4128 : 4109, 1, 128}};
  if (fp8) shapes.push_back({40, 50, 1, 16});  // block 16: the levels hand it to the reference
  for (const Shape& s : shapes) {
    for (int64_t m : {1, 2, 3, 4, 5, 8, 16, 17, 69}) {
      if (s.kw > 1000 && m > 17 && v.name == "amx_emu") continue;  // emulated tiles are slow
      Problem p = MakeProblem(rng, act, fmt, m, s.n, s.kw, s.groups, s.block);
      const std::vector<float> want = Reference(p);
      const std::vector<float> got = Run(v.run, p, threads.Get());
      ExpectMatches(v.name + " " + Describe(p, fmt), p, got, want, act == ActType::kF32 ? v.parts : 1.0);
      if (m == 5 || m == 17) {  // thread count must not matter
        const std::vector<float> serial = Run(v.run, p, dsv4::SerialParallel());
        dsv4_test::ExpectIdentical(v.name + " serial vs threads " + Describe(p, fmt), serial, got);
      }
      if (fp8) {  // the NaN-free promise (no NaN codes here) changes no result
        p.w.view.fp8_finite = true;
        dsv4_test::ExpectIdentical(v.name + " fp8_finite " + Describe(p, fmt), Run(v.run, p, threads.Get()), got);
      }
    }
  }
}

// FP8 NaN codes decode to NaN and reach exactly the outputs that read them (against a zero activation too, with
// either scale format, in a row's last partial chunk and in the last partial group of rows; with and without batch
// invariance, whose loops differ above four rows); M = 0 and N = 0 write nothing; Kw = 0 gives zeros.
void TestNanAndEmpty(const Variant& v) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(99);
  for (ActType act : {ActType::kF32, ActType::kBf16}) {
    for (Fmt fmt : {Fmt::kFp8E8m0, Fmt::kFp8F32}) {
      // 128-column blocks: fp32 activation rows alone and in pairs (also under batch invariance) take the quad route
      for (const auto& [m, invariant, block] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {1, 0, 32}, {2, 0, 32}, {3, 0, 32}, {4, 0, 32}, {6, 0, 32}, {20, 0, 32}, {6, 32, 32}, {20, 32, 32},
               {1, 0, 128}, {2, 0, 128}, {3, 0, 128}, {6, 32, 128}, {20, 32, 128}}) {
        Problem p = MakeProblem(rng, act, fmt, m, 39, 77, 1, block);
        p.w.view.invariant_rows = invariant;
        p.w.data[3 * 77 + 5] = 0x7F;
        p.w.data[17 * 77 + 76] = 0xFF;  // the row's partial last chunk
        p.w.data[38 * 77 + 40] = 0x7F;  // the last, partial group of four rows (36..38)
        for (int64_t i = 0; i < m; ++i) {  // a NaN code meets a zero activation: still NaN
          if (act == ActType::kF32) {
            p.x32[i * 77 + 5] = 0.0f;
          } else {
            p.x16[i * 77 + 5] = 0;
          }
        }
        const std::vector<float> got = Run(v.run, p, dsv4::SerialParallel());
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < 39; ++j) {
            const bool nan = std::isnan(got[i * 39 + j]);
            KT_CHECK(nan == (j == 3 || j == 17 || j == 38))
                << v.name << " " << FmtName(fmt) << " M=" << m << " block=" << block << " invariant_rows=" << invariant
                << " row " << i
                << " col " << j << ": " << got[i * 39 + j];
          }
        }
      }
    }
    const Problem p = MakeProblem(rng, act, Fmt::kBf16, 0, 8, 16, 1, 32);
    v.run(act, nullptr, 0, p.w.view, 1, nullptr, dsv4::SerialParallel());
    Problem q = MakeProblem(rng, act, Fmt::kBf16, 3, 0, 16, 1, 32);
    v.run(act, q.x(), 3, q.w.view, 1, nullptr, dsv4::SerialParallel());
    for (int64_t m : {3, 20}) {  // Kw = 0: zeros (rows and tiles paths)
      Problem z = MakeProblem(rng, act, Fmt::kBf16, m, 7, 0, 1, 32);
      const std::vector<float> got = Run(v.run, z, dsv4::SerialParallel());
      for (float g : got) KT_CHECK(g == 0.0f) << v.name << " Kw = 0, M = " << m << ": " << g;
    }
  }
}

// E8M0 scale extremes (bytes 1 and 254 with small / large codes) decode exactly on the fp32 rows paths.
void TestScaleExtremes(const Variant& v) {
  dsv4_test::RequireIsa(v.needs);
  for (Fmt fmt : {Fmt::kFp8E8m0, Fmt::kFp4}) {
    Rng rng(5);
    Problem p = MakeProblem(rng, ActType::kF32, fmt, 1, 2, 64, 1, 32);
    std::fill(p.w.data.begin(), p.w.data.end(), 0);
    p.x32.assign(64, 0.0f);
    p.x32[0] = 1.0f;
    if (fmt == Fmt::kFp4) {
      p.w.data[0] = 0x02;   // row 0, col 0: 1.0 x 2^127
      p.w.data[32] = 0x07;  // row 1, col 0: 6.0 x 2^-126
      p.w.scale = {254, 254, 1, 1};
    } else {
      // 33 rows (two row blocks of 32): row 0 reads scale byte 1, row 32 scale byte 254
      p = MakeProblem(rng, ActType::kF32, fmt, 1, 33, 64, 1, 32);
      std::fill(p.w.data.begin(), p.w.data.end(), 0);
      p.x32.assign(64, 0.0f);
      p.x32[0] = 1.0f;
      p.w.data[0] = 0x70;        // 128 x 2^-126
      p.w.data[32 * 64] = 0x08;  // 2^-6 x 2^127
      p.w.scale = {1, 1, 254, 254};
    }
    p.w.view.scale = p.w.scale.data();
    const std::vector<float> want = Reference(p), got = Run(v.run, p, dsv4::SerialParallel());
    for (size_t i = 0; i < want.size(); ++i) {
      KT_CHECK(got[i] == want[i] || (std::isinf(got[i]) && got[i] == want[i]))
          << v.name << " " << FmtName(fmt) << " output " << i << ": got " << got[i] << ", want " << want[i];
    }
  }
}

#if DSV4_X86_VARIANTS && DSV4_HAVE_AMX_EMULATION
// The real tiles equal the emulated ones bit for bit (same decoding values, same tile arithmetic).
void TestAmxMatchesEmulation() {
  dsv4_test::RequireIsa(IsaLevel::kAmx);
  const dsv4::LinearBlocks hw = AllTiles(dsv4::amx::kLinearBlocks);
  const dsv4_test::ThreadParallel threads(2);
  Rng rng(77);
  for (ActType act : {ActType::kF32, ActType::kBf16}) {
    for (Fmt fmt : kFormats) {
      if (act == ActType::kF32 && (fmt == Fmt::kF32 || fmt == Fmt::kFp8F32)) continue;  // not on the tiles
      for (int64_t m : {1, 17, 40}) {
        const Problem p = MakeProblem(rng, act, fmt, m, 100, fmt == Fmt::kFp4 ? 192 : 200, 1, 64);
        const auto run_hw = [&](ActType a, const void* x, int64_t mm, const WeightView& w, int64_t g, void* y,
                                const dsv4::Parallel& par) { dsv4::RunLinear(hw, a, x, mm, w, g, y, par); };
        const auto run_emu = [&](ActType a, const void* x, int64_t mm, const WeightView& w, int64_t g, void* y,
                                 const dsv4::Parallel& par) {
          dsv4::RunLinear(dsv4::amx_emu::kLinearBlocks, a, x, mm, w, g, y, par);
        };
        dsv4_test::ExpectIdentical("amx vs amx_emu " + Describe(p, fmt), Run(run_hw, p, threads.Get()),
                                   Run(run_emu, p, dsv4::SerialParallel()));
      }
    }
  }
}

// The vectorised activation layout and decoding equal the portable specification.
void TestLayoutsMatchPortable() {
  dsv4_test::RequireIsa(IsaLevel::kAvx512);
  Rng rng(3);
  for (ActType act : {ActType::kF32, ActType::kBf16}) {
    for (int64_t m : {1, 16, 21}) {
      for (int64_t kw : {1, 31, 64, 77}) {
        const Problem p = MakeProblem(rng, act, Fmt::kBf16, m, 4, kw, 1, 32);
        const size_t bytes = dsv4::TileXBytes(act, m, kw);
        std::vector<uint8_t> a(bytes, 0xAB), b(bytes, 0xCD);
        const int64_t blocks = (m + 15) / 16;
        dsv4::avx512::PrepareTileBlocks(act, p.x(), kw, nullptr, m, kw, 0, blocks, a.data());
        dsv4::portable::PrepareTileBlocks(act, p.x(), kw, nullptr, m, kw, 0, blocks, b.data());
        dsv4_test::ExpectIdentical("tile layout " + Describe(p, Fmt::kBf16), a, b);
      }
    }
  }
  for (Fmt fmt : kFormats) {
    const Weight w = MakeWeight(rng, fmt, 9, fmt == Fmt::kFp4 ? 96 : 77, 32);
    const int64_t kc = 96;
    std::vector<uint16_t> a(12 * kc, 1), b(12 * kc, 2);
    dsv4::avx512::DecodeRowsBf16(w.view, 2, 12, 0, kc, a.data(), kc);
    dsv4::portable::DecodeRowsBf16(w.view, 2, 12, 0, kc, b.data(), kc);
    dsv4_test::ExpectIdentical(std::string("bf16 decode ") + FmtName(fmt), a, b);
  }
}
#endif

#if DSV4_X86_VARIANTS
// Many tokens on the AVX512 panels: more than one pass over the weight rows (fp32: 24 token blocks per pass, bf16:
// 48), several 512-column blocks with a tail, a partial last group of rows, or whole groups and steps (in place);
// thread count must not matter.
void TestPanelPasses() {
  dsv4_test::RequireIsa(IsaLevel::kAvx512);
  Rng rng(7);
  const dsv4_test::ThreadParallel threads(3);
  for (ActType act : {ActType::kF32, ActType::kBf16}) {
    for (Fmt fmt : {Fmt::kBf16, Fmt::kFp8E8m0, Fmt::kFp4}) {
      for (int64_t m : {int64_t{401}, int64_t{801}}) {
        // 96 x 1088: whole groups of rows and 32-column steps (bf16 weights are then read in place)
        const bool whole = m == 801;
        Problem p = MakeProblem(rng, act, fmt, m, whole ? 96 : 75, whole || fmt == Fmt::kFp4 ? 1088 : 1100, 1, 32);
        const std::vector<float> want = Reference(p);
        const auto run = [](ActType a, const void* x, int64_t mm, const WeightView& w, int64_t g, void* y,
                            const dsv4::Parallel& par) { RunTable(dsv4::avx512::kLinear, a, x, mm, w, g, y, par); };
        const std::vector<float> got = Run(run, p, threads.Get());
        ExpectMatches("avx512 panels " + Describe(p, fmt), p, got, want, 1.0);
        dsv4_test::ExpectIdentical("avx512 panels serial vs threads " + Describe(p, fmt),
                                   Run(run, p, dsv4::SerialParallel()), got);
      }
    }
  }
}
#endif

// SplitBf16x3 reconstructs x exactly for |x| >= 2^-100 (below that the last parts are flushed denormals), keeps
// non-finite x in the first part.
KT_TEST(linear_split_bf16x3) {
  Rng rng(1);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::ldexp(rng.Normal(), static_cast<int>(rng.Index(190)) - 90);
    uint16_t h, m, l;
    dsv4::SplitBf16x3(x, &h, &m, &l);
    const double sum = static_cast<double>(dsv4::Bf16ToF32(h)) + dsv4::Bf16ToF32(m) + dsv4::Bf16ToF32(l);
    KT_CHECK(sum == static_cast<double>(x)) << "x = " << x << " sum " << sum;
  }
  for (float x : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    uint16_t h, m, l;
    dsv4::SplitBf16x3(x, &h, &m, &l);
    KT_CHECK(dsv4::Bf16ToF32(h) == x && m == 0 && l == 0);
  }
}

// The bf16 compute mode (linear.h, f32bf16_* slots): each level's blocks (rows, panels / tiles, the emulated AMX
// tiles) through RunLinearBf16Products against the reference slot, every format, decode and prefill row counts.
void TestBf16Products(const std::string& name, const dsv4::LinearBlocks& blocks, IsaLevel needs) {
  dsv4_test::RequireIsa(needs);
  Rng rng(4242);
  const dsv4_test::ThreadParallel threads(3);
  for (Fmt fmt : kFormats) {
    const bool fp4 = fmt == Fmt::kFp4, fp8 = fmt == Fmt::kFp8E8m0 || fmt == Fmt::kFp8F32;
    const dsv4::LinearKernels& r = dsv4::ref::kLinear;
    const dsv4::LinearF32Fn ref = fp8 ? r.f32bf16_fp8 : fp4 ? r.f32bf16_fp4 : r.f32bf16_dense;
    for (int64_t m : {1, 5, 17, 40}) {
      for (int64_t groups : {1, 2}) {
        Problem p = MakeProblem(rng, ActType::kF32, fmt, m, 38, fp4 ? 320 : 300, groups, 32);
        std::vector<float> want(p.m * p.w.view.rows), got(p.m * p.w.view.rows, -7.0f);
        ref(p.x32.data(), p.m, p.w.view, p.groups, want.data(), dsv4::SerialParallel());
        dsv4::RunLinearBf16Products(blocks, p.x32.data(), p.m, p.w.view, p.groups, got.data(), threads.Get());
        ExpectMatches(name + " bf16 products " + Describe(p, fmt), p, got, want, 1.0);
      }
    }
  }
}

// Batch invariance (WeightView::invariant_rows): with the bound set, row i of an M-row call equals, bit for bit,
// the same row computed alone, for every format, activation type and M up to the bound; the serving engine's
// promise that a request's output does not depend on what decodes beside it rests on this. Rows at different M
// would otherwise take different inner loops (in-register decode for M <= 4, scratch-decoded rows above, panels
// or tiles from the level's crossover), which sum in different orders.
void TestBatchInvariant(const Variant& v, ActType act, Fmt fmt) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(31337);
  const dsv4_test::ThreadParallel threads(2);
  constexpr int64_t kBound = 40;
  const bool fp4 = fmt == Fmt::kFp4;
  struct Shape {
    int64_t n, kw, groups, block;
  };
  // 3000 columns: one activation row reads the weight rows one at a time where two do not (RowsBlock's one_row,
  // DotFp8Rows)
  // Both row orders of the plan (WeightView::prefetch; off, one bf16 activation row reads FP8 rows one at a time
  // where the activations fit kFp8OneRowXBytes).
  // fp32 activations against FP8 rows with 128-column scale blocks take the quad route (activations reordered and
  // scaled by 2^112) row by row while every |x| < 2^15: with one large activation (row 5) that row takes the fp16
  // route, alone and in the pair (4, 5), and must still sum as it does alone, as must its neighbour.
  const bool fp8 = fmt == Fmt::kFp8E8m0 || fmt == Fmt::kFp8F32;
  for (const auto& [s, prefetch, large] : std::vector<std::tuple<Shape, bool, bool>>{
           {{70, fp4 ? 320 : 300, 1, 32}, true, false}, {{256, 256, 1, 128}, true, false},
           {{128, 64, 4, 128}, true, false}, {{64, 1024, 1, 128}, true, false},
           {{24, fp4 ? 3008 : 3000, 1, 128}, true, false}, {{70, fp4 ? 320 : 300, 1, 32}, false, false},
           {{64, 1024, 1, 128}, false, false}, {{24, 2048, 1, 128}, false, false}, {{64, 1024, 1, 128}, true, true},
           {{24, 2048, 1, 128}, false, true}}) {
    if (large && (act != ActType::kF32 || !fp8)) continue;
    Problem all = MakeProblem(rng, act, fmt, kBound, s.n, s.kw, s.groups, s.block);
    if (large) all.x32[5 * s.kw * s.groups + 3] = 1.0e6f;  // 2^112 times it overflows fp32
    all.w.view.invariant_rows = kBound;
    all.w.view.prefetch = prefetch;
    const int64_t n = all.w.view.rows, k = all.w.view.cols * all.groups;
    std::vector<std::vector<float>> alone(kBound);
    for (int64_t i = 0; i < kBound; ++i) {
      Problem one = all;
      one.m = 1;
      one.w.view.data = one.w.data.data();
      one.w.view.scale = one.w.scale.empty() ? nullptr : one.w.scale.data();
      one.x32.assign(all.x32.begin() + i * k, all.x32.begin() + (i + 1) * k);
      if (act == ActType::kBf16) one.x16.assign(all.x16.begin() + i * k, all.x16.begin() + (i + 1) * k);
      alone[i] = Run(v.run, one, threads.Get());
    }
    for (int64_t m : {2, 3, 4, 5, 8, 15, 16, 17, 24, 33, 40}) {
      Problem p = all;
      p.m = m;
      p.w.view.data = p.w.data.data();
      p.w.view.scale = p.w.scale.empty() ? nullptr : p.w.scale.data();
      const std::vector<float> got = Run(v.run, p, threads.Get());
      int64_t differ = 0;
      for (int64_t i = 0; i < m; ++i) differ += std::memcmp(got.data() + i * n, alone[i].data(), n * sizeof(float)) != 0;
      KT_CHECK(differ == 0) << v.name << " " << Describe(p, fmt) << " invariant_rows=" << kBound << " prefetch "
                            << prefetch << (large ? " large x" : "") << ": " << differ
                            << " of " << m << " rows differ from the row computed alone";
    }
  }
}

// bf16 products against FP8 rows with E8M0 scales: a weight whose every scale byte lies in [10, 246] decodes with
// the scale in the exponent and sums without block sums (ScaledBf16, linear_fused_avx512.cc); one byte outside sends
// the whole weight back to the folded loops. Either way each row matches the reference and sums as it does alone
// under batch invariance; the scaled weight's rows also equal their one-row results without it, at every row count
// below the panels on the AVX512 rows paths (they then all sum bf16(code * scale) * x in column order).
void TestFp8ScaledRoutes(const Variant& v) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(2718);
  const dsv4_test::ThreadParallel threads(2);
  constexpr int64_t kRows = 23;
  // 0: the usual bytes only; -1: the same without the op's scan (WeightView::fp8_scaled_range false, the folded
  // loops); else one scale byte set to it
  for (int extreme : {0, -1, 9, 247, 10, 246}) {
    for (int64_t block : {32, 128}) {
      Problem all = MakeProblem(rng, ActType::kBf16, Fmt::kFp8E8m0, kRows, 70, 300, 1, block);
      all.scan_scales = extreme != -1;
      if (extreme > 0) {
        // one block's scale byte; above 2^100 its codes are kept subnormal (at most 7 x 2^-9) so sums stay finite
        const int64_t at = static_cast<int64_t>(all.w.scale.size() / 2), scale_cols = (300 + block - 1) / block;
        all.w.scale[at] = static_cast<uint8_t>(extreme);
        for (int64_t r = (at / scale_cols) * block; r < std::min<int64_t>(70, (at / scale_cols + 1) * block); ++r) {
          for (int64_t c = (at % scale_cols) * block; c < std::min<int64_t>(300, (at % scale_cols + 1) * block); ++c) {
            if (extreme > 227) all.w.data[r * 300 + c] &= 0x87;
          }
        }
      }
      all.w.view.scale = all.w.scale.data();
      const bool scaled = extreme == 0 || (extreme >= dsv4::kFp8ScaledMinE && extreme <= dsv4::kFp8ScaledMaxE);
      const int64_t n = all.w.view.rows, k = all.w.view.cols;
      for (int64_t invariant : {int64_t{0}, kRows}) {
        all.w.view.invariant_rows = invariant;
        std::vector<std::vector<float>> alone(kRows);
        for (int64_t i = 0; i < kRows; ++i) {
          Problem one = all;
          one.m = 1;
          one.w.view.data = one.w.data.data();
          one.w.view.scale = one.w.scale.data();
          one.x16.assign(all.x16.begin() + i * k, all.x16.begin() + (i + 1) * k);
          alone[i] = Run(v.run, one, threads.Get());
        }
        for (int64_t m : {2, 4, 5, 8, 9, 12, 16, 17, 23}) {
          Problem p = all;
          p.m = m;
          p.w.view.data = p.w.data.data();
          p.w.view.scale = p.w.scale.data();
          p.x16.resize(m * k);
          const std::vector<float> got = Run(v.run, p, threads.Get());
          ExpectMatches(v.name + " scale byte " + std::to_string(extreme) + " " + Describe(p, Fmt::kFp8E8m0), p, got,
                        Reference(p), 1.0);
          // without invariance: only the AVX512 rows paths promise one-row sums for scaled weights (the folded
          // loops and the AVX2 level sum otherwise above their decode-path row counts)
          if (invariant == 0 && (!scaled || v.needs < IsaLevel::kAvx512)) continue;
          int64_t differ = 0;
          for (int64_t i = 0; i < m; ++i)
            differ += std::memcmp(got.data() + i * n, alone[i].data(), n * sizeof(float)) != 0;
          KT_CHECK(differ == 0) << v.name << " scale byte " << extreme << " block " << block << " M=" << m
                                << " invariant_rows=" << invariant << ": " << differ
                                << " rows differ from the row computed alone";
        }
      }
    }
  }
}

// The load-time scan behind WeightView::fp8_scaled_range: every byte in [10, 246], nothing else.
void TestFp8ScaledRangeScan() {
  std::vector<uint8_t> s(300, 127);
  KT_CHECK(dsv4::Fp8ScalesScaledRange(s.data(), s.size())) << "bytes of 127";
  for (const auto& [byte, in] : std::vector<std::pair<int, bool>>{{10, true}, {246, true}, {9, false}, {247, false},
                                                                  {0, false}, {254, false}}) {
    for (size_t at : {size_t{0}, size_t{63}, size_t{64}, s.size() - 1}) {
      std::vector<uint8_t> t = s;
      t[at] = static_cast<uint8_t>(byte);
      KT_CHECK(dsv4::Fp8ScalesScaledRange(t.data(), t.size()) == in) << "byte " << byte << " at " << at;
      KT_CHECK(dsv4::Fp8ScalesScaledRange(t.data(), at)) << "the bytes before " << at << " only";
    }
  }
}

// The scaled decoding's upper bound: scale byte 250 puts code 0x68 (2^6) past bf16's exponent field, where adding
// to the exponent would carry into the sign; a weight holding that byte takes the folded loops and gives the
// reference's +inf (bf16 activations, one-hot x). Codes 0x60 (2^5: exactly the field's 255, infinity) and 0x58 under
// the same byte stay exact. (Below kScaledMinE the guard keeps the folded loops' sums of subnormal products, which
// the scratch path flushes as VDPBF16PS does: linear_avx512.cc.)
void TestFp8ScaledGuard(const Variant& v) {
  dsv4_test::RequireIsa(v.needs);
  for (const auto& [byte, code] : std::vector<std::pair<uint8_t, uint8_t>>{{250, 0x68}, {250, 0x60}, {250, 0x58}}) {
    for (int64_t m : {1, 16}) {
      for (int64_t invariant : {int64_t{0}, int64_t{16}}) {
        Rng rng(3);
        Problem p = MakeProblem(rng, ActType::kBf16, Fmt::kFp8E8m0, m, 8, 64, 1, 32);
        std::fill(p.w.data.begin(), p.w.data.end(), 0);
        p.w.data[0] = code;  // row 0, column 0: the first scale block
        p.w.scale = {byte, 127};
        p.w.view.scale = p.w.scale.data();
        p.w.view.invariant_rows = invariant;
        p.x32.assign(m * 64, 0.0f);
        for (int64_t i = 0; i < m; ++i) p.x32[i * 64] = 1.0f;
        p.x16 = dsv4_test::ToBf16(p.x32);
        const std::vector<float> want = Reference(p), got = Run(v.run, p, dsv4::SerialParallel());
        for (int64_t i = 0; i < m; ++i) {
          const float g = got[i * 8], w = want[i * 8];
          KT_CHECK(g == w && w != 0.0f) << v.name << " scale byte " << int{byte} << " code 0x" << std::hex << int{code}
                                        << std::dec << " M=" << m << " invariant_rows=" << invariant << " row " << i
                                        << ": got " << g << ", want " << w;
        }
      }
    }
  }
}

// f() with MXCSR.DAZ set when daz (x86; elsewhere as is), the previous MXCSR restored after.
template <class F>
auto RunWithDaz(bool daz, F f) {
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned int csr = _mm_getcsr();
  if (daz) _mm_setcsr(csr | 0x40);
  auto r = f();
  _mm_setcsr(csr);
  return r;
#else
  (void)daz;
  return f();
#endif
}

// The weight prefetch (WeightView::prefetch, off on AMD Zen 4) only moves data: results are bit-identical with it
// on and off, for every format (bf16 / fp32 rows read in place are the ones it applies to) and row counts on the
// rows path and above it.
// Every FP8 code decodes to its exact value in every inner loop: activation rows that are one-hot (1.0 at column j
// of row i) make output (i, n) the weight W[n, j] itself, which must equal code value x E8M0 scale exactly
// (subnormal codes, zeros and both signs included; NaN codes have their own test). Tolerance-based checks could
// miss one wrong table entry among 256 codes.
void TestFp8CodesExact(const Variant& v) {
  dsv4_test::RequireIsa(v.needs);
  constexpr int64_t kN = 8, kK = 256, kBlock = 128;
  Weight w;
  w.view.format = WeightFormat::kFp8E4M3;
  w.view.scale_format = ScaleFormat::kE8M0;
  w.view.rows = kN;
  w.view.cols = kK;
  w.view.block = kBlock;
  w.data.resize(kN * kK);
  for (int64_t n = 0; n < kN; ++n) {
    for (int64_t k = 0; k < kK; ++k) {
      const uint8_t c = static_cast<uint8_t>((k + 37 * n) & 0xFF);
      w.data[n * kK + k] = (c & 0x7F) == 0x7F ? 0 : c;
    }
  }
  w.scale = {127, 120};  // 1 and 2^-7, per 128-column block
  for (ActType act : {ActType::kF32, ActType::kBf16}) {
    for (int64_t m : {1, 2, 3, 4, 5, 6, 8, 12, 16}) {
      for (int mode = 0; mode < 3; ++mode) {  // the plan's two row orders (DotFp8Rows), 5-8 fp32 rows' two paths
        const bool prefetch = mode == 0, daz = mode == 2;
        Problem p{act, m, 1, w, {}, {}};
        p.w.view.data = p.w.data.data();
        p.w.view.scale = p.w.scale.data();
        p.w.view.prefetch = prefetch;
        for (int64_t j = 0; j < kK; ++j) {
          p.x32.assign(m * kK, 0.0f);
          for (int64_t i = 0; i < m; ++i) p.x32[i * kK + (j + 61 * i) % kK] = 1.0f;
          p.x16 = dsv4_test::ToBf16(p.x32);
          // MXCSR.DAZ set (denormal inputs read as zero) must not lose the subnormal codes: the integer route of one
          // fp32 row (codes times 2^-120, subnormal in fp32) steps aside then
          const std::vector<float> got = RunWithDaz(daz, [&] { return Run(v.run, p, dsv4::SerialParallel()); });
          for (int64_t i = 0; i < m; ++i) {
            const int64_t col = (j + 61 * i) % kK;
            for (int64_t n = 0; n < kN; ++n) {
              const uint8_t code = p.w.data[n * kK + col];
              const float want = dsv4::Fp8E4M3ToF32(code) * dsv4::E8M0ToF32(p.w.scale[col / kBlock]);
              const float g = got[i * kN + n];
              KT_CHECK(g == want)  // exact (a sum from +0 turns the -0 code into +0)
                  << v.name << (act == ActType::kF32 ? " f32" : " bf16") << " M=" << m << " prefetch " << prefetch
                  << (daz ? " DAZ" : "")
                  << " row " << i << " code 0x" << std::hex << int{code} << std::dec << " (column " << col
                  << "): got " << g << ", want " << want;
            }
          }
        }
      }
    }
  }
}

void TestPrefetchOff(const Variant& v) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(515);
  const dsv4_test::ThreadParallel threads(2);
  for (ActType act : {ActType::kF32, ActType::kBf16}) {
    for (Fmt fmt : kFormats) {
      // 5-8: FP8 with fp32 x in register groups when off; bf16 rows go one weight row at a time for one activation
      // row (both widths at 299 columns, bf16 at 3000), side by side with the block-ahead prefetch for the other
      // counts (its range clamped at the last of 37 rows); folded FP8 rows one at a time for small activation blocks
      // (kOneRowXBytes, kFp8OneRowXBytes)
      for (const auto& [m, kw] : std::vector<std::pair<int64_t, int64_t>>{
               {1, 299}, {2, 299}, {3, 299}, {4, 299}, {5, 299}, {6, 299}, {8, 299}, {9, 299}, {16, 299}, {17, 299},
               {2, 1000}, {1, 3000}, {2, 3000}, {3, 3000}, {4, 3000}, {5, 3000}}) {
        // FP8 scale blocks of 128 columns: one or two fp32 rows take the quad route
        const bool fp8 = fmt == Fmt::kFp8E8m0 || fmt == Fmt::kFp8F32;
        Problem on = MakeProblem(rng, act, fmt, m, 37, fmt == Fmt::kFp4 ? (kw == 299 ? 288 : 3008) : kw, 1,
                                 fp8 && m <= 2 && kw >= 1000 ? 128 : 32);
        // one or two fp32 rows against FP8 rows with 128-column blocks take the quad route (activations scaled by
        // 2^112) only while every |x| < 2^15: a large activation (in the last row) must send that row to the fp16
        // route, not overflow
        for (bool large : {false, true}) {
          if (large && (act != ActType::kF32 || m > 2)) continue;
          if (large) on.x32[(m - 1) * on.w.view.cols + 7] = 1.0e6f;  // 2^112 times it overflows fp32
          Problem off = on;
          off.w.view.data = off.w.data.data();
          off.w.view.scale = off.w.scale.empty() ? nullptr : off.w.scale.data();
          off.w.view.prefetch = false;
          dsv4_test::ExpectIdentical(v.name + " prefetch off " + Describe(on, fmt) + (large ? " large x" : ""),
                                     Run(v.run, off, threads.Get()), Run(v.run, on, threads.Get()));
        }
      }
    }
  }
}

const bool kRegistered = [] {
  for (const Variant& v : Variants()) {
    kt::Register("linear_" + v.name + "_prefetch_off", [v] { TestPrefetchOff(v); });
    for (ActType act : {ActType::kF32, ActType::kBf16}) {
      for (Fmt fmt : kFormats) {
        kt::Register("linear_" + v.name + "_" + (act == ActType::kF32 ? "f32" : "bf16") + "_" + FmtName(fmt),
                     [v, act, fmt] { TestShapes(v, act, fmt); });
        kt::Register("linear_" + v.name + "_batch_invariant_" + (act == ActType::kF32 ? "f32" : "bf16") + "_" +
                         FmtName(fmt),
                     [v, act, fmt] { TestBatchInvariant(v, act, fmt); });
      }
    }
    kt::Register("linear_" + v.name + "_nan_codes_and_empty", [v] { TestNanAndEmpty(v); });
    kt::Register("linear_" + v.name + "_scale_extremes", [v] { TestScaleExtremes(v); });
    kt::Register("linear_" + v.name + "_fp8_codes_exact", [v] { TestFp8CodesExact(v); });
    kt::Register("linear_" + v.name + "_fp8_scaled_routes", [v] { TestFp8ScaledRoutes(v); });
    kt::Register("linear_" + v.name + "_fp8_scaled_guard", [v] { TestFp8ScaledGuard(v); });
  }
  kt::Register("linear_fp8_scaled_range_scan", TestFp8ScaledRangeScan);
#if DSV4_X86_VARIANTS && DSV4_HAVE_AMX_EMULATION
  kt::Register("linear_amx_matches_emulation", TestAmxMatchesEmulation);
  kt::Register("linear_avx512_layouts_match_portable", TestLayoutsMatchPortable);
#endif
#if DSV4_X86_VARIANTS
  kt::Register("linear_avx512_panel_passes", TestPanelPasses);
  kt::Register("linear_avx2_bf16_products",
               [] { TestBf16Products("avx2", dsv4::avx2::kLinearBlocks, IsaLevel::kAvx2); });
  kt::Register("linear_avx512_bf16_products",
               [] { TestBf16Products("avx512", dsv4::avx512::kLinearBlocks, IsaLevel::kAvx512); });
  kt::Register("linear_avx512_panels_bf16_products", [] {
    static const dsv4::LinearBlocks b = AllTiles(dsv4::avx512::kLinearBlocks);
    TestBf16Products("avx512_panels", b, IsaLevel::kAvx512);
  });
  kt::Register("linear_amx_bf16_products",
               [] { TestBf16Products("amx", dsv4::amx::kLinearBlocks, IsaLevel::kAmx); });
#endif
#if DSV4_HAVE_AMX_EMULATION
  kt::Register("linear_amx_emu_bf16_products",
               [] { TestBf16Products("amx_emu", dsv4::amx_emu::kLinearBlocks, IsaLevel::kScalar); });
#endif
  kt::Register("linear_portable_bf16_products",
               [] { TestBf16Products("portable", dsv4::portable::kRowBlocks, IsaLevel::kScalar); });
  return true;
}();

}  // namespace
