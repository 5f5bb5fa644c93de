// HcPre / HcPost / HcHead: ORT glue for kernels/hyper_connection.h. Leading dimensions are flattened into N
// tokens; every dimension that must agree between inputs is checked here.
#include "kernels/hyper_connection.h"
#include "ops/kernel_api.h"
#include "ops/op_checks.h"

namespace dsv4::glue {
namespace {

int64_t Product(const std::vector<int64_t>& shape, int begin, int end) {
  return ShapeProduct(shape, static_cast<size_t>(begin), static_cast<size_t>(end), "the product of x's dimensions");
}

// Streams and width of x [..., hc, d]; hc must be within the kernels' limit.
void StreamDims(const InputView& x, int64_t* hc, int64_t* d) {
  *hc = x.dim(-2);
  *d = x.dim(-1);
  if (*hc < 1 || *hc > kHcMaxStreams) Fail(x.name, " has ", *hc, " streams; supported: 1..", kHcMaxStreams);
  if (*d < 1) Fail(x.name, " has an empty last dimension, shape ", ShapeString(x.shape));
}

void ExpectShape(const InputView& t, const std::vector<int64_t>& want) {
  if (t.shape != want) Fail("input '", t.name, "' must have shape ", ShapeString(want), ", got ", ShapeString(t.shape));
}

std::vector<int64_t> Lead(const std::vector<int64_t>& shape, int drop) {
  return std::vector<int64_t>(shape.begin(), shape.end() - drop);
}

std::vector<int64_t> Append(std::vector<int64_t> v, std::initializer_list<int64_t> tail) {
  v.insert(v.end(), tail);
  return v;
}

// Elements of n rows of `width` (what the kernels write per output; the glue checks it against the table's rule).
int64_t Rows(int64_t n, int64_t width) { return CheckedMul(n, width, "the output element count"); }

class HcPreKernel final : public Kernel {
 public:
  explicit HcPreKernel(const KernelInit& init)
      : k_(*init.tables->hyper_connection),
        rms_eps_(init.attrs->Float("rms_eps")),
        hc_eps_(init.attrs->Float("hc_eps")),
        iters_(init.attrs->Int("sinkhorn_iters")) {}

  void Compute(ComputeContext& ctx) override {
    const InputView &x = ctx.Input(0), &fn = ctx.Input(1), &scale = ctx.Input(2), &base = ctx.Input(3);
    int64_t hc, d;
    StreamDims(x, &hc, &d);
    const int64_t mixes = (2 + hc) * hc;
    ExpectShape(fn, {mixes, CheckedMul(hc, d, "fn columns hc * d")});
    ExpectShape(scale, {3});
    ExpectShape(base, {mixes});
    const int64_t n = Product(x.shape, 0, x.rank() - 2);
    void* h = ctx.Output(0, Rows(n, d));
    float* post = ctx.OutputAs<float>(1, Rows(n, hc));
    float* comb = ctx.OutputAs<float>(2, Rows(n, hc * hc));
    if (n == 0) return;
    if (x.dtype == kBFloat16) {
      k_.pre_bf16(x.as<uint16_t>(), fn.as<float>(), scale.as<float>(), base.as<float>(), n, hc, d, rms_eps_, hc_eps_,
                  iters_, static_cast<uint16_t*>(h), post, comb, ctx.Par());
    } else {
      k_.pre_f32(x.as<float>(), fn.as<float>(), scale.as<float>(), base.as<float>(), n, hc, d, rms_eps_, hc_eps_,
                 iters_, static_cast<float*>(h), post, comb, ctx.Par());
    }
  }

 private:
  const HyperConnectionKernels& k_;
  float rms_eps_, hc_eps_;
  int64_t iters_;
};

class HcPostKernel final : public Kernel {
 public:
  explicit HcPostKernel(const KernelInit& init) : k_(*init.tables->hyper_connection) {}

  void Compute(ComputeContext& ctx) override {
    const InputView &f = ctx.Input(0), &r = ctx.Input(1), &post = ctx.Input(2), &comb = ctx.Input(3);
    int64_t hc, d;
    StreamDims(r, &hc, &d);
    const std::vector<int64_t> lead = Lead(r.shape, 2);
    ExpectShape(f, Append(lead, {d}));
    ExpectShape(post, Append(lead, {hc}));
    ExpectShape(comb, Append(lead, {hc, hc}));
    const int64_t n = Product(r.shape, 0, r.rank() - 2);
    void* out = ctx.Output(0, r.numel);
    if (n == 0) return;
    if (r.dtype == kBFloat16) {
      k_.post_bf16(f.as<uint16_t>(), r.as<uint16_t>(), post.as<float>(), comb.as<float>(), n, hc, d,
                   static_cast<uint16_t*>(out), ctx.Par());
    } else {
      k_.post_f32(f.as<float>(), r.as<float>(), post.as<float>(), comb.as<float>(), n, hc, d, static_cast<float*>(out),
                  ctx.Par());
    }
  }

 private:
  const HyperConnectionKernels& k_;
};

class HcHeadKernel final : public Kernel {
 public:
  explicit HcHeadKernel(const KernelInit& init)
      : k_(*init.tables->hyper_connection),
        rms_eps_(init.attrs->Float("rms_eps")),
        hc_eps_(init.attrs->Float("hc_eps")) {}

  void Compute(ComputeContext& ctx) override {
    const InputView &x = ctx.Input(0), &fn = ctx.Input(1), &scale = ctx.Input(2), &base = ctx.Input(3);
    int64_t hc, d;
    StreamDims(x, &hc, &d);
    ExpectShape(fn, {hc, CheckedMul(hc, d, "fn columns hc * d")});
    ExpectShape(scale, {1});
    ExpectShape(base, {hc});
    const int64_t n = Product(x.shape, 0, x.rank() - 2);
    void* y = ctx.Output(0, Rows(n, d));
    if (n == 0) return;
    if (x.dtype == kBFloat16) {
      k_.head_bf16(x.as<uint16_t>(), fn.as<float>(), scale.as<float>(), base.as<float>(), n, hc, d, rms_eps_, hc_eps_,
                   static_cast<uint16_t*>(y), ctx.Par());
    } else {
      k_.head_f32(x.as<float>(), fn.as<float>(), scale.as<float>(), base.as<float>(), n, hc, d, rms_eps_, hc_eps_,
                  static_cast<float*>(y), ctx.Par());
    }
  }

 private:
  const HyperConnectionKernels& k_;
  float rms_eps_, hc_eps_;
};

}  // namespace

std::unique_ptr<Kernel> MakeHcPre(const KernelInit& init) { return std::make_unique<HcPreKernel>(init); }
std::unique_ptr<Kernel> MakeHcPost(const KernelInit& init) { return std::make_unique<HcPostKernel>(init); }
std::unique_ptr<Kernel> MakeHcHead(const KernelInit& init) { return std::make_unique<HcHeadKernel>(init); }

}  // namespace dsv4::glue
