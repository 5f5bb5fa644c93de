// Sparse shared-KV attention kernel: every query head attends to its sliding window of raw kv plus the selected
// compressed entries, with a per-head attention sink, then the output's rope channels are rotated back.
//
// Spec: models/functional.py `sparse_attention` (dsv4-architecture.md §5.1-§5.2). Query token (b, s) sits at
// p = start_pos[b] + s; P0 = start_pos[b]. Its keys (each key is also the value), in this order:
//   1. ring slot j in [0, n_win) holding position rp = P0 - 1 - ((P0 - 1 - j) mod n_win) (the newest position
//      before P0 that maps to slot j), if rp >= 0 and p - n_win < rp                       (rp < P0 <= p always)
//   2. chunk token t in [0, S) at position P0 + t, if p - n_win < P0 + t <= p
//   3. (ratio > 0 and entries given) entry i with i < (p + 1) / ratio; with indices given only the distinct
//      i >= 0 listed in indices[b, s, :] (-1 = unused slot; duplicates count once)
// Per head h (float32; dots in double, rounded to float32):
//   l_j = (q[h] . key_j) * scale;  m = max(sink[h], max_j l_j);  den = sum_j exp(l_j - m) + exp(sink[h] - m)
//   p_j = RoundTo<T>(exp(l_j - m) * (1 / den));  o = RoundTo<T>(sum_j p_j * key_j)
//   o[D-rd:] = RoPE(o[D-rd:], p, inverse)  (rounded to T)
// A query with no key outputs 0 (the sink absorbs all the mass).
// WindowWrite then stores the chunk's last min(S, n_win) kv rows at slot (P0 + t) % n_win; the attention reads the
// window before that (call it after Attend when the window is updated in place).
//
// Shapes (row-major, contiguous; T = fp32 or bf16 for q, kv, window, entries, o):
//   q [B, S, H, D], kv [B, S, D], window [B, n_win, D], entries [B, N, D] or nullptr, indices [B, S, k] int64 or
//   nullptr, sink [H] fp32, inv_freq [half], start_pos [B] -> o [B, S, H, D]
// Preconditions (validated by the op glue): n_win >= 1; 2*half <= D; start_pos >= 0; every index in [-1, N);
// without indices, (p + 1) / ratio <= N for every query.
#pragma once

#include <cstddef>
#include <cstdint>

#include "custom_ops/platform/parallel.h"

namespace dsv4 {

struct SparseAttentionDims {
  int64_t batch, seq, heads, dim, window, half;
  int64_t ratio;     // 0 = window only
  int64_t capacity;  // N; 0 when entries == nullptr
  int64_t topk;      // k; 0 when indices == nullptr
};

using SparseAttendF32Fn = void (*)(const float* q, const float* kv, const float* window, const float* entries,
                                   const int64_t* indices, const float* sink, const float* inv_freq,
                                   const int64_t* start_pos, const SparseAttentionDims& dims, float scale, float* o,
                                   const Parallel& par);
using SparseAttendBf16Fn = void (*)(const uint16_t* q, const uint16_t* kv, const uint16_t* window,
                                    const uint16_t* entries, const int64_t* indices, const float* sink,
                                    const float* inv_freq, const int64_t* start_pos, const SparseAttentionDims& dims,
                                    float scale, uint16_t* o, const Parallel& par);
// Ring update; element-type agnostic (elem_bytes = 4 or 2). kv [B, S, D] -> window [B, n_win, D] (in place).
using WindowWriteFn = void (*)(const void* kv, const int64_t* start_pos, const SparseAttentionDims& dims,
                               size_t elem_bytes, void* window);
// fp32 inputs and output with bf16 products (the op's compute="bf16"): exactly attend_bf16 on q, kv, window and
// entries rounded to bf16 (round to nearest even), its output widened.
using SparseAttendF32Bf16Fn = void (*)(const float* q, const float* kv, const float* window, const float* entries,
                                       const int64_t* indices, const float* sink, const float* inv_freq,
                                       const int64_t* start_pos, const SparseAttentionDims& dims, float scale,
                                       float* o, const Parallel& par);

// One table per ISA level; every slot is non-null except attend_f32_bf16 (nullptr in the reference: its callers
// round the rows read and call attend_bf16, state_fp8_ops.h AttendBf16Products).
struct SparseAttentionKernels {
  SparseAttendF32Fn attend_f32;
  SparseAttendBf16Fn attend_bf16;
  WindowWriteFn window_write;
  SparseAttendF32Bf16Fn attend_f32_bf16 = nullptr;
};

namespace ref {
extern const SparseAttentionKernels kSparseAttention;
}  // namespace ref

namespace avx2 {
extern const SparseAttentionKernels kSparseAttention;
}  // namespace avx2

namespace avx512 {
extern const SparseAttentionKernels kSparseAttention;
// The same, with bf16 inputs (D a multiple of 32) multiplied on VDPBF16PS instead of widened to fp32 FMAs: chosen
// per CPU (FamilyPlan::bf16_dot, kernel_tables.h).
extern const SparseAttentionKernels kSparseAttentionBf16Dot;
}  // namespace avx512

namespace amx {
extern const SparseAttentionKernels kSparseAttention;
}  // namespace amx

namespace amx_emu {
extern const SparseAttentionKernels kSparseAttention;
}  // namespace amx_emu

}  // namespace dsv4
