// Linear / LinearFp8 / LinearFp4: ORT glue for kernels/linear.h. Leading dimensions of x are flattened into M rows;
// the op checks K against groups and the weight, the scale shape against the weight and block size, and every
// E8M0 scale byte (0xFF, the NaN code, is an error) or fp32 scale (must be finite) before the kernel runs. A scale
// that is a constant initializer is checked once, when the kernel is created (an invalid one fails session
// creation with the same message), and not again on each call. A constant FP8 weight is scanned once for NaN codes;
// without any, the kernels take their NaN-free decode (WeightView::fp8_finite); constant E8M0 scales are scanned once
// for the scaled decode's range (WeightView::fp8_scaled_range). Weights are used in place, in their
// checkpoint layout: the kernels need no repacked copy (kernels/linear_blocks.h), so a session holds each weight once.
#include <algorithm>
#include <string>

#include "kernels/linear.h"
#include "ops/kernel_api.h"
#include "ops/op_checks.h"
#include "ops/quant_checks.h"

namespace dsv4::glue {
namespace {

class LinearKernelBase : public Kernel {
 public:
  explicit LinearKernelBase(const KernelInit& init)
      : k_(*init.tables->linear),
        invariant_rows_(init.tables->invariant_rows),
        prefetch_(init.tables->weight_prefetch),
        groups_(init.attrs->Int("groups")),
        bf16_products_(init.attrs->String("compute") == "bf16") {}

  // Validates the values of a constant scale input once; Compute then skips the per-call check for that buffer.
  void CheckConstantScale(const KernelInit& init, int index) {
    InputView scale;
    if (init.constants != nullptr && init.constants->Get(index, &scale) && scale.data != nullptr) {
      CheckScaleValues(scale, 0, scale.numel);
      checked_scale_ = scale.data;
    }
  }

  void CheckScale(const InputView& scale) const {
    if (scale.data != checked_scale_ || checked_scale_ == nullptr) CheckScaleValues(scale, 0, scale.numel);
  }

 protected:
  // Validates x against the weight and groups, allocates y ([..., N] by the table's rule) and runs the slot for x's
  // type: fp32 x takes `f32`, or `f32bf16` in the bf16 compute mode (compute="bf16").
  void Run(ComputeContext& ctx, const WeightView& weight, LinearF32Fn f32, LinearBf16Fn bf16, LinearF32Fn f32bf16) const {
    WeightView w = weight;  // + the session's batch-invariance bound (WeightView::invariant_rows)
    w.invariant_rows = invariant_rows_;
    w.prefetch = prefetch_;
    const InputView& x = ctx.Input(0);
    const int64_t k = x.dim(-1);
    const int64_t want_k = CheckedMul(groups_, w.cols, "K = groups * Kw");
    if (k != want_k) {
      Fail("x has K=", k, " (shape ", ShapeString(x.shape), ") but the weight has Kw=", w.cols, " columns and groups=",
           groups_, ", so K must be ", want_k);
    }
    if (w.rows % groups_ != 0) Fail("weight has N=", w.rows, " rows, not a multiple of groups=", groups_);
    const int64_t m = ShapeProduct(x.shape, 0, x.shape.size() - 1, "the number of rows of x");
    void* y = ctx.Output(0, CheckedMul(m, w.rows, "the output element count"));
    if (m == 0 || w.rows == 0) return;
    if (w.cols == 0) {  // K = 0: every output is an empty sum (the kernels are not asked to tile zero columns)
      const size_t n = static_cast<size_t>(m) * static_cast<size_t>(w.rows);
      if (x.dtype == kBFloat16) {
        std::fill_n(static_cast<uint16_t*>(y), n, uint16_t{0});
      } else {
        std::fill_n(static_cast<float*>(y), n, 0.0f);
      }
      return;
    }
    if (x.dtype == kBFloat16) {
      bf16(x.as<uint16_t>(), m, w, groups_, static_cast<uint16_t*>(y), ctx.Par());
    } else {
      (bf16_products_ ? f32bf16 : f32)(x.as<float>(), m, w, groups_, static_cast<float*>(y), ctx.Par());
    }
  }

  const LinearKernels& k_;
  const int64_t invariant_rows_;  // DSV4_ORT_BATCH_INVARIANT of the session's plan
  const bool prefetch_;           // the plan's weight prefetch (WeightView::prefetch)
  const int64_t groups_;
  const bool bf16_products_;  // compute="bf16": fp32 activations multiply as bf16 (kernels/linear.h)
  const void* checked_scale_ = nullptr;  // constant scale validated at creation
};

class LinearKernel final : public LinearKernelBase {
 public:
  using LinearKernelBase::LinearKernelBase;

  void Compute(ComputeContext& ctx) override {
    const InputView& weight = ctx.Input(1);
    WeightView w;
    w.format = weight.dtype == kBFloat16 ? WeightFormat::kBf16 : WeightFormat::kF32;
    w.data = weight.data;
    w.rows = weight.dim(0);
    w.cols = weight.dim(1);
    Run(ctx, w, k_.f32_dense, k_.bf16_dense, k_.f32bf16_dense);
  }
};

class LinearFp8Kernel final : public LinearKernelBase {
 public:
  explicit LinearFp8Kernel(const KernelInit& init) : LinearKernelBase(init), block_(init.attrs->Int("block_size")) {
    CheckConstantScale(init, 2);
    // A constant weight without NaN codes lets the kernels skip the NaN fix-up (WeightView::fp8_finite).
    InputView weight;
    if (init.constants != nullptr && init.constants->Get(1, &weight) && weight.data != nullptr &&
        Fp8CodesFinite(weight)) {
      finite_weight_ = weight.data;
    }
    // Constant E8M0 scales all in the scaled decode's range let the AVX512 rows put them into the decoded
    // exponents (WeightView::fp8_scaled_range).
    InputView scale;
    if (init.constants != nullptr && init.constants->Get(2, &scale) && scale.data != nullptr &&
        scale.dtype == kUint8 && Fp8ScalesScaledRange(scale.as<uint8_t>(), static_cast<size_t>(scale.numel))) {
      scaled_range_scale_ = scale.data;
    }
  }

  void Compute(ComputeContext& ctx) override {
    const InputView &weight = ctx.Input(1), &scale = ctx.Input(2);
    WeightView w;
    w.format = WeightFormat::kFp8E4M3;
    w.data = weight.data;
    w.rows = weight.dim(0);
    w.cols = weight.dim(1);
    w.block = KernelBlock(block_, w.rows, w.cols);
    w.scale = scale.data;
    w.scale_format = scale.dtype == kUint8 ? ScaleFormat::kE8M0 : ScaleFormat::kF32;
    w.fp8_finite = finite_weight_ != nullptr && weight.data == finite_weight_;
    w.fp8_scaled_range = scaled_range_scale_ != nullptr && scale.data == scaled_range_scale_;
    ExpectScaleShape(scale, {BlockCount(w.rows, block_), BlockCount(w.cols, block_)},
                     "[ceil(N/block_size), ceil(Kw/block_size)] for weight " + ShapeString(weight.shape) +
                         " and block_size=" + std::to_string(block_));
    CheckScale(scale);
    Run(ctx, w, k_.f32_fp8, k_.bf16_fp8, k_.f32bf16_fp8);
  }

 private:
  const int64_t block_;
  const void* finite_weight_ = nullptr;  // constant weight scanned at creation: no NaN codes
  const void* scaled_range_scale_ = nullptr;  // constant E8M0 scales scanned at creation: all in the scaled range
};

class LinearFp4Kernel final : public LinearKernelBase {
 public:
  explicit LinearFp4Kernel(const KernelInit& init) : LinearKernelBase(init) { CheckConstantScale(init, 2); }

  void Compute(ComputeContext& ctx) override {
    const InputView &weight = ctx.Input(1), &scale = ctx.Input(2);
    WeightView w;
    w.format = WeightFormat::kFp4E2M1;
    w.data = weight.data;
    w.rows = weight.dim(0);
    w.cols = CheckedMul(2, weight.dim(1), "Kw = 2 * the packed weight columns");
    w.block = kFp4Block;
    w.scale = scale.data;
    w.scale_format = ScaleFormat::kE8M0;
    CheckFp4Width(weight, w.cols, "Kw");
    ExpectScaleShape(scale, {w.rows, w.cols / kFp4Block},
                     "[N, Kw/32] for weight " + ShapeString(weight.shape) + " (Kw=" + std::to_string(w.cols) + ")");
    CheckScale(scale);
    Run(ctx, w, k_.f32_fp4, k_.bf16_fp4, k_.f32bf16_fp4);
  }
};

}  // namespace

std::unique_ptr<Kernel> MakeLinear(const KernelInit& init) { return std::make_unique<LinearKernel>(init); }
std::unique_ptr<Kernel> MakeLinearFp8(const KernelInit& init) { return std::make_unique<LinearFp8Kernel>(init); }
std::unique_ptr<Kernel> MakeLinearFp4(const KernelInit& init) { return std::make_unique<LinearFp4Kernel>(init); }

}  // namespace dsv4::glue
