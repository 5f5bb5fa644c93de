// mHC kernels: the scalar reference against hand-computed values (a 2x2 Sinkhorn, tiny HcPre/HcPost/HcHead), then
// every accelerated variant this CPU supports against the reference, for fp32 and bf16 activations.
//
// Tolerances (fp32 outputs: |got - want| <= atol + rtol |want|):
//   the mixes differ from the reference only by summation order: the reference accumulates the hc*d-long dot
//   products in double, the variants in fp32 vector lanes over 256/512-column blocks (chains of 32 terms) folded
//   into double, so a mix is within ~10 fp32 ulps of the sum of |terms| (~1e-6 relative for these O(1) data).
//   The sigmoid gates pass that through (|sigmoid'| <= 1/4); softmax and the 20 Sinkhorn steps are smooth,
//   well-conditioned maps here (entries bounded away from 0 by hc_eps and the softmax), so they do not amplify it
//   materially; and pre/post/comb are then computed by the same scalar code (ref::HcPreWeights) in every variant.
//   Hence rtol = 1e-5 with atol = 1e-6 for post and comb (in (0, 2)) and atol = 1e-5 for h, y and the HcPost output
//   (O(1) sums of a few FMAs). The measured worst case is below 0.1 of these bounds (DSV4_KT_VERBOSE=1 prints it).
//   bf16 outputs are rounded once from fp32 values that differ by those few ulps: each must be within one bf16
//   ulp of the reference, and at most 2 + 1% of them may differ at all (observed: ~1e-4 of them).
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "custom_ops/kernels/hyper_connection.h"
#include "kernel_test_util.h"
#include "kt.h"

namespace {

using dsv4::HyperConnectionKernels;
using dsv4::IsaLevel;
using dsv4_test::Rng;

constexpr float kRmsEps = 1e-6f;
constexpr float kHcEps = 1e-6f;
constexpr double kRtol = 1e-5;
constexpr double kWeightAtol = 1e-6;
constexpr double kValueAtol = 1e-5;
constexpr double kBf16MaxDifferentFraction = 0.01;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

const HyperConnectionKernels* Table(IsaLevel level) {
  switch (level) {
    case IsaLevel::kScalar: return &dsv4::ref::kHyperConnection;
#if DSV4_X86_VARIANTS
    case IsaLevel::kAvx2: return &dsv4::avx2::kHyperConnection;
    case IsaLevel::kAvx512: return &dsv4::avx512::kHyperConnection;
#endif
    default: return nullptr;
  }
}

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// ---------------------------------------------------------------------------------------------------------------
// Problem data and runners.

struct PreProblem {
  int64_t N, hc, d, iters;
  std::vector<float> x, fn, scale, base;  // x [N, hc, d] (bf16-representable values)
};

PreProblem MakePre(Rng& rng, int64_t N, int64_t hc, int64_t d, int64_t iters, int64_t rows) {
  PreProblem p{N, hc, d, iters, {}, {}, {}, {}};
  const int64_t K = hc * d;
  p.x.resize(N * K);
  for (auto& v : p.x) v = dsv4::Bf16ToF32(dsv4::F32ToBf16(rng.Normal()));  // exact in both dtypes
  p.fn.resize(rows * K);
  const float amp = 2.0f / std::sqrt(static_cast<float>(K));  // mixes of order 1
  for (auto& v : p.fn) v = rng.Uniform(-amp, amp);
  p.scale = {rng.Uniform(0.5f, 2.0f), rng.Uniform(0.5f, 2.0f), rng.Uniform(0.5f, 2.0f)};
  p.base.resize(rows);
  for (auto& v : p.base) v = rng.Uniform(-1.0f, 1.0f);
  return p;
}

struct PreOut {
  std::vector<float> h, post, comb;
  std::vector<uint16_t> h_bf16;
};

PreOut RunPre(const HyperConnectionKernels& k, const PreProblem& p, bool bf16,
              const dsv4::Parallel& par = dsv4::SerialParallel()) {
  PreOut o;
  o.post.assign(p.N * p.hc, -7.0f);
  o.comb.assign(p.N * p.hc * p.hc, -7.0f);
  if (bf16) {
    const std::vector<uint16_t> x = dsv4_test::ToBf16(p.x);
    o.h_bf16.assign(p.N * p.d, 0xdead);
    k.pre_bf16(x.data(), p.fn.data(), p.scale.data(), p.base.data(), p.N, p.hc, p.d, kRmsEps, kHcEps, p.iters,
               o.h_bf16.data(), o.post.data(), o.comb.data(), par);
  } else {
    o.h.assign(p.N * p.d, -7.0f);
    k.pre_f32(p.x.data(), p.fn.data(), p.scale.data(), p.base.data(), p.N, p.hc, p.d, kRmsEps, kHcEps, p.iters,
              o.h.data(), o.post.data(), o.comb.data(), par);
  }
  return o;
}

struct PostProblem {
  int64_t N, hc, d;
  std::vector<float> f, residual, post, comb;
};

PostProblem MakePost(Rng& rng, int64_t N, int64_t hc, int64_t d) {
  PostProblem p{N, hc, d, {}, {}, {}, {}};
  p.f.resize(N * d);
  p.residual.resize(N * hc * d);
  for (auto& v : p.f) v = dsv4::Bf16ToF32(dsv4::F32ToBf16(rng.Normal()));
  for (auto& v : p.residual) v = dsv4::Bf16ToF32(dsv4::F32ToBf16(rng.Normal()));
  p.post.resize(N * hc);
  for (auto& v : p.post) v = rng.Uniform(0.0f, 2.0f);
  p.comb.resize(N * hc * hc);
  for (auto& v : p.comb) v = rng.Uniform(0.0f, 1.0f);
  return p;
}

std::vector<float> RunPostF32(const HyperConnectionKernels& k, const PostProblem& p,
                              const dsv4::Parallel& par = dsv4::SerialParallel()) {
  std::vector<float> out(p.N * p.hc * p.d, -7.0f);
  k.post_f32(p.f.data(), p.residual.data(), p.post.data(), p.comb.data(), p.N, p.hc, p.d, out.data(), par);
  return out;
}

std::vector<uint16_t> RunPostBf16(const HyperConnectionKernels& k, const PostProblem& p,
                                  const dsv4::Parallel& par = dsv4::SerialParallel()) {
  const std::vector<uint16_t> f = dsv4_test::ToBf16(p.f), r = dsv4_test::ToBf16(p.residual);
  std::vector<uint16_t> out(p.N * p.hc * p.d, 0xdead);
  k.post_bf16(f.data(), r.data(), p.post.data(), p.comb.data(), p.N, p.hc, p.d, out.data(), par);
  return out;
}

std::vector<float> RunHeadF32(const HyperConnectionKernels& k, const PreProblem& p,
                              const dsv4::Parallel& par = dsv4::SerialParallel()) {
  std::vector<float> y(p.N * p.d, -7.0f);
  k.head_f32(p.x.data(), p.fn.data(), p.scale.data(), p.base.data(), p.N, p.hc, p.d, kRmsEps, kHcEps, y.data(), par);
  return y;
}

std::vector<uint16_t> RunHeadBf16(const HyperConnectionKernels& k, const PreProblem& p,
                                  const dsv4::Parallel& par = dsv4::SerialParallel()) {
  const std::vector<uint16_t> x = dsv4_test::ToBf16(p.x);
  std::vector<uint16_t> y(p.N * p.d, 0xdead);
  k.head_bf16(x.data(), p.fn.data(), p.scale.data(), p.base.data(), p.N, p.hc, p.d, kRmsEps, kHcEps, y.data(), par);
  return y;
}

std::string Shape(int64_t N, int64_t hc, int64_t d) {
  return "N=" + std::to_string(N) + " hc=" + std::to_string(hc) + " d=" + std::to_string(d);
}

// (hc, d, N) combinations: odd and power-of-two widths, vector tails, and one DeepSeek-V4-Flash-like width.
struct Size {
  int64_t hc, d, N;
};

std::vector<Size> Sizes() {
  std::vector<Size> sizes;
  for (int64_t hc : {1, 2, 3, 4}) {
    for (int64_t d : {1, 7, 16, 31, 64, 129}) {
      for (int64_t N : {1, 3, 17}) sizes.push_back({hc, d, N});
    }
  }
  for (int64_t N : {1, 3, 5}) sizes.push_back({4, 4096 + 13, N});
  return sizes;
}

// ---------------------------------------------------------------------------------------------------------------
// Reference against hand-computed values.

KT_TEST(hyper_connection_ref_sinkhorn_2x2) {
  // hc = 2: mix = [pre(2), post(2), comb(4)]; unit scales, zero bases, hc_eps = 0.
  // comb logits [[0, ln 3], [0, 0]] -> row softmax [[1/4, 3/4], [1/2, 1/2]]
  //   -> column normalise (column sums 3/4, 5/4): [[1/3, 3/5], [2/3, 2/5]]                       (iters = 1)
  //   -> rows (sums 14/15, 16/15): [[5/14, 9/14], [5/8, 3/8]]
  //   -> columns (sums 55/56, 57/56): [[4/11, 12/19], [7/11, 7/19]]                               (iters = 2)
  const float mix[8] = {0, 0, 0, 0, 0, static_cast<float>(std::log(3.0)), 0, 0};
  const float scale[3] = {1, 1, 1};
  const float base[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float pre[2], post[2], comb[4];
  dsv4::ref::HcPreWeights(mix, scale, base, 2, 0.0f, 1, pre, post, comb);
  const double want1[4] = {1.0 / 3, 3.0 / 5, 2.0 / 3, 2.0 / 5};
  for (int i = 0; i < 4; ++i) KT_CHECK_CLOSE(comb[i], want1[i], 0.0, 1e-6) << "iters=1 element " << i;
  KT_CHECK_EQ(pre[0], 0.5f);
  KT_CHECK_EQ(post[1], 1.0f);

  dsv4::ref::HcPreWeights(mix, scale, base, 2, 0.0f, 2, pre, post, comb);
  const double want2[4] = {4.0 / 11, 12.0 / 19, 7.0 / 11, 7.0 / 19};
  for (int i = 0; i < 4; ++i) KT_CHECK_CLOSE(comb[i], want2[i], 0.0, 1e-6) << "iters=2 element " << i;

  // hc_eps enters pre additively.
  dsv4::ref::HcPreWeights(mix, scale, base, 2, 1e-3f, 2, pre, post, comb);
  KT_CHECK_CLOSE(pre[1], 0.501, 0.0, 1e-6);
}

KT_TEST(hyper_connection_ref_sinkhorn_properties) {
  Rng rng(7);
  const int64_t hc = 4;
  float mix[24], base[24], pre[4], post[4], comb[16], comb1[16], comb0[16];
  for (auto& v : mix) v = rng.Uniform(-2, 2);
  for (auto& v : base) v = rng.Uniform(-1, 1);
  const float scale[3] = {1.0f, 1.0f, 1.5f};
  dsv4::ref::HcPreWeights(mix, scale, base, hc, kHcEps, 20, pre, post, comb);
  for (int64_t j = 0; j < hc; ++j) {
    double col = 0, row = 0;
    for (int64_t k = 0; k < hc; ++k) {
      col += comb[k * hc + j];
      row += comb[j * hc + k];
    }
    KT_CHECK_CLOSE(col, 1.0, 1e-5, 0.0) << "column " << j << " (the last step normalises columns)";
    KT_CHECK_CLOSE(row, 1.0, 1e-3, 0.0) << "row " << j << " (nearly doubly stochastic after 20 iterations)";
    KT_CHECK(post[j] > 0.0f && post[j] < 2.0f);
    KT_CHECK(pre[j] > 0.0f && pre[j] < 1.0f + 2 * kHcEps);
  }
  // sinkhorn_iters <= 1 both mean softmax + one column normalisation (as HF's loop).
  dsv4::ref::HcPreWeights(mix, scale, base, hc, kHcEps, 1, pre, post, comb1);
  dsv4::ref::HcPreWeights(mix, scale, base, hc, kHcEps, 0, pre, post, comb0);
  for (int i = 0; i < 16; ++i) KT_CHECK_EQ(comb0[i], comb1[i]);
}

KT_TEST(hyper_connection_ref_pre_hand) {
  // hc = 1, d = 2, x = [3, 4]: mean(x^2) = 12.5; fn rows [1, 0], [0, 1], [1, 1] -> dots 3, 4, 7.
  const std::vector<float> x = {3, 4}, fn = {1, 0, 0, 1, 1, 1}, scale = {2.0f, 0.5f, 1.0f}, base = {0.1f, -0.2f, 0.3f};
  std::vector<float> h(2), post(1), comb(1);
  dsv4::ref::HcPreF32(x.data(), fn.data(), scale.data(), base.data(), 1, 1, 2, kRmsEps, kHcEps, 3, h.data(),
                      post.data(), comb.data(), dsv4::SerialParallel());
  const double r = 1.0 / std::sqrt(12.5 + kRmsEps);
  const double pre = Sigmoid(3 * r * 2.0 + 0.1) + kHcEps;
  KT_CHECK_CLOSE(h[0], pre * 3, 0.0, 1e-6);
  KT_CHECK_CLOSE(h[1], pre * 4, 0.0, 1e-6);
  KT_CHECK_CLOSE(post[0], 2 * Sigmoid(4 * r * 0.5 - 0.2), 0.0, 1e-6);
  // hc = 1: softmax of one logit is 1; + eps; then c / (c + eps) for the column, row, column steps.
  double c = 1.0 + kHcEps;
  for (int step = 0; step < 5; ++step) c = c / (c + kHcEps);
  KT_CHECK_CLOSE(comb[0], c, 0.0, 1e-6);
}

KT_TEST(hyper_connection_ref_post_hand) {
  // out[j] = post[j] f + sum_k comb[k][j] R[k], with a non-symmetric comb (catches a transposed index).
  const std::vector<float> f = {1, 2}, residual = {10, 20, 100, 200}, post = {2, 3}, comb = {1, 0, 0.5f, 0.25f};
  std::vector<float> out(4);
  dsv4::ref::HcPostF32(f.data(), residual.data(), post.data(), comb.data(), 1, 2, 2, out.data(),
                       dsv4::SerialParallel());
  const std::vector<float> want = {62, 124, 28, 56};
  for (int i = 0; i < 4; ++i) KT_CHECK_EQ(out[i], want[i]) << "element " << i;
}

KT_TEST(hyper_connection_ref_head_hand) {
  // hc = 2, d = 1, X = [[1], [2]]: mean(v^2) = 2.5; fn rows [1, 1], [1, -1] -> dots 3, -1.
  const std::vector<float> x = {1, 2}, fn = {1, 1, 1, -1}, scale = {0.5f}, base = {0.0f, 1.0f};
  std::vector<float> y(1);
  dsv4::ref::HcHeadF32(x.data(), fn.data(), scale.data(), base.data(), 1, 2, 1, kRmsEps, kHcEps, y.data(),
                       dsv4::SerialParallel());
  const double r = 1.0 / std::sqrt(2.5 + kRmsEps);
  const double want = (Sigmoid(1.5 * r) + kHcEps) * 1 + (Sigmoid(-0.5 * r + 1.0) + kHcEps) * 2;
  KT_CHECK_CLOSE(y[0], want, 0.0, 1e-6);

  // The bf16 path rounds the same fp32 value once.
  const std::vector<uint16_t> xb = dsv4_test::ToBf16(x);
  std::vector<uint16_t> yb(1);
  dsv4::ref::HcHeadBf16(xb.data(), fn.data(), scale.data(), base.data(), 1, 2, 1, kRmsEps, kHcEps, yb.data(),
                        dsv4::SerialParallel());
  KT_CHECK_EQ(yb[0], dsv4::F32ToBf16(y[0]));
}

// ---------------------------------------------------------------------------------------------------------------
// Variants against the reference.

void TestPre(IsaLevel level, bool bf16) {
  dsv4_test::RequireIsa(level);
  Rng rng(bf16 ? 0x9e16 : 0x9e32);
  for (const Size& s : Sizes()) {
    for (int64_t iters : {20, 1}) {
      const PreProblem p = MakePre(rng, s.N, s.hc, s.d, iters, (2 + s.hc) * s.hc);
      const PreOut want = RunPre(dsv4::ref::kHyperConnection, p, bf16);
      const PreOut got = RunPre(*Table(level), p, bf16);
      const std::string name = Shape(s.N, s.hc, s.d) + " iters=" + std::to_string(iters);
      dsv4_test::ExpectClose(name + " post", got.post, want.post, kWeightAtol, kRtol);
      dsv4_test::ExpectClose(name + " comb", got.comb, want.comb, kWeightAtol, kRtol);
      if (bf16) {
        dsv4_test::ExpectBf16Close(name + " h", got.h_bf16, want.h_bf16, 1e-6, kBf16MaxDifferentFraction);
      } else {
        dsv4_test::ExpectClose(name + " h", got.h, want.h, kValueAtol, kRtol);
      }
    }
  }
}

void TestPost(IsaLevel level, bool bf16) {
  dsv4_test::RequireIsa(level);
  Rng rng(bf16 ? 0x9016 : 0x9032);
  std::vector<Size> sizes = Sizes();
  sizes.push_back({4, 1024 + 7, 2});  // more than one 512-column work item per token
  for (const Size& s : sizes) {
    const PostProblem p = MakePost(rng, s.N, s.hc, s.d);
    const std::string name = Shape(s.N, s.hc, s.d) + " out";
    if (bf16) {
      dsv4_test::ExpectBf16Close(name, RunPostBf16(*Table(level), p), RunPostBf16(dsv4::ref::kHyperConnection, p),
                                 1e-6, kBf16MaxDifferentFraction);
    } else {
      dsv4_test::ExpectClose(name, RunPostF32(*Table(level), p), RunPostF32(dsv4::ref::kHyperConnection, p),
                             kValueAtol, kRtol);
    }
  }
}

void TestHead(IsaLevel level, bool bf16) {
  dsv4_test::RequireIsa(level);
  Rng rng(bf16 ? 0x4e16 : 0x4e32);
  for (const Size& s : Sizes()) {
    PreProblem p = MakePre(rng, s.N, s.hc, s.d, 0, s.hc);
    p.scale.resize(1);
    const std::string name = Shape(s.N, s.hc, s.d) + " y";
    if (bf16) {
      dsv4_test::ExpectBf16Close(name, RunHeadBf16(*Table(level), p), RunHeadBf16(dsv4::ref::kHyperConnection, p),
                                 1e-6, kBf16MaxDifferentFraction);
    } else {
      dsv4_test::ExpectClose(name, RunHeadF32(*Table(level), p), RunHeadF32(dsv4::ref::kHyperConnection, p),
                             kValueAtol, kRtol);
    }
  }
}

// hc up to the documented maximum of 16 (M = 288 projection rows).
void TestWideHc(IsaLevel level) {
  dsv4_test::RequireIsa(level);
  Rng rng(0x16);
  for (int64_t hc : {5, 8, 16}) {
    for (int64_t d : {1, 5, 33}) {
      const int64_t N = 3;
      const PreProblem p = MakePre(rng, N, hc, d, 20, (2 + hc) * hc);
      for (bool bf16 : {false, true}) {
        const PreOut want = RunPre(dsv4::ref::kHyperConnection, p, bf16);
        const PreOut got = RunPre(*Table(level), p, bf16);
        const std::string name = Shape(N, hc, d) + (bf16 ? " bf16" : " f32");
        dsv4_test::ExpectClose(name + " post", got.post, want.post, kWeightAtol, kRtol);
        dsv4_test::ExpectClose(name + " comb", got.comb, want.comb, kWeightAtol, kRtol);
        if (bf16) {
          dsv4_test::ExpectBf16Close(name + " h", got.h_bf16, want.h_bf16, 1e-6, kBf16MaxDifferentFraction);
        } else {
          dsv4_test::ExpectClose(name + " h", got.h, want.h, kValueAtol, kRtol);
        }
      }
      const PostProblem q = MakePost(rng, N, hc, d);
      dsv4_test::ExpectClose(Shape(N, hc, d) + " post out", RunPostF32(*Table(level), q),
                             RunPostF32(dsv4::ref::kHyperConnection, q), kValueAtol, kRtol);
      PreProblem head = MakePre(rng, N, hc, d, 0, hc);
      head.scale.resize(1);
      dsv4_test::ExpectClose(Shape(N, hc, d) + " head y", RunHeadF32(*Table(level), head),
                             RunHeadF32(dsv4::ref::kHyperConnection, head), kValueAtol, kRtol);
    }
  }
}

// A NaN in one token's activations poisons that token only; the others still match the reference.
void TestNan(IsaLevel level) {
  dsv4_test::RequireIsa(level);
  Rng rng(0xa11);
  const int64_t N = 3, hc = 4, d = 37;
  for (bool bf16 : {false, true}) {
    PreProblem p = MakePre(rng, N, hc, d, 20, (2 + hc) * hc);
    p.x[1 * hc * d + 5] = kNaN;
    const PreOut want = RunPre(dsv4::ref::kHyperConnection, p, bf16);
    const PreOut got = RunPre(*Table(level), p, bf16);
    const std::string name = std::string("NaN pre") + (bf16 ? " bf16" : " f32");
    dsv4_test::ExpectClose(name + " post", got.post, want.post, kWeightAtol, kRtol);
    dsv4_test::ExpectClose(name + " comb", got.comb, want.comb, kWeightAtol, kRtol);
    if (bf16) {
      dsv4_test::ExpectBf16Close(name + " h", got.h_bf16, want.h_bf16, 1e-6, kBf16MaxDifferentFraction);
    } else {
      dsv4_test::ExpectClose(name + " h", got.h, want.h, kValueAtol, kRtol);
    }
    for (int64_t j = 0; j < hc; ++j) KT_CHECK(std::isnan(got.post[1 * hc + j])) << name << ": token 1 post " << j;

    PostProblem q = MakePost(rng, N, hc, d);
    q.residual[2 * hc * d + 3] = kNaN;
    q.comb[0] = kNaN;
    if (bf16) {
      dsv4_test::ExpectBf16Close("NaN post bf16", RunPostBf16(*Table(level), q),
                                 RunPostBf16(dsv4::ref::kHyperConnection, q), 1e-6, kBf16MaxDifferentFraction);
    } else {
      dsv4_test::ExpectClose("NaN post f32", RunPostF32(*Table(level), q), RunPostF32(dsv4::ref::kHyperConnection, q),
                             kValueAtol, kRtol);
    }
    PreProblem head = MakePre(rng, N, hc, d, 0, hc);
    head.scale.resize(1);
    head.x[0] = kNaN;
    dsv4_test::ExpectClose("NaN head", RunHeadF32(*Table(level), head), RunHeadF32(dsv4::ref::kHyperConnection, head),
                           kValueAtol, kRtol);
  }
}

// Results are bit-identical whatever the thread count, the task order, or the batch a token arrives in (the
// variants use a different work split for few tokens than for many).
void TestThreadsAndBatching(IsaLevel level) {
  dsv4_test::RequireIsa(level);
  const HyperConnectionKernels& k = *Table(level);
  Rng rng(0x7777);
  const dsv4_test::ThreadParallel threads(3);
  const int64_t N = 17, hc = 4, d = 333;
  for (bool bf16 : {false, true}) {
    const std::string dtype = bf16 ? " bf16" : " f32";
    const PreProblem p = MakePre(rng, N, hc, d, 20, (2 + hc) * hc);
    const PreOut serial = RunPre(k, p, bf16);
    const PreOut threaded = RunPre(k, p, bf16, threads.Get());
    dsv4_test::ExpectIdentical("pre threaded post" + dtype, threaded.post, serial.post);
    dsv4_test::ExpectIdentical("pre threaded comb" + dtype, threaded.comb, serial.comb);
    dsv4_test::ExpectIdentical("pre threaded h" + dtype, threaded.h, serial.h);
    dsv4_test::ExpectIdentical("pre threaded h" + dtype, threaded.h_bf16, serial.h_bf16);
    for (int64_t n : {int64_t{0}, int64_t{9}, N - 1}) {
      PreProblem one = p;
      one.N = 1;
      one.x.assign(p.x.begin() + n * hc * d, p.x.begin() + (n + 1) * hc * d);
      const PreOut single = RunPre(k, one, bf16, threads.Get());
      const std::string what = "pre token " + std::to_string(n) + " alone vs in a batch" + dtype;
      dsv4_test::ExpectIdentical(what + " post",
                                 single.post, std::vector<float>(serial.post.begin() + n * hc,
                                                                 serial.post.begin() + (n + 1) * hc));
      dsv4_test::ExpectIdentical(what + " comb", single.comb,
                                 std::vector<float>(serial.comb.begin() + n * hc * hc,
                                                    serial.comb.begin() + (n + 1) * hc * hc));
      if (bf16) {
        dsv4_test::ExpectIdentical(what + " h", single.h_bf16,
                                   std::vector<uint16_t>(serial.h_bf16.begin() + n * d,
                                                         serial.h_bf16.begin() + (n + 1) * d));
      } else {
        dsv4_test::ExpectIdentical(what + " h", single.h,
                                   std::vector<float>(serial.h.begin() + n * d, serial.h.begin() + (n + 1) * d));
      }
    }
    const PostProblem q = MakePost(rng, N, hc, 1500);
    if (bf16) {
      dsv4_test::ExpectIdentical("post threaded" + dtype, RunPostBf16(k, q, threads.Get()), RunPostBf16(k, q));
    } else {
      dsv4_test::ExpectIdentical("post threaded" + dtype, RunPostF32(k, q, threads.Get()), RunPostF32(k, q));
    }
    PreProblem head = MakePre(rng, N, hc, d, 0, hc);
    head.scale.resize(1);
    if (bf16) {
      dsv4_test::ExpectIdentical("head threaded" + dtype, RunHeadBf16(k, head, threads.Get()), RunHeadBf16(k, head));
    } else {
      dsv4_test::ExpectIdentical("head threaded" + dtype, RunHeadF32(k, head, threads.Get()), RunHeadF32(k, head));
    }
  }
}

// N = 0 is a no-op that touches no memory.
void TestEmpty(IsaLevel level) {
  dsv4_test::RequireIsa(level);
  const HyperConnectionKernels& k = *Table(level);
  const dsv4_test::ThreadParallel threads(3);
  for (const dsv4::Parallel& par : {dsv4::SerialParallel(), threads.Get()}) {
    k.pre_f32(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, kRmsEps, kHcEps, 20, nullptr, nullptr, nullptr, par);
    k.pre_bf16(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, kRmsEps, kHcEps, 20, nullptr, nullptr, nullptr, par);
    k.post_f32(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, nullptr, par);
    k.post_bf16(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, nullptr, par);
    k.head_f32(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, kRmsEps, kHcEps, nullptr, par);
    k.head_bf16(nullptr, nullptr, nullptr, nullptr, 0, 4, 64, kRmsEps, kHcEps, nullptr, par);
  }
}

const bool kRegistered = [] {
  kt::Register("hyper_connection_threads_and_batching_scalar", [] { TestThreadsAndBatching(IsaLevel::kScalar); });
  kt::Register("hyper_connection_empty_scalar", [] { TestEmpty(IsaLevel::kScalar); });
  for (IsaLevel level : dsv4_test::VariantLevels()) {
    const std::string isa = dsv4::IsaName(level);
    for (bool bf16 : {false, true}) {
      const std::string dtype = bf16 ? "bf16" : "f32";
      kt::Register("hyper_connection_pre_" + dtype + "_" + isa, [level, bf16] { TestPre(level, bf16); });
      kt::Register("hyper_connection_post_" + dtype + "_" + isa, [level, bf16] { TestPost(level, bf16); });
      kt::Register("hyper_connection_head_" + dtype + "_" + isa, [level, bf16] { TestHead(level, bf16); });
    }
    kt::Register("hyper_connection_wide_hc_" + isa, [level] { TestWideHc(level); });
    kt::Register("hyper_connection_nan_inputs_" + isa, [level] { TestNan(level); });
    kt::Register("hyper_connection_empty_" + isa, [level] { TestEmpty(level); });
    kt::Register("hyper_connection_threads_and_batching_" + isa, [level] { TestThreadsAndBatching(level); });
  }
  return true;
}();

}  // namespace
