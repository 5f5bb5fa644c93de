// AMX-BF16 tiles path of the Linear and MoE expert kernels (linear_blocks.h), for calls with many activation rows
// (prefill); the rows path of the same level is the AVX512 one. Built twice: with AMX flags as dsv4::amx (the
// shipped level, needs AMX permission) and with -DDSV4_AMX_EMULATION as dsv4::amx_emu (test builds: emulated
// tiles, portable rows path, decoding and activation layout, so it runs on any CPU). Both give bit-identical
// results (the portable decoding and layout are the specification of the vectorised ones, and the emulated tiles
// reproduce the instructions). Versus linear_ref.cc: summation order (TDPBF16PS pairs, 32-column steps, the three
// activation parts for fp32) and the flushing of denormal inputs.
//
// The weight is the A operand: an A tile is 16 weight rows x 32 columns of bf16, read with the row stride of a
// decoded block. Per call (one task's weight rows [n0, n1)) with more than 32 tile rows (TilesFew below handles
// the rest):
//   for each block of 128 weight rows:
//     for each chunk of at most 4096 columns (one chunk unless Kw is larger):
//       decode rows x chunk to bf16 (<= 1 MiB) -- once, reused for every activation row; bf16 weights with
//       Kw a multiple of 32 are read in place instead
//       for each pair of 16-row activation blocks (32 tokens), for each 32-row half of the weight block:
//         C[2 x 2 tiles of 16 weight rows x 16 tokens] (zero, or reloaded when K is chunked)
//         per 32-column step: A0, A1 (weight rows r..r+15, r+16..r+31), then for each activation part
//         B0, B1 (the two token blocks) and four TDPBF16PS; with a single token block (M <= 16, the tail) the
//         odd steps go to the two C tiles the missing block leaves free (four independent chains instead of two,
//         the halves added at the end)
//         C tiles to the output, transposed to [token][weight row] (or parked for the next chunk)
// The activations (B operand) were laid out once per call by prepare_tiles: per part, per 16-token block, per
// 32-column step, one 1 KiB tile [16 column pairs][16 tokens][2] (see portable::PrepareTileBlocks); fp32
// activations of at most kFoldRows rows are folded into one part (TileLayoutOf: 3m tile rows, at most two token
// blocks) and unfolded in FinishTile. Weight rows
// past n1 and columns past Kw decode as zeros and padded tokens are zeros, so edges need no special tiles.
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/numerics/amx_tile.h"

namespace dsv4 {
namespace DSV4_AMX_NS {
namespace {

#if !defined(DSV4_AMX_EMULATION)
#include "custom_ops/kernels/simd_avx512.inc"
#endif

constexpr int64_t kBlockRows = 128;  // weight rows decoded together (tile_rows)
constexpr int64_t kMaxChunk = 4096;  // columns per decoded chunk: 128 x 4096 bf16 = 1 MiB

constexpr int kC00 = 0, kC01 = 1, kC10 = 2, kC11 = 3;  // C[weight tile][token tile]
constexpr int kA0 = 4, kA1 = 5, kB0 = 6, kB1 = 7;

#if defined(DSV4_AMX_EMULATION)
const LinearBlocks& RowSource() { return portable::kRowBlocks; }
void Decode(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, uint16_t* dst, int64_t ld) {
  portable::DecodeRowsBf16(w, n0, rows, k0, kc, dst, ld);
}
void Prepare(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw, int64_t b0,
             int64_t b1, void* dst) {
  portable::PrepareTileBlocks(act, x, ldx, index, m, kw, b0, b1, dst);
}
#else
const LinearBlocks& RowSource() { return avx512::kLinearBlocks; }
void Decode(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, uint16_t* dst, int64_t ld) {
  avx512::DecodeRowsBf16(w, n0, rows, k0, kc, dst, ld);
}
void Prepare(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw, int64_t b0,
             int64_t b1, void* dst) {
  avx512::PrepareTileBlocks(act, x, ldx, index, m, kw, b0, b1, dst);
}
#endif

// Rows path: the level's own (AVX512, or portable under emulation).
bool RowsSupported(ActType act, const WeightView& w) { return RowSource().rows_supported(act, w); }
size_t RowBytes(ActType act, const WeightView& w) { return RowSource().row_bytes(act, w); }
void PrepareRows(ActType act, const WeightView& w, const void* x, int64_t ldx, const int64_t* index, int64_t m,
                 void* dst) {
  RowSource().prepare_rows(act, w, x, ldx, index, m, dst);
}
size_t RowsScratch(ActType act, const WeightView& w, int64_t m) { return RowSource().rows_scratch(act, w, m); }
void Rows(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
          void* scratch) {
  RowSource().rows(act, xp, m, w, n0, n1, out, scratch);
}

// ---------------------------------------------------------------------------------------------------------------
// Tiles.

int64_t Pad32(int64_t c) { return (c + 31) / 32 * 32; }

// Columns per decoded chunk: all of them, or near-equal multiples of 32 of at most kMaxChunk.
int64_t ChunkCols(int64_t kp) {
  const int64_t chunks = (kp + kMaxChunk - 1) / kMaxChunk;
  return Pad32((kp + chunks - 1) / chunks);
}

bool TilesSupported(ActType act, const WeightView& w) {
  if (w.format == WeightFormat::kFp8E4M3 && !(w.block > 0 && w.block % 32 == 0)) return false;
  if (act == ActType::kBf16) return true;
  // fp32 activations: the weight must be exact in bf16.
  return w.format == WeightFormat::kBf16 || w.format == WeightFormat::kFp4E2M1 ||
         (w.format == WeightFormat::kFp8E4M3 && w.scale_format == ScaleFormat::kE8M0);
}

size_t TileXBytesFn(ActType act, int64_t m, int64_t kw) { return TileXBytes(act, m, kw); }
int64_t TileBlocksFn(ActType act, int64_t m) { return TileLayoutOf(act, m).blocks; }

// Scratch: the decoded block, then (K chunked only) parked C tiles for every 32-token x 32-row block.
constexpr int64_t kPieceCols = 256;  // columns of the decoded piece on the few-tokens path (TilesFew)

size_t TilesScratch(ActType act, const WeightView& w, int64_t m) {
  const int64_t kp = Pad32(w.cols), kc = ChunkCols(kp);
  const int64_t block = kBlockRows * kc > 32 * kPieceCols ? kBlockRows * kc : 32 * kPieceCols;
  size_t bytes = static_cast<size_t>(block) * sizeof(uint16_t);
  if (kc < kp) bytes += static_cast<size_t>((m + 31) / 32 * (kBlockRows / 32)) * 4 * 1024;
  return bytes;
}

void Prefetch(const void* p) {
#if defined(DSV4_AMX_EMULATION)
  (void)p;
#else
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#endif
}

void ConfigureTiles() {
  TileConfig cfg;
  for (int t = 0; t < kNumTiles; ++t) cfg.Set(t, kTileMaxRows, kTileMaxColsb);
  TileLoadConfig(cfg);
}

// A C tile c[16 weight rows][16 tokens] (row stride ldc floats) to out[token][weight row] for the first
// `tokens` x `rows`.
void StoreTransposed(const float* c, int64_t ldc, int64_t rows, int64_t tokens, const MatOut& out, int64_t tok0,
                     int64_t col0) {
#if !defined(DSV4_AMX_EMULATION)
  if (rows == 16) {
    // Transpose through 16 registers, then one (masked) row store per token.
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(c + i * ldc);
    Transpose16(r);
    for (int64_t tok = 0; tok < tokens; ++tok) {
      const int64_t at = (tok0 + tok) * out.ld + col0;
      if (out.bf16) {
        // nearest-even with denormals kept (F32ToBf16), NaN quietened
        VStore(static_cast<uint16_t*>(out.data) + at, TailMask(16), _mm512_castsi512_ps(r[tok]));
      } else {
        _mm512_storeu_si512(static_cast<float*>(out.data) + at, r[tok]);
      }
    }
    return;
  }
#endif
  for (int64_t tok = 0; tok < tokens; ++tok) {
    const int64_t at = (tok0 + tok) * out.ld + col0;
    for (int64_t n = 0; n < rows; ++n) {
      const float v = c[n * ldc + tok];
      if (out.bf16) {
        static_cast<uint16_t*>(out.data)[at + n] = F32ToBf16(v);
      } else {
        static_cast<float*>(out.data)[at + n] = v;
      }
    }
  }
}

struct Job {
  const uint16_t* a;  // decoded weight rows r.. of the block, first column of the chunk
  size_t lda_bytes;
  const uint16_t* b;  // first tile (part 0, token block mb, step s0)
  size_t part_stride;  // elements between parts
  size_t block_stride;  // elements between token blocks
  int64_t steps;        // 32-column steps in the chunk
  int64_t parts;
  bool prefetch = false;  // A read in place from the weight (not from a decoded block in cache)
};

// One 32-column step: A0 (A1) against every part's B0 (B1), accumulating into C tiles kCa (weight tile 0) and kCb
// (weight tile 1) for token tile 0, and kC01 / kC11 for token tile 1.
template <int kNT, int kMT, int kCa, int kCb>
void Step(const Job& j, int64_t s) {
  const uint16_t* a = j.a + s * 32;
  if (j.prefetch) {  // weight rows read in place from memory: one line per row, 2 KiB ahead
    const size_t lda = j.lda_bytes / sizeof(uint16_t);
    for (int r = 0; r < 16 * kNT; ++r) Prefetch(a + r * lda + 1024);
  }
  TileLoad<kA0>(a, j.lda_bytes);
  if constexpr (kNT == 2) TileLoad<kA1>(a + 16 * (j.lda_bytes / sizeof(uint16_t)), j.lda_bytes);
  for (int64_t p = 0; p < j.parts; ++p) {
    const uint16_t* b = j.b + p * j.part_stride + s * 512;
    TileLoad<kB0>(b, 64);
    if constexpr (kMT == 2) TileLoad<kB1>(b + j.block_stride, 64);
    TileDpbf16ps<kCa, kA0, kB0>();
    if constexpr (kMT == 2) TileDpbf16ps<kC01, kA0, kB1>();
    if constexpr (kNT == 2) TileDpbf16ps<kCb, kA1, kB0>();
    if constexpr (kNT == 2 && kMT == 2) TileDpbf16ps<kC11, kA1, kB1>();
  }
}

// All steps of one chunk. With one token tile the two C tiles it leaves free take the odd steps, so that four
// independent accumulation chains keep the tile unit busy (the halves are added when C is finished).
template <int kNT, int kMT>
void Accumulate(const Job& j) {
  if constexpr (kMT == 2) {
    for (int64_t s = 0; s < j.steps; ++s) Step<kNT, 2, kC00, kC10>(j, s);
  } else {
    int64_t s = 0;
    for (; s + 2 <= j.steps; s += 2) {
      Step<kNT, 1, kC00, kC10>(j, s);
      Step<kNT, 1, kC01, kC11>(j, s + 1);
    }
    if (s < j.steps) Step<kNT, 1, kC00, kC10>(j, s);
  }
}

// Tiles a block uses: with one token tile, C01 / C11 hold the odd-step halves.
template <int kNT, int kMT>
void ZeroC() {
  TileZero<kC00>();
  TileZero<kC01>();
  if constexpr (kNT == 2) {
    TileZero<kC10>();
    TileZero<kC11>();
  }
}

// Parked C tiles: 4 x 1 KiB at `park` (fp32 [16][16] each, tile 2a + b).
template <int kNT, int kMT>
void LoadC(const float* park) {
  TileLoad<kC00>(park, 64);
  TileLoad<kC01>(park + 256, 64);
  if constexpr (kNT == 2) {
    TileLoad<kC10>(park + 512, 64);
    TileLoad<kC11>(park + 768, 64);
  }
}

template <int kNT, int kMT>
void ParkC(float* park) {
  TileStore<kC00>(park, 64);
  TileStore<kC01>(park + 256, 64);
  if constexpr (kNT == 2) {
    TileStore<kC10>(park + 512, 64);
    TileStore<kC11>(park + 768, 64);
  }
}

// Folded fp32 activations (TileLayout): tile column t of part p is column p * m + t of c[16][ldc];
// c[n][t] = (part 0 + part 1) + part 2 for t < m.
void Unfold(float* c, int64_t ldc, int64_t m) {
  for (int n = 0; n < 16; ++n) {
    float* row = c + n * ldc;
    for (int64_t t = 0; t < m; ++t) row[t] = (row[t] + row[m + t]) + row[2 * m + t];
  }
}

// Weight tile (kCa, kCb) = its C tiles for token tiles 0 and 1 (with one token tile: the even and odd step halves)
// to the output: `rows` weight rows, `tokens` tile columns; `fold` = m for folded activations.
template <int kMT, int kCa, int kCb>
void FinishTile(int64_t rows, int64_t tokens, const MatOut& out, int64_t tok0, int64_t col0, int64_t fold) {
  alignas(64) float c[16 * 32];  // [16 weight rows][32 tile columns]
  TileStore<kCa>(c, 128);
  if constexpr (kMT == 1) {
    alignas(64) float d[256];
    TileStore<kCb>(d, 64);
    for (int n = 0; n < 16; ++n)
      for (int t = 0; t < 16; ++t) c[n * 32 + t] += d[n * 16 + t];
  } else {
    TileStore<kCb>(c + 16, 128);
  }
  if (fold > 0) {
    Unfold(c, 32, fold);
    StoreTransposed(c, 32, rows, fold, out, tok0, col0);
    return;
  }
  StoreTransposed(c, 32, rows, tokens < 16 ? tokens : 16, out, tok0, col0);
  if (kMT == 2 && tokens > 16) StoreTransposed(c + 16, 32, rows, tokens - 16, out, tok0 + 16, col0);
}

// Final C tiles to the output: rows / tokens valid in this 32 x 32 block.
template <int kNT, int kMT>
void FinishC(int64_t rows, int64_t tokens, const MatOut& out, int64_t tok0, int64_t col0, int64_t fold) {
  FinishTile<kMT, kC00, kC01>(rows < 16 ? rows : 16, tokens, out, tok0, col0, fold);
  if constexpr (kNT == 2) FinishTile<kMT, kC10, kC11>(rows - 16, tokens, out, tok0, col0 + 16, fold);
}

template <int kNT, int kMT>
void Block(const Job& j, bool first, bool last, float* park, int64_t rows, int64_t tokens, const MatOut& out,
           int64_t tok0, int64_t col0, int64_t fold) {
  if (first) {
    ZeroC<kNT, kMT>();
  } else {
    LoadC<kNT, kMT>(park);
  }
  Accumulate<kNT, kMT>(j);
  if (last) {
    FinishC<kNT, kMT>(rows, tokens, out, tok0, col0, fold);
  } else {
    ParkC<kNT, kMT>(park);
  }
}

// At most two token blocks (32 tile rows, the decode-sized calls): C stays in tiles over the whole K, and the
// weight is decoded 32 rows x kPieceCols columns at a time, a piece that stays in L1 (the large-M order decodes
// 128-row blocks of up to 4096 columns once and reuses them for every pair of token blocks).

template <int kNT, int kMT>
void FewBlock(const WeightView& w, bool in_place, int64_t row0, const uint16_t* x, int64_t steps, int64_t parts,
              int64_t blocks, uint16_t* piece, int64_t rows, int64_t tokens, const MatOut& out, int64_t col0,
              int64_t fold) {
  const int64_t kp = steps * 32;
  ZeroC<kNT, kMT>();
  Job j;
  j.part_stride = static_cast<size_t>(blocks * steps) * 512;
  j.block_stride = static_cast<size_t>(steps) * 512;
  j.parts = parts;
  if (in_place) {
    j.a = static_cast<const uint16_t*>(w.data) + row0 * w.cols;
    j.lda_bytes = static_cast<size_t>(w.cols) * sizeof(uint16_t);
    j.b = x;
    j.steps = steps;
    j.prefetch = true;
    Accumulate<kNT, kMT>(j);
  } else {
    for (int64_t k = 0; k < kp; k += kPieceCols) {
      const int64_t cols = kp - k < kPieceCols ? kp - k : kPieceCols;
      Decode(w, row0, 16 * kNT, k, cols, piece, kPieceCols);
      j.a = piece;
      j.lda_bytes = static_cast<size_t>(kPieceCols) * sizeof(uint16_t);
      j.b = x + (k / 32) * 512;
      j.steps = cols / 32;  // kPieceCols / 32 is even, so step parities stay those of the whole K
      Accumulate<kNT, kMT>(j);
    }
  }
  FinishC<kNT, kMT>(rows, tokens, out, 0, col0, fold);
}

void TilesFew(const WeightView& w, const uint16_t* x, const TileLayout& layout, int64_t fold, int64_t n0, int64_t n1,
              const MatOut& out, uint16_t* piece) {
  const int64_t kp = Pad32(w.cols), steps = kp / 32;
  const bool two_m = layout.blocks == 2;
  for (int64_t nb = n0; nb < n1; nb += 32) {
    const int64_t rows = n1 - nb < 32 ? n1 - nb : 32;
    const bool two_n = rows > 16;
    const bool in_place = w.format == WeightFormat::kBf16 && w.cols == kp && nb + (two_n ? 32 : 16) <= w.rows;
    if (two_n && two_m) {
      FewBlock<2, 2>(w, in_place, nb, x, steps, layout.parts, layout.blocks, piece, rows, layout.rows, out, nb - n0, fold);
    } else if (two_n) {
      FewBlock<2, 1>(w, in_place, nb, x, steps, layout.parts, layout.blocks, piece, rows, layout.rows, out, nb - n0, fold);
    } else if (two_m) {
      FewBlock<1, 2>(w, in_place, nb, x, steps, layout.parts, layout.blocks, piece, rows, layout.rows, out, nb - n0, fold);
    } else {
      FewBlock<1, 1>(w, in_place, nb, x, steps, layout.parts, layout.blocks, piece, rows, layout.rows, out, nb - n0, fold);
    }
  }
}

void Tiles(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
           void* scratch) {
  const int64_t kp = Pad32(w.cols), steps = kp / 32, kc = ChunkCols(kp);
  const TileLayout layout = TileLayoutOf(act, m);
  const int64_t blocks16 = layout.blocks, parts = layout.parts, tile_rows = layout.rows;
  const int64_t fold = layout.folded ? m : 0;
  if (blocks16 <= 2) {
    ConfigureTiles();
    TilesFew(w, static_cast<const uint16_t*>(xp), layout, fold, n0, n1, out, static_cast<uint16_t*>(scratch));
    TileRelease();
    return;
  }
  uint16_t* wbuf = static_cast<uint16_t*>(scratch);
  float* park = reinterpret_cast<float*>(wbuf + kBlockRows * kc);
  const uint16_t* x = static_cast<const uint16_t*>(xp);
  ConfigureTiles();
  for (int64_t nb = n0; nb < n1; nb += kBlockRows) {
    const int64_t rows = n1 - nb < kBlockRows ? n1 - nb : kBlockRows;
    const int64_t rows32 = Pad32(rows);
    // bf16 weights whose rows are whole 32-column steps are read in place (A tiles with the weight's row
    // stride) when the block's rows, padded to 32, exist; everything else goes through the decoded block.
    const bool in_place = w.format == WeightFormat::kBf16 && w.cols == kp && nb + rows32 <= w.rows;
    for (int64_t k0 = 0; k0 < kp; k0 += kc) {
      const int64_t cols = kp - k0 < kc ? kp - k0 : kc;
      const bool first = k0 == 0, last = k0 + cols == kp;
      const uint16_t* a_base = wbuf;
      int64_t lda = kc;
      if (in_place) {
        a_base = static_cast<const uint16_t*>(w.data) + nb * w.cols + k0;
        lda = w.cols;
      } else {
        Decode(w, nb, rows32, k0, cols, wbuf, kc);
      }
      for (int64_t mb = 0; mb < blocks16; mb += 2) {
        const bool two_m = mb + 1 < blocks16;
        const int64_t tokens = (tile_rows - mb * 16) < 32 ? tile_rows - mb * 16 : 32;
        for (int64_t r = 0; r < rows; r += 32) {
          const bool two_n = r + 16 < rows;
          Job j;
          j.a = a_base + r * lda;
          j.lda_bytes = static_cast<size_t>(lda) * sizeof(uint16_t);
          j.b = x + (mb * steps + k0 / 32) * 512;
          j.part_stride = static_cast<size_t>(blocks16 * steps) * 512;
          j.block_stride = static_cast<size_t>(steps) * 512;
          j.steps = cols / 32;
          j.parts = parts;
          j.prefetch = in_place && mb == 0;  // later token blocks find the rows in cache
          float* p = park + ((mb / 2) * (kBlockRows / 32) + r / 32) * 1024;
          const int64_t rr = rows - r < 32 ? rows - r : 32, col0 = nb - n0 + r;
          if (two_n && two_m) {
            Block<2, 2>(j, first, last, p, rr, tokens, out, mb * 16, col0, fold);
          } else if (two_n) {
            Block<2, 1>(j, first, last, p, rr, tokens, out, mb * 16, col0, fold);
          } else if (two_m) {
            Block<1, 2>(j, first, last, p, rr, tokens, out, mb * 16, col0, fold);
          } else {
            Block<1, 1>(j, first, last, p, rr, tokens, out, mb * 16, col0, fold);
          }
        }
      }
    }
  }
  TileRelease();
}

}  // namespace

// Crossover rows path -> tiles, from single-core throughput with the weights in cache (bench/bench_linear.py has
// the end-to-end figures): at 4 rows the AVX512 rows path still matches the tiles for fp32 activations (FP8 is
// faster there, bf16 weights slower), at 5 it needs a second pass over the weights; with bf16 activations the
// tiles win from 3-4 rows.
#if defined(DSV4_AMX_EMULATION)
constexpr int64_t kMinRowsF32 = 1, kMinRowsBf16 = 1;  // tests: every call on the (emulated) tiles
#else
constexpr int64_t kMinRowsF32 = 5, kMinRowsBf16 = 4;
#endif

extern const LinearBlocks kLinearBlocks = {
#if defined(DSV4_AMX_EMULATION)
    "amx_emu",
#else
    "amx",
#endif
    RowsSupported, RowBytes,    PrepareRows, RowsScratch,  Rows,  TilesSupported, TileXBytesFn, TileBlocksFn,
    Prepare,       TilesScratch, Tiles,      {kMinRowsF32, kMinRowsBf16}, kBlockRows,
#if defined(DSV4_AMX_EMULATION)
    nullptr,       nullptr,  // portable build: the driver's scalar loops
#else
    avx512::MoeSwiGluRow, avx512::MoeAccumulateRow,
#endif
};

}  // namespace DSV4_AMX_NS
}  // namespace dsv4
