// Scalar reference for kernels/sparse_attention.h: per query token, the list of visible keys is built once (ring
// slots, chunk tokens, entries, in the spec's order) and every head runs a plain two-pass softmax over it with the
// sink in the denominator. Query tokens run in parallel. Baseline ISA; written for clarity, not speed.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "custom_ops/kernels/rope.h"
#include "custom_ops/kernels/sparse_attention.h"
#include "custom_ops/numerics/element.h"

namespace dsv4 {
namespace ref {
namespace {

size_t NumChunks(const Parallel& par, int64_t items, int64_t cost_per_item) {
  const int64_t by_cost = std::max<int64_t>(1, items * std::max<int64_t>(1, cost_per_item) / 16384);
  const int64_t by_threads = 4 * std::max(1, par.num_threads);
  return static_cast<size_t>(std::max<int64_t>(1, std::min({items, by_cost, by_threads})));
}

// Floor modulo (Python's %) for a positive modulus.
int64_t FloorMod(int64_t a, int64_t m) {
  const int64_t r = a % m;
  return r < 0 ? r + m : r;
}

// The keys of query (b, s), in the spec's order.
template <class T>
void CollectKeys(const T* kv, const T* window, const T* entries, const int64_t* indices, const int64_t* start_pos,
                 const SparseAttentionDims& d, int64_t b, int64_t s, std::vector<int64_t>* picked,
                 std::vector<const T*>* keys) {
  keys->clear();
  const int64_t D = d.dim, n_win = d.window, p0 = start_pos[b], p = p0 + s;
  for (int64_t j = 0; j < n_win; ++j) {
    const int64_t rp = p0 - 1 - FloorMod(p0 - 1 - j, n_win);
    if (rp >= 0 && rp > p - n_win && rp <= p) keys->push_back(window + (b * n_win + j) * D);
  }
  for (int64_t t = 0; t < d.seq; ++t) {
    const int64_t kp = p0 + t;
    if (kp <= p && kp > p - n_win) keys->push_back(kv + (b * d.seq + t) * D);
  }
  if (d.ratio <= 0 || entries == nullptr || d.capacity <= 0) return;
  const int64_t visible = std::min((p + 1) / d.ratio, d.capacity);
  const T* eb = entries + b * d.capacity * D;
  if (indices == nullptr) {
    for (int64_t i = 0; i < visible; ++i) keys->push_back(eb + i * D);
    return;
  }
  const int64_t* sel = indices + (b * d.seq + s) * d.topk;
  picked->clear();
  for (int64_t k = 0; k < d.topk; ++k) {
    if (sel[k] >= 0 && sel[k] < visible) picked->push_back(sel[k]);
  }
  std::sort(picked->begin(), picked->end());
  picked->erase(std::unique(picked->begin(), picked->end()), picked->end());
  for (int64_t i : *picked) keys->push_back(eb + i * D);
}

template <class T>
void Attend(const T* q, const T* kv, const T* window, const T* entries, const int64_t* indices, const float* sink,
            const float* inv_freq, const int64_t* start_pos, const SparseAttentionDims& d, float scale, T* o,
            const Parallel& par) {
  assert(d.window >= 1 && 2 * d.half <= d.dim);
  const int64_t H = d.heads, D = d.dim, rd = 2 * d.half, queries = d.batch * d.seq;
  const int64_t max_keys = d.window + d.seq + d.capacity;
  par.ForRange(static_cast<size_t>(queries), NumChunks(par, queries, H * D * std::min<int64_t>(max_keys, 1024)),
               [&](size_t begin, size_t end) {
    std::vector<const T*> keys;
    std::vector<int64_t> picked;
    std::vector<float> logit, acc(D), cos(d.half), sin(d.half);
    for (size_t qi = begin; qi < end; ++qi) {
      const int64_t b = static_cast<int64_t>(qi) / d.seq, s = static_cast<int64_t>(qi) % d.seq;
      CollectKeys(kv, window, entries, indices, start_pos, d, b, s, &picked, &keys);
      const size_t n = keys.size();
      logit.resize(n);
      RopeCosSin(start_pos[b] + s, inv_freq, d.half, cos.data(), sin.data());
      for (int64_t h = 0; h < H; ++h) {
        const T* qh = q + (qi * H + h) * D;
        T* oh = o + (qi * H + h) * D;
        std::fill(acc.begin(), acc.end(), 0.0f);
        if (n > 0) {
          float m = sink[h];
          for (size_t j = 0; j < n; ++j) {
            double dot = 0.0;
            for (int64_t i = 0; i < D; ++i) dot += static_cast<double>(ToF32(qh[i])) * ToF32(keys[j][i]);
            logit[j] = static_cast<float>(dot) * scale;
            m = std::max(m, logit[j]);
          }
          float den = 0.0f;
          for (size_t j = 0; j < n; ++j) {
            logit[j] = std::exp(logit[j] - m);
            den += logit[j];
          }
          den += std::exp(sink[h] - m);
          const float inv_den = 1.0f / den;
          for (size_t j = 0; j < n; ++j) {
            const float pj = RoundTo<T>(logit[j] * inv_den);
            for (int64_t i = 0; i < D; ++i) acc[i] += pj * ToF32(keys[j][i]);
          }
          for (int64_t i = 0; i < D; ++i) acc[i] = RoundTo<T>(acc[i]);
          RopeRotate(acc.data() + D - rd, cos.data(), sin.data(), d.half, true);
        }
        for (int64_t i = 0; i < D; ++i) StoreAs(acc[i], oh + i);
      }
    }
  });
}

void AttendF32(const float* q, const float* kv, const float* window, const float* entries, const int64_t* indices,
               const float* sink, const float* inv_freq, const int64_t* start_pos, const SparseAttentionDims& dims,
               float scale, float* o, const Parallel& par) {
  Attend(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o, par);
}
void AttendBf16(const uint16_t* q, const uint16_t* kv, const uint16_t* window, const uint16_t* entries,
                const int64_t* indices, const float* sink, const float* inv_freq, const int64_t* start_pos,
                const SparseAttentionDims& dims, float scale, uint16_t* o, const Parallel& par) {
  Attend(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o, par);
}

void WindowWrite(const void* kv, const int64_t* start_pos, const SparseAttentionDims& d, size_t elem_bytes,
                 void* window) {
  const size_t row = static_cast<size_t>(d.dim) * elem_bytes;
  const auto* src = static_cast<const unsigned char*>(kv);
  auto* dst = static_cast<unsigned char*>(window);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t t = std::max<int64_t>(0, d.seq - d.window); t < d.seq; ++t) {
      const int64_t slot = (start_pos[b] + t) % d.window;
      std::memcpy(dst + (b * d.window + slot) * row, src + (b * d.seq + t) * row, row);
    }
  }
}

}  // namespace

const SparseAttentionKernels kSparseAttention = {&AttendF32, &AttendBf16, &WindowWrite};

}  // namespace ref
}  // namespace dsv4
