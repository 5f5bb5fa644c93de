// MoE expert kernels: the routed experts (and, in dense mode, the shared expert) of a DeepSeek-V4 MoE layer, for
// dense (fp32 / bf16), FP8 E4M3 block-scaled and packed FP4 E2M1 expert weights (models/functional.py
// `expert_ffn`, `moe_ffn`; dsv4-architecture.md §6, §8).
//
// For token t and slot j in [0, k), with expert e = indices[t][j] and routing weight w = weights[t][j]:
//   h1 = R(W1_e x_t), h3 = R(W3_e x_t)                 [I]   fp32 sums (x_t . row) as in linear.h, then R
//   a  = R(silu(min(h1, L)) * clamp(h3, -L, L) * w)     [I]   fp32 math; no clamp at all when L <= 0 (see below)
//   y_t += R(W2_e a)                                     [d]   fp32 sum per output, then R, added to y_t in fp32
// where R rounds to the activation type and back (identity for fp32; bf16: nearest-even) -- exactly the stages at
// which functional.expert_ffn / moe_ffn (and DeepSeek's reference, whose Linear outputs are bf16) round. y_t starts
// at +0; experts are added in ascending expert index (slots of one expert in ascending j), and y_t is rounded once to
// the activation type at the end. The weights are decoded and (for bf16 activations) rounded to bf16 exactly as in
// linear.h. Dense mode (weights == indices == nullptr): one expert (E == 1), every token through expert 0 with
// weight 1 (the multiply is skipped; it would be exact) -- the shared expert.
//
// Clamp: L = swiglu_limit. L > 0 clamps gate from above and up on both sides (DeepSeek's inference/model.py
// `if self.swiglu_limit > 0`, HF DeepseekV4Experts, functional.swiglu all agree for L > 0); L <= 0 disables the
// clamp, as DeepSeek's reference does (functional.swiglu would clamp to [L, L] instead). NaN propagates through
// the clamp. silu(g) = g / (1 + exp(-g)).
//
// compute="int8" (FP4 weights, bf16 activations; slot bf16_fp4_int8): as above with bf16 activations, but each
// matmul operand row (x_t for W1 / W3, a for W2) is first quantised to int8 per 32-column block
// (numerics/int8_blocks.h: codes q, scale s), and each product of a block is an integer sum:
//   (W x)_n = sum_b s_b * 2^(e_nb - 127) / 2 * sum_{k in b} q_k * (2 e2m1(code_nk))      [exact int32 inner sums]
// The fp32 combination of the blocks may be reassociated by the levels (as the sums above). This is what lets
// AVX512-VNNI run 64 products per VPDPBUSD on FP4 codes widened by one byte shuffle, as llama.cpp's
// MXFP4 x Q8_0 dot products do; the reference computes it block by block.
//
// Work split: tokens are grouped by expert with a counting sort, so each used expert's weights are read once per
// call (per token chunk, see kMoeActivationBudget). Phase 1 runs (expert, block of I rows) items in parallel and
// writes a for every (token, slot) assignment; phase 2 runs blocks of the d output rows of W2 in parallel, each
// looping over the used experts in ascending order, so the result does not depend on the thread count.
//
// Shapes (row-major, contiguous; T tokens, d = dim, I = intermediate, E experts):
//   x [T, d] fp32 or bf16 (uint16_t bits), weights [T, k] fp32, indices [T, k] int64, y [T, d] same type as x.
//   w1, w3: [I, d] views of expert 0 of stacked [E, I, d] tensors; w2: [d, I] view of expert 0 of [E, d, I]
//   (WeightSlice steps to expert e; data and scales stacked alike). All three share one weight format.
// Preconditions (asserted, not validated): every index in [0, E); both routing pointers null or both non-null;
// dense mode has E == 1; FP4 d and I multiples of 32; E8M0 scales of used experts are not 0xFF; y does not alias
// an input. Scratch is allocated before the parallel regions (re-entrant, no state).
#pragma once

#include <cstddef>
#include <cstdint>

#include "custom_ops/kernels/linear.h"
#include "custom_ops/platform/parallel.h"

namespace dsv4 {

// Bytes of fp32 intermediate activations held at once; tokens are processed in chunks that fit.
constexpr size_t kMoeActivationBudget = size_t{64} << 20;

struct ExpertWeights {
  WeightView w1;  // [I, d] of expert 0
  WeightView w2;  // [d, I] of expert 0
  WeightView w3;  // [I, d] of expert 0
  int64_t num_experts = 0;
};

using MoeExpertsF32Fn = void (*)(const float* x, int64_t tokens, const float* weights, const int64_t* indices,
                                 int64_t top_k, const ExpertWeights& w, float swiglu_limit, float* y,
                                 const Parallel& par);
using MoeExpertsBf16Fn = void (*)(const uint16_t* x, int64_t tokens, const float* weights, const int64_t* indices,
                                  int64_t top_k, const ExpertWeights& w, float swiglu_limit, uint16_t* y,
                                  const Parallel& par);

// One table per ISA level; every slot is non-null (an ISA that does not accelerate a slot points it at ref).
// Slots by activation type and weight family, as in LinearKernels.
struct MoeExpertsKernels {
  MoeExpertsF32Fn f32_dense;
  MoeExpertsF32Fn f32_fp8;
  MoeExpertsF32Fn f32_fp4;
  MoeExpertsBf16Fn bf16_dense;
  MoeExpertsBf16Fn bf16_fp8;
  MoeExpertsBf16Fn bf16_fp4;
  MoeExpertsBf16Fn bf16_fp4_int8;  // compute="int8"
};

namespace ref {
extern const MoeExpertsKernels kMoeExperts;

// The clamped SwiGLU of one element (see above), fp32.
float SwiGlu(float gate, float up, float limit);
}  // namespace ref

}  // namespace dsv4
