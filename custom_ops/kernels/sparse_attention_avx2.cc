// AVX2 SparseAttention (sparse_attention.h): fp32 products on 8-lane vectors for fp32 and bf16 inputs (bf16 keys are
// widened once per key block) and for fp32 inputs multiplied as bf16 (compute="bf16": query and keys rounded). The
// algorithm is in sparse_attention_simd.inc; this file supplies the vector layer. Must match sparse_attention_ref.cc
// within fp32 rounding; the bf16 rounding points are the spec's. Needs AVX2 + FMA.
#include "custom_ops/kernels/isa_prelude.h"

#include <cstdlib>
#include <new>

#include "custom_ops/kernels/sparse_attention.h"
#include "custom_ops/kernels/sparse_attention_keys.h"
#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace avx2 {
namespace {

constexpr int64_t kKeyBlock = 40;
constexpr int kQkSlabs = 2;
constexpr int kQkKeys = 5;
constexpr int kQkKeys1 = 8;
constexpr int kPvHeads = 4;
constexpr int kPvVecs = 2;

#include "custom_ops/kernels/simd_avx2.inc"

#include "custom_ops/kernels/sparse_attention_simd.inc"

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

}  // namespace

const SparseAttentionKernels kSparseAttention = {&AttendF32, &AttendBf16, &WindowWrite, &AttendF32AsBf16};

}  // namespace avx2
}  // namespace dsv4
