// Scalar reference for kernels/indexer.h: per query, every visible entry is scored in the order of the header, then
// the top k are picked with a partial sort under a strict total order (score, then index), which reproduces the
// spec's stable descending sort. Queries run in parallel. Baseline ISA; written for clarity, not speed.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <numeric>
#include <vector>

#include "custom_ops/kernels/indexer.h"
#include "custom_ops/numerics/element.h"

namespace dsv4 {
namespace ref {
namespace {

size_t NumChunks(const Parallel& par, int64_t items, int64_t cost_per_item) {
  const int64_t by_cost = std::max<int64_t>(1, items * std::max<int64_t>(1, cost_per_item) / 16384);
  const int64_t by_threads = 4 * std::max(1, par.num_threads);
  return static_cast<size_t>(std::max<int64_t>(1, std::min({items, by_cost, by_threads})));
}

template <class T>
void TopK(const T* q, const float* weights, const T* keys, const int64_t* start_pos, const IndexerDims& d,
          int64_t* indices, const Parallel& par) {
  assert(d.ratio >= 1 && d.topk >= 1);
  const int64_t nI = d.heads, cI = d.head_dim, queries = d.batch * d.seq;
  const float head_dim_scale = static_cast<float>(std::pow(static_cast<double>(cI), -0.5));
  const float heads_scale = static_cast<float>(std::pow(static_cast<double>(nI), -0.5));
  par.ForRange(static_cast<size_t>(queries), NumChunks(par, queries, d.capacity * nI * cI),
               [&](size_t begin, size_t end) {
    std::vector<float> score(d.capacity), w(nI);
    for (size_t qi = begin; qi < end; ++qi) {
      const int64_t b = static_cast<int64_t>(qi) / d.seq, s = static_cast<int64_t>(qi) % d.seq;
      const int64_t visible = (start_pos[b] + s + 1) / d.ratio;
      assert(visible <= d.capacity);
      const T* qt = q + qi * nI * cI;
      const T* kb = keys + b * d.capacity * cI;
      for (int64_t h = 0; h < nI; ++h) w[h] = weights[qi * nI + h] * heads_scale;
      for (int64_t j = 0; j < visible; ++j) {
        float acc = 0.0f;
        for (int64_t h = 0; h < nI; ++h) {
          double dot = 0.0;
          for (int64_t i = 0; i < cI; ++i) {
            dot += static_cast<double>(ToF32(qt[h * cI + i])) * ToF32(kb[j * cI + i]);
          }
          const float relu = std::max(static_cast<float>(dot), 0.0f);
          acc += (relu * head_dim_scale) * w[h];
        }
        score[j] = acc;
      }
      const int64_t k = std::min(d.topk, visible);
      int64_t* out = indices + qi * d.topk;
      SelectTopK(score.data(), visible, k, out);
      std::fill(out + k, out + d.topk, int64_t{-1});
    }
  });
}

void TopKF32(const float* q, const float* weights, const float* keys, const int64_t* start_pos,
             const IndexerDims& dims, int64_t* indices, const Parallel& par) {
  TopK(q, weights, keys, start_pos, dims, indices, par);
}
void TopKBf16(const uint16_t* q, const float* weights, const uint16_t* keys, const int64_t* start_pos,
              const IndexerDims& dims, int64_t* indices, const Parallel& par) {
  TopK(q, weights, keys, start_pos, dims, indices, par);
}

}  // namespace

void SelectTopK(const float* score, int64_t n, int64_t k, int64_t* out) {
  assert(k <= n);
  if (k <= 0) return;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  // a ranks before b: NaN above every number, then the larger score, then the lower index.
  auto before = [score](int64_t a, int64_t b) {
    const float x = score[a], y = score[b];
    const bool xn = std::isnan(x), yn = std::isnan(y);
    if (xn != yn) return xn;
    if (!xn && x != y) return x > y;
    return a < b;
  };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
  std::copy(order.begin(), order.begin() + k, out);
}

const IndexerKernels kIndexer = {&TopKF32, &TopKBf16};

}  // namespace ref
}  // namespace dsv4
