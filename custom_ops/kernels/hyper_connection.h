// mHC (manifold-constrained hyper-connections) kernels: the per-token mixing of `hc` parallel residual streams that
// wraps every attention and MoE sub-block of DeepSeek-V4, plus the final stream collapse before the output norm.
//
// Notation per token n: X = x[n] is [hc, d] (stream k = row k), v = vec(X) in fp32 ([hc*d]), M = (2+hc)*hc.
//
// HcPre (HF DeepseekV4HyperConnection.forward; dsv4-architecture.md §4.2):
//   r        = 1 / sqrt(sum(v^2) / (hc*d) + rms_eps)                     (weightless RMSNorm of v)
//   mix[m]   = dot(fn[m, :], v) * r                                      m in [0, M)
//   pre[k]   = sigmoid(mix[k] * scale[0] + base[k]) + hc_eps                             k in [0, hc)
//   post[j]  = 2 * sigmoid(mix[hc + j] * scale[1] + base[hc + j])                        j in [0, hc)
//   C[k][j]  = mix[2hc + k*hc + j] * scale[2] + base[2hc + k*hc + j]     (row k = source stream, column j = target)
//   C        = softmax over j of each row, + hc_eps
//   C[k][j] /= sum_k C[k][j] + hc_eps                                    (column normalise)
//   repeat (sinkhorn_iters - 1) times: row normalise (/ (sum_j + hc_eps)), then column normalise
//   h[i]     = sum_k pre[k] * X[k][i]      (fp32, rounded once to x's dtype)
//   outputs: h [d] (x's dtype), post [hc] fp32, comb = C [hc, hc] fp32.
//   HF computes dot(fn[m], v * r); the kernels compute dot(fn[m], v) * r (same value up to fp32 rounding, and the
//   scale can then be applied after a single fused pass over x). sinkhorn_iters <= 1 behaves like 1 (as HF's loop).
//
// HcPost (dsv4-architecture.md §4.3; HF DeepseekV4DecoderLayer: post * f + comb^T @ residual):
//   out[j][i] = post[j] * f[i] + sum_k comb[k][j] * R[k][i]     (fp32, rounded once to the residual dtype)
//   HF, for bf16 activations, first rounds post and comb to bf16 and mixes in bf16; these kernels keep fp32 (as the
//   DeepSeek reference and vLLM do), which is the more accurate of the two.
//
// HcHead (HF DeepseekV4HyperHead.forward; dsv4-architecture.md §3):
//   r = as above; mix[k] = dot(fn[k, :], v) * r (fn is [hc, hc*d]); pre[k] = sigmoid(mix[k] * scale[0] + base[k]) + hc_eps
//   y[i] = sum_k pre[k] * X[k][i]           (fp32, rounded once to x's dtype)
//
// bf16 tensors are uint16_t bit patterns; widening is exact and narrowing rounds to nearest-even with NaN kept quiet
// (custom_ops/numerics/bf16.h). All arithmetic is fp32, except that the two reductions of length hc*d (sum of
// squares, projection) fold their fp32 partial sums into double totals, so that every variant stays within a few
// fp32 ulps of the exact value and sums in an order that does not depend on batching or threading.
//
// Shapes (row-major, contiguous; N tokens, hc streams, d = dim):
//   HcPre   x [N, hc, d], fn [(2+hc)*hc, hc*d] fp32, scale [3], base [(2+hc)*hc]
//           -> h [N, d], post [N, hc] fp32, comb [N, hc, hc] fp32
//   HcPost  f [N, d], residual [N, hc, d], post [N, hc] fp32, comb [N, hc, hc] fp32 -> out [N, hc, d]
//   HcHead  x [N, hc, d], fn [hc, hc*d] fp32, scale [1], base [hc] -> y [N, d]
// Preconditions (asserted, not validated): 1 <= hc <= kHcMaxStreams, d >= 1, N >= 0; outputs do not alias inputs.
#pragma once

#include <cstdint>

#include "custom_ops/platform/parallel.h"

namespace dsv4 {

constexpr int64_t kHcMaxStreams = 16;

using HcPreF32Fn = void (*)(const float* x, const float* fn, const float* scale, const float* base, int64_t num_tokens,
                            int64_t hc, int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, float* h,
                            float* post, float* comb, const Parallel& par);
using HcPreBf16Fn = void (*)(const uint16_t* x, const float* fn, const float* scale, const float* base,
                             int64_t num_tokens, int64_t hc, int64_t dim, float rms_eps, float hc_eps,
                             int64_t sinkhorn_iters, uint16_t* h, float* post, float* comb, const Parallel& par);
using HcPostF32Fn = void (*)(const float* f, const float* residual, const float* post, const float* comb,
                             int64_t num_tokens, int64_t hc, int64_t dim, float* out, const Parallel& par);
using HcPostBf16Fn = void (*)(const uint16_t* f, const uint16_t* residual, const float* post, const float* comb,
                              int64_t num_tokens, int64_t hc, int64_t dim, uint16_t* out, const Parallel& par);
using HcHeadF32Fn = void (*)(const float* x, const float* fn, const float* scale, const float* base,
                             int64_t num_tokens, int64_t hc, int64_t dim, float rms_eps, float hc_eps, float* y,
                             const Parallel& par);
using HcHeadBf16Fn = void (*)(const uint16_t* x, const float* fn, const float* scale, const float* base,
                              int64_t num_tokens, int64_t hc, int64_t dim, float rms_eps, float hc_eps, uint16_t* y,
                              const Parallel& par);

// One table per ISA level; every slot is non-null (an ISA that does not accelerate a slot points it at ref).
struct HyperConnectionKernels {
  HcPreF32Fn pre_f32;
  HcPreBf16Fn pre_bf16;
  HcPostF32Fn post_f32;
  HcPostBf16Fn post_bf16;
  HcHeadF32Fn head_f32;
  HcHeadBf16Fn head_bf16;
};

namespace ref {
extern const HyperConnectionKernels kHyperConnection;

void HcPreF32(const float* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
              int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, float* h, float* post, float* comb,
              const Parallel& par);
void HcPreBf16(const uint16_t* x, const float* fn, const float* scale, const float* base, int64_t num_tokens,
               int64_t hc, int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, uint16_t* h, float* post,
               float* comb, const Parallel& par);
void HcPostF32(const float* f, const float* residual, const float* post, const float* comb, int64_t num_tokens,
               int64_t hc, int64_t dim, float* out, const Parallel& par);
void HcPostBf16(const uint16_t* f, const uint16_t* residual, const float* post, const float* comb, int64_t num_tokens,
                int64_t hc, int64_t dim, uint16_t* out, const Parallel& par);
void HcHeadF32(const float* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
               int64_t dim, float rms_eps, float hc_eps, float* y, const Parallel& par);
void HcHeadBf16(const uint16_t* x, const float* fn, const float* scale, const float* base, int64_t num_tokens,
                int64_t hc, int64_t dim, float rms_eps, float hc_eps, uint16_t* y, const Parallel& par);

// The per-token step after the projection, shared by every variant so that pre/post/comb depend only on the mixes.
// mix [(2+hc)*hc] (already multiplied by r) -> pre [hc], post [hc], comb [hc, hc].
void HcPreWeights(const float* mix, const float* scale, const float* base, int64_t hc, float hc_eps,
                  int64_t sinkhorn_iters, float* pre, float* post, float* comb);
// mix [hc] (already multiplied by r) -> pre [hc].
void HcHeadWeights(const float* mix, const float* scale, const float* base, int64_t hc, float hc_eps, float* pre);
}  // namespace ref

namespace avx2 {
extern const HyperConnectionKernels kHyperConnection;
}  // namespace avx2

namespace avx512 {
extern const HyperConnectionKernels kHyperConnection;
}  // namespace avx512

}  // namespace dsv4
