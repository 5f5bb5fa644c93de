// Scalar reference for the Linear family (linear.h): decode a block of weight rows to fp32 (bf16-rounded for bf16
// activations), then one fp32 dot product per output, k in increasing order. This is the spec the SIMD variants
// are tested against. Baseline ISA.
#include <algorithm>
#include <cassert>
#include <type_traits>
#include <vector>

#include "custom_ops/kernels/linear.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"

namespace dsv4 {

namespace {
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

size_t WeightDataBytes(const WeightView& w) {
  const size_t n = static_cast<size_t>(w.rows) * static_cast<size_t>(w.cols);
  switch (w.format) {
    case WeightFormat::kF32: return n * sizeof(float);
    case WeightFormat::kBf16: return n * sizeof(uint16_t);
    case WeightFormat::kFp8E4M3: return n;
    case WeightFormat::kFp4E2M1: return n / 2;
  }
  return 0;
}

size_t WeightScaleBytes(const WeightView& w) {
  const size_t elem = w.scale_format == ScaleFormat::kF32 ? sizeof(float) : 1;
  switch (w.format) {
    case WeightFormat::kFp8E4M3:
      return static_cast<size_t>(CeilDiv(w.rows, w.block) * CeilDiv(w.cols, w.block)) * elem;
    case WeightFormat::kFp4E2M1:
      return static_cast<size_t>(w.rows * (w.cols / kFp4Block)) * elem;
    default:
      return 0;
  }
}

bool Fp8ScalesScaledRange(const uint8_t* scale, size_t n) {
  uint8_t lo = 0xFF, hi = 0;
  for (size_t i = 0; i < n; ++i) {
    lo = scale[i] < lo ? scale[i] : lo;
    hi = scale[i] > hi ? scale[i] : hi;
  }
  return n == 0 || (lo >= kFp8ScaledMinE && hi <= kFp8ScaledMaxE);
}

WeightView WeightSlice(const WeightView& first, int64_t index) {
  WeightView w = first;
  w.data = static_cast<const uint8_t*>(first.data) + static_cast<size_t>(index) * WeightDataBytes(first);
  if (first.scale != nullptr) {
    w.scale = static_cast<const uint8_t*>(first.scale) + static_cast<size_t>(index) * WeightScaleBytes(first);
  }
  return w;
}

namespace ref {

void DecodeWeightRow(const WeightView& w, int64_t row, bool round_bf16, float* out) {
  const int64_t cols = w.cols;
  switch (w.format) {
    case WeightFormat::kF32: {
      const float* src = static_cast<const float*>(w.data) + row * cols;
      for (int64_t k = 0; k < cols; ++k) out[k] = src[k];
      break;
    }
    case WeightFormat::kBf16: {
      const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * cols;
      for (int64_t k = 0; k < cols; ++k) out[k] = Bf16ToF32(src[k]);
      break;
    }
    case WeightFormat::kFp8E4M3: {
      const uint8_t* src = static_cast<const uint8_t*>(w.data) + row * cols;
      const int64_t scale_cols = CeilDiv(cols, w.block), scale_row = row / w.block;
      for (int64_t k = 0; k < cols; ++k) {
        const int64_t s = scale_row * scale_cols + k / w.block;
        const float scale = w.scale_format == ScaleFormat::kE8M0 ? E8M0ToF32(static_cast<const uint8_t*>(w.scale)[s])
                                                                 : static_cast<const float*>(w.scale)[s];
        out[k] = Fp8E4M3ToF32(src[k]) * scale;
      }
      break;
    }
    case WeightFormat::kFp4E2M1: {
      const uint8_t* src = static_cast<const uint8_t*>(w.data) + row * (cols / 2);
      const uint8_t* scale = static_cast<const uint8_t*>(w.scale) + row * (cols / kFp4Block);
      for (int64_t k = 0; k < cols; ++k) out[k] = Fp4E2M1ToF32(Fp4Code(src, k)) * E8M0ToF32(scale[k / kFp4Block]);
      break;
    }
  }
  if (round_bf16) {
    for (int64_t k = 0; k < cols; ++k) out[k] = Bf16ToF32(F32ToBf16(out[k]));
  }
}

namespace {

// Weight rows decoded together; every x row is then read once per block instead of once per weight row.
constexpr int64_t kRowBlock = 8;

inline float Widen(float v) { return v; }
inline float Widen(uint16_t v) { return Bf16ToF32(v); }

template <class T>
T Narrow(float v) {
  if constexpr (std::is_same<T, uint16_t>::value) {
    return F32ToBf16(v);
  } else {
    return v;
  }
}

// kBf16Products (T = float only): the bf16 compute mode, x and the decoded weight rounded to bf16, fp32 sums
// stored unrounded.
template <class T, bool kBf16Products = false>
void LinearRef(const T* x, int64_t m, const WeightView& w, int64_t groups, T* y, const Parallel& par) {
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value || kBf16Products;
  const int64_t n = w.rows, kw = w.cols, k = groups * kw;
  assert(groups >= 1 && n % groups == 0 && m >= 0 && kw >= 0);
  assert(w.format != WeightFormat::kFp4E2M1 || kw % kFp4Block == 0);
  if (m == 0 || n == 0) return;
  const int64_t rows_per_group = n / groups;
  const int64_t blocks = CeilDiv(n, kRowBlock);
  const int64_t tasks = std::min<int64_t>(blocks, par.num_threads > 1 ? 4 * par.num_threads : 1);
  std::vector<float> scratch(static_cast<size_t>(tasks * kRowBlock * std::max<int64_t>(kw, 1)));
  par.For(static_cast<size_t>(tasks), [&](size_t task) {
    float* rows = scratch.data() + task * kRowBlock * std::max<int64_t>(kw, 1);
    const int64_t block_begin = blocks * static_cast<int64_t>(task) / tasks;
    const int64_t block_end = blocks * static_cast<int64_t>(task + 1) / tasks;
    for (int64_t b = block_begin; b < block_end; ++b) {
      const int64_t j0 = b * kRowBlock, j1 = std::min(n, j0 + kRowBlock);
      for (int64_t j = j0; j < j1; ++j) DecodeWeightRow(w, j, kBf16, rows + (j - j0) * kw);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = j0; j < j1; ++j) {
          const T* xi = x + i * k + (j / rows_per_group) * kw;
          const float* wj = rows + (j - j0) * kw;
          float acc = 0.0f;
          if constexpr (kBf16Products) {
            for (int64_t p = 0; p < kw; ++p) acc += Bf16ToF32(F32ToBf16(xi[p])) * wj[p];
          } else {
            for (int64_t p = 0; p < kw; ++p) acc += Widen(xi[p]) * wj[p];
          }
          y[i * n + j] = Narrow<T>(acc);
        }
      }
    }
  });
}

}  // namespace

extern const LinearKernels kLinear = {
    LinearRef<float>,       LinearRef<float>,       LinearRef<float>,       LinearRef<uint16_t>,
    LinearRef<uint16_t>,    LinearRef<uint16_t>,    LinearRef<float, true>, LinearRef<float, true>,
    LinearRef<float, true>,
};

}  // namespace ref
}  // namespace dsv4
