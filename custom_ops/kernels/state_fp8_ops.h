// SparseAttention, its ring update and the Indexer over FP8 state (layouts in state_fp8.h), for every ISA level, and
// SparseAttention's bf16 products on float32 inputs (compute="bf16"), which gather the same rows.
//
// The readers decode only what the call can read into a per-call scratch of the activation type and run the level's
// ordinary kernel on it, so the accelerated variants need no FP8 code of their own:
//   window   the ring slots visible to the chunk's first query (position rp >= 0 and rp > start_pos - n_win)
//   entries  without indices: entries [0, (start_pos + S) / ratio) of each row (every one is read by the row's last
//            query); with indices: the distinct valid selections of the row's queries, compacted in ascending entry
//            order and the indices renumbered to their rank (rank <= entry index, so visibility is unchanged, and the
//            order of the selections is kept). Work is O(rows read), independent of the entry capacity.
//   keys     indexer keys [0, (start_pos + S) / ratio) of each row (every visible key is scored).
// Decoding is exact, so the results equal the typed kernel run on dequantised float32 / bf16 state.
// WindowWriteFp8 quantises the chunk's last min(S, n_win) kv rows into their ring slots (rope = 2 * dims.half).
//
// Preconditions: as the typed kernels (validated by the op glue), plus the state row sizes of state_fp8.h.
#pragma once

#include <cstdint>

#include "custom_ops/kernels/indexer.h"
#include "custom_ops/kernels/sparse_attention.h"
#include "custom_ops/platform/parallel.h"

namespace dsv4 {
namespace state_fp8 {

// q, kv, o: float32 or bf16 (bf16 = true); window [B, n_win, EntryBytes(D, 2*half)], entries [B, N, EntryBytes] or
// nullptr; indices [B, S, k] or nullptr.
void Attend(const SparseAttentionKernels& k, bool bf16, const void* q, const void* kv, const uint8_t* window,
            const uint8_t* entries, const int64_t* indices, const float* sink, const float* inv_freq,
            const int64_t* start_pos, const SparseAttentionDims& d, float scale, void* o, const Parallel& par);

// compute="bf16" for float32 q / kv / o (the op attribute): the bf16 kernel on q and kv rounded to bf16 and on the
// state rows the call reads (the list above) rounded to bf16 (float32 state) or decoded to bf16 (FP8 state,
// fp8_state = true: window / entries as in Attend), o widened back. The float32 state is not written here.
void AttendBf16Products(const SparseAttentionKernels& k, const float* q, const float* kv, const void* window,
                        const void* entries, bool fp8_state, const int64_t* indices, const float* sink,
                        const float* inv_freq, const int64_t* start_pos, const SparseAttentionDims& d, float scale,
                        float* o, const Parallel& par);

// kv [B, S, D] (float32 or bf16) -> window slots (start_pos[b] + t) % n_win, in place.
void WindowWrite(const void* kv, bool bf16, const int64_t* start_pos, const SparseAttentionDims& d, uint8_t* window);

// q float32 or bf16 [B, S, nI, cI]; keys [B, N, cI + 4].
void IndexerTopk(const IndexerKernels& k, bool bf16, const void* q, const float* weights, const uint8_t* keys,
                 const int64_t* start_pos, const IndexerDims& d, int64_t* indices, const Parallel& par);

}  // namespace state_fp8
}  // namespace dsv4
