// AVX512 (F/BW/VL/DQ + AVX512-BF16) blocks of the Linear and MoE expert kernels (linear_blocks.h): the rows path
// for every weight format and both activation types, the panels (prefill), plus the vectorised weight decoding and
// activation layout that the AMX tiles (linear_amx.cc) use. Must match linear_ref.cc up to summation order: per
// output, fp32 accumulation in 16 lanes (bf16 activations: VDPBF16PS pairs) over K in 32-column steps, then one
// fixed horizontal sum; weights decode to exactly the reference values (bf16 activations: the same values rounded to
// bf16 by VCVTNE2PS2BF16, which also flushes denormal weights to zero, as VDPBF16PS does with any denormal input).
//
// This file holds the level's LinearBlocks table and the MoE element-wise steps; the rest is split by job:
//   linear_rows_avx512.cc     the rows path (K in the lanes, four weight rows x up to four activation rows), the
//                             decoding of weight rows into scratch (DecodeRowsBf16, also used by panels and tiles)
//   linear_fused_avx512.cc    the decode path: FP8 / FP4 rows decoded in registers for at most four activation rows
//   linear_panels_avx512.cc   the panels (tokens in the lanes) and the AMX tiles' activation layout (PrepareTileBlocks)
//   linear_common_avx512.inc  code they share: vector basics and register-level FP8 / FP4 decoding (private copies)
//   linear_avx512_internal.h  declarations across those files, the table's constants, the FP4 value tables
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_avx512_internal.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"
#include "custom_ops/kernels/moe_act_simd.inc"

}  // namespace

void MoeSwiGluRow(ActType act, float* g, const float* u, int64_t n, float limit, float scale, void* dst) {
  MoeSwiGlu(act, g, u, n, limit, scale, dst);
}
void MoeAccumulateRow(ActType act, const float* src, int64_t n, float* dst) { MoeAccumulate(act, src, n, dst); }

extern const LinearBlocks kLinearBlocks = {
    "avx512",      RowsSupported, RowBytes,     PrepareRows, RowsScratch, Rows, PanelsSupported, PanelXBytes,
    PanelBlocksFn, PreparePanels, PanelScratch, Panels,      {kPanelMinRowsF32, kPanelMinRowsBf16}, kPanelRows,
    MoeSwiGluRow,  MoeAccumulateRow, {kPanelMinRowsInPlaceF32, kPanelMinRowsInPlaceBf16}, kPanelTaskRows,
};

}  // namespace avx512
}  // namespace dsv4
