// MoE router kernels: turn gate logits into (expert index, routing weight) pairs per token.
//
// Two routings share one scoring step s = score(logit), computed in fp32:
//   kSqrtSoftplus  s = sqrt(softplus(x)), softplus(x) = x if x > 20 else log1p(exp(x))   (torch's threshold 20)
//   kSigmoid       s = 1 / (1 + exp(-x))
//   kSoftmax       s = exp(x - max_e x) / sum_e exp(x - max_e x)                          (over the E experts of a token)
// DeepSeek-V4 uses kSqrtSoftplus. HF transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter apply the activation
// `ACT2FN[config.scoring_func]` element-wise, which covers sqrtsoftplus and sigmoid; ACT2FN has no "softmax", so
// kSoftmax follows the DeepSeek-V3 reference gate (fp32 softmax over experts). Renormalisation is a separate flag for
// every score function (HF renormalises unconditionally; the DeepSeek reference skips it for softmax; the op glue
// passes `norm_topk_prob`).
//
// Top-k routing (score-routed layers):
//   key[e]    = s[e] + bias[e]            (bias = e_score_correction_bias; selection only; nullptr = no bias)
//   idx[0..k) = the k experts with the largest key, ordered by descending key; equal keys -> lower expert index first
//   w[i]      = s[idx[i]]                 (unbiased score)
//   w[i]      = w[i] / (sum_i w[i] + 1e-20)   if norm_topk_prob (sum taken in output order, fp32)
//   w[i]      = w[i] * routed_scaling_factor
// Fixed routing (hash layers): idx is given per token (tid2eid[input_id], gathered and range-checked by the op glue);
// the weights follow the same three last lines.
//
// NaN: a key that is NaN ranks exactly like -inf (below every other value; among themselves by lower index). So a
// token always gets k distinct valid experts; NaN experts are picked only when fewer than k keys are non-NaN. This
// deliberately differs from torch.topk, which ranks NaN highest. NaN scores propagate into the weights unchanged.
// Equal keys include +0 == -0.
//
// Shapes (row-major, contiguous):
//   logits       [T, E]  fp32
//   bias         [E]     fp32 or nullptr
//   expert_ids   [T, k]  int64, every id in [0, E)            (fixed routing input)
//   weights      [T, k]  fp32                                  (output)
//   indices      [T, k]  int64                                 (top-k output)
// Preconditions (asserted, not validated): E >= 1, 0 <= k <= E, T >= 0. Outputs must not alias inputs.
#pragma once

#include <cstdint>

#include "custom_ops/platform/parallel.h"

namespace dsv4 {

enum class MoeScoreFunc : int32_t {
  kSqrtSoftplus = 0,
  kSoftmax = 1,
  kSigmoid = 2,
};

// Top-k routing. Shapes: logits [T, E], bias [E] or nullptr -> weights [T, k], indices [T, k].
using MoeTopkRouteFn = void (*)(const float* logits, const float* bias, int64_t num_tokens, int64_t num_experts,
                                int64_t top_k, MoeScoreFunc score_func, bool norm_topk_prob,
                                float routed_scaling_factor, float* weights, int64_t* indices, const Parallel& par);

// Fixed-expert routing. Shapes: logits [T, E], expert_ids [T, k] (each in [0, E)) -> weights [T, k].
using MoeFixedRouteFn = void (*)(const float* logits, const int64_t* expert_ids, int64_t num_tokens,
                                 int64_t num_experts, int64_t top_k, MoeScoreFunc score_func, bool norm_topk_prob,
                                 float routed_scaling_factor, float* weights, const Parallel& par);

// One table per ISA level; every slot is non-null (an ISA that does not accelerate a slot points it at ref).
struct MoeRoutingKernels {
  MoeTopkRouteFn topk_route;
  MoeFixedRouteFn fixed_route;
};

namespace ref {
extern const MoeRoutingKernels kMoeRouting;

void MoeTopkRoute(const float* logits, const float* bias, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                  MoeScoreFunc score_func, bool norm_topk_prob, float routed_scaling_factor, float* weights,
                  int64_t* indices, const Parallel& par);

void MoeFixedRoute(const float* logits, const int64_t* expert_ids, int64_t num_tokens, int64_t num_experts,
                   int64_t top_k, MoeScoreFunc score_func, bool norm_topk_prob, float routed_scaling_factor,
                   float* weights, const Parallel& par);

// Scalar score functions (the element-wise definitions above). Shapes: x [n] -> s [n]; softmax is over the n values.
void MoeScores(const float* logits, int64_t n, MoeScoreFunc score_func, float* scores);
}  // namespace ref

namespace avx2 {
extern const MoeRoutingKernels kMoeRouting;
}  // namespace avx2

namespace avx512 {
extern const MoeRoutingKernels kMoeRouting;
}  // namespace avx512

}  // namespace dsv4
