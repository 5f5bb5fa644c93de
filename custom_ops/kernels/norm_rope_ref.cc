// Scalar reference for kernels/norm_rope.h (RmsNorm, NormRope, Rope): the spec the SIMD variants are tested against.
// Each vector is widened to a float32 scratch row, processed in the order written in the header and narrowed once
// (NormRope narrows twice, as the spec does). Baseline ISA; written for clarity, not speed.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

#include "custom_ops/kernels/norm_rope.h"
#include "custom_ops/kernels/rope.h"
#include "custom_ops/numerics/element.h"

namespace dsv4 {
namespace ref {
namespace {

size_t NumChunks(const Parallel& par, int64_t items, int64_t cost_per_item) {
  const int64_t by_cost = std::max<int64_t>(1, items * std::max<int64_t>(1, cost_per_item) / 16384);
  const int64_t by_threads = 4 * std::max(1, par.num_threads);
  return static_cast<size_t>(std::max<int64_t>(1, std::min({items, by_cost, by_threads})));
}

// v <- weight * (v * r) (weight may be nullptr).
void Normalise(float* v, const float* weight, int64_t n, float eps) {
  const float r = RmsScale(v, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    const float y = v[i] * r;
    v[i] = weight != nullptr ? weight[i] * y : y;
  }
}

template <class T>
void RmsNorm(const T* x, const float* weight, int64_t rows, int64_t n, float eps, T* y, const Parallel& par) {
  assert(n >= 1 && rows >= 0);
  par.ForRange(static_cast<size_t>(rows), NumChunks(par, rows, n), [&](size_t begin, size_t end) {
    std::vector<float> v(n);
    for (size_t row = begin; row < end; ++row) {
      const T* src = x + row * n;
      for (int64_t i = 0; i < n; ++i) v[i] = ToF32(src[i]);
      Normalise(v.data(), weight, n, eps);
      for (int64_t i = 0; i < n; ++i) StoreAs(v[i], y + row * n + i);
    }
  });
}

// Shared driver of NormRope and Rope: for every token, widen each head vector, optionally normalise (then round to
// T), rotate the last rd channels, narrow.
template <class T>
void TokenLoop(const T* x, const float* weight, bool normalise, const int64_t* start_pos, const float* inv_freq,
               const RopeDims& d, float eps, bool inverse, T* y, const Parallel& par) {
  assert(d.dim >= 1 && 2 * d.half <= d.dim);
  const int64_t tokens = d.batch * d.seq, per_token = d.heads * d.dim, rd = 2 * d.half;
  par.ForRange(static_cast<size_t>(tokens), NumChunks(par, tokens, per_token), [&](size_t begin, size_t end) {
    std::vector<float> v(d.dim), cos(d.half), sin(d.half);
    for (size_t tok = begin; tok < end; ++tok) {
      const int64_t b = static_cast<int64_t>(tok) / d.seq, s = static_cast<int64_t>(tok) % d.seq;
      RopeCosSin(start_pos[b] + s, inv_freq, d.half, cos.data(), sin.data());
      for (int64_t h = 0; h < d.heads; ++h) {
        const T* src = x + tok * per_token + h * d.dim;
        T* dst = y + tok * per_token + h * d.dim;
        for (int64_t i = 0; i < d.dim; ++i) v[i] = ToF32(src[i]);
        if (normalise) {
          Normalise(v.data(), weight, d.dim, eps);
          for (int64_t i = 0; i < d.dim; ++i) v[i] = RoundTo<T>(v[i]);
        }
        RopeRotate(v.data() + d.dim - rd, cos.data(), sin.data(), d.half, inverse);
        for (int64_t i = 0; i < d.dim; ++i) StoreAs(v[i], dst + i);
      }
    }
  });
}

void RmsNormF32(const float* x, const float* weight, int64_t rows, int64_t n, float eps, float* y,
                const Parallel& par) {
  RmsNorm(x, weight, rows, n, eps, y, par);
}
void RmsNormBf16(const uint16_t* x, const float* weight, int64_t rows, int64_t n, float eps, uint16_t* y,
                 const Parallel& par) {
  RmsNorm(x, weight, rows, n, eps, y, par);
}
void NormRopeF32(const float* x, const float* weight, const int64_t* start_pos, const float* inv_freq,
                 const RopeDims& dims, float eps, float* y, const Parallel& par) {
  TokenLoop(x, weight, true, start_pos, inv_freq, dims, eps, false, y, par);
}
void NormRopeBf16(const uint16_t* x, const float* weight, const int64_t* start_pos, const float* inv_freq,
                  const RopeDims& dims, float eps, uint16_t* y, const Parallel& par) {
  TokenLoop(x, weight, true, start_pos, inv_freq, dims, eps, false, y, par);
}
void RopeF32(const float* x, const int64_t* start_pos, const float* inv_freq, const RopeDims& dims, bool inverse,
             float* y, const Parallel& par) {
  TokenLoop(x, nullptr, false, start_pos, inv_freq, dims, 0.0f, inverse, y, par);
}
void RopeBf16(const uint16_t* x, const int64_t* start_pos, const float* inv_freq, const RopeDims& dims, bool inverse,
              uint16_t* y, const Parallel& par) {
  TokenLoop(x, nullptr, false, start_pos, inv_freq, dims, 0.0f, inverse, y, par);
}

}  // namespace

float RmsScale(const float* v, int64_t n, float eps) {
  double sum_sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sum_sq += static_cast<double>(v[i]) * v[i];
  const float mean = static_cast<float>(sum_sq) / static_cast<float>(n);
  return 1.0f / std::sqrt(mean + eps);
}

const NormRopeKernels kNormRope = {&RmsNormF32, &RmsNormBf16, &NormRopeF32, &NormRopeBf16, &RopeF32, &RopeBf16};

}  // namespace ref
}  // namespace dsv4
