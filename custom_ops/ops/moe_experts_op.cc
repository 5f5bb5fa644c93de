// MoeExperts / MoeExpertsFp8 / MoeExpertsFp4: ORT glue for kernels/moe_experts.h. Checks the routing inputs (both
// or neither; every index in [0, E)), the stacked weight shapes against x, the scale shapes, and the scale values of
// the experts this call uses, before the kernel runs. Scales that are constant initializers are checked whole (every
// expert) once, when the kernel is created, and not again per call. Constant FP8 expert weights are scanned once for
// NaN codes; without any, the kernels take their NaN-free decode (WeightView::fp8_finite); constant E8M0 scales are
// scanned once for the scaled decode's range (WeightView::fp8_scaled_range). Expert weights are used in place.
// compute="bf16" runs fp32 x through the bf16 slot (x rounded to bf16, y widened back): the experts then compute as
// DeepSeek's bf16 reference does, on the bf16 products of VDPBF16PS / AMX-BF16. MoeExpertsFp4's compute="int8" runs
// as compute="bf16" through the int8 slot (matmul operands quantised per 32-column block).
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/moe_experts.h"
#include "numerics/bf16.h"
#include "ops/kernel_api.h"
#include "ops/op_checks.h"
#include "ops/quant_checks.h"

namespace dsv4::glue {
namespace {

// Input positions (the same for the three ops; the quantised ones append s1, s2, s3).
enum : int { kX = 0, kWeights, kIndices, kW1, kW2, kW3, kS1, kS2, kS3 };

void ExpectShape(const InputView& t, const std::vector<int64_t>& want, const char* rule) {
  if (t.shape != want) {
    Fail("input '", t.name, "' must have shape ", ShapeString(want), " (", rule, "), got ", ShapeString(t.shape));
  }
}

class MoeExpertsKernelBase : public Kernel {
 public:
  explicit MoeExpertsKernelBase(const KernelInit& init)
      : k_(*init.tables->moe_experts),
        limit_(init.attrs->Float("swiglu_limit")),
        invariant_rows_(init.tables->invariant_rows),
        prefetch_(init.tables->weight_prefetch),
        bf16_products_(init.attrs->String("compute") != "fp32") {}

  // Validates the constant scale inputs s1, s2, s3 once (all experts); CheckUsedScales then skips those buffers.
  void CheckConstantScales(const KernelInit& init) {
    for (int i = 0; i < 3; ++i) {
      InputView scale;
      if (init.constants != nullptr && init.constants->Get(kS1 + i, &scale) && scale.data != nullptr) {
        CheckScaleValues(scale, 0, scale.numel);
        checked_scales_[i] = scale.data;
      }
    }
  }

 protected:
  struct Routing {
    bool dense = false;
    int64_t top_k = 1;
    std::vector<int64_t> used;  // the experts this call reads, ascending (never sized by E: empty weights leave E
                                // unbounded)
  };

  // Validates weights/indices against x and E; returns which experts this call reads.
  static Routing CheckRouting(const ComputeContext& ctx, int64_t experts) {
    const InputView &x = ctx.Input(kX), &weights = ctx.Input(kWeights), &indices = ctx.Input(kIndices);
    Routing r;
    const int64_t tokens = x.dim(0);
    if (weights.present != indices.present) {
      Fail("'weights' and 'indices' must be both present (routed experts) or both absent (dense MLP), got only '",
           weights.present ? weights.name : indices.name, "'");
    }
    if (!weights.present) {
      if (experts != 1) {
        Fail("dense-MLP mode (no weights/indices) needs exactly one expert, but the weights hold E=", experts);
      }
      r.dense = true;
      if (tokens > 0) r.used.push_back(0);
      return r;
    }
    r.top_k = indices.dim(1);
    if (indices.dim(0) != tokens) {
      Fail("input 'indices' has ", indices.dim(0), " rows but x has ", tokens, " tokens (shape ",
           ShapeString(indices.shape), ")");
    }
    if (weights.shape != indices.shape) {
      Fail("input 'weights' must have the shape of 'indices' ", ShapeString(indices.shape), ", got ",
           ShapeString(weights.shape));
    }
    const int64_t* idx = indices.as<int64_t>();
    // (With top_k = 0 the indices are empty and `tokens` may be any number: no per-token loop.)
    for (int64_t t = 0; t < tokens && r.top_k > 0; ++t) {
      for (int64_t j = 0; j < r.top_k; ++j) {
        const int64_t e = idx[t * r.top_k + j];
        if (e < 0 || e >= experts) {
          Fail("indices[", t, ", ", j, "]=", e, " (token ", t, ") is outside [0, ", experts, ")");
        }
        r.used.push_back(e);
      }
    }
    std::sort(r.used.begin(), r.used.end());
    r.used.erase(std::unique(r.used.begin(), r.used.end()), r.used.end());
    return r;
  }

  // x [T, d], w1/w3 [E, I, d / per_byte], w2 [E, d, I / per_byte]; returns E and fills d, I.
  static int64_t CheckWeights(const ComputeContext& ctx, int64_t per_byte, int64_t* dim, int64_t* inter) {
    const InputView &x = ctx.Input(kX), &w1 = ctx.Input(kW1), &w2 = ctx.Input(kW2), &w3 = ctx.Input(kW3);
    const int64_t experts = w1.dim(0);
    *dim = x.dim(1);
    *inter = w1.dim(1);
    if (experts < 1) Fail("input 'w1' holds no experts, shape ", ShapeString(w1.shape));
    const char* rule =
        per_byte == 2 ? "[E, I, d/2] with d = x's last dimension" : "[E, I, d] with d = x's last dimension";
    if (w1.dim(2) * per_byte != *dim) {
      Fail("input 'w1' must have shape ", rule, "; x has d=", *dim, ", w1 has shape ", ShapeString(w1.shape));
    }
    ExpectShape(w3, w1.shape, "like w1: [E, I, d]");
    const std::vector<int64_t> w2_shape = {experts, *dim, *inter / per_byte};
    if (*inter % per_byte != 0) Fail("input 'w1' has I=", *inter, " rows, which FP4 packing cannot halve");
    ExpectShape(w2, w2_shape, per_byte == 2 ? "[E, d, I/2]" : "[E, d, I]");
    return experts;
  }

  // Scale values of every used expert of a stacked scale tensor [E, ...] (unless validated at creation).
  void CheckUsedScales(const InputView& scale, const std::vector<int64_t>& used) const {
    for (const void* checked : checked_scales_) {
      if (checked != nullptr && checked == scale.data) return;
    }
    const int64_t per_expert = scale.numel / scale.dim(0);
    for (const int64_t e : used) CheckScaleValues(scale, e * per_expert, (e + 1) * per_expert);
  }

  void Run(ComputeContext& ctx, const ExpertWeights& weights_in, const Routing& r, MoeExpertsF32Fn f32,
           MoeExpertsBf16Fn bf16) const {
    ExpertWeights w = weights_in;  // + the session's batch-invariance bound (WeightView::invariant_rows)
    w.w1.invariant_rows = w.w2.invariant_rows = w.w3.invariant_rows = invariant_rows_;
    w.w1.prefetch = w.w2.prefetch = w.w3.prefetch = prefetch_;
    const InputView &x = ctx.Input(kX), &weights = ctx.Input(kWeights), &indices = ctx.Input(kIndices);
    const int64_t tokens = x.dim(0);
    void* y = ctx.Output(0, x.numel);
    if (tokens == 0 || x.dim(1) == 0) return;
    const float* wt = r.dense ? nullptr : weights.as<float>();
    const int64_t* idx = r.dense ? nullptr : indices.as<int64_t>();
    // No expert per token, or experts without intermediate units (I = 0): y = 0. The kernels are not called, so E
    // (unbounded when the weights are empty) never sizes their buffers.
    if (r.top_k == 0 || w.w1.rows == 0) {
      if (x.dtype == kBFloat16) {
        std::fill_n(static_cast<uint16_t*>(y), x.numel, uint16_t{0});
      } else {
        std::fill_n(static_cast<float*>(y), x.numel, 0.0f);
      }
      return;
    }
    if (x.dtype == kBFloat16) {
      bf16(x.as<uint16_t>(), tokens, wt, idx, r.top_k, w, limit_, static_cast<uint16_t*>(y), ctx.Par());
    } else if (bf16_products_) {
      // fp32 x as bf16, y back to fp32 ([T, d] each: small beside the weights the call reads)
      const size_t n = static_cast<size_t>(x.numel);
      std::vector<uint16_t> xb(n), yb(n);
      const float* xf = x.as<float>();
      for (size_t i = 0; i < n; ++i) xb[i] = F32ToBf16(xf[i]);
      bf16(xb.data(), tokens, wt, idx, r.top_k, w, limit_, yb.data(), ctx.Par());
      float* yf = static_cast<float*>(y);
      for (size_t i = 0; i < n; ++i) yf[i] = Bf16ToF32(yb[i]);
    } else {
      f32(x.as<float>(), tokens, wt, idx, r.top_k, w, limit_, static_cast<float*>(y), ctx.Par());
    }
  }

  static WeightView View(const InputView& t, WeightFormat format, int64_t rows, int64_t cols) {
    WeightView w;
    w.format = format;
    w.data = t.data;
    w.rows = rows;
    w.cols = cols;
    return w;
  }

  const MoeExpertsKernels& k_;
  const float limit_;
  const int64_t invariant_rows_;  // DSV4_ORT_BATCH_INVARIANT of the session's plan
  const bool prefetch_;           // the plan's weight prefetch (WeightView::prefetch)
  const bool bf16_products_;      // compute="bf16" (or "int8"): fp32 x through the bf16 slot
  const void* checked_scales_[3] = {nullptr, nullptr, nullptr};  // constant s1, s2, s3 validated at creation
};

class MoeExpertsKernel final : public MoeExpertsKernelBase {
 public:
  using MoeExpertsKernelBase::MoeExpertsKernelBase;

  void Compute(ComputeContext& ctx) override {
    int64_t dim, inter;
    const int64_t experts = CheckWeights(ctx, 1, &dim, &inter);
    const Routing r = CheckRouting(ctx, experts);
    const WeightFormat format = ctx.Input(kW1).dtype == kBFloat16 ? WeightFormat::kBf16 : WeightFormat::kF32;
    ExpertWeights w;
    w.w1 = View(ctx.Input(kW1), format, inter, dim);
    w.w2 = View(ctx.Input(kW2), format, dim, inter);
    w.w3 = View(ctx.Input(kW3), format, inter, dim);
    w.num_experts = experts;
    Run(ctx, w, r, k_.f32_dense, k_.bf16_dense);
  }
};

class MoeExpertsFp8Kernel final : public MoeExpertsKernelBase {
 public:
  explicit MoeExpertsFp8Kernel(const KernelInit& init)
      : MoeExpertsKernelBase(init), block_(init.attrs->Int("block_size")) {
    CheckConstantScales(init);
    // Constant expert weights without NaN codes let the kernels skip the NaN fix-up (WeightView::fp8_finite).
    for (int i = 0; i < 3; ++i) {
      InputView weight;
      if (init.constants != nullptr && init.constants->Get(kW1 + i, &weight) && weight.data != nullptr &&
          Fp8CodesFinite(weight)) {
        finite_weights_[i] = weight.data;
      }
      // constant E8M0 scales of every expert in the scaled decode's range (WeightView::fp8_scaled_range)
      InputView scale;
      if (init.constants != nullptr && init.constants->Get(kS1 + i, &scale) && scale.data != nullptr &&
          scale.dtype == kUint8 && Fp8ScalesScaledRange(scale.as<uint8_t>(), static_cast<size_t>(scale.numel))) {
        scaled_range_scales_[i] = scale.data;
      }
    }
  }

  void Compute(ComputeContext& ctx) override {
    int64_t dim, inter;
    const int64_t experts = CheckWeights(ctx, 1, &dim, &inter);
    const InputView &s1 = ctx.Input(kS1), &s2 = ctx.Input(kS2), &s3 = ctx.Input(kS3);
    const std::string b = std::to_string(block_);
    ExpectScaleShape(s1, {experts, BlockCount(inter, block_), BlockCount(dim, block_)},
                     "[E, ceil(I/" + b + "), ceil(d/" + b + ")]");
    ExpectScaleShape(s2, {experts, BlockCount(dim, block_), BlockCount(inter, block_)},
                     "[E, ceil(d/" + b + "), ceil(I/" + b + ")]");
    ExpectScaleShape(s3, s1.shape, "like s1: [E, ceil(I/" + b + "), ceil(d/" + b + ")]");
    const Routing r = CheckRouting(ctx, experts);
    for (const InputView* s : {&s1, &s2, &s3}) CheckUsedScales(*s, r.used);
    const ScaleFormat sf = s1.dtype == kUint8 ? ScaleFormat::kE8M0 : ScaleFormat::kF32;
    ExpertWeights w;
    const int64_t block = KernelBlock(block_, inter, dim);
    w.w1 = Quantised(ctx.Input(kW1), s1, sf, inter, dim, block);
    w.w2 = Quantised(ctx.Input(kW2), s2, sf, dim, inter, block);
    w.w3 = Quantised(ctx.Input(kW3), s3, sf, inter, dim, block);
    WeightView* views[3] = {&w.w1, &w.w2, &w.w3};
    for (int i = 0; i < 3; ++i) {
      views[i]->fp8_finite = finite_weights_[i] != nullptr && ctx.Input(kW1 + i).data == finite_weights_[i];
      views[i]->fp8_scaled_range =
          scaled_range_scales_[i] != nullptr && ctx.Input(kS1 + i).data == scaled_range_scales_[i];
    }
    w.num_experts = experts;
    Run(ctx, w, r, k_.f32_fp8, k_.bf16_fp8);
  }

 private:
  static WeightView Quantised(const InputView& t, const InputView& s, ScaleFormat sf, int64_t rows, int64_t cols,
                              int64_t block) {
    WeightView w = View(t, WeightFormat::kFp8E4M3, rows, cols);
    w.scale = s.data;
    w.scale_format = sf;
    w.block = block;
    return w;
  }

  const int64_t block_;
  const void* finite_weights_[3] = {nullptr, nullptr, nullptr};  // constant w1, w2, w3 without NaN codes
  const void* scaled_range_scales_[3] = {nullptr, nullptr, nullptr};  // constant s1, s2, s3 in the scaled range
};

class MoeExpertsFp4Kernel final : public MoeExpertsKernelBase {
 public:
  explicit MoeExpertsFp4Kernel(const KernelInit& init)
      : MoeExpertsKernelBase(init), int8_(init.attrs->String("compute") == "int8") {
    CheckConstantScales(init);
  }

  void Compute(ComputeContext& ctx) override {
    const InputView &w1 = ctx.Input(kW1), &w2 = ctx.Input(kW2);
    CheckFp4Width(w1, CheckedMul(2, w1.dim(2), "d = 2 * the packed w1 columns"), "d");
    CheckFp4Width(w2, CheckedMul(2, w2.dim(2), "I = 2 * the packed w2 columns"), "I");
    int64_t dim, inter;
    const int64_t experts = CheckWeights(ctx, 2, &dim, &inter);
    const InputView &s1 = ctx.Input(kS1), &s2 = ctx.Input(kS2), &s3 = ctx.Input(kS3);
    ExpectScaleShape(s1, {experts, inter, dim / kFp4Block}, "[E, I, d/32]");
    ExpectScaleShape(s2, {experts, dim, inter / kFp4Block}, "[E, d, I/32]");
    ExpectScaleShape(s3, s1.shape, "like s1: [E, I, d/32]");
    const Routing r = CheckRouting(ctx, experts);
    for (const InputView* s : {&s1, &s2, &s3}) CheckUsedScales(*s, r.used);
    ExpertWeights w;
    w.w1 = Quantised(w1, s1, inter, dim);
    w.w2 = Quantised(w2, s2, dim, inter);
    w.w3 = Quantised(ctx.Input(kW3), s3, inter, dim);
    w.num_experts = experts;
    Run(ctx, w, r, k_.f32_fp4, int8_ ? k_.bf16_fp4_int8 : k_.bf16_fp4);
  }

 private:
  const bool int8_;  // compute="int8": bf16 activations, matmul operands quantised to int8 (moe_experts.h)

  static WeightView Quantised(const InputView& t, const InputView& s, int64_t rows, int64_t cols) {
    WeightView w = View(t, WeightFormat::kFp4E2M1, rows, cols);
    w.scale = s.data;
    w.scale_format = ScaleFormat::kE8M0;
    w.block = kFp4Block;
    return w;
  }
};

}  // namespace

std::unique_ptr<Kernel> MakeMoeExperts(const KernelInit& init) { return std::make_unique<MoeExpertsKernel>(init); }
std::unique_ptr<Kernel> MakeMoeExpertsFp8(const KernelInit& init) {
  return std::make_unique<MoeExpertsFp8Kernel>(init);
}
std::unique_ptr<Kernel> MakeMoeExpertsFp4(const KernelInit& init) {
  return std::make_unique<MoeExpertsFp4Kernel>(init);
}

}  // namespace dsv4::glue
