// KV compressor kernel: pools every `ratio` consecutive tokens' kv into one compressed entry (softmax gate per
// channel), streaming through a fixed-size per-row state.
//
// Spec: models/functional.py `compressor_step` (dsv4-architecture.md §5.3). Notation: r = ratio, c = entry width,
// coff = 2 when the blocks overlap (CSA, r = 4) else 1, W = coff*c, off = r if overlapping else 0, rd = 2*half.
// Token t of row b sits at p = start_pos[b] + t and is processed in order:
//   kv_state[off + p%r]    = kv[t]                        (all W channels, float32)
//   score_state[off + p%r] = score[t] + ape[p%r]
//   if (p+1) % r == 0, entry i = p / r is emitted:
//     rows   = non-overlap: state rows [0, r), channels [0, c)
//              overlap:     state rows [0, r) channels [0, c) (the previous block; skipped when i == 0)
//                         + state rows [r, 2r) channels [c, 2c) (block i)
//     w      = softmax over the rows of the scores, per channel;  pooled = sum_rows w * kv
//     e      = RMSNorm(pooled; norm_weight, rms_eps), RoPE on the last rd channels at position i*r
//     entries[i] = e (rounded once to the entries type)
//     overlap: state rows [r, 2r) are copied to rows [0, r) (full width: the previous block of the next entry)
// The kernel updates `entries`, `kv_state` and `score_state` in place and touches only the rows and slots named
// above: O(new tokens) work per call. State rows that hold no token of the current (or, with overlap, previous)
// block keep whatever they held; the spec never reads them (it rewrites them to 0 / -inf, which is equivalent).
// One-shot, chunked and token-by-token calls give bit-identical entries and state.
//
// Shapes (row-major, contiguous; B rows, S tokens, N entry capacity):
//   kv, score [B, S, W] fp32;  ape [r, W] fp32;  norm_weight [c] fp32;  inv_freq [half];  start_pos [B]
//   entries [B, N, c] fp32 or bf16, or FP8 state rows (state_fp8.h: attention or index-key layout, encoded from the
//   float32 entry);  kv_state, score_state [B, coff*r, W] fp32   (in/out)
// Preconditions (validated by the op glue): coff in {1, 2}; r >= 1; 2*half <= c; start_pos >= 0; every emitted
// entry index < N; the state holds the tokens of the current block before start_pos (and, with overlap and
// start_pos >= r, the previous block).
#pragma once

#include <cstdint>

#include "custom_ops/kernels/state_fp8.h"
#include "custom_ops/platform/parallel.h"

namespace dsv4 {

struct CompressorDims {
  int64_t batch, seq, ratio, width, coff, half, capacity;
};

using CompressorStepF32Fn = void (*)(const float* kv, const float* score, const float* ape, const float* norm_weight,
                                     const float* inv_freq, const int64_t* start_pos, const CompressorDims& dims,
                                     float rms_eps, float* entries, float* kv_state, float* score_state,
                                     const Parallel& par);
using CompressorStepBf16Fn = void (*)(const float* kv, const float* score, const float* ape,
                                      const float* norm_weight, const float* inv_freq, const int64_t* start_pos,
                                      const CompressorDims& dims, float rms_eps, uint16_t* entries, float* kv_state,
                                      float* score_state, const Parallel& par);

// FP8 entries: entry i of row b is encoded into entries.data + (b * N + i) * entries.row_bytes.
using CompressorStepFp8Fn = void (*)(const float* kv, const float* score, const float* ape, const float* norm_weight,
                                     const float* inv_freq, const int64_t* start_pos, const CompressorDims& dims,
                                     float rms_eps, const state_fp8::EntryOut& entries, float* kv_state,
                                     float* score_state, const Parallel& par);

// One table per ISA level; every slot is non-null. The suffix names the entries type.
struct CompressorKernels {
  CompressorStepF32Fn step_f32;
  CompressorStepBf16Fn step_bf16;
  CompressorStepFp8Fn step_fp8;
};

namespace ref {
extern const CompressorKernels kCompressor;
}  // namespace ref

namespace avx2 {
extern const CompressorKernels kCompressor;
}  // namespace avx2

namespace avx512 {
extern const CompressorKernels kCompressor;
}  // namespace avx512

}  // namespace dsv4
