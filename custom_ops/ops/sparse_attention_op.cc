// SparseAttention: ORT glue for kernels/sparse_attention.h. The window ring is read from past_window and written to
// present_window; when the runtime binds one buffer to both (IOBinding, same OrtValue) only the chunk's slots are
// written, after the attention has read the ring. Index ranges and entry capacity are validated before anything is
// written. uint8 window / entries are FP8 state (kernels/state_fp8.h): decoded for the rows read, quantised on write.
// compute="bf16" with float inputs runs the bf16 kernel on the rounded inputs and rows read, o widened back
// (state_fp8_ops.h); the ring write is unchanged.
#include <cmath>

#include "kernels/sparse_attention.h"
#include "kernels/state_fp8.h"
#include "kernels/state_fp8_ops.h"
#include "ops/kernel_api.h"
#include "ops/op_checks.h"

namespace dsv4::glue {
namespace {

class SparseAttentionKernel final : public Kernel {
 public:
  explicit SparseAttentionKernel(const KernelInit& init)
      : k_(*init.tables->sparse_attention),
        ratio_(init.attrs->Int("ratio")),
        softmax_scale_(init.attrs->Float("softmax_scale")),
        bf16_products_(init.attrs->String("compute") == "bf16") {}

  void Compute(ComputeContext& ctx) override {
    const InputView &q = ctx.Input(0), &kv = ctx.Input(1), &window = ctx.Input(2), &entries = ctx.Input(3);
    const InputView &indices = ctx.Input(4), &sink = ctx.Input(5), &inv_freq = ctx.Input(6), &start_pos = ctx.Input(7);
    SparseAttentionDims d;
    d.batch = q.dim(0);
    d.seq = q.dim(1);
    d.heads = q.dim(2);
    d.dim = q.dim(3);
    d.ratio = ratio_;
    RequireShape(kv, {d.batch, d.seq, d.dim});
    RequireShape(sink, {d.heads});
    d.half = CheckInvFreq(inv_freq, d.dim, "the head dimension of 'q'");
    // State rows: D elements of q's type, or one FP8 entry (EntryBytes(D, rd) bytes) when the state is uint8.
    const bool fp8 = window.dtype == kUint8;
    if (!fp8 && window.dtype != q.dtype) Fail("input 'past_window' must have the type of 'q' or be uint8 (FP8 state)");
    int64_t row = d.dim;
    if (fp8) {
      row = state_fp8::EntryBytes(d.dim, 2 * d.half);
      if (row < 0) {
        Fail("FP8 state needs the no-rope channels (D - rd = ", d.dim, " - ", 2 * d.half,
             ") to be a multiple of ", state_fp8::kBlock);
      }
    }
    if (window.rank() != 3 || window.dim(0) != d.batch || window.dim(2) != row || window.dim(1) < 1) {
      Fail("input 'past_window' must have shape [", d.batch, ", n_win >= 1, ", row, "]",
           fp8 ? " (FP8 entry bytes for D = " : "", fp8 ? std::to_string(d.dim) : "", fp8 ? ")" : "", ", got ",
           ShapeString(window.shape));
    }
    d.window = window.dim(1);
    const int64_t* sp = CheckStartPos(start_pos, d.batch, d.seq);

    // Entries and indices take part only when ratio > 0 and entries are given (as in the spec).
    const bool use_entries = d.ratio > 0 && entries.present;
    d.capacity = 0;
    d.topk = 0;
    if (entries.present) {
      if (entries.rank() != 3 || entries.dim(0) != d.batch || entries.dim(2) != row) {
        Fail("input 'entries' must have shape [", d.batch, ", N, ", row, "]",
             fp8 ? " (FP8 entry bytes for D = " : "", fp8 ? std::to_string(d.dim) : "", fp8 ? ")" : "", ", got ",
             ShapeString(entries.shape));
      }
      if (use_entries) d.capacity = entries.dim(1);
    }
    if (indices.present) {
      if (indices.rank() != 3 || indices.dim(0) != d.batch || indices.dim(1) != d.seq) {
        Fail("input 'indices' must have shape [", d.batch, ", ", d.seq, ", k], got ", ShapeString(indices.shape));
      }
    }
    const bool use_indices = use_entries && indices.present;
    if (use_indices && indices.dim(2) == 0) d.capacity = 0;  // an empty selection: no entry is attended
    if (use_indices) {
      d.topk = indices.dim(2);
      const int64_t* idx = indices.as<int64_t>();
      for (int64_t i = 0; i < indices.numel; ++i) {
        if (idx[i] < -1 || idx[i] >= d.capacity) {
          Fail("input 'indices' holds ", idx[i], " at flat position ", i, "; valid: -1 (unused) or [0, ", d.capacity,
               ") (the entries capacity)");
        }
      }
    } else if (use_entries) {
      for (int64_t b = 0; b < d.batch && d.seq > 0; ++b) {
        const int64_t visible = (sp[b] + d.seq) / d.ratio;  // of the row's last query
        if (visible > d.capacity) {
          Fail("row ", b, ": the query at position ", sp[b] + d.seq - 1, " sees ", visible, " entries (ratio ",
               d.ratio, ") but input 'entries' holds only ", d.capacity, " (capacity limit)");
        }
      }
    }
    const float scale = softmax_scale_ != 0.0f ? softmax_scale_
                                               : static_cast<float>(std::pow(static_cast<double>(d.dim), -0.5));

    void* o = ctx.Output(0, q.numel);
    void* present = ctx.Output(1, window.numel);
    if (q.numel > 0 && bf16_products_ && q.dtype == kFloat) {
      const int64_t* idx = use_indices && d.topk > 0 ? indices.as<int64_t>() : nullptr;
      // the level's own bf16 products on float rows where it has them; FP8 state, and the reference, take the rows
      // read decoded / rounded to bf16 first
      if (!fp8 && k_.attend_f32_bf16 != nullptr) {
        k_.attend_f32_bf16(q.as<float>(), kv.as<float>(), window.as<float>(),
                           use_entries ? entries.as<float>() : nullptr, idx, sink.as<float>(), inv_freq.as<float>(),
                           sp, d, scale, static_cast<float*>(o), ctx.Par());
      } else {
        state_fp8::AttendBf16Products(k_, q.as<float>(), kv.as<float>(), window.data,
                                      use_entries ? entries.data : nullptr, fp8, idx, sink.as<float>(),
                                      inv_freq.as<float>(), sp, d, scale, static_cast<float*>(o), ctx.Par());
      }
    } else if (q.numel > 0 && fp8) {
      const int64_t* idx = use_indices && d.topk > 0 ? indices.as<int64_t>() : nullptr;
      state_fp8::Attend(k_, q.dtype == kBFloat16, q.data, kv.data, window.as<uint8_t>(),
                        use_entries ? entries.as<uint8_t>() : nullptr, idx, sink.as<float>(), inv_freq.as<float>(), sp,
                        d, scale, o, ctx.Par());
    } else if (q.numel > 0) {
      const int64_t* idx = use_indices && d.topk > 0 ? indices.as<int64_t>() : nullptr;
      if (q.dtype == kBFloat16) {
        k_.attend_bf16(q.as<uint16_t>(), kv.as<uint16_t>(), window.as<uint16_t>(),
                       use_entries ? entries.as<uint16_t>() : nullptr, idx, sink.as<float>(), inv_freq.as<float>(), sp,
                       d, scale, static_cast<uint16_t*>(o), ctx.Par());
      } else {
        k_.attend_f32(q.as<float>(), kv.as<float>(), window.as<float>(), use_entries ? entries.as<float>() : nullptr,
                      idx, sink.as<float>(), inv_freq.as<float>(), sp, d, scale, static_cast<float*>(o), ctx.Par());
      }
    }
    // The ring is updated only after the attention has read it (present may be past's own buffer).
    PreparePresent(window, present, "present_window");
    if (kv.numel > 0 && fp8) {
      state_fp8::WindowWrite(kv.data, kv.dtype == kBFloat16, sp, d, static_cast<uint8_t*>(present));
    } else if (kv.numel > 0) {
      k_.window_write(kv.data, sp, d, ElementBytes(kv.dtype), present);
    }
  }

 private:
  const SparseAttentionKernels& k_;
  int64_t ratio_;
  float softmax_scale_;
  const bool bf16_products_;  // compute="bf16": float inputs multiply as bf16 (attend_f32_bf16)
};

}  // namespace

std::unique_ptr<Kernel> MakeSparseAttention(const KernelInit& init) {
  return std::make_unique<SparseAttentionKernel>(init);
}

}  // namespace dsv4::glue
