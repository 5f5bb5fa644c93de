// MoE expert kernels (kernels/moe_experts.h, moe_experts_fast.cc): every accelerated variant against the scalar
// reference (moe_experts_ref.cc) for every weight format, both activation types, routed and dense (shared-expert)
// mode, token counts that put experts on the rows path, the tiles path or both, odd d / I (tails) and the SwiGLU
// clamp on and off.
//
// Variants: the avx2 / avx512 / amx tables as dispatched, the AVX2 / AVX512 panels for every expert, the
// AMX tiles for every expert (amx_tiles, real hardware) and on the tile emulation (amx_emu, any CPU).
//
// Tolerances. The matmuls differ from the reference only in summation order (linear.h), but the result passes
// through rounding points (bf16: h1, h3, the activation, each expert's output) and the SwiGLU, so a one-ulp change
// of an intermediate can move the output by about one ulp of the terms it feeds. Measured on these data: fp32
// outputs agree to ~1e-6 of the output scale, bf16 outputs to about one bf16 ulp. Checked: fp32 |got - want| <=
// 1e-5 (rtol) |want| + 1e-5 rms(want); bf16 <= 2^-6 |want| + 2^-7 rms(want). Results must not depend on the thread
// count (bitwise).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/kernels/moe_experts.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp4.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::ActType;
using dsv4::ExpertWeights;
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

// Stacked [E, rows, cols] weights of one format; `gain` sets |row . x| for x of unit entries.
struct Stacked {
  std::vector<uint8_t> data, scale;
  WeightView first;
};

Stacked MakeStacked(Rng& rng, Fmt fmt, int64_t experts, int64_t rows, int64_t cols, int64_t block, float gain) {
  Stacked s;
  WeightView& v = s.first;
  v.rows = rows;
  v.cols = cols;
  const float amp = gain / std::sqrt(static_cast<float>(cols));
  const int64_t n = experts * rows * cols;
  switch (fmt) {
    case Fmt::kF32: {
      v.format = WeightFormat::kF32;
      s.data.resize(n * sizeof(float));
      float* d = reinterpret_cast<float*>(s.data.data());
      for (int64_t i = 0; i < n; ++i) d[i] = amp * rng.Normal();
      break;
    }
    case Fmt::kBf16: {
      v.format = WeightFormat::kBf16;
      s.data.resize(n * sizeof(uint16_t));
      uint16_t* d = reinterpret_cast<uint16_t*>(s.data.data());
      for (int64_t i = 0; i < n; ++i) d[i] = dsv4::F32ToBf16(amp * rng.Normal());
      break;
    }
    case Fmt::kFp8E8m0:
    case Fmt::kFp8F32: {
      v.format = WeightFormat::kFp8E4M3;
      v.block = block;
      s.data.resize(n);
      for (auto& c : s.data) {
        c = static_cast<uint8_t>(rng.Index(256));
        if ((c & 0x7F) == 0x7F) c ^= 0x01;
      }
      // |code| averages ~100: scale ~ amp / 100
      const int64_t per = ((rows + block - 1) / block) * ((cols + block - 1) / block);
      if (fmt == Fmt::kFp8E8m0) {
        v.scale_format = ScaleFormat::kE8M0;
        s.scale.resize(experts * per);
        const int e0 = 127 + static_cast<int>(std::floor(std::log2(amp / 100.0f)));
        for (auto& b : s.scale) b = static_cast<uint8_t>(e0 + rng.Index(2));
      } else {
        v.scale_format = ScaleFormat::kF32;
        s.scale.resize(experts * per * sizeof(float));
        float* f = reinterpret_cast<float*>(s.scale.data());
        for (int64_t i = 0; i < experts * per; ++i) f[i] = amp / 100.0f * rng.Uniform(0.7f, 1.4f);
      }
      break;
    }
    case Fmt::kFp4: {
      v.format = WeightFormat::kFp4E2M1;
      v.block = dsv4::kFp4Block;
      v.scale_format = ScaleFormat::kE8M0;
      s.data.resize(n / 2);
      for (auto& c : s.data) c = static_cast<uint8_t>(rng.Index(256));
      s.scale.resize(experts * rows * (cols / 32));
      const int e0 = 127 + static_cast<int>(std::floor(std::log2(amp / 3.0f)));
      for (auto& b : s.scale) b = static_cast<uint8_t>(e0 + rng.Index(2));
      break;
    }
  }
  v.data = s.data.data();
  v.scale = s.scale.empty() ? nullptr : s.scale.data();
  return s;
}

struct Problem {
  ActType act;
  int64_t tokens, top_k;
  Stacked w1, w2, w3;
  ExpertWeights ew;
  std::vector<float> weights, x32;
  std::vector<int64_t> indices;  // empty: dense mode
  std::vector<uint16_t> x16;
  float limit;
  const void* x() const { return act == ActType::kF32 ? static_cast<const void*>(x32.data()) : x16.data(); }
};

// `hot` experts get most tokens (so some experts reach the tiles path and others stay on the rows path).
Problem MakeProblem(Rng& rng, ActType act, Fmt fmt, int64_t tokens, int64_t experts, int64_t top_k, int64_t dim,
                    int64_t inter, int64_t block, float limit, bool dense) {
  Problem p;
  p.act = act;
  p.tokens = tokens;
  p.top_k = dense ? 1 : top_k;
  p.limit = limit;
  const int64_t e = dense ? 1 : experts;
  p.w1 = MakeStacked(rng, fmt, e, inter, dim, block, 2.0f);
  p.w2 = MakeStacked(rng, fmt, e, dim, inter, block, 1.0f);
  p.w3 = MakeStacked(rng, fmt, e, inter, dim, block, 2.0f);
  p.ew.w1 = p.w1.first;
  p.ew.w2 = p.w2.first;
  p.ew.w3 = p.w3.first;
  p.ew.num_experts = e;
  p.x32.resize(tokens * dim);
  for (auto& v : p.x32) v = rng.Normal();
  if (act == ActType::kBf16) p.x16 = dsv4_test::ToBf16(p.x32);
  if (!dense) {
    p.indices.resize(tokens * top_k);
    p.weights.resize(tokens * top_k);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int64_t> pool;
      for (int64_t i = 0; i < experts - 1; ++i) pool.push_back(i);  // the last expert is never used
      for (int64_t j = 0; j < top_k; ++j) {
        // expert 0 and 1 are hot: half of the picks when available
        int64_t pick = rng.Index(static_cast<int64_t>(pool.size()));
        if (rng.Index(2) == 0 && pool[0] <= 1) pick = 0;
        p.indices[t * top_k + j] = pool[pick];
        pool.erase(pool.begin() + pick);
        p.weights[t * top_k + j] = rng.Uniform(0.2f, 1.2f);
      }
    }
  }
  return p;
}

using MoeFn = std::function<void(ActType, const void*, int64_t, const float*, const int64_t*, int64_t,
                                  const ExpertWeights&, float, void*, const dsv4::Parallel&)>;

void RunTable(const dsv4::MoeExpertsKernels& k, ActType act, const void* x, int64_t tokens, const float* weights,
              const int64_t* indices, int64_t top_k, const ExpertWeights& w, float limit, void* y,
              const dsv4::Parallel& par) {
  const bool fp8 = w.w1.format == WeightFormat::kFp8E4M3, fp4 = w.w1.format == WeightFormat::kFp4E2M1;
  if (act == ActType::kF32) {
    (fp8 ? k.f32_fp8 : fp4 ? k.f32_fp4 : k.f32_dense)(static_cast<const float*>(x), tokens, weights, indices, top_k,
                                                       w, limit, static_cast<float*>(y), par);
  } else {
    (fp8 ? k.bf16_fp8 : fp4 ? k.bf16_fp4 : k.bf16_dense)(static_cast<const uint16_t*>(x), tokens, weights, indices,
                                                         top_k, w, limit, static_cast<uint16_t*>(y), par);
  }
}

struct Variant {
  std::string name;
  IsaLevel needs;
  MoeFn run;
};

dsv4::LinearBlocks AllTiles(const dsv4::LinearBlocks& b) {
  dsv4::LinearBlocks t = b;
  t.tile_min_rows[0] = t.tile_min_rows[1] = 1;
  t.tile_min_rows_in_place[0] = t.tile_min_rows_in_place[1] = 0;
  return t;
}

std::vector<Variant> Variants() {
  std::vector<Variant> v;
#if DSV4_X86_VARIANTS
  v.push_back({"avx2", IsaLevel::kAvx2, [](auto... a) { RunTable(dsv4::avx2::kMoeExperts, a...); }});
  v.push_back({"avx512", IsaLevel::kAvx512, [](auto... a) { RunTable(dsv4::avx512::kMoeExperts, a...); }});
  v.push_back({"avx2_panels", IsaLevel::kAvx2, [](auto... a) {
                 static const dsv4::LinearBlocks b = AllTiles(dsv4::avx2::kLinearBlocks);
                 dsv4::RunMoeExperts(b, a...);
               }});
  v.push_back({"avx512_panels", IsaLevel::kAvx512, [](auto... a) {
                 static const dsv4::LinearBlocks b = AllTiles(dsv4::avx512::kLinearBlocks);
                 dsv4::RunMoeExperts(b, a...);
               }});
  v.push_back({"amx", IsaLevel::kAmx, [](auto... a) { RunTable(dsv4::amx::kMoeExperts, a...); }});
  v.push_back({"amx_tiles", IsaLevel::kAmx, [](auto... a) {
                 static const dsv4::LinearBlocks b = AllTiles(dsv4::amx::kLinearBlocks);
                 dsv4::RunMoeExperts(b, a...);
               }});
#endif
#if DSV4_HAVE_AMX_EMULATION
  v.push_back({"amx_emu", IsaLevel::kScalar,
               [](auto... a) { dsv4::RunMoeExperts(dsv4::amx_emu::kLinearBlocks, a...); }});
#endif
  return v;
}

std::vector<float> Run(const MoeFn& f, const Problem& p, const dsv4::Parallel& par) {
  const int64_t dim = p.ew.w1.cols;
  const float* wt = p.indices.empty() ? nullptr : p.weights.data();
  const int64_t* idx = p.indices.empty() ? nullptr : p.indices.data();
  ExpertWeights ew = p.ew;  // the scales' range flag as the op sets it for constant scales
  for (WeightView* w : {&ew.w1, &ew.w2, &ew.w3}) dsv4_test::SetScaledRangeAsOps(*w, ew.num_experts);
  if (p.act == ActType::kF32) {
    std::vector<float> y(p.tokens * dim, -7.0f);
    f(p.act, p.x(), p.tokens, wt, idx, p.top_k, ew, p.limit, y.data(), par);
    return y;
  }
  std::vector<uint16_t> y(p.tokens * dim, 0xBEEF);
  f(p.act, p.x(), p.tokens, wt, idx, p.top_k, ew, p.limit, y.data(), par);
  return dsv4_test::FromBf16(y);
}

void ExpectMatches(const std::string& what, ActType act, const std::vector<float>& got,
                   const std::vector<float>& want) {
  double ss = 0.0;
  for (float v : want) ss += static_cast<double>(v) * v;
  const double rms = want.empty() ? 0.0 : std::sqrt(ss / static_cast<double>(want.size()));
  if (act == ActType::kF32) {
    dsv4_test::ExpectClose(what, got, want, 1e-5 * rms + 1e-30, 1e-5);
  } else {
    dsv4_test::ExpectClose(what, got, want, std::ldexp(rms, -7) + 1e-30, std::ldexp(1.0, -6));
  }
}

std::string Describe(const Problem& p, Fmt fmt) {
  return std::string(p.act == ActType::kF32 ? "f32" : "bf16") + " x " + FmtName(fmt) +
         " T=" + std::to_string(p.tokens) + (p.indices.empty() ? " dense" : " k=" + std::to_string(p.top_k)) +
         " E=" + std::to_string(p.ew.num_experts) + " d=" + std::to_string(p.ew.w1.cols) +
         " I=" + std::to_string(p.ew.w1.rows) + " L=" + std::to_string(p.limit);
}

void TestVariant(const Variant& v, ActType act, Fmt fmt) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(500 + static_cast<int>(fmt) * 7 + static_cast<int>(act));
  const dsv4_test::ThreadParallel threads(3);
  const bool fp4 = fmt == Fmt::kFp4;
  struct Case {
    int64_t tokens, experts, k, dim, inter, block;
    float limit;
    bool dense;
  };
  const std::vector<Case> cases = {
      {1, 6, 2, 96, 64, 32, 10.0f, false},                             // decode-like: every expert on the rows path
      {17, 6, 3, fp4 ? 96 : 100, fp4 ? 64 : 70, 32, 1.5f, false},      // hot experts reach the tiles, odd d / I
      {40, 5, 2, 64, fp4 ? 160 : 130, 64, 0.0f, false},                // no clamp
      {23, 1, 1, fp4 ? 64 : 72, fp4 ? 96 : 90, 32, 10.0f, true},        // dense mode (shared expert)
      {3, 9, 4, fp4 ? 128 : 150, 64, 128, 10.0f, false},
      {2, 8, 3, 160, fp4 ? 288 : 300, 32, 10.0f, false},               // decode's wide units: I > kWideRows
  };
  const bool fp8 = fmt == Fmt::kFp8E8m0 || fmt == Fmt::kFp8F32;
  for (const Case& c : cases) {
    Problem p = MakeProblem(rng, act, fmt, c.tokens, c.experts, c.k, c.dim, c.inter, c.block, c.limit, c.dense);
    const std::vector<float> want = Run([](auto... a) { RunTable(dsv4::ref::kMoeExperts, a...); }, p,
                                        dsv4::SerialParallel());
    const std::vector<float> got = Run(v.run, p, threads.Get());
    ExpectMatches(v.name + " " + Describe(p, fmt), act, got, want);
    dsv4_test::ExpectIdentical(v.name + " serial vs threads " + Describe(p, fmt), Run(v.run, p, dsv4::SerialParallel()),
                               got);
    if (fp8) {  // the NaN-free promise changes nothing for weights without NaN codes
      p.ew.w1.fp8_finite = p.ew.w2.fp8_finite = p.ew.w3.fp8_finite = true;
      dsv4_test::ExpectIdentical(v.name + " fp8_finite " + Describe(p, fmt), Run(v.run, p, threads.Get()), got);
    }
  }
}

// FP8 NaN codes (without the fp8_finite promise) reach exactly the outputs the reference makes NaN: one in W2 of a
// used expert poisons one output column of its tokens, one in W1 every output of its tokens.
void TestNanCodes(const Variant& v, ActType act) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(71);
  for (int where = 0; where < 2; ++where) {
    for (int64_t tokens : {1, 17}) {
      Problem p = MakeProblem(rng, act, Fmt::kFp8E8m0, tokens, 6, 2, 96, 64, 32, 10.0f, false);
      const int64_t e = p.indices[0];
      if (where == 0) {
        p.w2.data[e * 96 * 64 + 5 * 64 + 3] = 0x7F;  // W2 of expert e, output row 5
      } else {
        p.w1.data[e * 64 * 96 + 9 * 96 + 40] = 0xFF;  // W1 of expert e, intermediate row 9
      }
      const std::vector<float> want = Run([](auto... a) { RunTable(dsv4::ref::kMoeExperts, a...); }, p,
                                          dsv4::SerialParallel());
      const std::vector<float> got = Run(v.run, p, dsv4::SerialParallel());
      int64_t nans = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        nans += std::isnan(want[i]) ? 1 : 0;
        KT_CHECK(std::isnan(got[i]) == std::isnan(want[i]))
            << v.name << " NaN code in W" << (where == 0 ? 2 : 1) << ", T=" << tokens << ", output " << i << ": got "
            << got[i] << ", want " << want[i];
      }
      KT_CHECK(nans > 0) << "the NaN code must reach some output";
    }
  }
}

// Batch invariance (WeightView::invariant_rows on the expert weights): token t of a T-token call equals, bit for
// bit, token t routed alone, for T up to the bound. Without it the hot experts' token counts would pick the panels /
// tiles (another summation order) and the FP8 decode would group rows differently.
void TestBatchInvariant(const Variant& v, ActType act, Fmt fmt) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(900 + static_cast<int>(fmt));
  const dsv4_test::ThreadParallel threads(2);
  constexpr int64_t kBound = 24;
  const bool fp4 = fmt == Fmt::kFp4;
  const int64_t dim = fp4 ? 96 : 100, inter = fp4 ? 64 : 70;
  Problem all = MakeProblem(rng, act, fmt, kBound, 6, 2, dim, inter, 32, 10.0f, false);
  all.ew.w1.invariant_rows = all.ew.w2.invariant_rows = all.ew.w3.invariant_rows = kBound;
  std::vector<std::vector<float>> alone(kBound);
  for (int64_t t = 0; t < kBound; ++t) {
    Problem one = all;
    one.tokens = 1;
    one.x32.assign(all.x32.begin() + t * dim, all.x32.begin() + (t + 1) * dim);
    if (act == ActType::kBf16) one.x16.assign(all.x16.begin() + t * dim, all.x16.begin() + (t + 1) * dim);
    one.indices.assign(all.indices.begin() + t * 2, all.indices.begin() + (t + 1) * 2);
    one.weights.assign(all.weights.begin() + t * 2, all.weights.begin() + (t + 1) * 2);
    alone[t] = Run(v.run, one, threads.Get());
  }
  for (int64_t tokens : {2, 3, 5, 16, 17, 24}) {
    Problem p = all;
    p.tokens = tokens;
    const std::vector<float> got = Run(v.run, p, threads.Get());
    int64_t differ = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      differ += std::memcmp(got.data() + t * dim, alone[t].data(), dim * sizeof(float)) != 0;
    }
    KT_CHECK(differ == 0) << v.name << " " << Describe(p, fmt) << " invariant_rows=" << kBound << ": " << differ
                          << " of " << tokens << " tokens differ from the token computed alone";
  }
}

// compute="int8" (slot bf16_fp4_int8): each level's table against the reference's int8 slot (same codes, block sums
// exact; only the fp32 combination and the rounding points differ, so the bf16 tolerance of TestVariant holds),
// thread-independent, batch-invariant at any bound (the int8 rows compute each activation row alone); and the mode
// does change the result, by about the quantisation error, against the bf16 slot.
using TableFn = const dsv4::MoeExpertsKernels* (*)();
struct Int8Variant {
  std::string name;
  IsaLevel needs;
  TableFn table;
};

std::vector<Int8Variant> Int8Variants() {
  std::vector<Int8Variant> v;
#if DSV4_X86_VARIANTS
  v.push_back({"avx2", IsaLevel::kAvx2, [] { return &dsv4::avx2::kMoeExperts; }});
  v.push_back({"avx512", IsaLevel::kAvx512, [] { return &dsv4::avx512::kMoeExperts; }});
  v.push_back({"amx", IsaLevel::kAmx, [] { return &dsv4::amx::kMoeExperts; }});
#endif
  return v;
}

std::vector<float> RunInt8(const dsv4::MoeExpertsKernels& k, const Problem& p, const dsv4::Parallel& par,
                           bool int8 = true) {
  const int64_t dim = p.ew.w1.cols;
  std::vector<uint16_t> y(p.tokens * dim, 0xBEEF);
  (int8 ? k.bf16_fp4_int8 : k.bf16_fp4)(p.x16.data(), p.tokens, p.indices.empty() ? nullptr : p.weights.data(),
                                         p.indices.empty() ? nullptr : p.indices.data(), p.top_k, p.ew, p.limit,
                                         y.data(), par);
  return dsv4_test::FromBf16(y);
}

void TestInt8(const Int8Variant& v) {
  dsv4_test::RequireIsa(v.needs);
  Rng rng(1300);
  const dsv4_test::ThreadParallel threads(3);
  const dsv4::MoeExpertsKernels& k = *v.table();
  struct Case {
    int64_t tokens, experts, k, dim, inter;
    float limit;
    bool dense;
  };
  // d / I multiples of 32 but not of 64 (a half chunk at the row's end), decode and prefill token counts
  for (const Case& c : {Case{1, 6, 2, 96, 64, 10.0f, false}, Case{17, 6, 3, 96, 160, 1.5f, false},
                        Case{40, 5, 2, 64, 96, 0.0f, false}, Case{23, 1, 1, 160, 96, 10.0f, true},
                        Case{2, 8, 3, 160, 288, 10.0f, false}}) {
    const Problem p = MakeProblem(rng, ActType::kBf16, Fmt::kFp4, c.tokens, c.experts, c.k, c.dim, c.inter, 32,
                                  c.limit, c.dense);
    const std::string what = v.name + " int8 " + Describe(p, Fmt::kFp4);
    const std::vector<float> want = RunInt8(dsv4::ref::kMoeExperts, p, dsv4::SerialParallel());
    const std::vector<float> got = RunInt8(k, p, threads.Get());
    ExpectMatches(what, ActType::kBf16, got, want);
    dsv4_test::ExpectIdentical(what + " serial vs threads", RunInt8(k, p, dsv4::SerialParallel()), got);
    // against bf16 products: int8 codes carry ~7 bits per block, so outputs move by ~1e-2 of their scale, not more
    const std::vector<float> bf16 = RunInt8(dsv4::ref::kMoeExperts, p, dsv4::SerialParallel(), false);
    double ss = 0.0, diff = 0.0;
    for (size_t i = 0; i < bf16.size(); ++i) {
      ss += static_cast<double>(bf16[i]) * bf16[i];
      diff += (static_cast<double>(want[i]) - bf16[i]) * (static_cast<double>(want[i]) - bf16[i]);
    }
    KT_CHECK(diff > 0.0) << what << ": compute=int8 gave the bf16 result exactly";
    KT_CHECK(diff < 1e-3 * ss) << what << ": int8 vs bf16 relative squared error " << diff / ss;
  }
  // batch invariance: token t of a 24-token call equals token t alone, bit for bit
  Problem all = MakeProblem(rng, ActType::kBf16, Fmt::kFp4, 24, 6, 2, 96, 64, 32, 10.0f, false);
  const std::vector<float> got = RunInt8(k, all, threads.Get());
  for (int64_t t = 0; t < all.tokens; ++t) {
    Problem one = all;
    one.tokens = 1;
    one.x16.assign(all.x16.begin() + t * 96, all.x16.begin() + (t + 1) * 96);
    one.indices.assign(all.indices.begin() + t * 2, all.indices.begin() + (t + 1) * 2);
    one.weights.assign(all.weights.begin() + t * 2, all.weights.begin() + (t + 1) * 2);
    const std::vector<float> alone = RunInt8(k, one, threads.Get());
    KT_CHECK(std::memcmp(alone.data(), got.data() + t * 96, 96 * sizeof(float)) == 0)
        << v.name << " int8: token " << t << " of 24 differs from the token computed alone";
  }
  // a NaN activation makes its token's outputs NaN (its block scale is NaN) and no other token's
  Problem nan = MakeProblem(rng, ActType::kBf16, Fmt::kFp4, 5, 6, 2, 96, 64, 32, 10.0f, false);
  nan.x16[2 * 96 + 40] = 0x7FC0;
  const std::vector<float> y = RunInt8(k, nan, threads.Get());
  for (int64_t t = 0; t < nan.tokens; ++t) {
    for (int64_t c = 0; c < 96; ++c) {
      KT_CHECK(std::isnan(y[t * 96 + c]) == (t == 2)) << v.name << " int8 NaN in token 2: token " << t << " output "
                                                      << c << " = " << y[t * 96 + c];
    }
  }
}

const bool kRegistered = [] {
  for (const Int8Variant& v : Int8Variants()) kt::Register("moe_experts_" + v.name + "_bf16_fp4_int8", [v] { TestInt8(v); });
  for (const Variant& v : Variants()) {
    for (ActType act : {ActType::kF32, ActType::kBf16}) {
      for (Fmt fmt : kFormats) {
        kt::Register("moe_experts_" + v.name + "_" + (act == ActType::kF32 ? "f32" : "bf16") + "_" + FmtName(fmt),
                     [v, act, fmt] { TestVariant(v, act, fmt); });
        kt::Register("moe_experts_" + v.name + "_batch_invariant_" + (act == ActType::kF32 ? "f32" : "bf16") + "_" +
                         FmtName(fmt),
                     [v, act, fmt] { TestBatchInvariant(v, act, fmt); });
      }
      kt::Register("moe_experts_" + v.name + "_" + (act == ActType::kF32 ? "f32" : "bf16") + "_fp8_nan_codes",
                   [v, act] { TestNanCodes(v, act); });
    }
  }
  return true;
}();

}  // namespace
