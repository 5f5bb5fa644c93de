// The MoE expert driver on a level's blocks (linear_blocks.h) and the MoeExpertsKernels tables of the accelerated
// levels. Same stages, rounding points and accumulation order as moe_experts_ref.cc (moe_experts.h); the matmuls go
// through the level's rows / tiles paths. Baseline ISA.
//
// Per token chunk (as the reference) the (token, slot) assignments are counting-sorted by expert, and the used
// experts are taken in ascending order, in batches whose prepared operands fit kMoeActivationBudget:
//   1. the batch's token rows are prepared per expert (gathered through the sorted token list) for W1 / W3;
//   2. gate/up: tasks over (expert, block of I rows); each computes both projections for all of the expert's
//      tokens from one decode of the weight rows and writes the rounded, clamped SwiGLU times the routing weight;
//   3. those activations are prepared per expert for W2;
//   4. down: tasks over blocks of d rows; each loops over the batch's experts in ascending order and adds the
//      rounded projection into the fp32 accumulator of each token.
// A single decode step (6 experts of 256, one token) is one batch: stage 2 has 6 x I / kWideRows items and stage 4
// one block of d rows per task, so every core streams long runs of weight rows. Each expert takes the tiles path
// when it has at least the level's tile_min_rows tokens. Results do not depend on the thread count (fixed
// per-output operation order, experts added in ascending order).
#include <algorithm>
#include <cassert>
#include <vector>

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/kernels/linear_buffer.h"
#include "custom_ops/numerics/bf16.h"

namespace dsv4 {
namespace {

const Parallel kSerial{};

// Decode-sized batches (every expert at most kWideMaxRows tokens, rows path) take wide work units: the gate/up
// items span kWideRows rows of I (w1 then w3, 128 KiB each for FP4 at d = 2048) instead of 16, and each down task
// reads its whole block of d rows of one expert's W2 before the next expert's, instead of alternating between the
// experts every 16 rows. Fewer, longer sequential streams: the hardware prefetchers keep up. Same sums in the same
// order (bit-identical). AMD EPYC family 0x19 model 0x11, two cores, bench preset (32 experts, top-6, d = 2048,
// I = 1024, FP4), decode step, two builds interleaved in one process: 38.71 -> 38.42 ms (MoeExpertsFp4 7.2-7.4 ->
// 6.7-7.3 ms per step in the profile).
constexpr int64_t kWideMaxRows = 4, kWideRows = 128;

int64_t TargetTasks(const Parallel& par) { return par.num_threads > 1 ? 4 * static_cast<int64_t>(par.num_threads) : 1; }

void RunReference(ActType act, const void* x, int64_t tokens, const float* weights, const int64_t* indices,
                  int64_t top_k, const ExpertWeights& w, float limit, void* y, const Parallel& par) {
  const MoeExpertsKernels& r = ref::kMoeExperts;
  const bool fp8 = w.w1.format == WeightFormat::kFp8E4M3, fp4 = w.w1.format == WeightFormat::kFp4E2M1;
  if (act == ActType::kF32) {
    (fp8 ? r.f32_fp8 : fp4 ? r.f32_fp4 : r.f32_dense)(static_cast<const float*>(x), tokens, weights, indices, top_k,
                                                       w, limit, static_cast<float*>(y), par);
  } else {
    (fp8 ? r.bf16_fp8 : fp4 ? r.bf16_fp4 : r.bf16_dense)(static_cast<const uint16_t*>(x), tokens, weights, indices,
                                                         top_k, w, limit, static_cast<uint16_t*>(y), par);
  }
}

float RoundAct(ActType act, float v) { return act == ActType::kBf16 ? Bf16ToF32(F32ToBf16(v)) : v; }

// One used expert of a batch.
struct ExpertJob {
  int64_t expert;
  int64_t begin, count;  // its assignments: sorted slots [begin, begin + count)
  bool tiles;
  size_t x_offset, a_offset;  // prepared operands (bytes into the batch buffer)
};

// Prepared-operand bytes of an expert with `count` rows against weight `w` (cols = operand width).
size_t OperandBytes(const LinearBlocks& b, ActType act, const WeightView& w, int64_t count, bool tiles) {
  return RoundUp64(tiles ? b.tile_x_bytes(act, count, w.cols) : static_cast<size_t>(count) * b.row_bytes(act, w));
}

size_t BlockScratch(const LinearBlocks& b, ActType act, const WeightView& w, int64_t count, bool tiles) {
  return RoundUp64(tiles ? b.tiles_scratch(act, w, count) : b.rows_scratch(act, w, count));
}

void Prepare(const LinearBlocks& b, ActType act, const WeightView& w, const void* x, int64_t ldx,
             const int64_t* index, int64_t count, bool tiles, uint8_t* dst, int64_t block_begin, int64_t block_end,
             const Int8Fp4Rows* int8) {
  if (int8 != nullptr) {  // compute="int8": bf16 rows quantised, in 16-row blocks
    const int64_t r0 = block_begin * 16, r1 = std::min(count, block_end * 16);
    if (r1 <= r0) return;
    const uint16_t* src = static_cast<const uint16_t*>(x) + (index != nullptr ? 0 : r0 * ldx);
    int8->prepare(src, ldx, index != nullptr ? index + r0 : nullptr, r1 - r0, w.cols,
                  dst + static_cast<size_t>(r0) * int8->row_bytes(w.cols));
    return;
  }
  if (tiles) {
    b.prepare_tiles(act, x, ldx, index, count, w.cols, block_begin, block_end, dst);
    return;
  }
  // rows path: 16-row blocks as for the tiles
  const int64_t r0 = block_begin * 16, r1 = std::min(count, block_end * 16);
  if (r1 <= r0) return;
  const size_t elem = act == ActType::kF32 ? sizeof(float) : sizeof(uint16_t);
  const void* src = index != nullptr ? x : static_cast<const uint8_t*>(x) + static_cast<size_t>(r0 * ldx) * elem;
  b.prepare_rows(act, w, src, ldx, index != nullptr ? index + r0 : nullptr, r1 - r0,
                 dst + static_cast<size_t>(r0) * b.row_bytes(act, w));
}

// Prepares every expert's operand (x rows through `index` + begin, or contiguous rows from `base` + begin) over
// the thread pool, in items of up to `chunk` 16-row blocks.
template <class OperandOf>
void PrepareAll(const LinearBlocks& b, ActType act, const WeightView& w, const std::vector<ExpertJob>& jobs,
                OperandOf operand, uint8_t* buffer, bool use_a_offset, const Parallel& par,
                const Int8Fp4Rows* int8) {
  struct Item {
    size_t job;
    int64_t b0, b1;
  };
  std::vector<Item> items;
  const auto blocks_of = [&](const ExpertJob& j) {
    return j.tiles ? b.tile_blocks(act, j.count) : (j.count + 15) / 16;
  };
  int64_t total_blocks = 0;
  for (const ExpertJob& j : jobs) total_blocks += blocks_of(j);
  const int64_t chunk = std::max<int64_t>(1, (total_blocks + TargetTasks(par) - 1) / TargetTasks(par));
  for (size_t i = 0; i < jobs.size(); ++i) {
    const int64_t blocks = blocks_of(jobs[i]);
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk) items.push_back({i, b0, std::min(blocks, b0 + chunk)});
  }
  // A decode step prepares a few rows per expert: not worth waking the pool.
  const Parallel& run_on = total_blocks <= 4 ? kSerial : par;
  run_on.For(items.size(), [&](size_t i) {
    const ExpertJob& j = jobs[items[i].job];
    const void* x;
    int64_t ldx;
    const int64_t* index;
    operand(j, &x, &ldx, &index);
    Prepare(b, act, w, x, ldx, index, j.count, j.tiles, buffer + (use_a_offset ? j.a_offset : j.x_offset),
            items[i].b0, items[i].b1, int8);
  });
}

}  // namespace

void RunMoeExperts(const LinearBlocks& b, ActType act, const void* x, int64_t tokens, const float* weights,
                   const int64_t* indices, int64_t top_k, const ExpertWeights& w, float swiglu_limit, void* y,
                   const Parallel& par, const Int8Fp4Rows* int8) {
  const int64_t dim = w.w1.cols, inter = w.w1.rows, experts = w.num_experts;
  const bool dense = indices == nullptr;
  const int64_t k = dense ? 1 : top_k;
  assert((weights == nullptr) == dense && (!dense || experts == 1) && experts >= 1);
  assert(w.w2.rows == dim && w.w2.cols == inter && w.w3.rows == inter && w.w3.cols == dim);
  if (tokens == 0 || dim == 0) return;
  assert(int8 == nullptr || (act == ActType::kBf16 && w.w1.format == WeightFormat::kFp4E2M1 &&
                             w.w2.format == WeightFormat::kFp4E2M1 && w.w3.format == WeightFormat::kFp4E2M1));
  if (int8 != nullptr && inter == 0) {
    ref::kMoeExperts.bf16_fp4_int8(static_cast<const uint16_t*>(x), tokens, weights, indices, top_k, w,
                                   swiglu_limit, static_cast<uint16_t*>(y), par);
    return;
  }
  if (int8 == nullptr &&
      (!b.rows_supported(act, w.w1) || !b.rows_supported(act, w.w2) || !b.rows_supported(act, w.w3) || inter == 0)) {
    RunReference(act, x, tokens, weights, indices, top_k, w, swiglu_limit, y, par);
    return;
  }
  const bool bf16 = act == ActType::kBf16;
  const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
  const int64_t min_tile_rows = b.tile_min_rows[static_cast<int>(act)];
  // compute="int8" has the rows path only (int8 rows functions for every M)
  const bool tiles13 = int8 == nullptr && b.tiles != nullptr && b.tiles_supported(act, w.w1) &&
                       b.tiles_supported(act, w.w3);
  const bool tiles2 = int8 == nullptr && b.tiles != nullptr && b.tiles_supported(act, w.w2);
  const auto operand_bytes = [&](const WeightView& wv, int64_t count, bool tiles) {
    return int8 != nullptr ? RoundUp64(static_cast<size_t>(count) * int8->row_bytes(wv.cols))
                           : OperandBytes(b, act, wv, count, tiles);
  };
  const auto block_scratch = [&](const WeightView& wv, int64_t count, bool tiles) {
    return int8 != nullptr ? size_t{0} : BlockScratch(b, act, wv, count, tiles);
  };

  const int64_t chunk = std::max<int64_t>(
      1, std::min<int64_t>(tokens, static_cast<int64_t>(kMoeActivationBudget / sizeof(float)) /
                                       std::max<int64_t>(1, k * inter)));
  std::vector<int64_t> start(static_cast<size_t>(experts + 1)), cursor(static_cast<size_t>(experts));
  std::vector<int64_t> slot_token(static_cast<size_t>(chunk * k));
  std::vector<float> slot_weight(static_cast<size_t>(chunk * k));
  AlignedBuffer acc_buf(bf16 ? static_cast<size_t>(chunk * dim) * sizeof(float) : 0);
  // Activations between the projections, in the activation type (the reference's rounding point).
  AlignedBuffer act_buf(static_cast<size_t>(chunk * k * inter) * elem);

  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t nt = std::min(chunk, tokens - t0);
    const uint8_t* xc = static_cast<const uint8_t*>(x) + static_cast<size_t>(t0 * dim) * elem;
    float* acc = bf16 ? acc_buf.as<float>() : static_cast<float*>(y) + t0 * dim;
    std::fill(acc, acc + nt * dim, 0.0f);

    std::fill(start.begin(), start.end(), 0);
    for (int64_t s = 0; s < nt * k; ++s) ++start[static_cast<size_t>(dense ? 0 : indices[t0 * k + s]) + 1];
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    std::copy(start.begin(), start.end() - 1, cursor.begin());
    for (int64_t s = 0; s < nt * k; ++s) {
      const int64_t e = dense ? 0 : indices[t0 * k + s];
      const int64_t pos = cursor[e]++;
      slot_token[pos] = s / k;
      slot_weight[pos] = dense ? 1.0f : weights[t0 * k + s];
    }

    // Used experts in ascending order, grouped into batches.
    std::vector<ExpertJob> all;
    for (int64_t e = 0; e < experts; ++e) {
      if (start[e + 1] == start[e]) continue;
      ExpertJob j;
      j.expert = e;
      j.begin = start[e];
      j.count = start[e + 1] - start[e];
      j.tiles = j.count >= min_tile_rows && j.count > w.w1.invariant_rows;  // WeightView::invariant_rows
      j.x_offset = j.a_offset = 0;
      all.push_back(j);
    }
    for (size_t first = 0; first < all.size();) {
      std::vector<ExpertJob> batch;
      size_t bytes = 0;
      for (size_t i = first; i < all.size(); ++i) {
        ExpertJob j = all[i];
        const bool t13 = tiles13 && j.tiles, t2 = tiles2 && j.tiles;
        const size_t need = operand_bytes(w.w1, j.count, t13) + operand_bytes(w.w2, j.count, t2);
        if (!batch.empty() && bytes + need > kMoeActivationBudget) break;
        j.x_offset = bytes;
        j.a_offset = bytes + operand_bytes(w.w1, j.count, t13);
        bytes += need;
        batch.push_back(j);
      }
      first += batch.size();
      AlignedBuffer operands(bytes);

      // Per-task scratch sizes (the largest expert of the batch decides).
      int64_t max_count = 0;
      for (const ExpertJob& j : batch) max_count = std::max(max_count, j.count);
      const auto uses_tiles = [&](const ExpertJob& j, bool stage2) { return (stage2 ? tiles2 : tiles13) && j.tiles; };
      size_t s1 = 0, s2 = 0;
      for (const ExpertJob& j : batch) {
        s1 = std::max(s1, std::max(block_scratch(w.w1, j.count, uses_tiles(j, false)),
                                   block_scratch(w.w3, j.count, uses_tiles(j, false))));
        s2 = std::max(s2, block_scratch(w.w2, j.count, uses_tiles(j, true)));
      }
      // Work units: blocks of I rows (stages 1-2) and of d rows (stage 4); wide (see kWideMaxRows) takes blocks of
      // kWideRows I rows and one block of d rows per task.
      bool wide = max_count <= kWideMaxRows;
      int64_t batch_rows = 0;
      for (const ExpertJob& j : batch) {
        wide = wide && !uses_tiles(j, false) && !uses_tiles(j, true);
        batch_rows += j.count;
      }
      const int64_t unit1 = wide ? kWideRows : tiles13 ? std::max<int64_t>(16, b.tile_rows) : 16;
      const int64_t unit2 = tiles2 ? std::max<int64_t>(16, b.tile_rows) : 16;
      const int64_t tasks = TargetTasks(par);
      const int64_t units2 = (dim + unit2 - 1) / unit2, tasks2 = std::min(tasks, units2);
      const int64_t task_cols = (units2 + tasks2 - 1) / tasks2 * unit2;  // most d rows a task takes
      const size_t gu_bytes = RoundUp64(static_cast<size_t>(max_count * unit1) * sizeof(float));
      const size_t out2_bytes =
          RoundUp64(static_cast<size_t>(wide ? batch_rows * task_cols : max_count * unit2) * sizeof(float));
      const size_t task1_bytes = s1 + 2 * gu_bytes, task2_bytes = s2 + out2_bytes;
      AlignedBuffer scratch(static_cast<size_t>(tasks) * std::max(task1_bytes, task2_bytes));

      // 1. token rows per expert, for W1 / W3.
      for (ExpertJob& j : batch) j.tiles = uses_tiles(j, false);
      PrepareAll(
          b, act, w.w1, batch,
          [&](const ExpertJob& j, const void** src, int64_t* ld, const int64_t** index) {
            *src = xc;
            *ld = dim;
            *index = slot_token.data() + j.begin;
          },
          operands.bytes(), false, par, int8);

      // 2. gate/up + SwiGLU: items (expert, block of unit1 rows of I).
      struct Item1 {
        size_t job;
        int64_t i0, i1;
      };
      std::vector<Item1> items1;
      for (size_t i = 0; i < batch.size(); ++i) {
        for (int64_t r = 0; r < inter; r += unit1) items1.push_back({i, r, std::min(inter, r + unit1)});
      }
      const int64_t tasks1 = std::min<int64_t>(tasks, static_cast<int64_t>(items1.size()));
      par.For(static_cast<size_t>(tasks1), [&](size_t task) {
        uint8_t* base = scratch.bytes() + task * task1_bytes;
        float* g = reinterpret_cast<float*>(base + s1);
        float* u = reinterpret_cast<float*>(base + s1 + gu_bytes);
        const int64_t it0 = static_cast<int64_t>(items1.size()) * static_cast<int64_t>(task) / tasks1;
        const int64_t it1 = static_cast<int64_t>(items1.size()) * static_cast<int64_t>(task + 1) / tasks1;
        for (int64_t it = it0; it < it1; ++it) {
          const Item1& item = items1[static_cast<size_t>(it)];
          const ExpertJob& j = batch[item.job];
          const WeightView w1 = WeightSlice(w.w1, j.expert), w3 = WeightSlice(w.w3, j.expert);
          const int64_t rows = item.i1 - item.i0;
          const uint8_t* xp = operands.bytes() + j.x_offset;
          if (int8 != nullptr) {
            int8->rows(xp, j.count, w1, item.i0, item.i1, MatOut{g, rows, false});
            int8->rows(xp, j.count, w3, item.i0, item.i1, MatOut{u, rows, false});
          } else {
            const auto mm = j.tiles ? b.tiles : b.rows;
            mm(act, xp, j.count, w1, item.i0, item.i1, MatOut{g, rows, false}, base);
            mm(act, xp, j.count, w3, item.i0, item.i1, MatOut{u, rows, false}, base);
          }
          for (int64_t p = 0; p < j.count; ++p) {
            const int64_t pos = j.begin + p;
            if (b.moe_swiglu != nullptr) {
              b.moe_swiglu(act, g + p * rows, u + p * rows, rows, swiglu_limit, dense ? 1.0f : slot_weight[pos],
                           act_buf.bytes() + static_cast<size_t>(pos * inter + item.i0) * elem);
              continue;
            }
            for (int64_t i = 0; i < rows; ++i) {
              float a = ref::SwiGlu(RoundAct(act, g[p * rows + i]), RoundAct(act, u[p * rows + i]), swiglu_limit);
              if (!dense) a *= slot_weight[pos];
              const size_t at = static_cast<size_t>(pos * inter + item.i0 + i);
              if (bf16) {
                act_buf.as<uint16_t>()[at] = F32ToBf16(a);
              } else {
                act_buf.as<float>()[at] = a;
              }
            }
          }
        }
      });

      // 3. activations per expert, for W2 (contiguous rows of act_buf).
      for (ExpertJob& j : batch) j.tiles = uses_tiles(j, true);
      PrepareAll(
          b, act, w.w2, batch,
          [&](const ExpertJob& j, const void** src, int64_t* ld, const int64_t** index) {
            *src = act_buf.bytes() + static_cast<size_t>(j.begin * inter) * elem;
            *ld = inter;
            *index = nullptr;
          },
          operands.bytes(), true, par, int8);

      // 4. down projection: tasks over blocks of d rows, experts in ascending order inside. Wide: one block per
      //    task, whose experts' outputs are all computed before they are added (same order, same sums).
      par.For(static_cast<size_t>(tasks2), [&](size_t task) {
        uint8_t* base = scratch.bytes() + task * task2_bytes;
        float* out = reinterpret_cast<float*>(base + s2);
        const int64_t c0 = units2 * static_cast<int64_t>(task) / tasks2 * unit2;
        const int64_t c1 = std::min(dim, units2 * static_cast<int64_t>(task + 1) / tasks2 * unit2);
        const auto add = [&](const ExpertJob& j, const float* o, int64_t cb, int64_t cols) {
          for (int64_t p = 0; p < j.count; ++p) {
            float* dst = acc + slot_token[j.begin + p] * dim + cb;
            if (b.moe_accumulate != nullptr) {
              b.moe_accumulate(act, o + p * cols, cols, dst);
            } else {
              for (int64_t c = 0; c < cols; ++c) dst[c] += RoundAct(act, o[p * cols + c]);
            }
          }
        };
        const int64_t block = wide ? c1 - c0 : unit2;
        for (int64_t cb = c0; cb < c1; cb += block) {
          const int64_t ce = std::min(c1, cb + block), cols = ce - cb;
          float* o = out;
          for (const ExpertJob& j : batch) {
            const WeightView w2 = WeightSlice(w.w2, j.expert);
            if (int8 != nullptr) {
              int8->rows(operands.bytes() + j.a_offset, j.count, w2, cb, ce, MatOut{o, cols, false});
            } else {
              (j.tiles ? b.tiles : b.rows)(act, operands.bytes() + j.a_offset, j.count, w2, cb, ce,
                                           MatOut{o, cols, false}, base);
            }
            if (wide) {
              o += j.count * cols;
            } else {
              add(j, o, cb, cols);
            }
          }
          if (wide) {
            o = out;
            for (const ExpertJob& j : batch) {
              add(j, o, cb, cols);
              o += j.count * cols;
            }
          }
        }
        if (bf16 && first >= all.size()) {  // last batch: round this block of columns into y
          uint16_t* yc = static_cast<uint16_t*>(y) + t0 * dim;
          for (int64_t t = 0; t < nt; ++t)
            for (int64_t c = c0; c < c1; ++c) yc[t * dim + c] = F32ToBf16(acc[t * dim + c]);
        }
      });
    }
  }
}

#if DSV4_X86_VARIANTS
namespace {

template <const LinearBlocks* B>
void F32Slot(const float* x, int64_t tokens, const float* weights, const int64_t* indices, int64_t top_k,
             const ExpertWeights& w, float limit, float* y, const Parallel& par) {
  RunMoeExperts(*B, ActType::kF32, x, tokens, weights, indices, top_k, w, limit, y, par);
}

template <const LinearBlocks* B>
void Bf16Slot(const uint16_t* x, int64_t tokens, const float* weights, const int64_t* indices, int64_t top_k,
              const ExpertWeights& w, float limit, uint16_t* y, const Parallel& par) {
  RunMoeExperts(*B, ActType::kBf16, x, tokens, weights, indices, top_k, w, limit, y, par);
}

template <const LinearBlocks* B, const Int8Fp4Rows* I>
void Bf16Int8Slot(const uint16_t* x, int64_t tokens, const float* weights, const int64_t* indices, int64_t top_k,
                  const ExpertWeights& w, float limit, uint16_t* y, const Parallel& par) {
  RunMoeExperts(*B, ActType::kBf16, x, tokens, weights, indices, top_k, w, limit, y, par, I);
}

template <const LinearBlocks* B, const Int8Fp4Rows* I>
constexpr MoeExpertsKernels MakeTable() {
  return {F32Slot<B>, F32Slot<B>, F32Slot<B>, Bf16Slot<B>, Bf16Slot<B>, Bf16Slot<B>, Bf16Int8Slot<B, I>};
}

}  // namespace

namespace avx2 {
extern const MoeExpertsKernels kMoeExperts = MakeTable<&kLinearBlocks, &kInt8Fp4Rows>();
}  // namespace avx2
namespace avx512 {
extern const MoeExpertsKernels kMoeExperts = MakeTable<&kLinearBlocks, &kInt8Fp4Rows>();
}  // namespace avx512
namespace amx {
extern const MoeExpertsKernels kMoeExperts = MakeTable<&kLinearBlocks, &avx512::kInt8Fp4Rows>();
}  // namespace amx
#endif

}  // namespace dsv4
