// Internal to the AVX2 level of the Linear kernels (linear_avx2.cc and the linear_*_avx2.cc files it is split into;
// include it from those files only): what one of them defines and another uses, i.e. the functions of the level's
// LinearBlocks table, the decoding of weight rows into scratch that the rows path and the panels share, the rows
// path's hand-off to the in-register decode paths, and the constants the table needs. They live in dsv4::avx2 with
// external linkage (hidden by the library's visibility preset). The register-level helpers the files share are
// code, not declarations: linear_common_avx2.inc, included inside each file's anonymous namespace (private copies,
// as simd_avx2.inc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "custom_ops/kernels/linear_blocks.h"

namespace dsv4 {
namespace avx2 {

// ---------------------------------------------------------------------------------------------------------------
// Rows path (linear_rows_avx2.cc): LinearBlocks::rows_supported, row_bytes, prepare_rows, rows_scratch, rows.

bool RowsSupported(ActType act, const WeightView& w);
size_t RowBytes(ActType act, const WeightView& w);
void PrepareRows(ActType act, const WeightView& w, const void* x, int64_t ldx, const int64_t* index, int64_t m,
                 void* dst);
size_t RowsScratch(ActType act, const WeightView& w, int64_t m);
void Rows(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
          void* scratch);
// Weight rows [n0, n0 + rows) decoded to fp32 into dst (kp columns, zero tail; rows kp floats apart; rows past
// w.rows are zeros), in the column order of the rows path's activations (EvenOdd: [8 even, 8 odd] per 16 columns for
// FP4, column order otherwise) and, for bf16 activations, rounded to bf16 where the format is not exact in bf16.
void DecodeRows(ActType act, const WeightView& w, int64_t n0, int64_t rows, int64_t kp, float* dst);

// ---------------------------------------------------------------------------------------------------------------
// Decode paths (linear_fused_avx2.cc), which Rows hands over to; neither needs scratch.

// FP8 weights against one activation row, or up to WeightView::invariant_rows rows (batch invariance: each row as
// it sums alone); not for fp32 scales under bf16 activations.
bool FusedFp8(ActType act, const WeightView& w, int64_t m);
// Rows() for FusedFp8: weight rows [n0, n1) against the m prepared activation rows x (xs floats apart).
void RowsFp8Fused(const float* x, int64_t xs, int64_t m, const WeightView& w, int64_t n0, int64_t n1,
                  const MatOut& out);
// FP4 weights against one to four activation rows.
bool FusedFp4(const WeightView& w, int64_t m);
// Rows() for FusedFp4: weight rows [n0, n1) against the m prepared activation rows x (xs floats apart).
void RowsFp4Fused(const float* x, int64_t xs, int64_t m, const WeightView& w, int64_t n0, int64_t n1,
                  const MatOut& out);

// ---------------------------------------------------------------------------------------------------------------
// Panels (linear_panels_avx2.cc): the LinearBlocks tiles slot of this level.

constexpr int64_t kPanelGroup = 8;  // weight rows decoded at a time (the task unit)

// Rows -> panels crossover, from single-core GFLOP/s of 512 x 4096 FP4 and bf16 weights (in L2 / L3), either
// activation type: the rows path is ahead up to 12 rows (1.1-1.3x), panels lead from 16 (FP4 1.15x, bf16 even) and
// reach 1.2x (bf16) - 1.37x (FP4) at 48, 0.87 of the ymm FMA peak.
constexpr int64_t kPanelMinRowsF32 = 16, kPanelMinRowsBf16 = 16;

bool PanelsSupported(ActType act, const WeightView& w);
size_t PanelXBytes(ActType act, int64_t m, int64_t kw);
int64_t PanelBlocksFn(ActType act, int64_t m);
void PreparePanels(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                   int64_t block_begin, int64_t block_end, void* dst);
size_t PanelScratch(ActType act, const WeightView& w, int64_t m);
void Panels(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
            void* scratch);

}  // namespace avx2
}  // namespace dsv4
