// Indexer kernels and the radix top-k: every accelerated variant this CPU supports (avx2, avx512, amx) and the AMX
// code on emulated tiles (amx_emu) against the scalar reference, fp32 and bf16, serial and on 3 threads (a single
// query then scores ranges of entries in parallel).
//
//   topk_select_*         SelectTopKRadix == ref::SelectTopK exactly: random scores with many exact ties, +0/-0,
//                         +-inf and NaN, every k from 0 to n for small n, long vectors
//   indexer_exact_*       integer-valued q, keys and weights with power-of-four head counts and widths: every score is
//                         exact in fp32 whatever the summation order, so ties are real and the indices (tie rule
//                         included) must equal the reference's bit for bit; rows at different positions, k below, at
//                         and above the visible count
//   indexer_random_*      Gaussian inputs at odd sizes and at DeepSeek-V4 sizes (64 heads of 128, top-512 of up to
//                         4k entries): scores differ from the reference by summation order only (~1e-6 relative), so
//                         the selection is checked against exact (double) scores: the right count, distinct visible
//                         entries in non-increasing score order, nothing left out that scores higher than something
//                         kept (all up to 1e-5 relative), and at least 99% of positions equal to the reference's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "custom_ops/kernels/indexer.h"
#include "custom_ops/kernels/topk_select.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::IndexerDims;
using dsv4::IndexerKernels;
using dsv4::IsaLevel;
using dsv4_test::Rng;

// ---------------------------------------------------------------------------------------------------------------
// Radix top-k against the reference partial sort.

void CheckSelect(const std::vector<float>& score, int64_t k, const std::string& what) {
  const int64_t n = static_cast<int64_t>(score.size());
  std::vector<int64_t> want(k + 1, -7), got(k + 1, -7);
  dsv4::ref::SelectTopK(score.data(), n, k, want.data());
  dsv4::SelectTopKRadix(score.data(), n, k, got.data());
  for (int64_t i = 0; i < k; ++i) KT_CHECK_EQ(got[i], want[i]) << what << " n=" << n << " k=" << k << " pos " << i;
  KT_CHECK_EQ(got[k], int64_t{-7}) << what << ": wrote past k";
}

KT_TEST(topk_select_matches_ref) {
  Rng rng(11);
  const float kInf = std::numeric_limits<float>::infinity(), kNaN = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : {1, 2, 3, 7, 16, 33}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> s(n);
      for (auto& v : s) {
        const int64_t c = rng.Index(10);
        v = c == 0 ? 0.0f : c == 1 ? -0.0f : c == 2 ? kInf : c == 3 ? -kInf : c == 4 ? kNaN
            : c == 5 ? -kNaN : static_cast<float>(rng.Index(5)) - 2.0f;  // many exact ties
      }
      for (int64_t k = 0; k <= n; ++k) CheckSelect(s, k, "special values");
    }
  }
  for (int64_t n : {1000, 4096, 16384}) {
    std::vector<float> s(n);
    for (auto& v : s) v = rng.Normal();
    for (int64_t k : {int64_t{1}, int64_t{511}, int64_t{512}, n / 2, n}) CheckSelect(s, k, "gaussian");
    for (auto& v : s) v = static_cast<float>(rng.Index(7));  // ties everywhere
    for (int64_t k : {int64_t{1}, int64_t{512}, n - 1}) CheckSelect(s, k, "seven values");
    for (auto& v : s) v = std::ldexp(1.0f + static_cast<float>(rng.Index(3)) * 0x1p-23f, -130);  // subnormals
    CheckSelect(s, 300, "subnormals");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Indexer variants.

const IndexerKernels* Table(IsaLevel level) {
  switch (level) {
    case IsaLevel::kScalar: return &dsv4::ref::kIndexer;
#if DSV4_X86_VARIANTS
    case IsaLevel::kAvx2: return &dsv4::avx2::kIndexer;
    case IsaLevel::kAvx512: return &dsv4::avx512::kIndexer;
    case IsaLevel::kAmx: return &dsv4::amx::kIndexer;
#endif
    default: return nullptr;
  }
}

struct Problem {
  IndexerDims d;
  std::vector<float> q, weights, keys;
  std::vector<int64_t> start_pos;
};

float Bf16Value(float v) { return dsv4::Bf16ToF32(dsv4::F32ToBf16(v)); }

// start positions chosen so that every query sees at most N entries.
Problem Make(Rng& rng, int64_t B, int64_t S, int64_t nI, int64_t cI, int64_t N, int64_t ratio, int64_t topk,
             bool integer) {
  Problem p;
  p.d = IndexerDims{B, S, nI, cI, N, ratio, topk};
  const auto value = [&](int lo, int hi, float amp) {
    return integer ? static_cast<float>(lo + rng.Index(hi - lo + 1)) : Bf16Value(amp * rng.Normal());
  };
  p.q.resize(B * S * nI * cI);
  for (auto& v : p.q) v = value(-3, 3, 1.0f);
  p.keys.resize(B * N * cI);
  for (auto& v : p.keys) v = value(-3, 3, 1.0f);
  p.weights.resize(B * S * nI);
  for (auto& v : p.weights) v = value(-2, 4, 1.0f);
  p.start_pos.resize(B);
  const int64_t max_start = (N + 1) * ratio - 1 - S;  // the last query at (N + 1) * ratio - 2 sees N entries
  for (int64_t b = 0; b < B; ++b) p.start_pos[b] = b == 0 ? 0 : rng.Index(std::max<int64_t>(1, max_start + 1));
  if (B > 1) p.start_pos[B - 1] = max_start;
  return p;
}

std::vector<int64_t> Run(const IndexerKernels& k, const Problem& p, bool bf16, const dsv4::Parallel& par) {
  std::vector<int64_t> out(p.d.batch * p.d.seq * p.d.topk, -7);
  if (bf16) {
    const auto q = dsv4_test::ToBf16(p.q), keys = dsv4_test::ToBf16(p.keys);
    k.topk_bf16(q.data(), p.weights.data(), keys.data(), p.start_pos.data(), p.d, out.data(), par);
  } else {
    k.topk_f32(p.q.data(), p.weights.data(), p.keys.data(), p.start_pos.data(), p.d, out.data(), par);
  }
  return out;
}

std::string Describe(const IndexerDims& d) {
  return "B=" + std::to_string(d.batch) + " S=" + std::to_string(d.seq) + " nI=" + std::to_string(d.heads) +
         " cI=" + std::to_string(d.head_dim) + " N=" + std::to_string(d.capacity) + " ratio=" +
         std::to_string(d.ratio) + " k=" + std::to_string(d.topk);
}

void TestExact(const IndexerKernels& k, bool bf16) {
  Rng rng(bf16 ? 0x1d2 : 0x1d1);
  const dsv4_test::ThreadParallel threads(3);
  struct Size {
    int64_t B, S, nI, cI, N, ratio, topk;
  };
  const Size sizes[] = {{2, 9, 4, 16, 12, 4, 1}, {2, 9, 4, 16, 12, 4, 8},  {2, 9, 4, 16, 12, 4, 20},
                        {3, 5, 16, 64, 40, 4, 7}, {1, 1, 64, 64, 700, 4, 512}, {2, 3, 16, 256, 300, 4, 64},
                        {1, 2, 1, 16, 33, 1, 40}};
  for (const Size& s : sizes) {
    const Problem p = Make(rng, s.B, s.S, s.nI, s.cI, s.N, s.ratio, s.topk, true);
    const auto want = Run(dsv4::ref::kIndexer, p, bf16, dsv4::SerialParallel());
    dsv4_test::ExpectIdentical(Describe(p.d) + " serial", Run(k, p, bf16, dsv4::SerialParallel()), want);
    dsv4_test::ExpectIdentical(Describe(p.d) + " 3 threads", Run(k, p, bf16, threads.Get()), want);
  }
}

// Exact score of entry j for query qi (double, the spec's formula).
double ExactScore(const Problem& p, bool bf16, int64_t qi, int64_t j) {
  const IndexerDims& d = p.d;
  const auto val = [&](float v) { return static_cast<double>(bf16 ? Bf16Value(v) : v); };
  const int64_t b = qi / d.seq;
  double score = 0.0;
  for (int64_t h = 0; h < d.heads; ++h) {
    double dot = 0.0;
    for (int64_t c = 0; c < d.head_dim; ++c) {
      dot += val(p.q[(qi * d.heads + h) * d.head_dim + c]) * val(p.keys[(b * d.capacity + j) * d.head_dim + c]);
    }
    score += std::max(dot, 0.0) / std::sqrt(static_cast<double>(d.head_dim)) * p.weights[qi * d.heads + h] /
             std::sqrt(static_cast<double>(d.heads));
  }
  return score;
}

void CheckValidTopK(const Problem& p, bool bf16, const std::vector<int64_t>& got, const std::vector<int64_t>& want,
                    const std::string& what) {
  const IndexerDims& d = p.d;
  size_t same = 0, total = 0;
  for (int64_t qi = 0; qi < d.batch * d.seq; ++qi) {
    const int64_t b = qi / d.seq, s = qi % d.seq;
    const int64_t visible = std::min((p.start_pos[b] + s + 1) / d.ratio, d.capacity);
    const int64_t k = std::min(d.topk, visible);
    std::vector<double> score(visible);
    double scale = 1e-30;
    for (int64_t j = 0; j < visible; ++j) {
      score[j] = ExactScore(p, bf16, qi, j);
      scale = std::max(scale, std::fabs(score[j]));
    }
    const double eps = 1e-5 * scale;
    const int64_t* g = got.data() + qi * d.topk;
    std::vector<char> kept(visible, 0);
    double lowest_kept = std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < d.topk; ++i) {
      if (i >= k) {
        KT_CHECK_EQ(g[i], int64_t{-1}) << what << " query " << qi << " slot " << i;
        continue;
      }
      const bool ok = g[i] >= 0 && g[i] < visible && !kept[g[i]];
      KT_CHECK(ok) << what << " query " << qi << " slot " << i << ": " << g[i] << " (visible " << visible << ")";
      if (!ok) return;
      kept[g[i]] = 1;
      if (i > 0) {
        KT_CHECK(score[g[i]] <= score[g[i - 1]] + eps) << what << " query " << qi << ": out of order at " << i;
      }
      lowest_kept = std::min(lowest_kept, score[g[i]]);
      same += g[i] == want[qi * d.topk + i];
      ++total;
    }
    for (int64_t j = 0; j < visible; ++j) {
      if (!kept[j]) {
        KT_CHECK(score[j] <= lowest_kept + eps) << what << " query " << qi << ": left out entry " << j;
      }
    }
  }
  KT_CHECK(static_cast<double>(same) >= 0.99 * static_cast<double>(total))
      << what << ": only " << same << " of " << total << " positions equal to the reference";
}

void TestRandom(const IndexerKernels& k, bool bf16) {
  Rng rng(bf16 ? 0x2d2 : 0x2d1);
  const dsv4_test::ThreadParallel threads(3);
  struct Size {
    int64_t B, S, nI, cI, N, ratio, topk;
  };
  const Size sizes[] = {{1, 1, 1, 4, 5, 4, 6}, {2, 7, 3, 20, 37, 4, 6}, {3, 2, 8, 64, 70, 4, 6},
                        {2, 3, 17, 40, 90, 4, 16}, {1, 1, 64, 128, 4096, 4, 512}, {2, 2, 64, 128, 1000, 4, 512}};
  for (const Size& s : sizes) {
    const Problem p = Make(rng, s.B, s.S, s.nI, s.cI, s.N, s.ratio, s.topk, false);
    const auto want = Run(dsv4::ref::kIndexer, p, bf16, dsv4::SerialParallel());
    CheckValidTopK(p, bf16, Run(k, p, bf16, dsv4::SerialParallel()), want, Describe(p.d) + " serial");
    CheckValidTopK(p, bf16, Run(k, p, bf16, threads.Get()), want, Describe(p.d) + " 3 threads");
  }
}

void RegisterTable(const std::string& isa, const IndexerKernels* (*get)(), IsaLevel require) {
  for (bool bf16 : {false, true}) {
    const std::string dtype = bf16 ? "bf16" : "f32";
    kt::Register("indexer_exact_" + dtype + "_" + isa, [get, require, bf16] {
      dsv4_test::RequireIsa(require);
      TestExact(*get(), bf16);
    });
    kt::Register("indexer_random_" + dtype + "_" + isa, [get, require, bf16] {
      dsv4_test::RequireIsa(require);
      TestRandom(*get(), bf16);
    });
  }
}

const bool kRegistered = [] {
#if DSV4_X86_VARIANTS
  RegisterTable("avx2", [] { return Table(IsaLevel::kAvx2); }, IsaLevel::kAvx2);
  RegisterTable("avx512", [] { return Table(IsaLevel::kAvx512); }, IsaLevel::kAvx512);
  RegisterTable("amx", [] { return Table(IsaLevel::kAmx); }, IsaLevel::kAmx);
#endif
#if DSV4_HAVE_AMX_EMULATION
  RegisterTable("amx_emu", [] { return &dsv4::amx_emu::kIndexer; }, IsaLevel::kScalar);
#endif
  return true;
}();

}  // namespace
