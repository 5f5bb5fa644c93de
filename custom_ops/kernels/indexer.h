// Lightning-indexer kernel: scores the visible compressed entries for every query token and returns the top-k.
//
// Spec: models/functional.py `indexer_topk` (dsv4-architecture.md §5.4). For the query token (b, s) at position
// p = start_pos[b] + s, entry j is visible iff j < visible = (p + 1) / ratio, and
//   score[j] = sum_h (relu(q[h] . keys[j]) * cI^-0.5) * (weights[h] * nI^-0.5)        (float32; the dot in double)
// indices[0, k) = the k = min(index_topk, visible) visible entries in descending score order, equal scores by
// lowest entry index (+0 == -0; NaN ranks above every number, as torch.sort does); indices[k, index_topk) = -1.
// Top-k is a partial selection; its order is the spec's stable sort order exactly.
//
// Shapes (row-major, contiguous): q [B, S, nI, cI], keys [B, N, cI] (fp32 or bf16, same type), weights [B, S, nI]
// fp32, start_pos [B] -> indices [B, S, index_topk] int64.
// Preconditions (validated by the op glue): ratio >= 1; index_topk >= 1; start_pos >= 0; visible <= N for every
// query.
#pragma once

#include <cstdint>

#include "custom_ops/platform/parallel.h"

namespace dsv4 {

struct IndexerDims {
  int64_t batch, seq, heads, head_dim, capacity, ratio, topk;
};

using IndexerTopkF32Fn = void (*)(const float* q, const float* weights, const float* keys, const int64_t* start_pos,
                                  const IndexerDims& dims, int64_t* indices, const Parallel& par);
using IndexerTopkBf16Fn = void (*)(const uint16_t* q, const float* weights, const uint16_t* keys,
                                   const int64_t* start_pos, const IndexerDims& dims, int64_t* indices,
                                   const Parallel& par);

// One table per ISA level; every slot is non-null. The suffix names the type of q and keys.
struct IndexerKernels {
  IndexerTopkF32Fn topk_f32;
  IndexerTopkBf16Fn topk_bf16;
};

namespace ref {
extern const IndexerKernels kIndexer;

// Orders the candidates [0, n) of `score` and writes the first k of that order to out[0, k): descending score,
// equal scores by lower index, NaN first. Shared by the variants so that the selection rule lives in one place.
void SelectTopK(const float* score, int64_t n, int64_t k, int64_t* out);
}  // namespace ref

namespace avx2 {
extern const IndexerKernels kIndexer;
}  // namespace avx2

namespace avx512 {
extern const IndexerKernels kIndexer;
}  // namespace avx512

namespace amx {
extern const IndexerKernels kIndexer;
}  // namespace amx

namespace amx_emu {
extern const IndexerKernels kIndexer;
}  // namespace amx_emu

}  // namespace dsv4
