// MoE routing kernels: the scalar reference against hand-computed values, then every accelerated variant this CPU
// supports against the reference.
//
// Index outputs must match exactly. They are compared on inputs whose selection keys are tie-free with a margin
// (resampled until adjacent keys among the k+1 largest differ by >= 1e-5 relative, two orders of magnitude above
// the few-ulp score differences between libm and the vector exp/log), and on inputs built to tie exactly, where
// every variant must resolve ties the same way (lower expert index first). Weights are compared with rtol 1e-5
// (fp32: a handful of ulps from exp/log1p/sqrt plus the k-term normalisation).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "custom_ops/kernels/moe_routing.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::IsaLevel;
using dsv4::MoeRoutingKernels;
using dsv4::MoeScoreFunc;
using dsv4_test::Rng;

constexpr double kWeightRtol = 1e-5;
constexpr double kWeightAtol = 1e-9;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

const MoeScoreFunc kScoreFuncs[] = {MoeScoreFunc::kSqrtSoftplus, MoeScoreFunc::kSigmoid, MoeScoreFunc::kSoftmax};

const char* FuncName(MoeScoreFunc f) {
  switch (f) {
    case MoeScoreFunc::kSqrtSoftplus: return "sqrtsoftplus";
    case MoeScoreFunc::kSigmoid: return "sigmoid";
    case MoeScoreFunc::kSoftmax: return "softmax";
  }
  return "?";
}

const MoeRoutingKernels* Table(IsaLevel level) {
  switch (level) {
    case IsaLevel::kScalar: return &dsv4::ref::kMoeRouting;
#if DSV4_X86_VARIANTS
    case IsaLevel::kAvx2: return &dsv4::avx2::kMoeRouting;
    case IsaLevel::kAvx512: return &dsv4::avx512::kMoeRouting;
#endif
    default: return nullptr;
  }
}

struct Routing {
  std::vector<float> weights;
  std::vector<int64_t> indices;
};

struct TopkCase {
  int64_t T, E, k;
  MoeScoreFunc func;
  const float* bias;  // [E] or nullptr
  bool norm;
  float scale;
};

Routing RunTopk(const MoeRoutingKernels& kernels, const std::vector<float>& logits, const TopkCase& c,
                const dsv4::Parallel& par = dsv4::SerialParallel()) {
  Routing r;
  r.weights.assign(c.T * c.k, -1.0f);
  r.indices.assign(c.T * c.k, -1);
  kernels.topk_route(logits.data(), c.bias, c.T, c.E, c.k, c.func, c.norm, c.scale, r.weights.data(),
                     r.indices.data(), par);
  return r;
}

std::vector<float> RunFixed(const MoeRoutingKernels& kernels, const std::vector<float>& logits,
                            const std::vector<int64_t>& ids, int64_t T, int64_t E, int64_t k, MoeScoreFunc f,
                            bool norm, float scale, const dsv4::Parallel& par = dsv4::SerialParallel()) {
  std::vector<float> w(T * k, -1.0f);
  kernels.fixed_route(logits.data(), ids.data(), T, E, k, f, norm, scale, w.data(), par);
  return w;
}

// Every row holds k distinct indices in [0, E).
void ExpectValidIndices(const std::string& what, const std::vector<int64_t>& idx, int64_t T, int64_t E, int64_t k) {
  for (int64_t t = 0; t < T; ++t) {
    std::vector<bool> seen(E, false);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t e = idx[t * k + i];
      KT_CHECK(e >= 0 && e < E) << what << ": token " << t << " slot " << i << " index " << e;
      if (e < 0 || e >= E) continue;
      KT_CHECK(!seen[e]) << what << ": token " << t << " selects expert " << e << " twice";
      seen[e] = true;
    }
  }
}

// Reference selection keys of one token (NaN ranked as -inf, as the kernels do).
std::vector<float> RefKeys(const float* logits, const float* bias, int64_t E, MoeScoreFunc f) {
  std::vector<float> s(E);
  dsv4::ref::MoeScores(logits, E, f, s.data());
  for (int64_t e = 0; e < E; ++e) {
    s[e] += bias != nullptr ? bias[e] : 0.0f;
    if (std::isnan(s[e])) s[e] = -kInf;
  }
  return s;
}

// Logits in [-3, 3) whose reference keys have, per token, relative gaps >= 1e-5 between the k+1 largest.
std::vector<float> TieFreeLogits(Rng& rng, int64_t T, int64_t E, int64_t k, MoeScoreFunc f, const float* bias) {
  std::vector<float> logits(T * E);
  for (int64_t t = 0; t < T; ++t) {
    float* row = logits.data() + t * E;
    for (int attempt = 0;; ++attempt) {
      for (int64_t e = 0; e < E; ++e) row[e] = rng.Uniform(-3.0f, 3.0f);
      std::vector<float> keys = RefKeys(row, bias, E, f);
      std::sort(keys.begin(), keys.end(), [](float a, float b) { return a > b; });
      bool ok = true;
      for (int64_t i = 0; i + 1 < std::min(k + 1, E); ++i) {
        const double margin = 1e-5 * (std::fabs(keys[i]) + (bias != nullptr ? 1.0 : 0.0));
        ok = ok && static_cast<double>(keys[i]) - keys[i + 1] >= margin;
      }
      if (ok) break;
      if (attempt > 1000) kt::Skip("could not draw tie-free logits");  // not expected with these sizes
    }
  }
  return logits;
}

std::vector<float> RandomBias(Rng& rng, int64_t E) {
  std::vector<float> bias(E);
  for (auto& b : bias) b = rng.Uniform(-0.5f, 0.5f);
  return bias;
}

std::string CaseName(const TopkCase& c) {
  return "T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " " +
         FuncName(c.func) + (c.bias ? " bias" : "") + (c.norm ? " norm" : "");
}

const int64_t kExpertCounts[] = {1, 7, 8, 16, 17, 64, 256, 257};
const int64_t kTopKs[] = {1, 2, 6, 8};
const int64_t kTokenCounts[] = {1, 3, 17};

// The k values exercised for E experts: the usual ones that fit, plus k = E for small E.
std::vector<int64_t> TopKsFor(int64_t E) {
  std::vector<int64_t> ks;
  for (int64_t k : kTopKs) {
    if (k <= E) ks.push_back(k);
  }
  if (E <= 17 && std::find(ks.begin(), ks.end(), E) == ks.end()) ks.push_back(E);
  return ks;
}

// ---------------------------------------------------------------------------------------------------------------
// Reference against hand-computed values.

KT_TEST(moe_routing_ref_score_values) {
  const std::vector<float> x = {0.0f, 25.0f, 20.0f, -30.0f, 1.0f};
  std::vector<float> s(x.size());
  dsv4::ref::MoeScores(x.data(), static_cast<int64_t>(x.size()), MoeScoreFunc::kSqrtSoftplus, s.data());
  KT_CHECK_CLOSE(s[0], std::sqrt(std::log(2.0)), 0.0, 1e-6) << "sqrtsoftplus(0) = sqrt(ln 2)";
  KT_CHECK_EQ(s[1], 5.0f) << "softplus(x) = x above the threshold 20";
  KT_CHECK_CLOSE(s[2], std::sqrt(std::log1p(std::exp(20.0))), 0.0, 1e-6) << "softplus(20) still uses log1p(exp)";
  KT_CHECK_CLOSE(s[3], std::exp(-15.0), 0.0, 1e-5) << "sqrt(log1p(e^-30)) ~ e^-15";
  KT_CHECK_CLOSE(s[4], std::sqrt(std::log1p(std::exp(1.0))), 0.0, 1e-6);

  const std::vector<float> y = {0.0f, 2.0f};
  std::vector<float> sig(2);
  dsv4::ref::MoeScores(y.data(), 2, MoeScoreFunc::kSigmoid, sig.data());
  KT_CHECK_EQ(sig[0], 0.5f);
  KT_CHECK_CLOSE(sig[1], 1.0 / (1.0 + std::exp(-2.0)), 0.0, 1e-6);

  const std::vector<float> z = {0.0f, static_cast<float>(std::log(3.0))};
  std::vector<float> soft(2);
  dsv4::ref::MoeScores(z.data(), 2, MoeScoreFunc::kSoftmax, soft.data());
  KT_CHECK_CLOSE(soft[0], 0.25, 0.0, 1e-6);
  KT_CHECK_CLOSE(soft[1], 0.75, 0.0, 1e-6);
}

KT_TEST(moe_routing_ref_topk_hand) {
  // The bias lifts expert 0 into the selection; its weight still uses the unbiased score.
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 3.0f};
  const std::vector<float> bias = {10.0f, 0.0f, 0.0f, 0.0f};
  const TopkCase c{1, 4, 2, MoeScoreFunc::kSqrtSoftplus, bias.data(), true, 1.5f};
  const Routing r = RunTopk(dsv4::ref::kMoeRouting, logits, c);
  KT_CHECK_EQ(r.indices[0], 0);
  KT_CHECK_EQ(r.indices[1], 3);
  const double s0 = std::sqrt(std::log(2.0)), s3 = std::sqrt(std::log1p(std::exp(3.0)));
  KT_CHECK_CLOSE(r.weights[0], 1.5 * s0 / (s0 + s3), 0.0, 1e-6);
  KT_CHECK_CLOSE(r.weights[1], 1.5 * s3 / (s0 + s3), 0.0, 1e-6);

  // Without renormalisation: w = s * scale, in descending key order.
  const TopkCase c2{1, 4, 3, MoeScoreFunc::kSigmoid, nullptr, false, 2.0f};
  const Routing r2 = RunTopk(dsv4::ref::kMoeRouting, logits, c2);
  KT_CHECK_EQ(r2.indices[0], 3);
  KT_CHECK_EQ(r2.indices[1], 2);
  KT_CHECK_EQ(r2.indices[2], 1);
  for (int i = 0; i < 3; ++i) {
    const double x = logits[r2.indices[i]];
    KT_CHECK_CLOSE(r2.weights[i], 2.0 / (1.0 + std::exp(-x)), 0.0, 1e-6);
  }
}

KT_TEST(moe_routing_ref_ties_lowest_index_first) {
  const std::vector<float> equal(5, 0.0f);
  const Routing r = RunTopk(dsv4::ref::kMoeRouting, equal, {1, 5, 3, MoeScoreFunc::kSqrtSoftplus, nullptr, true, 1.0f});
  KT_CHECK(r.indices == std::vector<int64_t>({0, 1, 2}));
  for (float w : r.weights) KT_CHECK_CLOSE(w, 1.0 / 3.0, 0.0, 1e-6);

  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 1.0f, 2.0f};
  const Routing r2 = RunTopk(dsv4::ref::kMoeRouting, logits, {1, 5, 2, MoeScoreFunc::kSigmoid, nullptr, true, 1.0f});
  KT_CHECK(r2.indices == std::vector<int64_t>({1, 2}));
  const Routing r4 = RunTopk(dsv4::ref::kMoeRouting, logits, {1, 5, 4, MoeScoreFunc::kSigmoid, nullptr, true, 1.0f});
  KT_CHECK(r4.indices == std::vector<int64_t>({1, 2, 4, 0}));

  // A bias that creates a tie between different logits: keys 2+0 (expert 0) and 1+1 (expert 1) -> 0 first.
  const std::vector<float> sp = {2.0f, 1.0f, 0.0f};
  std::vector<float> s(3);
  dsv4::ref::MoeScores(sp.data(), 3, MoeScoreFunc::kSoftmax, s.data());
  const std::vector<float> bias = {0.0f, s[0] - s[1], 0.0f};
  if (s[1] + bias[1] == s[0]) {
    const Routing r3 = RunTopk(dsv4::ref::kMoeRouting, sp, {1, 3, 1, MoeScoreFunc::kSoftmax, bias.data(), true, 1.0f});
    KT_CHECK_EQ(r3.indices[0], 0);
  }
}

KT_TEST(moe_routing_ref_fixed_hand) {
  // softmax([0, 0, ln 3]) = [0.2, 0.2, 0.6]; experts (2, 0) -> [0.6, 0.2] / 0.8 * 2 = [1.5, 0.5].
  const std::vector<float> logits = {0.0f, 0.0f, static_cast<float>(std::log(3.0))};
  const std::vector<int64_t> ids = {2, 0};
  const std::vector<float> w = RunFixed(dsv4::ref::kMoeRouting, logits, ids, 1, 3, 2, MoeScoreFunc::kSoftmax, true, 2.0f);
  KT_CHECK_CLOSE(w[0], 1.5, 0.0, 1e-6);
  KT_CHECK_CLOSE(w[1], 0.5, 0.0, 1e-6);
  const std::vector<float> raw =
      RunFixed(dsv4::ref::kMoeRouting, logits, ids, 1, 3, 2, MoeScoreFunc::kSoftmax, false, 2.0f);
  KT_CHECK_CLOSE(raw[0], 1.2, 0.0, 1e-6);
  KT_CHECK_CLOSE(raw[1], 0.4, 0.0, 1e-6);
}

KT_TEST(moe_routing_ref_nan_ranks_lowest) {
  // NaN keys rank like -inf: never chosen over a number, chosen (lowest index first) only to fill k.
  const std::vector<float> logits = {kNaN, 1.0f, kNaN, -kInf, 0.5f, kNaN};
  const Routing r =
      RunTopk(dsv4::ref::kMoeRouting, logits, {1, 6, 5, MoeScoreFunc::kSigmoid, nullptr, false, 1.0f});
  // sigmoid(-inf) = 0 is a number, so expert 3 ranks above the NaN experts 0 and 2.
  KT_CHECK(r.indices == std::vector<int64_t>({1, 4, 3, 0, 2}));
  const std::vector<float> all_nan(8, kNaN);
  const Routing r2 =
      RunTopk(dsv4::ref::kMoeRouting, all_nan, {1, 8, 3, MoeScoreFunc::kSoftmax, nullptr, true, 1.0f});
  KT_CHECK(r2.indices == std::vector<int64_t>({0, 1, 2}));
}

// ---------------------------------------------------------------------------------------------------------------
// Variants against the reference.

// All scores over a sweep that covers the softplus threshold, exp overflow/underflow, subnormal results,
// infinities and NaN (fixed routing of every expert, no renormalisation, scale 1 = the raw scores).
void TestScores(IsaLevel level) {
  dsv4_test::RequireIsa(level);
  std::vector<float> x;
  for (float v = -120.0f; v <= 120.0f; v += 0.37f) x.push_back(v);
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 19.999f, 20.0f, 20.001f, 88.7f, 88.8f, -87.5f, -103.9f, -104.5f,
                  kInf, -kInf, kNaN}) {
    x.push_back(v);
  }
  const int64_t E = static_cast<int64_t>(x.size());
  std::vector<int64_t> ids(E);
  for (int64_t e = 0; e < E; ++e) ids[e] = e;
  for (MoeScoreFunc f : {MoeScoreFunc::kSqrtSoftplus, MoeScoreFunc::kSigmoid}) {
    const auto want = RunFixed(dsv4::ref::kMoeRouting, x, ids, 1, E, E, f, false, 1.0f);
    const auto got = RunFixed(*Table(level), x, ids, 1, E, E, f, false, 1.0f);
    // The vector exp/log1p are ~1-2 ulps from libm; 2e-6 relative is ~16 ulps. Subnormal results carry few
    // significant bits, hence the absolute floor.
    dsv4_test::ExpectClose(std::string("scores ") + FuncName(f), got, want, 1e-37, 2e-6);
  }
  // Softmax over a wide row (no NaN: a NaN poisons the whole row, tested separately).
  std::vector<float> row(x.begin(), x.end() - 3);
  std::vector<int64_t> row_ids(ids.begin(), ids.end() - 3);
  const int64_t n = static_cast<int64_t>(row.size());
  const auto want = RunFixed(dsv4::ref::kMoeRouting, row, row_ids, 1, n, n, MoeScoreFunc::kSoftmax, false, 1.0f);
  const auto got = RunFixed(*Table(level), row, row_ids, 1, n, n, MoeScoreFunc::kSoftmax, false, 1.0f);
  dsv4_test::ExpectClose("scores softmax", got, want, 1e-37, 2e-6);
}

void TestTopk(IsaLevel level, MoeScoreFunc f) {
  dsv4_test::RequireIsa(level);
  Rng rng(0x5eed0000 + static_cast<int>(f));
  for (int64_t E : kExpertCounts) {
    const std::vector<float> bias = RandomBias(rng, E);
    for (int64_t k : TopKsFor(E)) {
      for (int64_t T : kTokenCounts) {
        for (int variant = 0; variant < 4; ++variant) {
          const bool with_bias = variant & 1, norm = (variant & 2) == 0;
          const TopkCase c{T, E, k, f, with_bias ? bias.data() : nullptr, norm, norm ? 2.5f : 1.5f};
          const std::vector<float> logits = TieFreeLogits(rng, T, E, k, f, c.bias);
          const Routing want = RunTopk(dsv4::ref::kMoeRouting, logits, c);
          const Routing got = RunTopk(*Table(level), logits, c);
          KT_CHECK(got.indices == want.indices) << CaseName(c) << ": indices differ";
          dsv4_test::ExpectClose(CaseName(c) + " weights", got.weights, want.weights, kWeightAtol, kWeightRtol);
        }
      }
    }
  }
}

// Logits from {-1, 0, 0.5} and a bias from {0, 0.25}: many exact ties in every variant, resolved identically.
void TestTopkTies(IsaLevel level, MoeScoreFunc f) {
  dsv4_test::RequireIsa(level);
  Rng rng(0x71e5 + static_cast<int>(f));
  const float values[] = {-1.0f, 0.0f, 0.5f};
  for (int64_t E : kExpertCounts) {
    std::vector<float> bias(E);
    for (auto& b : bias) b = rng.Index(2) ? 0.25f : 0.0f;
    std::vector<int64_t> ks = TopKsFor(E);
    if (E >= 64) {  // long insertion runs in the streaming selection
      ks.push_back(E / 2 + 1);
      ks.push_back(E);
    }
    for (int64_t k : ks) {
      for (bool with_bias : {false, true}) {
        const int64_t T = 17;
        std::vector<float> logits(T * E);
        for (auto& v : logits) v = values[rng.Index(3)];
        const TopkCase c{T, E, k, f, with_bias ? bias.data() : nullptr, true, 1.0f};
        const Routing want = RunTopk(dsv4::ref::kMoeRouting, logits, c);
        const Routing got = RunTopk(*Table(level), logits, c);
        KT_CHECK(got.indices == want.indices) << CaseName(c) << ": indices differ on tied keys";
        dsv4_test::ExpectClose(CaseName(c) + " weights", got.weights, want.weights, kWeightAtol, kWeightRtol);
        // The reference itself: keys non-increasing along each row, equal keys in increasing expert order.
        for (int64_t t = 0; t < T; ++t) {
          const std::vector<float> keys = RefKeys(logits.data() + t * E, c.bias, E, f);
          for (int64_t i = 0; i + 1 < k; ++i) {
            const int64_t a = want.indices[t * k + i], b = want.indices[t * k + i + 1];
            KT_CHECK(keys[a] > keys[b] || (keys[a] == keys[b] && a < b))
                << CaseName(c) << ": token " << t << " slots " << i << "," << i + 1 << " out of order";
          }
        }
      }
    }
  }
}

void TestFixed(IsaLevel level, MoeScoreFunc f) {
  dsv4_test::RequireIsa(level);
  Rng rng(0xf1ed + static_cast<int>(f));
  for (int64_t E : kExpertCounts) {
    for (int64_t k : TopKsFor(E)) {
      for (int64_t T : kTokenCounts) {
        for (bool norm : {true, false}) {
          std::vector<float> logits(T * E);
          for (auto& v : logits) v = rng.Uniform(-6.0f, 6.0f);
          std::vector<int64_t> ids(T * k);
          for (auto& id : ids) id = rng.Index(E);
          const auto want = RunFixed(dsv4::ref::kMoeRouting, logits, ids, T, E, k, f, norm, 1.5f);
          const auto got = RunFixed(*Table(level), logits, ids, T, E, k, f, norm, 1.5f);
          dsv4_test::ExpectClose("fixed T=" + std::to_string(T) + " E=" + std::to_string(E) + " k=" +
                                     std::to_string(k) + " " + FuncName(f) + (norm ? " norm" : ""),
                                 got, want, kWeightAtol, kWeightRtol);
        }
      }
    }
  }
}

// NaN/inf logits and biases: k distinct valid indices per token in every variant; for the element-wise score
// functions also the same indices as the reference (a NaN only affects its own expert). Softmax rows with a NaN
// are all-NaN, so their selection is 0..k-1.
void TestNan(IsaLevel level) {
  dsv4_test::RequireIsa(level);
  Rng rng(0xa0a0);
  for (MoeScoreFunc f : kScoreFuncs) {
    for (int64_t E : kExpertCounts) {
      for (int64_t k : TopKsFor(E)) {
        const int64_t T = 17;
        std::vector<float> logits(T * E), bias(E);
        for (auto& v : logits) {
          const int64_t pick = rng.Index(10);
          v = pick == 0 ? kNaN : pick == 1 ? kInf : pick == 2 ? -kInf : rng.Uniform(-3.0f, 3.0f);
        }
        for (int64_t t = 0; t < T; t += 5) {
          for (int64_t e = 0; e < E; ++e) logits[t * E + e] = kNaN;  // whole rows of NaN
        }
        for (auto& b : bias) b = rng.Index(8) == 0 ? kNaN : rng.Uniform(-0.5f, 0.5f);
        for (bool with_bias : {false, true}) {
          const TopkCase c{T, E, k, f, with_bias ? bias.data() : nullptr, true, 1.0f};
          const Routing got = RunTopk(*Table(level), logits, c);
          ExpectValidIndices(CaseName(c) + " (NaN inputs)", got.indices, T, E, k);
          const Routing want = RunTopk(dsv4::ref::kMoeRouting, logits, c);
          ExpectValidIndices(CaseName(c) + " (NaN inputs, ref)", want.indices, T, E, k);
          if (f != MoeScoreFunc::kSoftmax) {
            KT_CHECK(got.indices == want.indices) << CaseName(c) << ": indices differ on NaN/inf inputs";
          }
        }
      }
    }
  }
}

// Results do not depend on the thread count, the task order or on which other tokens share the call.
void TestThreadsAndBatching(IsaLevel level) {
  dsv4_test::RequireIsa(level);
  const MoeRoutingKernels& kernels = *Table(level);
  Rng rng(0xbeef);
  const dsv4_test::ThreadParallel threads(3);
  for (MoeScoreFunc f : kScoreFuncs) {
    const int64_t T = 203, E = 256, k = 8;
    const std::vector<float> bias = RandomBias(rng, E);
    std::vector<float> logits(T * E);
    for (auto& v : logits) v = rng.Uniform(-3.0f, 3.0f);
    const TopkCase c{T, E, k, f, bias.data(), true, 2.5f};
    const Routing serial = RunTopk(kernels, logits, c);
    const Routing threaded = RunTopk(kernels, logits, c, threads.Get());
    dsv4_test::ExpectIdentical(std::string(FuncName(f)) + " threaded weights", threaded.weights, serial.weights);
    dsv4_test::ExpectIdentical(std::string(FuncName(f)) + " threaded indices", threaded.indices, serial.indices);
    for (int64_t t : {int64_t{0}, int64_t{101}, T - 1}) {
      const std::vector<float> one(logits.begin() + t * E, logits.begin() + (t + 1) * E);
      const Routing single = RunTopk(kernels, one, {1, E, k, f, bias.data(), true, 2.5f});
      const std::vector<float> w(serial.weights.begin() + t * k, serial.weights.begin() + (t + 1) * k);
      const std::vector<int64_t> idx(serial.indices.begin() + t * k, serial.indices.begin() + (t + 1) * k);
      dsv4_test::ExpectIdentical(std::string(FuncName(f)) + " single-token weights", single.weights, w);
      dsv4_test::ExpectIdentical(std::string(FuncName(f)) + " single-token indices", single.indices, idx);
    }
    std::vector<int64_t> ids(T * k);
    for (auto& id : ids) id = rng.Index(E);
    const auto fixed_serial = RunFixed(kernels, logits, ids, T, E, k, f, true, 1.5f);
    const auto fixed_threaded = RunFixed(kernels, logits, ids, T, E, k, f, true, 1.5f, threads.Get());
    dsv4_test::ExpectIdentical(std::string(FuncName(f)) + " fixed threaded", fixed_threaded, fixed_serial);
  }
}

// T = 0 and k = 0 are no-ops that touch no memory.
void TestEmpty(IsaLevel level) {
  dsv4_test::RequireIsa(level);
  const MoeRoutingKernels& kernels = *Table(level);
  for (MoeScoreFunc f : kScoreFuncs) {
    kernels.topk_route(nullptr, nullptr, 0, 8, 2, f, true, 1.0f, nullptr, nullptr, dsv4::SerialParallel());
    kernels.fixed_route(nullptr, nullptr, 0, 8, 2, f, true, 1.0f, nullptr, dsv4::SerialParallel());
    const std::vector<float> logits(3 * 8, 0.5f);
    kernels.topk_route(logits.data(), nullptr, 3, 8, 0, f, true, 1.0f, nullptr, nullptr, dsv4::SerialParallel());
    kernels.fixed_route(logits.data(), nullptr, 3, 8, 0, f, true, 1.0f, nullptr, dsv4::SerialParallel());
  }
}

const bool kRegistered = [] {
  // The reference runs the threaded test too (its own determinism).
  kt::Register("moe_routing_threads_and_batching_scalar", [] { TestThreadsAndBatching(IsaLevel::kScalar); });
  kt::Register("moe_routing_empty_scalar", [] { TestEmpty(IsaLevel::kScalar); });
  for (IsaLevel level : dsv4_test::VariantLevels()) {
    const std::string isa = dsv4::IsaName(level);
    kt::Register("moe_routing_scores_" + isa, [level] { TestScores(level); });
    for (MoeScoreFunc f : kScoreFuncs) {
      const std::string fn = FuncName(f);
      kt::Register("moe_routing_topk_" + fn + "_" + isa, [level, f] { TestTopk(level, f); });
      kt::Register("moe_routing_topk_ties_" + fn + "_" + isa, [level, f] { TestTopkTies(level, f); });
      kt::Register("moe_routing_fixed_" + fn + "_" + isa, [level, f] { TestFixed(level, f); });
    }
    kt::Register("moe_routing_nan_inputs_" + isa, [level] { TestNan(level); });
    kt::Register("moe_routing_empty_" + isa, [level] { TestEmpty(level); });
    kt::Register("moe_routing_threads_and_batching_" + isa, [level] { TestThreadsAndBatching(level); });
  }
  return true;
}();

}  // namespace
