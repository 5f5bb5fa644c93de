// RmsNorm / NormRope / Rope: ORT glue for kernels/norm_rope.h. x [B, S, ..., D] is viewed as [B, S, H, D] with H
// the product of the middle dimensions (1 for kv).
#include "kernels/norm_rope.h"
#include "ops/kernel_api.h"
#include "ops/op_checks.h"

namespace dsv4::glue {
namespace {

int64_t Product(const std::vector<int64_t>& shape, int begin, int end) {
  return ShapeProduct(shape, static_cast<size_t>(begin), static_cast<size_t>(end), "the product of x's dimensions");
}

void CheckWeight(const InputView& weight, int64_t n) {
  if (weight.present && weight.dim(0) != n) {
    Fail("input 'weight' has ", weight.dim(0), " channels but x has ", n, " (its last dimension)");
  }
}

// [B, S, H, D] view of x (rank >= 3) plus the rope table's half width.
RopeDims TokenDims(const InputView& x, const InputView& start_pos, const InputView& inv_freq) {
  RopeDims d;
  d.batch = x.dim(0);
  d.seq = x.dim(1);
  d.heads = Product(x.shape, 2, x.rank() - 1);
  d.dim = x.dim(-1);
  d.half = CheckInvFreq(inv_freq, d.dim, "x's last dimension");
  CheckStartPos(start_pos, d.batch, d.seq);
  return d;
}

class RmsNormKernel final : public Kernel {
 public:
  explicit RmsNormKernel(const KernelInit& init) : k_(*init.tables->norm_rope), eps_(init.attrs->Float("eps")) {}

  void Compute(ComputeContext& ctx) override {
    const InputView &x = ctx.Input(0), &weight = ctx.Input(1);
    const int64_t n = x.dim(-1), rows = Product(x.shape, 0, x.rank() - 1);
    CheckWeight(weight, n);
    void* y = ctx.Output(0, x.numel);
    if (x.numel == 0) return;
    const F32Vector w(weight);
    if (x.dtype == kBFloat16) {
      k_.rms_norm_bf16(x.as<uint16_t>(), w.data(), rows, n, eps_, static_cast<uint16_t*>(y), ctx.Par());
    } else {
      k_.rms_norm_f32(x.as<float>(), w.data(), rows, n, eps_, static_cast<float*>(y), ctx.Par());
    }
  }

 private:
  const NormRopeKernels& k_;
  float eps_;
};

class NormRopeKernel final : public Kernel {
 public:
  explicit NormRopeKernel(const KernelInit& init) : k_(*init.tables->norm_rope), eps_(init.attrs->Float("eps")) {}

  void Compute(ComputeContext& ctx) override {
    const InputView &x = ctx.Input(0), &weight = ctx.Input(1), &start_pos = ctx.Input(2), &inv_freq = ctx.Input(3);
    const RopeDims d = TokenDims(x, start_pos, inv_freq);
    CheckWeight(weight, d.dim);
    void* y = ctx.Output(0, x.numel);
    if (x.numel == 0) return;
    const F32Vector w(weight);
    const int64_t* sp = start_pos.as<int64_t>();
    if (x.dtype == kBFloat16) {
      k_.norm_rope_bf16(x.as<uint16_t>(), w.data(), sp, inv_freq.as<float>(), d, eps_, static_cast<uint16_t*>(y),
                        ctx.Par());
    } else {
      k_.norm_rope_f32(x.as<float>(), w.data(), sp, inv_freq.as<float>(), d, eps_, static_cast<float*>(y), ctx.Par());
    }
  }

 private:
  const NormRopeKernels& k_;
  float eps_;
};

class RopeKernel final : public Kernel {
 public:
  explicit RopeKernel(const KernelInit& init)
      : k_(*init.tables->norm_rope), inverse_(init.attrs->Int("inverse") != 0) {}

  void Compute(ComputeContext& ctx) override {
    const InputView &x = ctx.Input(0), &start_pos = ctx.Input(1), &inv_freq = ctx.Input(2);
    const RopeDims d = TokenDims(x, start_pos, inv_freq);
    void* y = ctx.Output(0, x.numel);
    if (x.numel == 0) return;
    const int64_t* sp = start_pos.as<int64_t>();
    if (x.dtype == kBFloat16) {
      k_.rope_bf16(x.as<uint16_t>(), sp, inv_freq.as<float>(), d, inverse_, static_cast<uint16_t*>(y), ctx.Par());
    } else {
      k_.rope_f32(x.as<float>(), sp, inv_freq.as<float>(), d, inverse_, static_cast<float*>(y), ctx.Par());
    }
  }

 private:
  const NormRopeKernels& k_;
  bool inverse_;
};

}  // namespace

std::unique_ptr<Kernel> MakeRmsNorm(const KernelInit& init) { return std::make_unique<RmsNormKernel>(init); }
std::unique_ptr<Kernel> MakeNormRope(const KernelInit& init) { return std::make_unique<NormRopeKernel>(init); }
std::unique_ptr<Kernel> MakeRope(const KernelInit& init) { return std::make_unique<RopeKernel>(init); }

}  // namespace dsv4::glue
