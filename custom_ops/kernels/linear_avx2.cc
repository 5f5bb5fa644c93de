// AVX2 + FMA (+F16C) blocks of the Linear and MoE expert kernels (linear_blocks.h): the rows path and the panels
// (prefill), all in fp32. Must match linear_ref.cc up to summation order (8 fp32 lanes, one fixed horizontal sum per
// output on the rows path); the weights decode to exactly the reference values, bf16 activations are widened exactly
// and meet the weights rounded to bf16 as the reference does (nearest-even, denormals kept).
//
// This file holds the level's LinearBlocks table and the MoE element-wise steps; the rest is split by job:
//   linear_rows_avx2.cc     the rows path (K in the lanes) and the decoding of weight rows into fp32 scratch
//   linear_fused_avx2.cc    the decode paths: FP8 (one activation row) / FP4 (up to four) decoded in registers
//   linear_panels_avx2.cc   the panels (tokens in the lanes)
//   linear_common_avx2.inc  code they share: row kinds, padding, horizontal sum, FP8 conversion (private copies)
//   linear_avx2_internal.h  declarations across those files and the table's constants
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_avx2_internal.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"
#include "custom_ops/kernels/moe_act_simd.inc"

}  // namespace

extern const LinearBlocks kLinearBlocks = {
    "avx2",        RowsSupported, RowBytes,     PrepareRows, RowsScratch, Rows, PanelsSupported, PanelXBytes,
    PanelBlocksFn, PreparePanels, PanelScratch, Panels,      {kPanelMinRowsF32, kPanelMinRowsBf16}, kPanelGroup,
    MoeSwiGlu,     MoeAccumulate,
};

}  // namespace avx2
}  // namespace dsv4
