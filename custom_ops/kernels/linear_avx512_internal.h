// Internal to the AVX512 level of the Linear kernels (linear_avx512.cc and the linear_*_avx512.cc files it is split
// into; include it from those files only): what one of them defines and another uses, i.e. the functions of the
// level's LinearBlocks table, the rows path's hand-off to the in-register decode path, the constants the table
// needs, and the FP4 value tables (constant data, one copy for the level). They live in dsv4::avx512 with external
// linkage (hidden by the library's visibility preset); the pieces the AMX level also uses (DecodeRowsBf16,
// PrepareTileBlocks, MoeSwiGluRow / MoeAccumulateRow) are declared in linear_blocks.h. The register-level helpers
// the files share are code, not declarations: linear_common_avx512.inc, included inside each file's anonymous
// namespace (private copies, as simd_avx512.inc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "custom_ops/kernels/linear_blocks.h"

namespace dsv4 {
namespace avx512 {

// ---------------------------------------------------------------------------------------------------------------
// FP4 E2M1 value tables (the block decoders are in linear_common_avx512.inc).

// bf16 bits of FP4 value `code` times 2^(e - 127), exact (the product has at most two significant bits, so even
// denormal results are exact; overflow gives infinity, as the fp32 product in the reference does).
constexpr uint16_t Fp4Bf16(int e, int code) {
  // magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as m * 2^p with m in {1, 1.5}
  constexpr int kP[8] = {0, -1, 0, 0, 1, 1, 2, 2};
  constexpr bool kHalf[8] = {false, false, false, true, false, true, false, true};
  const uint16_t sign = (code & 8) ? 0x8000 : 0;
  const int c = code & 7;
  if (c == 0) return sign;
  const int biased = kP[c] + e;  // bf16 exponent field of the result
  if (biased >= 255) return static_cast<uint16_t>(sign | 0x7F80);
  if (biased >= 1) return static_cast<uint16_t>(sign | (biased << 7) | (kHalf[c] ? 0x40 : 0));
  // denormal: mantissa m * 2^(biased + 6) in units of 2^-133
  const int shift = biased + 6;
  const int mant = kHalf[c] ? (3 << shift) >> 1 : (1 << shift);
  return static_cast<uint16_t>(sign | mant);
}

struct Fp4Tables {
  uint16_t value[256][16];  // [scale byte][code]
};

constexpr Fp4Tables MakeFp4Tables() {
  Fp4Tables t{};
  for (int e = 0; e < 256; ++e)
    for (int c = 0; c < 16; ++c) t.value[e][c] = Fp4Bf16(e, c);
  return t;
}

// Constant data (8 KiB, built at compile time): the 16 bf16 values of every scale byte.
inline constexpr Fp4Tables kFp4Tables = MakeFp4Tables();

struct Fp4F32Tables {
  uint32_t bits[256][16];  // fp32 bits of the same values
};

constexpr Fp4F32Tables MakeFp4F32Tables() {
  Fp4F32Tables t{};
  for (int e = 0; e < 256; ++e)
    for (int c = 0; c < 16; ++c) t.bits[e][c] = static_cast<uint32_t>(kFp4Tables.value[e][c]) << 16;
  return t;
}

// 16 KiB; in practice a checkpoint uses a handful of scale bytes, so few rows of it are ever touched.
inline constexpr Fp4F32Tables kFp4F32Tables = MakeFp4F32Tables();

// ---------------------------------------------------------------------------------------------------------------
// Rows path (linear_rows_avx512.cc): LinearBlocks::rows_supported, row_bytes, prepare_rows, rows_scratch, rows.

bool RowsSupported(ActType act, const WeightView& w);
size_t RowBytes(ActType act, const WeightView& w);
void PrepareRows(ActType act, const WeightView& w, const void* x, int64_t ldx, const int64_t* index, int64_t m,
                 void* dst);
size_t RowsScratch(ActType act, const WeightView& w, int64_t m);
void Rows(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
          void* scratch);

// ---------------------------------------------------------------------------------------------------------------
// Decode path (linear_fused_avx512.cc), which Rows hands over to.

// True when rows() decodes in registers (the decode path of FP8 / FP4 weights: at most four activation rows, up to
// eight for FP8 rows with bf16 products and E8M0 scales or fp32 products on the Zen 4 plan, or up to
// WeightView::invariant_rows for FP8 rows whose scale folds).
bool FusedDecode(ActType act, const WeightView& w, int64_t m);
// Scratch bytes RowsFused needs (four decoded weight rows when several groups of activation rows read them; else 0).
size_t FusedScratch(ActType act, const WeightView& w, int64_t m);
// Rows() for FusedDecode(act, w, m): weight rows [n0, n1) against the m prepared activation rows xp (PrepareRows
// layout, rows Pad32(w.cols) elements apart); scratch: FusedScratch(act, w, m) bytes.
void RowsFused(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
               void* scratch);

// ---------------------------------------------------------------------------------------------------------------
// Panels (linear_panels_avx512.cc): the LinearBlocks tiles slot of this level.

constexpr int64_t kPanelRows = 48;   // weight rows decoded per block (groups of 8)
constexpr int64_t kPanelTaskRows = 8;  // Linear tasks split N in multiples of this (LinearBlocks::tile_task_rows)

// Rows -> panels crossover, from single-core GFLOP/s of 512 x 4096 FP4 and bf16 weights (in L2 / L3) at M = 5 ... 96
// on an AVX512-BF16 CPU without AMX: fp32 activations, panels 0.6x the rows path at M = 8, even at 12, 1.2x at 16
// (one full token block), 1.6x from 32; bf16 activations, rows 1.05x ahead at 16, panels 1.2x at 24 and 1.6x
// from 32 (a single VDPBF16PS block wastes more of each broadcast).
constexpr int64_t kPanelMinRowsF32 = 16, kPanelMinRowsBf16 = 24;
// The crossover for bf16 / fp32 weights, which the rows path reads in place (LinearBlocks::tile_min_rows_in_place):
// streamed from DRAM, the rows path (with the block-ahead prefetch of linear_rows_avx512.cc where the plan turns the
// per-row prefetch off) beats the panels up to these counts. AMD EPYC family 0x19 model 0x11, two cores,
// bench-preset head 129280 x 2048 bf16, two builds interleaved, rows / panels: fp32 activations M = 16 / 32 / 64:
// 45.3 / 88.5 / 181 ms against 71.4 / 110.7 / 186; bf16 activations M = 24 / 32 / 64: 35.5 / 46.2 / 87.8 against
// 44.2 / 44.0 / 82.3. Not measured on Intel, where the AMX level (tiles from 16 rows) is the one picked.
constexpr int64_t kPanelMinRowsInPlaceF32 = 64, kPanelMinRowsInPlaceBf16 = 32;

bool PanelsSupported(ActType act, const WeightView& w);
size_t PanelXBytes(ActType act, int64_t m, int64_t kw);
int64_t PanelBlocksFn(ActType act, int64_t m);
void PreparePanels(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                   int64_t block_begin, int64_t block_end, void* dst);
size_t PanelScratch(ActType act, const WeightView& w, int64_t m);
void Panels(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
            void* scratch);

}  // namespace avx512
}  // namespace dsv4
