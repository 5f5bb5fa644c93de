// AMX-BF16 GEMM (gemm_bf16.h): C[M,N] fp32 = A[M,K] bf16 x B[N,K]^T bf16, on tiles through numerics/amx_tile.h
// only. Built twice: with AMX flags as dsv4::amx (the shipped table, needs AMX-TILE + AMX-BF16 and the kernel's
// tile permission) and with -DDSV4_AMX_EMULATION as dsv4::amx_emu (test builds, runs anywhere); both give
// bit-identical results. Checked against gemm_bf16_ref.cc within the fp32 accumulation bound stated in
// gemm_bf16.h, and amx against amx_emu bit for bit (tests/custom_ops/kernels/test_gemm_bf16.cc).
//
// Register blocking: a 32 x 32 block of C lives in four fp32 accumulator tiles (tmm0..3, 16 x 16 each) for the
// whole K loop; per 32-wide K step two A tiles (tmm4, tmm5: 16 rows x 32 bf16) and two B tiles (tmm6, tmm7) are
// loaded and four TDPBF16PS issued. Blocks at the M or N edge use 1 x 2, 2 x 1 or 1 x 1 tiles. One tile
// configuration (all eight tiles 16 x 64 bytes) serves every block, so each task configures once: edges are
// handled with zero padding instead of narrower tiles. A rows past M and A columns past K go through a 1 KiB
// zero-padded copy on the stack (K padding must be real zeros: a garbage NaN times a zero weight is NaN);
// output tiles that overhang M or N are stored to a stack tile and copied out.
#include <cstring>

#include "custom_ops/kernels/gemm_bf16.h"
#include "custom_ops/numerics/amx_tile.h"

namespace dsv4 {
namespace DSV4_AMX_NS {
namespace {

constexpr size_t kTileM = 16;  // rows of an A / C tile
constexpr size_t kTileN = 16;  // fp32 columns of a C tile = columns of a packed B panel
constexpr size_t kTileK = 32;  // bf16 values of K per tile row (16 pairs)
constexpr size_t kBlockM = 2 * kTileM;
constexpr size_t kBlockN = 2 * kTileN;
constexpr size_t kBTileElems = kTileK * kTileN;  // bf16 values in one B tile (1 KiB)

// Tile registers.
constexpr int kC00 = 0, kC01 = 1, kC10 = 2, kC11 = 3;
constexpr int kA0 = 4, kA1 = 5;
constexpr int kB0 = 6, kB1 = 7;

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }
size_t Min(size_t a, size_t b) { return a < b ? a : b; }
size_t PaddedK(size_t k) { return CeilDiv(k, kTileK) * kTileK; }
size_t PanelElems(size_t k) { return PaddedK(k) * kTileN; }

// Packed B layout (VNNI pairs, one panel per 16 output columns).
//
// TDPBF16PS reads its B operand as a 16-row tile whose row q holds, for each of the 16 output columns n, the pair
// (B[n][2q], B[n][2q+1]) in one 32-bit slot: K runs down the tile two values per row, N runs across it. The
// packer stores the weight [N, K] directly in that order:
//
//   Kp = K rounded up to a multiple of 32 (a whole number of B tiles), panels = ceil(N / 16)
//   panel p   = bf16 [Kp / 2][16][2], contiguous, at offset p * Kp * 16 elements
//   element   panel[q][c][h] = B[16 p + c][2 q + h]   or 0 where 16 p + c >= N or 2 q + h >= K
//
// The B tile for K step s of panel p is rows q in [16 s, 16 s + 16): 1 KiB contiguous at panel + s * 512, loaded
// with a 64-byte stride. Zero columns make N edges harmless (their outputs are never stored); zero K padding
// meets zero-padded A columns, so both pair halves contribute +0 products and odd K needs no special case.
// Total size: ceil(N / 16) * Kp * 16 * 2 bytes; for N = 7168, K = 4096 that is exactly N * K * 2.
size_t PackedBSize(size_t n, size_t k) { return CeilDiv(n, kTileN) * PanelElems(k) * sizeof(uint16_t); }

void PackB(const uint16_t* b, size_t ldb, size_t n, size_t k, void* packed) {
  uint16_t* out = static_cast<uint16_t*>(packed);
  const size_t pairs = PaddedK(k) / 2;
  for (size_t p = 0; p < CeilDiv(n, kTileN); ++p) {
    uint16_t* panel = out + p * PanelElems(k);
    for (size_t q = 0; q < pairs; ++q) {
      for (size_t c = 0; c < kTileN; ++c) {
        const size_t col = p * kTileN + c;
        for (size_t h = 0; h < 2; ++h) {
          const size_t kk = 2 * q + h;
          panel[(q * kTileN + c) * 2 + h] = (col < n && kk < k) ? b[col * ldb + kk] : uint16_t{0};
        }
      }
    }
  }
}

void ConfigureTiles() {
  TileConfig cfg;
  for (int t = 0; t < kNumTiles; ++t) cfg.Set(t, static_cast<int>(kTileM), kTileMaxColsb);
  TileLoadConfig(cfg);
}

// One block of at most 32 x 32 outputs.
struct Block {
  const uint16_t* a;       // first A row of the block
  size_t lda;              // elements
  size_t rows;             // 1..32
  const uint16_t* panel0;  // packed panel of the block's first 16 columns; the next panel follows it
  size_t panel_elems;
  size_t k;
  float* c;  // first C element of the block
  size_t ldc;
  size_t cols;  // 1..32
};

// Scratch tiles on the stack of the task.
struct Scratch {
  alignas(64) uint16_t a[kTileM * kTileK];
  alignas(64) float c[kTileM * kTileN];
};

// A rows [row0, row0 + 16) x K step `step` into tile kT; through the zero-padded scratch at an M or K edge.
template <int kT>
void LoadA(const Block& blk, size_t row0, size_t step, Scratch& s) {
  const size_t rows = Min(kTileM, blk.rows - row0);
  const size_t k0 = step * kTileK;
  const size_t width = Min(kTileK, blk.k - k0);
  const uint16_t* src = blk.a + row0 * blk.lda + k0;
  if (rows == kTileM && width == kTileK) {
    TileLoad<kT>(src, blk.lda * sizeof(uint16_t));
    return;
  }
  std::memset(s.a, 0, sizeof s.a);
  for (size_t r = 0; r < rows; ++r) std::memcpy(s.a + r * kTileK, src + r * blk.lda, width * sizeof(uint16_t));
  TileLoad<kT>(s.a, kTileK * sizeof(uint16_t));
}

// Accumulator tile kT = C rows [row0, row0 + 16) x columns [col0, col0 + 16), clipped to the block.
template <int kT>
void StoreC(const Block& blk, size_t row0, size_t col0, Scratch& s) {
  const size_t rows = Min(kTileM, blk.rows - row0);
  const size_t cols = Min(kTileN, blk.cols - col0);
  float* dst = blk.c + row0 * blk.ldc + col0;
  if (rows == kTileM && cols == kTileN) {
    TileStore<kT>(dst, blk.ldc * sizeof(float));
    return;
  }
  TileStore<kT>(s.c, kTileN * sizeof(float));
  for (size_t r = 0; r < rows; ++r) std::memcpy(dst + r * blk.ldc, s.c + r * kTileN, cols * sizeof(float));
}

// kMT x kNT tiles of 16 x 16 (each 1 or 2).
template <int kMT, int kNT>
void ComputeBlock(const Block& blk, Scratch& s) {
  TileZero<kC00>();
  if constexpr (kNT == 2) TileZero<kC01>();
  if constexpr (kMT == 2) TileZero<kC10>();
  if constexpr (kMT == 2 && kNT == 2) TileZero<kC11>();
  const size_t steps = CeilDiv(blk.k, kTileK);
  for (size_t step = 0; step < steps; ++step) {
    LoadA<kA0>(blk, 0, step, s);
    if constexpr (kMT == 2) LoadA<kA1>(blk, kTileM, step, s);
    TileLoad<kB0>(blk.panel0 + step * kBTileElems, kTileMaxColsb);
    if constexpr (kNT == 2) TileLoad<kB1>(blk.panel0 + blk.panel_elems + step * kBTileElems, kTileMaxColsb);
    TileDpbf16ps<kC00, kA0, kB0>();
    if constexpr (kNT == 2) TileDpbf16ps<kC01, kA0, kB1>();
    if constexpr (kMT == 2) TileDpbf16ps<kC10, kA1, kB0>();
    if constexpr (kMT == 2 && kNT == 2) TileDpbf16ps<kC11, kA1, kB1>();
  }
  StoreC<kC00>(blk, 0, 0, s);
  if constexpr (kNT == 2) StoreC<kC01>(blk, 0, kTileN, s);
  if constexpr (kMT == 2) StoreC<kC10>(blk, kTileM, 0, s);
  if constexpr (kMT == 2 && kNT == 2) StoreC<kC11>(blk, kTileM, kTileN, s);
}

// [begin, end) of chunk `index` when `count` items are split into `chunks` near-equal contiguous chunks.
void ChunkRange(size_t count, size_t chunks, size_t index, size_t* begin, size_t* end) {
  const size_t base = count / chunks, extra = count % chunks;
  *begin = index * base + Min(index, extra);
  *end = *begin + base + (index < extra ? 1 : 0);
}

void Gemm(const uint16_t* a, size_t lda, const void* packed_b, size_t m, size_t n, size_t k, float* c, size_t ldc,
          const Parallel& par) {
  if (m == 0 || n == 0) return;
  const uint16_t* packed = static_cast<const uint16_t*>(packed_b);
  const size_t panel_elems = PanelElems(k);
  const size_t m_blocks = CeilDiv(m, kBlockM), n_blocks = CeilDiv(n, kBlockN);
  // A few tasks per thread, split over N first (each task then streams its own slice of the weight); over M too
  // when N alone has too few blocks.
  const size_t target = par.num_threads > 1 ? 4 * static_cast<size_t>(par.num_threads) : 1;
  const size_t n_chunks = Min(n_blocks, target);
  const size_t m_chunks = Min(m_blocks, CeilDiv(target, n_chunks));
  par.For(n_chunks * m_chunks, [&](size_t task) {
    size_t nb_begin, nb_end, mb_begin, mb_end;
    ChunkRange(n_blocks, n_chunks, task % n_chunks, &nb_begin, &nb_end);
    ChunkRange(m_blocks, m_chunks, task / n_chunks, &mb_begin, &mb_end);
    ConfigureTiles();  // tile state is per thread: configure on the thread that runs this task
    Scratch scratch;
    for (size_t nb = nb_begin; nb < nb_end; ++nb) {
      for (size_t mb = mb_begin; mb < mb_end; ++mb) {
        Block blk;
        blk.a = a + mb * kBlockM * lda;
        blk.lda = lda;
        blk.rows = Min(kBlockM, m - mb * kBlockM);
        blk.panel0 = packed + 2 * nb * panel_elems;
        blk.panel_elems = panel_elems;
        blk.k = k;
        blk.c = c + mb * kBlockM * ldc + nb * kBlockN;
        blk.ldc = ldc;
        blk.cols = Min(kBlockN, n - nb * kBlockN);
        const bool two_m = blk.rows > kTileM, two_n = blk.cols > kTileN;
        if (two_m && two_n) {
          ComputeBlock<2, 2>(blk, scratch);
        } else if (two_m) {
          ComputeBlock<2, 1>(blk, scratch);
        } else if (two_n) {
          ComputeBlock<1, 2>(blk, scratch);
        } else {
          ComputeBlock<1, 1>(blk, scratch);
        }
      }
    }
    TileRelease();
  });
}

}  // namespace

extern const GemmBf16Kernels kGemmBf16 = {PackedBSize, PackB, Gemm};

}  // namespace DSV4_AMX_NS
}  // namespace dsv4
