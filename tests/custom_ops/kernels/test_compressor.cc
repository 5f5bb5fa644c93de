// Compressor kernels: every accelerated variant this CPU supports against the scalar reference, fp32 and bf16
// entries, serial and on 3 threads: overlapping (ratio 4, two blocks per entry) and non-overlapping (ratios 3, 16
// and 128) pools, odd entry widths (vector tails) and rope widths, rows of a batch at different positions (inside a
// block, at a block boundary, at the sequence start), one-shot chunks that emit several entries, and the same
// sequence fed token by token through the state.
//
// The state (kv rows and score + ape rows) is copied and added exactly as in the reference: bit-identical. Entries
// differ by the exp of the softmax (a few ulps) and fused products: fp32 within 1e-5 relative to the entry's
// largest value; bf16 within one bf16 ulp with at most 1% of them differing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "custom_ops/kernels/compressor.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::CompressorDims;
using dsv4::CompressorKernels;
using dsv4::IsaLevel;
using dsv4_test::Rng;

const CompressorKernels* Table(IsaLevel level) {
  switch (level) {
    case IsaLevel::kScalar: return &dsv4::ref::kCompressor;
#if DSV4_X86_VARIANTS
    case IsaLevel::kAvx2: return &dsv4::avx2::kCompressor;
    case IsaLevel::kAvx512: return &dsv4::avx512::kCompressor;
#endif
    default: return nullptr;
  }
}

constexpr float kEps = 1e-6f;

struct Sequence {
  int64_t B, T, ratio, c, coff, half, N;
  std::vector<float> kv, score, ape, weight, inv_freq;  // kv / score [B, T, W]
  std::vector<int64_t> start;                            // first position of every row
};

Sequence MakeSequence(Rng& rng, int64_t B, int64_t T, int64_t ratio, int64_t c, int64_t coff, int64_t half) {
  Sequence s{B, T, ratio, c, coff, half, 0, {}, {}, {}, {}, {}, {}};
  const int64_t W = coff * c;
  s.kv.resize(B * T * W);
  s.score.resize(B * T * W);
  for (auto& v : s.kv) v = rng.Normal();
  for (auto& v : s.score) v = 2.0f * rng.Normal();
  s.ape.resize(ratio * W);
  for (auto& v : s.ape) v = rng.Normal();
  s.weight.resize(c);
  for (auto& v : s.weight) v = rng.Uniform(0.5f, 1.5f);
  s.inv_freq.resize(half);
  for (int64_t i = 0; i < half; ++i) s.inv_freq[i] = static_cast<float>(std::pow(160000.0, -2.0 * i / (2.0 * half)));
  // row 0 starts the sequence; the others start inside a block or on a block boundary (their state is what a
  // previous call would have left: random, which is fine since a row's first tokens overwrite what is read)
  s.start.resize(B);
  for (int64_t b = 0; b < B; ++b) s.start[b] = b == 0 ? 0 : (b % 2 ? 5 * ratio + 1 : 7 * ratio);
  s.N = (s.start.back() + T) / ratio + 2;
  return s;
}

struct State {
  std::vector<float> entries, kv_state, score_state;
  std::vector<uint16_t> entries_bf16;
};

State InitialState(const Sequence& s, bool bf16) {
  State st;
  const int64_t W = s.coff * s.c, rows = s.coff * s.ratio;
  st.kv_state.assign(s.B * rows * W, 0.25f);
  st.score_state.assign(s.B * rows * W, -1.0f);
  if (bf16) {
    st.entries_bf16.assign(s.B * s.N * s.c, 0x1234);
  } else {
    st.entries.assign(s.B * s.N * s.c, -3.0f);
  }
  return st;
}

// Feeds tokens [t0, t1) of every row.
void Step(const CompressorKernels& k, const Sequence& s, int64_t t0, int64_t t1, bool bf16, State& st,
          const dsv4::Parallel& par) {
  const int64_t W = s.coff * s.c, S = t1 - t0;
  std::vector<float> kv(s.B * S * W), score(s.B * S * W);
  std::vector<int64_t> start(s.B);
  for (int64_t b = 0; b < s.B; ++b) {
    std::copy(s.kv.begin() + (b * s.T + t0) * W, s.kv.begin() + (b * s.T + t1) * W, kv.begin() + b * S * W);
    std::copy(s.score.begin() + (b * s.T + t0) * W, s.score.begin() + (b * s.T + t1) * W, score.begin() + b * S * W);
    start[b] = s.start[b] + t0;
  }
  const CompressorDims d{s.B, S, s.ratio, W, s.coff, s.half, s.N};
  if (bf16) {
    k.step_bf16(kv.data(), score.data(), s.ape.data(), s.weight.data(), s.inv_freq.data(), start.data(), d, kEps,
                st.entries_bf16.data(), st.kv_state.data(), st.score_state.data(), par);
  } else {
    k.step_f32(kv.data(), score.data(), s.ape.data(), s.weight.data(), s.inv_freq.data(), start.data(), d, kEps,
               st.entries.data(), st.kv_state.data(), st.score_state.data(), par);
  }
}

void CompareStates(const std::string& what, const Sequence& s, const State& got, const State& want, bool bf16) {
  dsv4_test::ExpectIdentical(what + " kv_state", got.kv_state, want.kv_state);
  dsv4_test::ExpectIdentical(what + " score_state", got.score_state, want.score_state);
  if (bf16) {
    dsv4_test::ExpectBf16Close(what + " entries", got.entries_bf16, want.entries_bf16, 0.0, 0.01);
    return;
  }
  for (size_t e0 = 0; e0 < want.entries.size(); e0 += s.c) {
    double peak = 0.0;
    for (int64_t i = 0; i < s.c; ++i) peak = std::max(peak, static_cast<double>(std::fabs(want.entries[e0 + i])));
    dsv4_test::ExpectClose(what + " entry " + std::to_string(e0 / s.c), got.entries.data() + e0,
                           want.entries.data() + e0, s.c, 1e-5 * peak, 0.0);
  }
}

void TestMatchesRef(IsaLevel level, bool bf16) {
  dsv4_test::RequireIsa(level);
  const CompressorKernels& k = *Table(level);
  Rng rng(bf16 ? 0xc02 : 0xc01);
  const dsv4_test::ThreadParallel threads(3);
  struct Config {
    int64_t B, T, ratio, c, coff, half;
  };
  const Config configs[] = {{2, 23, 4, 24, 2, 4},  {3, 19, 3, 40, 1, 8},  {2, 40, 16, 37, 1, 5},
                            {1, 300, 128, 512, 1, 32}, {3, 33, 4, 512, 2, 32}, {2, 17, 4, 128, 2, 32},
                            {1, 9, 1, 18, 1, 9}};
  for (const Config& cfg : configs) {
    const Sequence s = MakeSequence(rng, cfg.B, cfg.T, cfg.ratio, cfg.c, cfg.coff, cfg.half);
    const std::string shape = "B=" + std::to_string(cfg.B) + " T=" + std::to_string(cfg.T) + " ratio=" +
                              std::to_string(cfg.ratio) + " c=" + std::to_string(cfg.c) + " coff=" +
                              std::to_string(cfg.coff) + " half=" + std::to_string(cfg.half);
    State want = InitialState(s, bf16);
    Step(dsv4::ref::kCompressor, s, 0, s.T, bf16, want, dsv4::SerialParallel());
    State one_shot = InitialState(s, bf16);
    Step(k, s, 0, s.T, bf16, one_shot, threads.Get());
    CompareStates(shape + " one shot", s, one_shot, want, bf16);
    State chunked = InitialState(s, bf16);
    const int64_t cut = s.T / 3;
    Step(k, s, 0, cut, bf16, chunked, dsv4::SerialParallel());
    for (int64_t t = cut; t < s.T; ++t) Step(k, s, t, t + 1, bf16, chunked, dsv4::SerialParallel());
    // chunked and one-shot calls of the same variant are bit-identical (the header's contract)
    dsv4_test::ExpectIdentical(shape + " chunked == one shot kv_state", chunked.kv_state, one_shot.kv_state);
    dsv4_test::ExpectIdentical(shape + " chunked == one shot entries", chunked.entries, one_shot.entries);
    dsv4_test::ExpectIdentical(shape + " chunked == one shot entries", chunked.entries_bf16, one_shot.entries_bf16);
  }
}

const bool kRegistered = [] {
  for (IsaLevel level : dsv4_test::VariantLevels()) {
    const std::string isa = dsv4::IsaName(level);
    for (bool bf16 : {false, true}) {
      kt::Register(std::string("compressor_") + (bf16 ? "bf16_" : "f32_") + isa,
                   [level, bf16] { TestMatchesRef(level, bf16); });
    }
  }
  return true;
}();

}  // namespace
