// Key lists of SparseAttention queries (sparse_attention_keys.h). Baseline ISA.
#include "custom_ops/kernels/sparse_attention_keys.h"

#include <algorithm>

namespace dsv4 {
namespace attn_keys {

int64_t MaxKeyRows(const SparseAttentionDims& d, bool has_entries, bool has_indices) {
  int64_t n = d.window;
  if (d.ratio > 0 && has_entries && d.capacity > 0) n += has_indices ? std::min(d.topk, d.capacity) : d.capacity;
  return n;
}

size_t MarkBytes(const SparseAttentionDims& d, bool has_indices) {
  return has_indices && d.ratio > 0 ? static_cast<size_t>(d.capacity) : 0;
}

int64_t CollectKeyRows(const void* kv, const void* window, const void* entries, const int64_t* indices,
                       const int64_t* start_pos, const SparseAttentionDims& d, size_t elem_bytes, int64_t b, int64_t s,
                       const void** rows, uint8_t* mark) {
  const size_t row_bytes = static_cast<size_t>(d.dim) * elem_bytes;
  const auto* win = static_cast<const unsigned char*>(window);
  const auto* chunk = static_cast<const unsigned char*>(kv);
  const int64_t n_win = d.window, p0 = start_pos[b], p = p0 + s;
  int64_t n = 0;
  for (int64_t j = 0; j < n_win; ++j) {
    const int64_t rp = p0 - 1 - FloorMod(p0 - 1 - j, n_win);
    if (rp >= 0 && rp > p - n_win) rows[n++] = win + static_cast<size_t>(b * n_win + j) * row_bytes;
  }
  for (int64_t t = std::max<int64_t>(0, s - n_win + 1); t <= s; ++t) {
    rows[n++] = chunk + static_cast<size_t>(b * d.seq + t) * row_bytes;
  }
  if (d.ratio <= 0 || entries == nullptr || d.capacity <= 0) return n;
  const int64_t visible = std::min((p + 1) / d.ratio, d.capacity);
  const auto* eb = static_cast<const unsigned char*>(entries) + static_cast<size_t>(b * d.capacity) * row_bytes;
  if (indices == nullptr) {
    for (int64_t i = 0; i < visible; ++i) rows[n++] = eb + static_cast<size_t>(i) * row_bytes;
    return n;
  }
  const int64_t* sel = indices + (b * d.seq + s) * d.topk;
  for (int64_t k = 0; k < d.topk; ++k) {
    const int64_t i = sel[k];
    if (i < 0 || i >= visible || mark[i]) continue;
    mark[i] = 1;
    rows[n++] = eb + static_cast<size_t>(i) * row_bytes;
  }
  for (int64_t k = 0; k < d.topk; ++k) {
    if (sel[k] >= 0 && sel[k] < visible) mark[sel[k]] = 0;
  }
  return n;
}

}  // namespace attn_keys
}  // namespace dsv4
