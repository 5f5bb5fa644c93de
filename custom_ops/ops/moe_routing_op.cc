// MoeRouteTopK / MoeRouteHash: ORT glue for kernels/moe_routing.h. Validates shapes, the expert count against
// top_k, and (hash routing) every token id and table entry before the kernel runs.
#include <string>

#include "kernels/moe_routing.h"
#include "ops/kernel_api.h"

namespace dsv4::glue {
namespace {

MoeScoreFunc ParseScoring(const std::string& s) {
  if (s == "sqrtsoftplus") return MoeScoreFunc::kSqrtSoftplus;
  if (s == "softmax") return MoeScoreFunc::kSoftmax;
  return MoeScoreFunc::kSigmoid;  // the table restricts the choices
}

class MoeRouteTopKKernel final : public Kernel {
 public:
  explicit MoeRouteTopKKernel(const KernelInit& init)
      : kernels_(*init.tables->moe_routing),
        top_k_(init.attrs->Int("top_k")),
        scoring_(ParseScoring(init.attrs->String("scoring"))),
        norm_(init.attrs->Int("norm_topk_prob") != 0),
        scale_(init.attrs->Float("routed_scaling_factor")) {}

  void Compute(ComputeContext& ctx) override {
    const InputView& logits = ctx.Input(0);
    const InputView& bias = ctx.Input(1);
    const int64_t tokens = logits.dim(0), experts = logits.dim(1);
    if (experts < 1) Fail("logits must have at least one expert column, got shape ", ShapeString(logits.shape));
    if (top_k_ > experts) Fail("top_k=", top_k_, " exceeds the number of experts ", experts);
    if (bias.present && bias.dim(0) != experts) {
      Fail("bias has ", bias.dim(0), " entries but logits have ", experts, " experts");
    }
    float* weights = ctx.OutputAs<float>(0, tokens * top_k_);  // top_k <= experts: no overflow
    int64_t* indices = ctx.OutputAs<int64_t>(1, tokens * top_k_);
    if (tokens == 0) return;
    kernels_.topk_route(logits.as<float>(), bias.present ? bias.as<float>() : nullptr, tokens, experts, top_k_,
                        scoring_, norm_, scale_, weights, indices, ctx.Par());
  }

 private:
  const MoeRoutingKernels& kernels_;
  int64_t top_k_;
  MoeScoreFunc scoring_;
  bool norm_;
  float scale_;
};

class MoeRouteHashKernel final : public Kernel {
 public:
  explicit MoeRouteHashKernel(const KernelInit& init)
      : kernels_(*init.tables->moe_routing),
        scoring_(ParseScoring(init.attrs->String("scoring"))),
        norm_(init.attrs->Int("norm_topk_prob") != 0),
        scale_(init.attrs->Float("routed_scaling_factor")) {}

  void Compute(ComputeContext& ctx) override {
    const InputView& logits = ctx.Input(0);
    const InputView& ids = ctx.Input(1);
    const InputView& table = ctx.Input(2);
    const int64_t tokens = logits.dim(0), experts = logits.dim(1);
    const int64_t vocab = table.dim(0), k = table.dim(1);
    if (experts < 1) Fail("logits must have at least one expert column, got shape ", ShapeString(logits.shape));
    if (ids.dim(0) != tokens) Fail("input_ids has ", ids.dim(0), " tokens but logits have ", tokens);
    if (k > experts) Fail("tid2eid has ", k, " experts per token but logits have only ", experts, " experts");
    float* weights = ctx.OutputAs<float>(0, tokens * k);  // k <= experts: no overflow
    int64_t* indices = ctx.OutputAs<int64_t>(1, tokens * k);
    if (tokens == 0 || k == 0) return;
    // indices = tid2eid[input_ids], every index checked before the kernel reads it.
    const int64_t* id = ids.as<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      if (id[t] < 0 || id[t] >= vocab) Fail("input_ids[", t, "]=", id[t], " is outside [0, ", vocab, ")");
      for (int64_t j = 0; j < k; ++j) {
        const int64_t flat = id[t] * k + j;
        const int64_t e = table.dtype == kInt32 ? table.as<int32_t>()[flat] : table.as<int64_t>()[flat];
        if (e < 0 || e >= experts) Fail("tid2eid[", id[t], ", ", j, "]=", e, " is outside [0, ", experts, ")");
        indices[t * k + j] = e;
      }
    }
    kernels_.fixed_route(logits.as<float>(), indices, tokens, experts, k, scoring_, norm_, scale_, weights,
                         ctx.Par());
  }

 private:
  const MoeRoutingKernels& kernels_;
  MoeScoreFunc scoring_;
  bool norm_;
  float scale_;
};

}  // namespace

std::unique_ptr<Kernel> MakeMoeRouteTopK(const KernelInit& init) { return std::make_unique<MoeRouteTopKKernel>(init); }
std::unique_ptr<Kernel> MakeMoeRouteHash(const KernelInit& init) { return std::make_unique<MoeRouteHashKernel>(init); }

}  // namespace dsv4::glue
