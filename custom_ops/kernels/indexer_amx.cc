// AMX Indexer (indexer.h) for bf16 inputs: the q . key products on AMX-BF16 tiles through numerics/amx_tile.h, the
// relu / weighted head sum on vectors, the radix top-k of topk_select.h. fp32 inputs take the vector path of
// indexer_simd.inc (AMX has no fp32 product, and rounding the inputs to bf16 could reorder close scores). Built
// twice: with AMX flags as dsv4::amx (AVX512 vectors) and with -DDSV4_AMX_EMULATION as dsv4::amx_emu (kernel tests;
// software tiles and portable vectors). bf16 x bf16 products are exact and accumulate in fp32, as in the spec, so
// the scores match indexer_ref.cc within fp32 summation-order rounding.
//
// Per query, entries in blocks of 32: scores^T = K Q^T with A = 16 key rows x 32 channels, loaded straight from the
// keys (rows are contiguous; a padded copy only for a block that would run past the buffer or a width that is not a
// multiple of 32), B = the query in VNNI order qt [cIp/2][HGp][2] (channel pairs down, heads across), packed once
// per query, C = 16 entries x 16 heads; a 2 x 2 block of C tiles covers 32 entries x 32 heads per pass over the
// channels. The C tiles go to sc [32][HGp] and every entry's row of head dots is reduced on vectors.
#include "custom_ops/kernels/isa_prelude.h"

#include <cstdlib>

#include "custom_ops/kernels/indexer.h"
#include "custom_ops/kernels/topk_select.h"
#include "custom_ops/numerics/amx_tile.h"
#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace DSV4_AMX_NS {
namespace {

#if !defined(DSV4_AMX_EMULATION)
#include "custom_ops/kernels/simd_avx512.inc"
#else
#include "custom_ops/kernels/simd_portable.inc"
#endif

constexpr int kIdxSlabs = 4;
constexpr int kIdxKeys = 6;
constexpr int64_t kIdxKeyBlock = 48;

#include "custom_ops/kernels/indexer_simd.inc"

constexpr int64_t kTileRows = 32;  // entries per block
constexpr int64_t kPrefetchBlocks = 4;  // about 32 KiB ahead for 128-channel bf16 keys
constexpr int kPrefetchLocality = 2;  // prefetcht1: into L2
constexpr int kC0 = 0, kC1 = 1, kC2 = 2, kC3 = 3, kA0 = 4, kA1 = 5, kB0 = 6, kB1 = 7;

struct IdxTileScorer {
  uint16_t* qt = nullptr;  // [cIp/2][HGp][2]
  float* wq = nullptr;     // [HGp]
  uint16_t* kc = nullptr;  // [32][cIp] padded copy of a block
  float* sc = nullptr;     // [32][HGp] head dots of a block

  static size_t Bytes(const IdxGeometry& g) {
    return IdxArena::Bytes(g.cIp * g.HGp, 2) + IdxArena::Bytes(g.HGp, 4) + IdxArena::Bytes(kTileRows * g.cIp, 2) +
           IdxArena::Bytes(kTileRows * g.HGp, 4);
  }
  void Init(IdxArena& a, const IdxGeometry& g) {
    qt = a.Take<uint16_t>(g.cIp * g.HGp);
    wq = a.Take<float>(g.HGp);
    kc = a.Take<uint16_t>(kTileRows * g.cIp);
    sc = a.Take<float>(kTileRows * g.HGp);
  }
  void Begin() {
    TileConfig cfg;
    for (int t = 0; t < kNumTiles; ++t) cfg.Set(t, 16, kTileMaxColsb);
    TileLoadConfig(cfg);
  }
  void End() { TileRelease(); }

  // qt[k2][h][2] = (q[h][2 k2], q[h][2 k2 + 1]); 0 for padding heads and channels.
  void Prepare(const uint16_t* q, const float* weights, const IdxGeometry& g) {
    std::memset(qt, 0, sizeof(uint16_t) * g.cIp * g.HGp);
    for (int64_t h = 0; h < g.nI; ++h) {
      for (int64_t d = 0; d < g.cI; ++d) qt[((d / 2) * g.HGp + h) * 2 + (d & 1)] = q[h * g.cI + d];
    }
    for (int64_t h = 0; h < g.HGp; ++h) wq[h] = h < g.nI ? weights[h] * g.heads_scale : 0.0f;
  }

  // sc = the 32 rows at a (row stride lda elements) times qt, every head.
  void Dots(const uint16_t* a, int64_t lda, const IdxGeometry& g) {
    const size_t a_stride = lda * sizeof(uint16_t), b_stride = g.HGp * 2 * sizeof(uint16_t);
    const size_t c_stride = g.HGp * sizeof(float);
    for (int64_t t = 0; t < g.HGp / 16; t += 2) {
      TileZero<kC0>();
      TileZero<kC1>();
      TileZero<kC2>();
      TileZero<kC3>();
      for (int64_t s = 0; s < g.cIp / 32; ++s) {
        TileLoad<kA0>(a + s * 32, a_stride);
        TileLoad<kA1>(a + 16 * lda + s * 32, a_stride);
        TileLoad<kB0>(qt + (s * 16 * g.HGp + t * 16) * 2, b_stride);
        TileLoad<kB1>(qt + (s * 16 * g.HGp + t * 16 + 16) * 2, b_stride);
        TileDpbf16ps<kC0, kA0, kB0>();
        TileDpbf16ps<kC1, kA0, kB1>();
        TileDpbf16ps<kC2, kA1, kB0>();
        TileDpbf16ps<kC3, kA1, kB1>();
      }
      TileStore<kC0>(sc + t * 16, c_stride);
      TileStore<kC1>(sc + t * 16 + 16, c_stride);
      TileStore<kC2>(sc + 16 * g.HGp + t * 16, c_stride);
      TileStore<kC3>(sc + 16 * g.HGp + t * 16 + 16, c_stride);
    }
  }

  void Score(const uint16_t* kb, int64_t j0, int64_t j1, const IdxGeometry& g, float* score) {
    const Vf vh = VSet1(g.head_dim_scale);
    const int64_t ahead = kPrefetchBlocks * kTileRows;
    const char* pf_end = reinterpret_cast<const char*>(kb + j1 * g.cI);
    for (int64_t j = j0; j < j1; j += kTileRows) {
      const int64_t nb = IdxMin(kTileRows, j1 - j);
      // Tile loads do not train the hardware prefetcher: ask for the block kPrefetchBlocks ahead.
      const char* pf = reinterpret_cast<const char*>(kb + (j + ahead) * g.cI);
      for (int64_t off = 0; off < kTileRows * g.cI * 2 && pf + off < pf_end; off += 64) {
        __builtin_prefetch(pf + off, 0, kPrefetchLocality);
      }
      if (g.cI == g.cIp && j + kTileRows <= g.capacity) {
        Dots(kb + j * g.cI, g.cI, g);
      } else {
        for (int64_t r = 0; r < kTileRows; ++r) {
          uint16_t* dst = kc + r * g.cIp;
          if (r < nb) {
            std::memcpy(dst, kb + (j + r) * g.cI, sizeof(uint16_t) * g.cI);
            std::memset(dst + g.cI, 0, sizeof(uint16_t) * (g.cIp - g.cI));
          } else {
            std::memset(dst, 0, sizeof(uint16_t) * g.cIp);
          }
        }
        Dots(kc, g.cIp, g);
      }
      for (int64_t r = 0; r < nb; ++r) {
        const float* row = sc + r * g.HGp;
        Vf sum = VZero();
        for (int64_t s = 0; s < g.HGp; s += kLanes) {
          const Vf t = VMul(VMax(VZero(), VLoad(row + s)), vh);  // relu; NaN stays NaN
          sum = VFma(t, VLoad(wq + s), sum);
        }
        score[j + r] = VSum(sum);
      }
    }
  }
};

void TopKF32(const float* q, const float* weights, const float* keys, const int64_t* start_pos,
             const IndexerDims& dims, int64_t* indices, const Parallel& par) {
  IdxTopK(q, weights, keys, start_pos, dims, indices, par);
}

void TopKBf16(const uint16_t* q, const float* weights, const uint16_t* keys, const int64_t* start_pos,
              const IndexerDims& dims, int64_t* indices, const Parallel& par) {
  IdxTopK<uint16_t, IdxTileScorer>(q, weights, keys, start_pos, dims, indices, par,
                                   MakeIdxGeometry(dims, par.num_threads));
}

}  // namespace

const IndexerKernels kIndexer = {&TopKF32, &TopKBf16};

}  // namespace DSV4_AMX_NS
}  // namespace dsv4
