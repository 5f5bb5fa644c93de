// SparseAttention kernels: every accelerated variant this CPU supports (avx2, avx512, amx) and the AMX code on
// emulated tiles (amx_emu) against the scalar reference, for fp32 and bf16, serial and on 3 and 8 threads (queries
// fewer than threads take the split-over-keys path with its log-sum-exp merge).
//
// Cases: window-only rows at the sequence start and with a wrapped ring, chunks longer than the window, entries
// whose visibility changes inside the chunk (all visible: HCA; selected with -1, duplicates and not-yet-visible
// indices: CSA), rows with no selected entry, rows of a batch at different positions, odd head counts and widths
// (vector and tile tails), DeepSeek-V4 shapes (64 heads of 512, window 128) in decode and in a short prefill, decode
// with full-precision fp32 values at several head counts, key counts and batch positions (the fp32 decode paths: key
// ranges per task with their merge on 3 and 8 threads, whole items serially), and a sink so large that the output is
// exactly zero.
//
// Tolerances: fp32 outputs differ from the reference by summation order only (the reference accumulates dots in
// double; the variants in fp32 over at most a few thousand terms of O(1) values, exp within a few ulp), so
// |got - want| <= 2e-5 + 2e-4 |want| (measured worst below 0.1 of it). bf16: the variants round the same
// quantities as the spec (p after normalisation, o before and after the inverse RoPE), but a logit that differs in
// its last fp32 bit can move p across a bf16 rounding boundary; each output must be within 2^-6 relative plus
// 2^-8 of the largest output (two bf16 ulps and one ulp of accumulated p rounding), and at most 2% of them may
// differ at all.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "custom_ops/kernels/sparse_attention.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::IsaLevel;
using dsv4::SparseAttentionDims;
using dsv4::SparseAttentionKernels;
using dsv4_test::Rng;

const SparseAttentionKernels* Table(IsaLevel level) {
  switch (level) {
    case IsaLevel::kScalar: return &dsv4::ref::kSparseAttention;
#if DSV4_X86_VARIANTS
    case IsaLevel::kAvx2: return &dsv4::avx2::kSparseAttention;
    case IsaLevel::kAvx512: return &dsv4::avx512::kSparseAttention;
    case IsaLevel::kAmx: return &dsv4::amx::kSparseAttention;
#endif
    default: return nullptr;
  }
}

struct Problem {
  SparseAttentionDims d;
  std::vector<float> q, kv, window, entries, sink, inv_freq;
  std::vector<int64_t> indices, start_pos;
  bool with_entries = false, with_indices = false;
  float scale = 0.0f;
};

struct Config {
  int64_t B, S, H, D, n_win, half, ratio, N, topk;
  std::vector<int64_t> starts;
  float q_amp = 1.5f;
  bool bf16_values = true;  // false: full fp32 values (the fp32 tile path's mid and lo pieces are non-zero)
  bool no_entries_row0 = false;  // row 0 of the batch selects no entry at all (every index -1)
};

std::string Describe(const Config& c) {
  std::string s = "B=" + std::to_string(c.B) + " S=" + std::to_string(c.S) + " H=" + std::to_string(c.H) +
                  " D=" + std::to_string(c.D) + " win=" + std::to_string(c.n_win) + " ratio=" +
                  std::to_string(c.ratio) + " N=" + std::to_string(c.N) + " k=" + std::to_string(c.topk) + " starts";
  for (int64_t p : c.starts) s += " " + std::to_string(p);
  return s;
}

// Values are bf16-representable, so the fp32 and bf16 runs see the same inputs, unless a config asks for full fp32
// ones (the bf16 run then sees them rounded, as its reference does).
float Bf16Value(float v) { return dsv4::Bf16ToF32(dsv4::F32ToBf16(v)); }

Problem Make(Rng& rng, const Config& c) {
  Problem p;
  p.d = SparseAttentionDims{c.B, c.S, c.H, c.D, c.n_win, c.half, c.ratio, c.ratio > 0 ? c.N : 0,
                            c.topk > 0 ? c.topk : 0};
  const auto fill = [&](std::vector<float>& v, size_t n, float amp) {
    v.resize(n);
    for (auto& x : v) x = c.bf16_values ? Bf16Value(amp * rng.Normal()) : amp * rng.Normal();
  };
  fill(p.q, c.B * c.S * c.H * c.D, c.q_amp);
  fill(p.kv, c.B * c.S * c.D, 1.0f);
  fill(p.window, c.B * c.n_win * c.D, 1.0f);
  p.with_entries = c.ratio > 0 && c.N > 0;
  if (p.with_entries) fill(p.entries, c.B * c.N * c.D, 1.0f);
  p.sink.resize(c.H);
  for (auto& x : p.sink) x = 0.5f * rng.Normal();
  p.inv_freq.resize(c.half);
  for (int64_t i = 0; i < c.half; ++i) {
    p.inv_freq[i] = static_cast<float>(1.0 / std::pow(160000.0, 2.0 * static_cast<double>(i) / (2.0 * c.half)));
  }
  p.start_pos = c.starts;
  p.with_indices = p.with_entries && c.topk > 0;
  if (p.with_indices) {
    p.indices.resize(c.B * c.S * c.topk);
    for (auto& x : p.indices) x = rng.Index(c.N + 1) - 1;  // -1 .. N-1: unused, visible and not yet visible
    // duplicates, and one query with no selected entry
    if (c.topk >= 3) p.indices[1] = p.indices[2] = p.indices[0];
    if (c.B * c.S > 1) std::fill(p.indices.begin() + c.topk, p.indices.begin() + 2 * c.topk, int64_t{-1});
    if (c.no_entries_row0) std::fill(p.indices.begin(), p.indices.begin() + c.S * c.topk, int64_t{-1});
  }
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.D)));
  return p;
}

std::vector<float> Run(const SparseAttentionKernels& k, const Problem& p, bool bf16, const dsv4::Parallel& par) {
  const int64_t* idx = p.with_indices ? p.indices.data() : nullptr;
  const size_t n_out = p.q.size();
  if (!bf16) {
    std::vector<float> o(n_out, -7.0f);
    k.attend_f32(p.q.data(), p.kv.data(), p.window.data(), p.with_entries ? p.entries.data() : nullptr, idx,
                 p.sink.data(), p.inv_freq.data(), p.start_pos.data(), p.d, p.scale, o.data(), par);
    return o;
  }
  const auto q = dsv4_test::ToBf16(p.q), kv = dsv4_test::ToBf16(p.kv), w = dsv4_test::ToBf16(p.window),
             e = dsv4_test::ToBf16(p.entries);
  std::vector<uint16_t> o(n_out, 0xdead);
  k.attend_bf16(q.data(), kv.data(), w.data(), p.with_entries ? e.data() : nullptr, idx, p.sink.data(),
                p.inv_freq.data(), p.start_pos.data(), p.d, p.scale, o.data(), par);
  return dsv4_test::FromBf16(o);
}

void Compare(const std::string& what, const std::vector<float>& got, const std::vector<float>& want, bool bf16) {
  if (!bf16) {
    dsv4_test::ExpectClose(what, got, want, 2e-5, 2e-4);
    return;
  }
  KT_CHECK_EQ(got.size(), want.size()) << what;
  if (got.size() != want.size()) return;
  double peak = 0.0;
  for (float w : want) peak = std::max(peak, static_cast<double>(std::fabs(w)));
  const double atol = std::ldexp(peak, -8);
  size_t differ = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]))) continue;
    ++differ;
    const double bound = atol + std::ldexp(std::fabs(want[i]), -6);
    worst = std::max(worst, std::fabs(got[i] - want[i]) / bound);
    KT_CHECK(std::fabs(got[i] - want[i]) <= bound) << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  }
  KT_CHECK(static_cast<double>(differ) <= 2.0 + 0.02 * static_cast<double>(got.size()))
      << what << ": " << differ << " of " << got.size() << " values differ";
  if (dsv4_test::Verbose()) {
    std::printf("    %s: %zu of %zu differ, worst error / bound %.3g\n", what.c_str(), differ, got.size(), worst);
  }
}

std::vector<Config> Configs() {
  std::vector<Config> c;
  // window only: a fresh row and a wrapped ring; chunks shorter and longer than the window
  for (int64_t S : {1, 5, 11}) c.push_back({2, S, 3, 24, 8, 4, 0, 0, 0, {0, 13}});
  // all visible entries (HCA), visibility changing inside the chunk
  for (int64_t ratio : {4, 16}) {
    c.push_back({2, 1, 5, 40, 8, 8, ratio, 12, 0, {2, 29}});
    c.push_back({2, 6, 5, 40, 8, 8, ratio, 12, 0, {0, 17}});
  }
  // selected entries (CSA): -1, duplicates, not yet visible, a query without any
  c.push_back({2, 7, 3, 24, 8, 4, 4, 10, 6, {1, 33}});
  c.push_back({3, 4, 17, 130, 16, 16, 4, 40, 12, {3, 60, 150}});
  // odd heads and widths: tails of vectors, of 32-channel tiles and of 16-head tiles
  c.push_back({1, 3, 1, 8, 4, 2, 4, 6, 3, {9}});
  c.push_back({2, 2, 33, 72, 8, 4, 4, 20, 8, {40, 7}});
  c.push_back({1, 2, 70, 96, 12, 16, 4, 30, 10, {90}});
  // DeepSeek-V4 shapes: decode (the split path on threads) and a short prefill with a wrapped ring
  c.push_back({1, 1, 64, 512, 128, 32, 4, 300, 256, {1199}});
  c.push_back({2, 1, 64, 512, 128, 32, 128, 12, 0, {1500, 700}});
  c.push_back({1, 5, 64, 512, 128, 32, 4, 300, 160, {1170}});
  // decode with full fp32 values (every piece of the fp32 tile split in play): head counts that are and are not
  // multiples of 16 and above 64 (two groups); key counts that straddle the 32-key blocks and the split ranges at the
  // window / entry boundary; a row without any selected entry next to rows at other positions (empty split ranges);
  // batch rows at different positions
  Config f{1, 1, 64, 512, 128, 32, 4, 700, 512, {2700}};
  f.bf16_values = false;
  c.push_back(f);
  for (int64_t H : {7, 17, 40, 80}) {
    Config h{2, 1, H, 96, 24, 8, 4, 200, 90, {61, 779}};
    h.bf16_values = false;
    c.push_back(h);
  }
  Config r{3, 1, 33, 128, 40, 16, 4, 120, 100, {0, 37, 470}};
  r.bf16_values = false;
  r.no_entries_row0 = true;
  c.push_back(r);
  Config w{2, 1, 16, 64, 200, 8, 128, 9, 0, {5, 1150}};  // HCA: window rows only on the fresh row
  w.bf16_values = false;
  c.push_back(w);
  return c;
}

void TestMatchesRef(const SparseAttentionKernels& k, bool bf16) {
  Rng rng(bf16 ? 0x5a17 : 0x5a16);
  const dsv4_test::ThreadParallel threads(3), many(8);  // 8: a short prefill takes the split path too
  for (const Config& c : Configs()) {
    const Problem p = Make(rng, c);
    const std::vector<float> want = Run(dsv4::ref::kSparseAttention, p, bf16, dsv4::SerialParallel());
    Compare(Describe(c) + " serial", Run(k, p, bf16, dsv4::SerialParallel()), want, bf16);
    Compare(Describe(c) + " 3 threads", Run(k, p, bf16, threads.Get()), want, bf16);
    if (c.B * c.S < 8) Compare(Describe(c) + " 8 threads", Run(k, p, bf16, many.Get()), want, bf16);
  }
}

// A sink far above every logit takes all the mass: the output is exactly zero, as in the spec.
void TestDominantSink(const SparseAttentionKernels& k, bool bf16) {
  Rng rng(0x51);
  const dsv4_test::ThreadParallel threads(3);
  const Config configs[] = {Config{2, 3, 5, 40, 8, 8, 4, 6, 0, {4, 9}},
                            Config{1, 1, 64, 512, 128, 32, 4, 300, 256, {1199}}};
  for (const Config& c : configs) {
    Problem p = Make(rng, c);
    std::fill(p.sink.begin(), p.sink.end(), 1e4f);
    for (const dsv4::Parallel& par : {dsv4::SerialParallel(), threads.Get()}) {
      const std::vector<float> got = Run(k, p, bf16, par);
      for (size_t i = 0; i < got.size(); ++i) KT_CHECK_EQ(got[i], 0.0f) << Describe(c) << " element " << i;
    }
  }
}

// Decode with fewer queries than threads splits the heads into groups (of 16 or more) before it splits the keys: every
// head sums alike in any group, so the output is bit-identical to the serial one as long as the head groups suffice
// (64 heads: 2 and 4 threads); 8 threads split the keys as well (Compare above).
void TestHeadSplitIdentical(const SparseAttentionKernels& k, bool bf16) {
  Rng rng(0x5a18);
  const dsv4_test::ThreadParallel two(2), four(4);
  for (Config c : {Config{1, 1, 64, 512, 128, 32, 4, 300, 256, {1199}}, Config{1, 1, 64, 512, 128, 32, 0, 0, 0, {70}},
                   Config{1, 1, 48, 96, 24, 8, 4, 200, 90, {779}}}) {
    c.bf16_values = bf16;
    const Problem p = Make(rng, c);
    const std::vector<float> serial = Run(k, p, bf16, dsv4::SerialParallel());
    dsv4_test::ExpectIdentical(Describe(c) + " 2 threads", Run(k, p, bf16, two.Get()), serial);
    dsv4_test::ExpectIdentical(Describe(c) + " 4 threads", Run(k, p, bf16, four.Get()), serial);
  }
}

// attend_f32_bf16 (compute="bf16"), where a table has it: for every config (fp32 values, so the rounding matters)
// exactly attend_bf16's output on the rounded inputs, widened (Run rounds to nearest even as the slot promises);
// serial and on 3 threads.
void TestF32Bf16(const SparseAttentionKernels& k) {
  Rng rng(0x5a18);
  const dsv4_test::ThreadParallel threads(3);
  for (Config c : Configs()) {
    c.bf16_values = false;
    const Problem p = Make(rng, c);
    const std::vector<float> want = Run(k, p, true, dsv4::SerialParallel());
    for (const bool serial : {true, false}) {
      std::vector<float> o(p.q.size(), -7.0f);
      const dsv4::Parallel par = serial ? dsv4::SerialParallel() : threads.Get();
      k.attend_f32_bf16(p.q.data(), p.kv.data(), p.window.data(), p.with_entries ? p.entries.data() : nullptr,
                        p.with_indices ? p.indices.data() : nullptr, p.sink.data(), p.inv_freq.data(),
                        p.start_pos.data(), p.d, p.scale, o.data(), par);
      dsv4_test::ExpectIdentical(Describe(c) + (serial ? " serial" : " 3 threads"), o, want);
    }
  }
}

void RegisterTable(const std::string& isa, const SparseAttentionKernels* (*get)(), IsaLevel require) {
  for (bool bf16 : {false, true}) {
    const std::string dtype = bf16 ? "bf16" : "f32";
    kt::Register("sparse_attention_" + dtype + "_" + isa, [get, require, bf16] {
      dsv4_test::RequireIsa(require);
      TestMatchesRef(*get(), bf16);
    });
    kt::Register("sparse_attention_head_split_" + dtype + "_" + isa, [get, require, bf16] {
      dsv4_test::RequireIsa(require);
      TestHeadSplitIdentical(*get(), bf16);
    });
    kt::Register("sparse_attention_dominant_sink_" + dtype + "_" + isa, [get, require, bf16] {
      dsv4_test::RequireIsa(require);
      TestDominantSink(*get(), bf16);
    });
  }
  // every accelerated table has its own attend_f32_bf16; the reference alone leaves it to the op's rounding gather
  kt::Register("sparse_attention_f32_bf16_products_" + isa, [get, require, isa] {
    dsv4_test::RequireIsa(require);
    const SparseAttentionKernels& k = *get();
    if (isa == "scalar") {
      KT_CHECK(k.attend_f32_bf16 == nullptr);
    } else {
      KT_CHECK(k.attend_f32_bf16 != nullptr);
      if (k.attend_f32_bf16 != nullptr) TestF32Bf16(k);
    }
  });
}

const bool kRegistered = [] {
  RegisterTable("scalar", [] { return Table(IsaLevel::kScalar); }, IsaLevel::kScalar);
#if DSV4_X86_VARIANTS
  RegisterTable("avx2", [] { return Table(IsaLevel::kAvx2); }, IsaLevel::kAvx2);
  RegisterTable("avx512", [] { return Table(IsaLevel::kAvx512); }, IsaLevel::kAvx512);
  RegisterTable("avx512_bf16dot", [] { return &dsv4::avx512::kSparseAttentionBf16Dot; }, IsaLevel::kAvx512);
  RegisterTable("amx", [] { return Table(IsaLevel::kAmx); }, IsaLevel::kAmx);
#endif
#if DSV4_HAVE_AMX_EMULATION
  RegisterTable("amx_emu", [] { return &dsv4::amx_emu::kSparseAttention; }, IsaLevel::kScalar);
#endif
  return true;
}();

}  // namespace
