// Scalar reference for the MoE router kernels (moe_routing.h): scoring, top-k selection with a deterministic
// tie rule, fixed-expert (hash) routing, renormalisation and scaling, all in fp32. This file is the spec the AVX2 and
// AVX512 variants are tested against; it mirrors HF transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter
// (scores -> select on scores + bias -> gather unbiased scores -> w / (sum + 1e-20) -> * routed_scaling_factor).
// Baseline x86-64 (or any) ISA; written for clarity, not speed.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "custom_ops/kernels/moe_routing.h"

namespace dsv4 {
namespace ref {
namespace {

float SqrtSoftplus(float x) {
  const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));  // torch.nn.functional.softplus, threshold 20
  return std::sqrt(softplus);
}

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Selection key: NaN ranks like -inf (see the header).
float SelectionKey(float score, float bias) {
  const float key = score + bias;
  return std::isnan(key) ? -std::numeric_limits<float>::infinity() : key;
}

// w[i] <- (norm ? w[i] / (sum_i w[i] + 1e-20) : w[i]) * scale; the sum runs in output order.
void NormaliseAndScale(float* w, int64_t k, bool norm_topk_prob, float routed_scaling_factor) {
  if (norm_topk_prob) {
    float sum = 0.0f;
    for (int64_t i = 0; i < k; ++i) sum += w[i];
    const float denom = sum + 1e-20f;
    for (int64_t i = 0; i < k; ++i) w[i] = w[i] / denom;
  }
  for (int64_t i = 0; i < k; ++i) w[i] = w[i] * routed_scaling_factor;
}

// Roughly 16k element-operations per task and at most 4 tasks per thread.
size_t NumChunks(const Parallel& par, int64_t items, int64_t cost_per_item) {
  const int64_t by_cost = std::max<int64_t>(1, items * std::max<int64_t>(1, cost_per_item) / 16384);
  const int64_t by_threads = 4 * std::max(1, par.num_threads);
  return static_cast<size_t>(std::max<int64_t>(1, std::min({items, by_cost, by_threads})));
}

}  // namespace

void MoeScores(const float* logits, int64_t n, MoeScoreFunc score_func, float* scores) {
  switch (score_func) {
    case MoeScoreFunc::kSqrtSoftplus:
      for (int64_t e = 0; e < n; ++e) scores[e] = SqrtSoftplus(logits[e]);
      break;
    case MoeScoreFunc::kSigmoid:
      for (int64_t e = 0; e < n; ++e) scores[e] = Sigmoid(logits[e]);
      break;
    case MoeScoreFunc::kSoftmax: {
      float max_logit = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < n; ++e) {
        if (logits[e] > max_logit) max_logit = logits[e];  // NaN never wins; it then poisons the sum (all NaN)
      }
      float sum = 0.0f;
      for (int64_t e = 0; e < n; ++e) {
        scores[e] = std::exp(logits[e] - max_logit);
        sum += scores[e];
      }
      for (int64_t e = 0; e < n; ++e) scores[e] = scores[e] / sum;
      break;
    }
  }
}

void MoeTopkRoute(const float* logits, const float* bias, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                  MoeScoreFunc score_func, bool norm_topk_prob, float routed_scaling_factor, float* weights,
                  int64_t* indices, const Parallel& par) {
  assert(num_experts >= 1 && top_k >= 0 && top_k <= num_experts && num_tokens >= 0);
  const int64_t E = num_experts, K = top_k;
  par.ForRange(static_cast<size_t>(num_tokens), NumChunks(par, num_tokens, 8 * E), [&](size_t begin, size_t end) {
    std::vector<float> scores(E), keys(E);
    std::vector<int64_t> order(E);
    for (size_t t = begin; t < end; ++t) {
      MoeScores(logits + t * E, E, score_func, scores.data());
      for (int64_t e = 0; e < E; ++e) {
        keys[e] = SelectionKey(scores[e], bias != nullptr ? bias[e] : 0.0f);
        order[e] = e;
      }
      // A strict total order (keys are NaN-free): larger key first, then lower index.
      const auto ranks_before = [&](int64_t a, int64_t b) { return keys[a] > keys[b] || (keys[a] == keys[b] && a < b); };
      std::partial_sort(order.begin(), order.begin() + K, order.end(), ranks_before);

      float* w = weights + t * K;
      int64_t* idx = indices + t * K;
      for (int64_t i = 0; i < K; ++i) {
        idx[i] = order[i];
        w[i] = scores[order[i]];
      }
      NormaliseAndScale(w, K, norm_topk_prob, routed_scaling_factor);
    }
  });
}

void MoeFixedRoute(const float* logits, const int64_t* expert_ids, int64_t num_tokens, int64_t num_experts,
                   int64_t top_k, MoeScoreFunc score_func, bool norm_topk_prob, float routed_scaling_factor,
                   float* weights, const Parallel& par) {
  assert(num_experts >= 1 && top_k >= 0 && num_tokens >= 0);
  const int64_t E = num_experts, K = top_k;
  par.ForRange(static_cast<size_t>(num_tokens), NumChunks(par, num_tokens, 4 * E), [&](size_t begin, size_t end) {
    std::vector<float> scores(E);
    for (size_t t = begin; t < end; ++t) {
      MoeScores(logits + t * E, E, score_func, scores.data());
      const int64_t* ids = expert_ids + t * K;
      float* w = weights + t * K;
      for (int64_t i = 0; i < K; ++i) {
        assert(ids[i] >= 0 && ids[i] < E);
        w[i] = scores[ids[i]];
      }
      NormaliseAndScale(w, K, norm_topk_prob, routed_scaling_factor);
    }
  });
}

const MoeRoutingKernels kMoeRouting = {&MoeTopkRoute, &MoeFixedRoute};

}  // namespace ref
}  // namespace dsv4
