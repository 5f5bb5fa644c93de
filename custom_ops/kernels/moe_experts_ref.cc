// Scalar reference for the MoE expert family (moe_experts.h): counting sort of the (token, slot) assignments by
// expert, then phase 1 (gate/up projections and the clamped SwiGLU per expert and block of I rows) and phase 2
// (down projection per block of output rows, experts in ascending order). Weight rows are decoded by
// ref::DecodeWeightRow (linear_ref.cc), so every format shares one decode. Baseline ISA.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <type_traits>
#include <vector>

#include "custom_ops/kernels/moe_experts.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"
#include "custom_ops/numerics/int8_blocks.h"

namespace dsv4 {
namespace ref {

float SwiGlu(float gate, float up, float limit) {
  if (limit > 0.0f) {
    gate = gate > limit ? limit : gate;  // NaN compares false and is kept
    up = up > limit ? limit : (up < -limit ? -limit : up);
  }
  return gate / (1.0f + std::exp(-gate)) * up;
}

namespace {

constexpr int64_t kInterRows = 16;  // rows of W1/W3 per phase-1 item
constexpr int64_t kDimRows = 16;    // rows of W2 (outputs) per phase-2 item

inline float Widen(float v) { return v; }
inline float Widen(uint16_t v) { return Bf16ToF32(v); }

// The value v takes when stored as T (the spec's `.to(x.dtype)` between stages); identity for fp32.
template <class T>
float Round(float v) {
  if constexpr (std::is_same<T, uint16_t>::value) {
    return Bf16ToF32(F32ToBf16(v));
  } else {
    return v;
  }
}

// Splits [0, items) into at most `tasks` contiguous ranges and calls f(task, begin, end) for each, in parallel.
template <class F>
void ForTasks(const Parallel& par, int64_t items, int64_t tasks, F&& f) {
  if (items <= 0) return;
  par.For(static_cast<size_t>(tasks), [&](size_t task) {
    const int64_t t = static_cast<int64_t>(task);
    f(t, items * t / tasks, items * (t + 1) / tasks);
  });
}

int64_t NumTasks(const Parallel& par, int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>(items, par.num_threads > 1 ? 4 * par.num_threads : 1));
}

// compute="int8": rows of n values quantised per block (numerics/int8_blocks.h), codes [rows, n], scales
// [rows, n / 32].
void QuantizeRows(const float* v, int64_t rows, int64_t n, int8_t* q, float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < n / kInt8Block; ++b) {
      const int64_t at = r * n + b * kInt8Block;
      scale[r * (n / kInt8Block) + b] = QuantizeInt8Block(v + at, kInt8Block, q + at);
    }
  }
}

// Row `row` of FP4 weight w against quantised codes q / scales s (moe_experts.h, compute="int8"): exact integer
// block sums, each times s_b * 2^(e - 127) / 2, added in block order.
float Int8Fp4Dot(const int8_t* q, const float* s, const WeightView& w, int64_t row) {
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + row * (w.cols / 2);
  const uint8_t* scales = static_cast<const uint8_t*>(w.scale) + row * (w.cols / kFp4Block);
  float sum = 0.0f;
  for (int64_t b = 0; b < w.cols / kFp4Block; ++b) {
    int32_t isum = 0;
    for (int64_t k = b * kFp4Block; k < (b + 1) * kFp4Block; ++k) isum += q[k] * kFp4E2M1Doubled[Fp4Code(codes, k)];
    sum += static_cast<float>(isum) * (s[b] * 0.5f * E8M0ToF32(scales[b]));
  }
  return sum;
}

template <class T, bool kInt8 = false>
void MoeExpertsRef(const T* x, int64_t tokens, const float* weights, const int64_t* indices, int64_t top_k,
                   const ExpertWeights& w, float swiglu_limit, T* y, const Parallel& par) {
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value;
  static_assert(!kInt8 || kBf16, "compute=int8 runs on bf16 activations");
  const int64_t dim = w.w1.cols, inter = w.w1.rows, experts = w.num_experts;
  assert(!kInt8 || (w.w1.format == WeightFormat::kFp4E2M1 && w.w2.format == WeightFormat::kFp4E2M1 &&
                    w.w3.format == WeightFormat::kFp4E2M1));
  const bool dense = indices == nullptr;
  const int64_t k = dense ? 1 : top_k;
  assert((weights == nullptr) == dense && (!dense || experts == 1) && experts >= 1);
  assert(w.w2.rows == dim && w.w2.cols == inter && w.w3.rows == inter && w.w3.cols == dim);
  if (tokens == 0 || dim == 0) return;

  const int64_t chunk = std::max<int64_t>(
      1, std::min<int64_t>(tokens, static_cast<int64_t>(kMoeActivationBudget / sizeof(float)) /
                                       std::max<int64_t>(1, k * inter)));
  // Per-call scratch, allocated here so that nothing inside the parallel regions can throw.
  std::vector<float> act(static_cast<size_t>(chunk * k * inter));
  std::vector<float> acc_buf(kBf16 ? static_cast<size_t>(chunk * dim) : 0);
  std::vector<int64_t> start(static_cast<size_t>(experts + 1)), cursor(static_cast<size_t>(experts));
  std::vector<int64_t> slot_token(static_cast<size_t>(chunk * k));
  std::vector<float> slot_weight(static_cast<size_t>(chunk * k));
  std::vector<int64_t> used;
  used.reserve(static_cast<size_t>(experts));
  struct Item {
    int64_t expert, row_begin, row_end;
  };
  const int64_t max_items1 = std::min(experts, chunk * k) * ((inter + kInterRows - 1) / kInterRows);
  std::vector<Item> items1;
  items1.reserve(static_cast<size_t>(max_items1));
  const int64_t items2 = (dim + kDimRows - 1) / kDimRows;
  const int64_t max_tasks1 = NumTasks(par, max_items1);
  const int64_t tasks2 = NumTasks(par, items2);
  std::vector<float> rows1(static_cast<size_t>(max_tasks1 * 2 * dim));  // a W1 row and a W3 row per task
  std::vector<float> rows2(static_cast<size_t>(tasks2 * std::max<int64_t>(inter, 1)));
  // compute="int8": the chunk's token rows and activations, quantised
  std::vector<float> xf(kInt8 ? static_cast<size_t>(chunk * dim) : 0);
  std::vector<int8_t> qx(xf.size()), qa(kInt8 ? act.size() : 0);
  std::vector<float> sx(xf.size() / kInt8Block), sa(qa.size() / kInt8Block);

  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t nt = std::min(chunk, tokens - t0);
    const T* xc = x + t0 * dim;
    T* yc = y + t0 * dim;
    float* acc = acc_buf.data();
    if constexpr (!kBf16) acc = yc;  // fp32 output: accumulate in place
    std::fill(acc, acc + nt * dim, 0.0f);

    // Counting sort: the assignments of expert e are slots start[e] .. start[e+1]-1, in (token, j) order.
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
    used.clear();
    items1.clear();
    for (int64_t e = 0; e < experts; ++e) {
      if (start[e + 1] == start[e]) continue;
      used.push_back(e);
      for (int64_t r = 0; r < inter; r += kInterRows) items1.push_back({e, r, std::min(inter, r + kInterRows)});
    }

    if constexpr (kInt8) {
      for (int64_t i = 0; i < nt * dim; ++i) xf[i] = Widen(xc[i]);
      QuantizeRows(xf.data(), nt, dim, qx.data(), sx.data());
    }

    // Phase 1: act[pos][i] = round(swiglu(round(W1_e x), round(W3_e x)) * weight) for every assignment pos of e.
    const int64_t tasks1 = NumTasks(par, static_cast<int64_t>(items1.size()));
    ForTasks(par, static_cast<int64_t>(items1.size()), tasks1, [&](int64_t task, int64_t begin, int64_t end) {
      float* w1_row = rows1.data() + task * 2 * dim;
      float* w3_row = w1_row + dim;
      for (int64_t it = begin; it < end; ++it) {
        const Item& item = items1[it];
        const WeightView w1 = WeightSlice(w.w1, item.expert), w3 = WeightSlice(w.w3, item.expert);
        for (int64_t i = item.row_begin; i < item.row_end; ++i) {
          if constexpr (!kInt8) {
            DecodeWeightRow(w1, i, kBf16, w1_row);
            DecodeWeightRow(w3, i, kBf16, w3_row);
          }
          for (int64_t pos = start[item.expert]; pos < start[item.expert + 1]; ++pos) {
            float gate = 0.0f, up = 0.0f;
            if constexpr (kInt8) {
              const int64_t t = slot_token[pos];
              gate = Int8Fp4Dot(qx.data() + t * dim, sx.data() + t * (dim / kInt8Block), w1, i);
              up = Int8Fp4Dot(qx.data() + t * dim, sx.data() + t * (dim / kInt8Block), w3, i);
            } else {
              const T* xt = xc + slot_token[pos] * dim;
              for (int64_t p = 0; p < dim; ++p) gate += Widen(xt[p]) * w1_row[p];
              for (int64_t p = 0; p < dim; ++p) up += Widen(xt[p]) * w3_row[p];
            }
            float a = SwiGlu(Round<T>(gate), Round<T>(up), swiglu_limit);
            if (!dense) a *= slot_weight[pos];
            act[pos * inter + i] = Round<T>(a);
          }
        }
      }
    });

    if constexpr (kInt8) QuantizeRows(act.data(), nt * k, inter, qa.data(), sa.data());

    // Phase 2: acc[t][c] += round(W2_e[c] . act[pos]) for the used experts in ascending order, then round to T.
    ForTasks(par, items2, tasks2, [&](int64_t task, int64_t begin, int64_t end) {
      float* w2_row = rows2.data() + task * std::max<int64_t>(inter, 1);
      const int64_t c0 = begin * kDimRows, c1 = std::min(dim, end * kDimRows);
      for (int64_t e : used) {
        const WeightView w2 = WeightSlice(w.w2, e);
        for (int64_t c = c0; c < c1; ++c) {
          if constexpr (!kInt8) DecodeWeightRow(w2, c, kBf16, w2_row);
          for (int64_t pos = start[e]; pos < start[e + 1]; ++pos) {
            const float* a = act.data() + pos * inter;
            float sum = 0.0f;
            if constexpr (kInt8) {
              sum = Int8Fp4Dot(qa.data() + pos * inter, sa.data() + pos * (inter / kInt8Block), w2, c);
            } else {
              for (int64_t i = 0; i < inter; ++i) sum += a[i] * w2_row[i];
            }
            acc[slot_token[pos] * dim + c] += Round<T>(sum);
          }
        }
      }
      if constexpr (kBf16) {
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t c = c0; c < c1; ++c) yc[t * dim + c] = F32ToBf16(acc[t * dim + c]);
      }
    });
  }
}

}  // namespace

extern const MoeExpertsKernels kMoeExperts = {
    MoeExpertsRef<float>,    MoeExpertsRef<float>,    MoeExpertsRef<float>,
    MoeExpertsRef<uint16_t>, MoeExpertsRef<uint16_t>, MoeExpertsRef<uint16_t>,
    MoeExpertsRef<uint16_t, true>,
};

}  // namespace ref
}  // namespace dsv4
