// Building blocks of the accelerated Linear and MoE expert kernels (linear.h, moe_experts.h), and the drivers that
// run them.
//
// Every accelerated level computes what the reference does (linear.h): out[i][j] = sum_k X_i[k] W[j][k] with W
// decoded exactly (and, for bf16 activations, rounded to bf16). What differs is how W reaches the inner loop.
//
// Weight layout. No level repacks a weight: all work on the checkpoint layout [N, Kw] (row-major), which is
// already what both inner loops want, so nothing is produced at kernel creation and a session holds each weight
// once (ONNX Runtime's copy, memory-mapped when the model keeps its weights as external data) plus per-call
// scratch. Packing was considered and does not pay here: the decode path streams each weight byte once per token,
// so a VNNI copy would double resident memory to save nothing (row-dot products need no interleaving), and the
// tiles take the weight as their A operand, whose layout *is* row-major rows, decoding FP8/FP4 on the fly at a
// cost that prefill amortises over the activation rows.
//
//   rows   (every level; the decode path, and every M where there are no tiles) four weight rows against up to
//          four activation rows at a time, K in the vector lanes, one fp32 accumulator per (row, activation row)
//          folded horizontally at the end. bf16 and fp32 weights are read in place. FP8 / FP4 rows are decoded in
//          registers inside the loop for up to four activation rows (FP8 moves half and FP4 a quarter of the
//          bytes of bf16 from memory, and nothing is written back), and decoded into a small scratch once per
//          block of weight rows for more.
//   panels (AVX512, in the tiles slot) the activations are prepared K-major in 16-token blocks and the weight rows
//          decoded per 48 x 512 block and broadcast, so each FMA (fp32 activations) or VDPBF16PS (bf16, column
//          pairs) has 16 tokens in its lanes; see linear_panels_avx512.cc.
//   tiles  (AMX) the weight is the A operand of TDPBF16PS: a 16 x 32 bf16 A tile is 16 weight rows x 32 columns,
//          i.e. [N, Kw] read with the row stride: in place for bf16 weights, from a decoded bf16 block for the
//          rest (128 rows x up to 4096 columns decoded once and reused for every 32 activation rows; pieces of
//          32 x 256 that stay in L1 when there are at most 32). The activations are the B operand, transposed
//          into VNNI pairs once per call ([16 column pairs][16 tokens][2] per tile). C tiles come out as
//          [16 weight rows][16 tokens] and are transposed on the way out. fp32 activations are split
//          x = hi + mid + lo into three bf16 parts (24 significand bits in all, so every product is exact) and
//          take three tile products (fewer when at most kFoldRows rows let the three parts share the B tiles' 16
//          token columns: TileLayout). This needs the weight to be exact in bf16: true for bf16, FP4 and
//          E8M0-scaled FP8 weights; fp32 weights and FP8 with fp32 scales under fp32 activations stay on the rows
//          path.
//
// The activation operand is prepared once per call (per group, per expert) into the layout the level's inner loop
// reads and padded with zeros to a multiple of 32 columns; weight tails are read with masks or decoded into
// zero-padded scratch, so any N and Kw work.
//
// Drivers (linear_fast.cc, moe_experts_fast.cc, baseline ISA) allocate all scratch before their parallel regions
// and split work over `par`; a level's functions run inside one task, allocate nothing and are re-entrant. Results
// do not depend on the number of threads: each output is computed by one fixed sequence of operations whatever
// the task split (they may depend on M, which picks rows or tiles). A level's rows path falls back to the
// reference for what it does not take (FP8 scale blocks that are not a multiple of 32 columns).
#pragma once

#include <cstddef>
#include <cstdint>

#include "custom_ops/kernels/linear.h"
#include "custom_ops/kernels/moe_experts.h"
#include "custom_ops/platform/parallel.h"

namespace dsv4 {

enum class ActType : int { kF32 = 0, kBf16 = 1 };

// Where a matmul writes: out[i * ld + j] as fp32, or rounded to bf16 (nearest-even) when bf16.
struct MatOut {
  void* data = nullptr;
  int64_t ld = 0;
  bool bf16 = false;
};

// One level's functions. `w` is always the whole [N, Kw] matrix (FP8 scales are indexed by the global row), and
// [n0, n1) the weight rows a call computes; out column j - n0 holds weight row j.
struct LinearBlocks {
  const char* name;

  // --- rows path (always present) ---
  // False when the rows path cannot take this weight (the driver then runs the reference).
  bool (*rows_supported)(ActType act, const WeightView& w);
  // Bytes of one prepared activation row for this weight (columns padded to a multiple of 32).
  size_t (*row_bytes)(ActType act, const WeightView& w);
  // dst row i = activation row index[i] (i when index is null) of x, columns [0, w.cols); x rows are ldx elements
  // apart. fp32 (act kF32) or bf16 bits (kBf16).
  void (*prepare_rows)(ActType act, const WeightView& w, const void* x, int64_t ldx, const int64_t* index,
                       int64_t m, void* dst);
  // Scratch bytes one rows() call needs for m activation rows.
  size_t (*rows_scratch)(ActType act, const WeightView& w, int64_t m);
  void (*rows)(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1,
               const MatOut& out, void* scratch);

  // --- tiles path: AMX tiles, or the AVX512 panels (null where the level has none) ---
  bool (*tiles_supported)(ActType act, const WeightView& w);
  // Bytes of the prepared activations for m rows of kw columns.
  size_t (*tile_x_bytes)(ActType act, int64_t m, int64_t kw);
  // Number of independent 16-row blocks the prepared activations of m rows consist of.
  int64_t (*tile_blocks)(ActType act, int64_t m);
  // Prepares blocks [block_begin, block_end) of tile_blocks(act, m) (index / ldx as in prepare_rows) into dst (the
  // whole prepared buffer); blocks are independent, so the driver splits them over threads.
  void (*prepare_tiles)(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                        int64_t block_begin, int64_t block_end, void* dst);
  size_t (*tiles_scratch)(ActType act, const WeightView& w, int64_t m);
  void (*tiles)(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1,
                const MatOut& out, void* scratch);
  // The tiles path runs when a call has at least this many activation rows (per activation type).
  int64_t tile_min_rows[2];
  // Weight rows per tiles() block; tasks split N in multiples of it.
  int64_t tile_rows;

  // --- MoE element-wise steps (null: the driver's scalar loops) ---
  // dst[i] = round(SwiGlu(round(g[i]), round(u[i]), limit) * scale) for i < n, in the activation type (fp32, or
  // bf16 bits), with round the activation type's rounding (moe_experts.h); g is overwritten.
  void (*moe_swiglu)(ActType act, float* g, const float* u, int64_t n, float limit, float scale, void* dst);
  // dst[i] += round(src[i]) for i < n.
  void (*moe_accumulate)(ActType act, const float* src, int64_t n, float* dst);

  // Linear only: for bf16 / fp32 weights, which the rows path reads in place (no decoding to amortise over the
  // activation rows), the tiles path runs from this many activation rows instead, if more (0: tile_min_rows alone).
  // Independent of WeightView::prefetch, so that results never depend on it.
  int64_t tile_min_rows_in_place[2] = {0, 0};
  // Linear only: tasks of a tiles-path call split N in multiples of this instead of tile_rows, if set (0: tile_rows).
  // A finer split evens out the threads' shares where N is a few tile_rows blocks; the MoE items keep tile_rows.
  int64_t tile_task_rows = 0;
};

// FP4 weight rows against int8-quantised bf16 activation rows: the rows path of the FP4 experts' compute="int8"
// (moe_experts.h; numerics/int8_blocks.h). Each level prepares rows in its own layout (row_bytes, prepare and rows
// belong together); the codes and scales in it are always numerics/int8_blocks.h's. The portable layout (also the
// AVX2 level's; the AVX512 one is in moe_int8_avx512.cc): per 64 columns (blocks b0 and b1; past the row's end, b1
// is all zero) 192 bytes:
//   64 int8 codes   [b0 even columns | b1 even | b0 odd | b1 odd], 16 each: the order in which the FP4 bytes'
//                   low and high nibbles come out, so a 32-byte weight load needs no interleaving;
//   16 int32        -12 x the sum of the 4 codes of each 4-byte lane: VPDPBUSD multiplies unsigned bytes, so the
//                   weights enter as 2 e2m1 + 12 (0..24) and this starting value takes the 12 x sum(q) back out;
//   16 fp32         the block scale / 2 of each lane (lanes 0-3 and 8-11: b0; 4-7 and 12-15: b1).
struct Int8Fp4Rows {
  // Bytes of one prepared row of `cols` columns (a multiple of 32).
  size_t (*row_bytes)(int64_t cols);
  // dst row i = bf16 row index[i] (i when index is null) of x, rows ldx elements apart, cols a multiple of 32.
  void (*prepare)(const uint16_t* x, int64_t ldx, const int64_t* index, int64_t m, int64_t cols, void* dst);
  // out[i][j - n0] = row j of the FP4 weight w against prepared row i, for j in [n0, n1); fp32, unrounded.
  void (*rows)(const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out);
};
constexpr int64_t kInt8ChunkBytes = 192;  // per 64 columns, portable layout
size_t Int8RowBytes(int64_t cols);        // a prepared row in the portable layout (moe_int8.cc, baseline)

// Drivers: the LinearKernels / MoeExpertsKernels slot semantics (linear.h, moe_experts.h) on a level's blocks.
// f32_out (bf16 activations only): fp32 outputs, unrounded (the bf16 compute mode).
void RunLinear(const LinearBlocks& b, ActType act, const void* x, int64_t m, const WeightView& w, int64_t groups,
               void* y, const Parallel& par, bool f32_out = false);
// The f32bf16_* slots: x rounded to bf16, then RunLinear with bf16 activations and fp32 outputs.
void RunLinearBf16Products(const LinearBlocks& b, const float* x, int64_t m, const WeightView& w, int64_t groups,
                           float* y, const Parallel& par);
// int8 (FP4 experts, bf16 activations only): compute="int8" on those rows functions instead of b's matmuls.
void RunMoeExperts(const LinearBlocks& b, ActType act, const void* x, int64_t tokens, const float* weights,
                   const int64_t* indices, int64_t top_k, const ExpertWeights& w, float swiglu_limit, void* y,
                   const Parallel& par, const Int8Fp4Rows* int8 = nullptr);

// Levels. The amx_emu blocks are the AMX sources built against the tile emulation (test builds only), with
// portable rows and decoding, so that the tiles path is tested on any CPU.
namespace avx2 {
extern const LinearBlocks kLinearBlocks;
extern const Int8Fp4Rows kInt8Fp4Rows;
extern const LinearKernels kLinear;
extern const MoeExpertsKernels kMoeExperts;
}  // namespace avx2
namespace avx512 {
extern const LinearBlocks kLinearBlocks;
extern const Int8Fp4Rows kInt8Fp4Rows;
extern const LinearKernels kLinear;
extern const MoeExpertsKernels kMoeExperts;
// Shared with the AMX tiles: W rows [n0, n0 + rows) x columns [k0, k0 + kc) as bf16 (exact decode, rounded to bf16
// as linear.h specifies for bf16 activations) into dst (row stride ld elements); rows at or past w.rows and columns
// at or past w.cols are written as zeros. k0 and kc are multiples of 32.
void DecodeRowsBf16(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, uint16_t* dst,
                    int64_t ld);
// The MoE element-wise steps (LinearBlocks::moe_swiglu / moe_accumulate), shared with the AMX level.
void MoeSwiGluRow(ActType act, float* g, const float* u, int64_t n, float limit, float scale, void* dst);
void MoeAccumulateRow(ActType act, const float* src, int64_t n, float* dst);
// The tiles' activation layout (see linear_amx.cc), vectorised.
void PrepareTileBlocks(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                       int64_t block_begin, int64_t block_end, void* dst);
}  // namespace avx512
namespace amx {
extern const LinearBlocks kLinearBlocks;
extern const LinearKernels kLinear;
extern const MoeExpertsKernels kMoeExperts;
}  // namespace amx
namespace amx_emu {
extern const LinearBlocks kLinearBlocks;
}  // namespace amx_emu

// Portable (baseline) versions of the pieces above, used by amx_emu and as the specification of the layouts.
namespace portable {
extern const LinearBlocks kRowBlocks;  // rows path only
extern const Int8Fp4Rows kInt8Fp4Rows;
void DecodeRowsBf16(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, uint16_t* dst,
                    int64_t ld);
void PrepareTileBlocks(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                       int64_t block_begin, int64_t block_end, void* dst);
}  // namespace portable

// Helpers shared by the levels (linear_fast.cc).
int64_t PaddedCols(int64_t cols);  // cols rounded up to a multiple of 32

// How the m activation rows of a call are laid out for the tiles: `parts` bf16 parts (3 for fp32, 1 for bf16) of
// `rows` tile rows in ceil(rows / 16) blocks of 16. fp32 activations with at most kFoldRows rows are folded: the
// three parts of row t become tile rows t, m + t, 2m + t of a single part (one or two B tiles hold them all, a
// third or two thirds of the tile products), and the three partial results are added at the end.
constexpr int64_t kFoldRows = 10;
struct TileLayout {
  int64_t parts, rows, blocks;
  bool folded;
};
TileLayout TileLayoutOf(ActType act, int64_t m);
// Bytes of the prepared activations: parts x blocks x PaddedCols(kw)/32 steps of 16 x 16 bf16 pairs (1 KiB).
size_t TileXBytes(ActType act, int64_t m, int64_t kw);
// fp32 -> three bf16 parts with x == hi + mid + lo exactly for |x| >= 2^-100; non-finite x gives (x, 0, 0).
// Denormal inputs and parts are flushed to zero, as the hardware conversion does (so tinier x lose low bits).
void SplitBf16x3(float x, uint16_t* hi, uint16_t* mid, uint16_t* lo);

}  // namespace dsv4
