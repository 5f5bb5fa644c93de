// Indexer: ORT glue for kernels/indexer.h. Checks that every query's visible entries exist in `keys`. uint8 keys are
// FP8 state (kernels/state_fp8.h index-key layout), decoded for the visible entries only.
#include "kernels/indexer.h"
#include "kernels/state_fp8.h"
#include "kernels/state_fp8_ops.h"
#include "ops/kernel_api.h"
#include "ops/op_checks.h"

namespace dsv4::glue {
namespace {

class IndexerKernel final : public Kernel {
 public:
  explicit IndexerKernel(const KernelInit& init)
      : k_(*init.tables->indexer), ratio_(init.attrs->Int("ratio")), topk_(init.attrs->Int("index_topk")) {}

  void Compute(ComputeContext& ctx) override {
    const InputView &q = ctx.Input(0), &weights = ctx.Input(1), &keys = ctx.Input(2), &start_pos = ctx.Input(3);
    IndexerDims d;
    d.batch = q.dim(0);
    d.seq = q.dim(1);
    d.heads = q.dim(2);
    d.head_dim = q.dim(3);
    d.ratio = ratio_;
    d.topk = topk_;
    if (d.heads < 1 || d.head_dim < 1) {
      Fail("input 'q' must have at least one head and channel, got shape ", ShapeString(q.shape));
    }
    RequireShape(weights, {d.batch, d.seq, d.heads});
    const bool fp8 = keys.dtype == kUint8;
    if (!fp8 && keys.dtype != q.dtype) Fail("input 'keys' must have the type of 'q' or be uint8 (FP8 state)");
    const int64_t row = fp8 ? state_fp8::IndexKeyBytes(d.head_dim) : d.head_dim;
    if (keys.rank() != 3 || keys.dim(0) != d.batch || keys.dim(2) != row) {
      Fail("input 'keys' must have shape [", d.batch, ", N, ", row, "]",
           fp8 ? " (FP8 key bytes: cI codes + a float32 scale)" : "", ", got ", ShapeString(keys.shape));
    }
    d.capacity = keys.dim(1);
    const int64_t* sp = CheckStartPos(start_pos, d.batch, d.seq);
    for (int64_t b = 0; b < d.batch && d.seq > 0; ++b) {
      const int64_t visible = (sp[b] + d.seq) / d.ratio;  // of the row's last query
      if (visible > d.capacity) {
        Fail("row ", b, ": the query at position ", sp[b] + d.seq - 1, " sees ", visible, " entries (ratio ", d.ratio,
             ") but input 'keys' holds only ", d.capacity, " (capacity limit)");
      }
    }
    int64_t* indices = ctx.OutputAs<int64_t>(
        0, CheckedMul(CheckedMul(d.batch, d.seq, "the query count"), d.topk, "the output element count"));
    if (d.batch == 0 || d.seq == 0) return;
    const F32Vector w(weights);
    if (fp8) {
      state_fp8::IndexerTopk(k_, q.dtype == kBFloat16, q.data, w.data(), keys.as<uint8_t>(), sp, d, indices,
                             ctx.Par());
    } else if (q.dtype == kBFloat16) {
      k_.topk_bf16(q.as<uint16_t>(), w.data(), keys.as<uint16_t>(), sp, d, indices, ctx.Par());
    } else {
      k_.topk_f32(q.as<float>(), w.data(), keys.as<float>(), sp, d, indices, ctx.Par());
    }
  }

 private:
  const IndexerKernels& k_;
  int64_t ratio_, topk_;
};

}  // namespace

std::unique_ptr<Kernel> MakeIndexer(const KernelInit& init) { return std::make_unique<IndexerKernel>(init); }

}  // namespace dsv4::glue
