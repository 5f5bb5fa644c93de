// The key list of one SparseAttention query, shared by the accelerated variants (kernels/sparse_attention.h has the
// rules). Built at the baseline: ISA files call it, it never calls into them.
//
// CollectKeyRows writes, for query (b, s), the address of every key row it sees: the valid ring slots, then the
// chunk's visible tokens, then the entries (all visible ones, or the distinct visible ones listed in `indices` in
// their first-listed order). The order only changes the floating-point summation order, never the set.
// MaxKeyRows bounds the count for any query of the call, so callers can size their scratch once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "custom_ops/kernels/sparse_attention.h"

namespace dsv4 {
namespace attn_keys {

// Floor modulo (Python's %) for a positive modulus: the ring slot of a window position.
inline int64_t FloorMod(int64_t a, int64_t m) {
  const int64_t r = a % m;
  return r < 0 ? r + m : r;
}

// Upper bound of CollectKeyRows' count for every query of a call: the window spans n_win positions, plus the
// entries (at most min(k, N) with indices, else N).
int64_t MaxKeyRows(const SparseAttentionDims& d, bool has_entries, bool has_indices);

// Bytes of the `mark` scratch CollectKeyRows needs (0 when there are no indices). It must be zero on the first
// call; CollectKeyRows leaves it zero again.
size_t MarkBytes(const SparseAttentionDims& d, bool has_indices);

// Fills rows[0, count) and returns count. elem_bytes: 4 (fp32) or 2 (bf16); kv [B, S, D], window [B, n_win, D],
// entries [B, N, D] or nullptr, indices [B, S, k] or nullptr.
int64_t CollectKeyRows(const void* kv, const void* window, const void* entries, const int64_t* indices,
                       const int64_t* start_pos, const SparseAttentionDims& d, size_t elem_bytes, int64_t b, int64_t s,
                       const void** rows, uint8_t* mark);

}  // namespace attn_keys
}  // namespace dsv4
