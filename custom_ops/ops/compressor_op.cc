// Compressor: ORT glue for kernels/compressor.h. The three state tensors are read from past_* and written to
// present_*; when the runtime binds one buffer to both (IOBinding, same OrtValue) the kernel updates it in place
// and writes only the new rows and entry slots, otherwise past is copied to present first. Everything, including
// the entry capacity, is validated before any output is written. uint8 entries are FP8 state rows
// (kernels/state_fp8.h), in the layout named by the fp8_layout attribute.
#include "kernels/compressor.h"
#include "kernels/state_fp8.h"
#include "ops/kernel_api.h"
#include "ops/op_checks.h"

namespace dsv4::glue {
namespace {

class CompressorKernel final : public Kernel {
 public:
  explicit CompressorKernel(const KernelInit& init)
      : k_(*init.tables->compressor),
        rms_eps_(init.attrs->Float("rms_eps")),
        index_layout_(init.attrs->String("fp8_layout") == "index") {}

  void Compute(ComputeContext& ctx) override {
    const InputView &kv = ctx.Input(0), &score = ctx.Input(1), &ape = ctx.Input(2), &norm_weight = ctx.Input(3);
    const InputView &inv_freq = ctx.Input(4), &start_pos = ctx.Input(5), &past_entries = ctx.Input(6);
    const InputView &past_kv = ctx.Input(7), &past_score = ctx.Input(8);

    CompressorDims d;
    d.batch = kv.dim(0);
    d.seq = kv.dim(1);
    d.width = kv.dim(2);
    RequireShape(score, kv.shape);
    const int64_t c = norm_weight.dim(0);
    if (c < 1) Fail("input 'norm_weight' must not be empty");
    if (d.width != c && d.width != 2 * c) {
      Fail("input 'kv' has width ", d.width, "; it must be 1x (no overlap) or 2x (overlap) the entry width ", c,
           " of 'norm_weight'");
    }
    d.coff = d.width / c;
    d.ratio = ape.dim(0);
    if (d.ratio < 1) {
      Fail("input 'ape' must have at least one row (the compress ratio), got shape ", ShapeString(ape.shape));
    }
    RequireShape(ape, {d.ratio, d.width});
    d.half = CheckInvFreq(inv_freq, c, "the entry width");
    const int64_t* sp = CheckStartPos(start_pos, d.batch, d.seq);
    const bool fp8 = past_entries.dtype == kUint8;
    int64_t row = c;
    if (fp8) {
      row = index_layout_ ? state_fp8::IndexKeyBytes(c) : state_fp8::EntryBytes(c, 2 * d.half);
      if (row < 0) {
        Fail("FP8 entries in the attention layout need the no-rope channels (c - rd = ", c, " - ", 2 * d.half,
             ") to be a multiple of ", state_fp8::kBlock);
      }
    }
    if (past_entries.rank() != 3 || past_entries.dim(0) != d.batch || past_entries.dim(2) != row) {
      Fail("input 'past_entries' must have shape [", d.batch, ", N, ", row, "]",
           fp8 ? (index_layout_ ? " (FP8 index-key bytes for c = " : " (FP8 entry bytes for c = ") : "",
           fp8 ? std::to_string(c) : "", fp8 ? ")" : "", ", got ", ShapeString(past_entries.shape));
    }
    d.capacity = past_entries.dim(1);
    RequireShape(past_kv, {d.batch, d.coff * d.ratio, d.width});
    RequireShape(past_score, {d.batch, d.coff * d.ratio, d.width});
    for (int64_t b = 0; b < d.batch; ++b) {
      const int64_t first = sp[b] / d.ratio, end = (sp[b] + d.seq) / d.ratio;  // entries [first, end) are emitted
      if (end > first && end > d.capacity) {
        Fail("row ", b, " would emit entry ", end - 1, " (tokens up to position ", sp[b] + d.seq - 1, ", ratio ",
             d.ratio, ") but input 'past_entries' holds only ", d.capacity, " entries (capacity limit)");
      }
    }

    void* entries = ctx.Output(0, past_entries.numel);
    float* kv_state = ctx.OutputAs<float>(1, past_kv.numel);
    float* score_state = ctx.OutputAs<float>(2, past_score.numel);
    PreparePresent(past_entries, entries, "present_entries");
    PreparePresent(past_kv, kv_state, "present_kv_state");
    PreparePresent(past_score, score_state, "present_score_state");
    if (d.batch == 0 || d.seq == 0) return;

    const F32Vector w(norm_weight);
    if (fp8) {
      const state_fp8::EntryOut out{static_cast<uint8_t*>(entries), row, 2 * d.half, index_layout_};
      k_.step_fp8(kv.as<float>(), score.as<float>(), ape.as<float>(), w.data(), inv_freq.as<float>(), sp, d, rms_eps_,
                  out, kv_state, score_state, ctx.Par());
    } else if (past_entries.dtype == kBFloat16) {
      k_.step_bf16(kv.as<float>(), score.as<float>(), ape.as<float>(), w.data(), inv_freq.as<float>(), sp, d, rms_eps_,
                   static_cast<uint16_t*>(entries), kv_state, score_state, ctx.Par());
    } else {
      k_.step_f32(kv.as<float>(), score.as<float>(), ape.as<float>(), w.data(), inv_freq.as<float>(), sp, d, rms_eps_,
                  static_cast<float*>(entries), kv_state, score_state, ctx.Par());
    }
  }

 private:
  const CompressorKernels& k_;
  float rms_eps_;
  bool index_layout_;
};

}  // namespace

std::unique_ptr<Kernel> MakeCompressor(const KernelInit& init) { return std::make_unique<CompressorKernel>(init); }

}  // namespace dsv4::glue
