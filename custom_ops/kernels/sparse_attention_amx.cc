// AMX SparseAttention (sparse_attention.h): both products on AMX-BF16 tiles through numerics/amx_tile.h. bf16
// inputs go to the tiles as they are; fp32 inputs, in decode as in prefill, are split exactly into three bf16 pieces
// and multiplied with six tile products (see "fp32 on tiles" below), which is as accurate as fp32 arithmetic. Built
// twice: with AMX flags as dsv4::amx (shipped; the vector code uses AVX512) and with -DDSV4_AMX_EMULATION as
// dsv4::amx_emu (kernel tests; software tiles and portable vector code). Must match sparse_attention_ref.cc within
// fp32 accumulation error; the spec's bf16 rounding points are kept exactly: the probabilities are normalised and
// rounded to bf16 before they enter the PV product (which AMX then takes as is), and the output is rounded before the
// inverse RoPE.
//
// bf16, per query and group of heads (see sparse_attention_simd.inc for the surrounding algorithm and the split of
// decode into key ranges), keys in blocks of 32:
//   QK   L^T = K Q^T: A = 16 key rows x 32 channels, copied from the gathered rows into kc [32][Dp] (a tile needs a
//        fixed row stride); B = the query in VNNI order, qt [Dp/2][HGp][2] (channel pairs down, heads across),
//        packed once per query; C = 16 keys x 16 heads, stored straight into L [key][head] (heads in lanes, as the
//        vector softmax wants). A 2 x 2 block of C tiles: 32 keys x 32 heads per pass over the channels.
//   PV   O = P V: A = the probabilities transposed to pt [HGp][n32] bf16 (16 heads x 32 keys per tile row); B = the
//        keys with consecutive pairs interleaved, vi [n32/2][Dp][2] (key pairs down, channels across), built from
//        kc while the block is at hand; C = 16 heads x 16 channels, a 2 x 2 block over the whole key range, then
//        stored into O [HGp][Dp].
// Key counts are padded to 32 with zero rows (zero keys and zero probabilities contribute +0); padded heads have
// zero queries and are never stored.
#include "custom_ops/kernels/isa_prelude.h"

#include <cstdlib>
#include <new>

#include "custom_ops/kernels/sparse_attention.h"
#include "custom_ops/kernels/sparse_attention_keys.h"
#include "custom_ops/numerics/amx_tile.h"
#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace DSV4_AMX_NS {
namespace {

constexpr int64_t kKeyBlock = 48;  // for the vector (fp32) path
constexpr int kQkSlabs = 4;
constexpr int kQkKeys = 6;
constexpr int kQkKeys1 = 12;
constexpr int kPvHeads = 8;
constexpr int kPvVecs = 3;

#if !defined(DSV4_AMX_EMULATION)
#include "custom_ops/kernels/simd_avx512.inc"
#else
#include "custom_ops/kernels/simd_portable.inc"
#endif

#include "custom_ops/kernels/sparse_attention_simd.inc"
#include "custom_ops/kernels/sparse_attention_pairs.inc"

// ---------------------------------------------------------------------------------------------------------------
// bf16 on tiles.

constexpr int64_t kTileKeys = 32;  // keys per QK block and per PV step
constexpr int64_t kPrefetchBlocks = 2;  // key blocks requested ahead of the one being multiplied
// Tile registers: C 0..3, A 4..5, B 6..7.
constexpr int kC0 = 0, kC1 = 1, kC2 = 2, kC3 = 3, kA0 = 4, kA1 = 5, kB0 = 6, kB1 = 7;

void ConfigureTiles() {
  TileConfig cfg;
  for (int t = 0; t < kNumTiles; ++t) cfg.Set(t, 16, kTileMaxColsb);
  TileLoadConfig(cfg);
}


// kc[r][0, Dp) = rows[r] (bf16, zero past D) for r < nb, zero rows up to kTileKeys.
template <class X>
void CopyKeyBlock(const void* const* rows, int64_t nb, const Geometry& g, uint16_t* kc) {
  for (int64_t r = 0; r < kTileKeys; ++r) {
    uint16_t* dst = kc + r * g.Dp;
    if (r < nb) {
      if constexpr (sizeof(X) == sizeof(float)) {
        StoreRow(static_cast<const float*>(rows[r]), g.D, dst);  // float keys rounded (compute="bf16")
      } else {
        std::memcpy(dst, rows[r], sizeof(uint16_t) * g.D);
      }
      if (g.Dp > g.D) std::memset(dst + g.D, 0, sizeof(uint16_t) * (g.Dp - g.D));
    } else {
      std::memset(dst, 0, sizeof(uint16_t) * g.Dp);
    }
  }
}

// Walks the lines of a list of rows, a few prefetches at a time, so that requests for the next key blocks are spread
// over the tile work instead of stalling it in one burst (the rows are scattered, so the hardware prefetcher only
// sees each one briefly).
struct LinePrefetcher {
  const void* const* rows = nullptr;
  int64_t n = 0;
  size_t row_bytes = 0;
  int64_t r = 0;
  size_t off = 0;
  // kLocality: __builtin_prefetch's (3: into L1, 2: into L2).
  template <int kLocality = 3>
  void Issue(int lines) {
    for (; lines > 0 && r < n; --lines) {
      __builtin_prefetch(static_cast<const char*>(rows[r]) + off, 0, kLocality);
      off += 64;
      if (off >= row_bytes) {
        off = 0;
        ++r;
      }
    }
  }
};


// L rows [0, 32) (ld HGp) = scale * kc [32 keys] . qt for every head tile; pf issues prefetches along the way.
void QkTiles(const uint16_t* kc, const uint16_t* qt, const Geometry& g, float* L, LinePrefetcher& pf, int per_step) {
  const int64_t head_tiles = g.HGp / 16, steps = g.Dp / 32;
  const size_t a_stride = g.Dp * sizeof(uint16_t), b_stride = g.HGp * 2 * sizeof(uint16_t);
  const size_t c_stride = g.HGp * sizeof(float);
  int64_t t = 0;
  for (; t + 2 <= head_tiles; t += 2) {
    TileZero<kC0>();
    TileZero<kC1>();
    TileZero<kC2>();
    TileZero<kC3>();
    for (int64_t s = 0; s < steps; ++s) {
      TileLoad<kA0>(kc + s * 32, a_stride);
      TileLoad<kA1>(kc + 16 * g.Dp + s * 32, a_stride);
      TileLoad<kB0>(qt + (s * 16 * g.HGp + t * 16) * 2, b_stride);
      TileLoad<kB1>(qt + (s * 16 * g.HGp + t * 16 + 16) * 2, b_stride);
      TileDpbf16ps<kC0, kA0, kB0>();
      TileDpbf16ps<kC1, kA0, kB1>();
      TileDpbf16ps<kC2, kA1, kB0>();
      TileDpbf16ps<kC3, kA1, kB1>();
      pf.Issue(per_step);
    }
    TileStore<kC0>(L + t * 16, c_stride);
    TileStore<kC1>(L + t * 16 + 16, c_stride);
    TileStore<kC2>(L + 16 * g.HGp + t * 16, c_stride);
    TileStore<kC3>(L + 16 * g.HGp + t * 16 + 16, c_stride);
  }
  if (t < head_tiles) {
    TileZero<kC0>();
    TileZero<kC2>();
    for (int64_t s = 0; s < steps; ++s) {
      TileLoad<kA0>(kc + s * 32, a_stride);
      TileLoad<kA1>(kc + 16 * g.Dp + s * 32, a_stride);
      TileLoad<kB0>(qt + (s * 16 * g.HGp + t * 16) * 2, b_stride);
      TileDpbf16ps<kC0, kA0, kB0>();
      TileDpbf16ps<kC2, kA1, kB0>();
      pf.Issue(per_step);
    }
    TileStore<kC0>(L + t * 16, c_stride);
    TileStore<kC2>(L + 16 * g.HGp + t * 16, c_stride);
  }
}

// pt[h * ldpt + j] = Lrows[j * HGp + h] for j < 32 (0 for j >= nvalid), h < HGp. The probabilities are bf16 values
// already (rounded by the softmax), so dropping the low half of each float is exact.
void TransposeBlock(const float* Lrows, int64_t nvalid, const Geometry& g, int64_t ldpt, uint16_t* pt) {
#if !defined(DSV4_AMX_EMULATION)
  for (int64_t h0 = 0; h0 < g.HGp; h0 += 16) {
    for (int64_t jb = 0; jb < kTileKeys; jb += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        r[j] = jb + j < nvalid ? _mm512_castps_si512(_mm512_loadu_ps(Lrows + (jb + j) * g.HGp + h0))
                               : _mm512_setzero_si512();
      }
      Transpose16(r);
      for (int h = 0; h < 16; ++h) {
        const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[h], 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + (h0 + h) * ldpt + jb), b);
      }
    }
  }
#else
  for (int64_t h = 0; h < g.HGp; ++h) {
    for (int64_t j = 0; j < kTileKeys; ++j) {
      pt[h * ldpt + j] = j < nvalid ? F32ToBf16(Lrows[j * g.HGp + h]) : uint16_t{0};
    }
  }
#endif
}

// C tiles (head tiles t[, t+1] x channel tiles d0, d0+16) += sum over the piece pairs (a, b) of pt[a] x vi[b], over
// `steps` key steps of 32. pt[a]: [HGp][kChunk] probabilities; vi[b]: [kChunk/2][Dp][2] key pairs interleaved. The
// pairs are ordered so that one A pair stays loaded across consecutive B pieces.
template <bool kTwoHeadTiles, int kNumPairs>
void ValueProducts(const uint16_t* const* pt, const uint16_t* const* vi, const int (&pairs)[kNumPairs][2],
                   int64_t ldpt, const Geometry& g, int64_t t, int64_t d0, int64_t steps) {
  const size_t a_stride = ldpt * sizeof(uint16_t), b_stride = g.Dp * 2 * sizeof(uint16_t);
  for (int64_t s = 0; s < steps; ++s) {
    int loaded_a = -1;
    for (const auto& pr : pairs) {
      if (pr[0] != loaded_a) {
        TileLoad<kA0>(pt[pr[0]] + t * 16 * ldpt + s * kTileKeys, a_stride);
        if constexpr (kTwoHeadTiles) TileLoad<kA1>(pt[pr[0]] + (t * 16 + 16) * ldpt + s * kTileKeys, a_stride);
        loaded_a = pr[0];
      }
      const uint16_t* b = vi[pr[1]] + (s * 16 * g.Dp + d0) * 2;
      TileLoad<kB0>(b, b_stride);
      TileLoad<kB1>(b + 32, b_stride);
      TileDpbf16ps<kC0, kA0, kB0>();
      TileDpbf16ps<kC1, kA0, kB1>();
      if constexpr (kTwoHeadTiles) {
        TileDpbf16ps<kC2, kA1, kB0>();
        TileDpbf16ps<kC3, kA1, kB1>();
      }
    }
  }
}

// O [HGp][Dp] += the products of one chunk (`steps` key steps): 2 x 2 C tiles of 16 heads x 16 channels, loaded
// from O and stored back once per chunk.
template <int kNumPairs>
void ChunkOutput(const uint16_t* const* pt, const uint16_t* const* vi, const int (&pairs)[kNumPairs][2],
                 int64_t ldpt, const Geometry& g, int64_t steps, float* O) {
  const int64_t head_tiles = g.HGp / 16;
  const size_t c_stride = g.Dp * sizeof(float);
  for (int64_t d0 = 0; d0 < g.Dp; d0 += 32) {
    int64_t t = 0;
    for (; t + 2 <= head_tiles; t += 2) {
      float* o = O + t * 16 * g.Dp + d0;
      TileLoad<kC0>(o, c_stride);
      TileLoad<kC1>(o + 16, c_stride);
      TileLoad<kC2>(o + 16 * g.Dp, c_stride);
      TileLoad<kC3>(o + 16 * g.Dp + 16, c_stride);
      ValueProducts<true>(pt, vi, pairs, ldpt, g, t, d0, steps);
      TileStore<kC0>(o, c_stride);
      TileStore<kC1>(o + 16, c_stride);
      TileStore<kC2>(o + 16 * g.Dp, c_stride);
      TileStore<kC3>(o + 16 * g.Dp + 16, c_stride);
    }
    if (t < head_tiles) {
      float* o = O + t * 16 * g.Dp + d0;
      TileLoad<kC0>(o, c_stride);
      TileLoad<kC1>(o + 16, c_stride);
      ValueProducts<false>(pt, vi, pairs, ldpt, g, t, d0, steps);
      TileStore<kC0>(o, c_stride);
      TileStore<kC1>(o + 16, c_stride);
    }
  }
}

// bf16 products on tiles: the product policy of the driver in sparse_attention_simd.inc for bf16 inputs (X =
// uint16_t) and for float inputs multiplied as bf16 (X = float, compute="bf16": the query and each key block rounded
// where they are copied). QK on blocks of 32 keys copied into kc; PV on chunks of kChunk keys: the chunk's keys
// interleaved by pairs into vi and its probabilities transposed into pt, then one product per key step.
template <class X>
struct TileQkBf16 {
  static constexpr int64_t kChunk = 256;
  static constexpr int kPairs[1][2] = {{0, 0}};
  uint16_t* qt = nullptr;  // [Dp/2][HGp][2]
  uint16_t* kc = nullptr;  // [32][Dp]
  uint16_t* vi = nullptr;  // [kChunk/2][Dp][2]
  uint16_t* pt = nullptr;  // [HGp][kChunk]

  static size_t Bytes(const Geometry& g) {
    return Arena::Bytes(g.Dp * g.HGp, 2) + Arena::Bytes(kTileKeys * g.Dp, 2) + Arena::Bytes(kChunk * g.Dp, 2) +
           Arena::Bytes(g.HGp * kChunk, 2);
  }
  void Init(Arena& a, const Geometry& g) {
    qt = a.Take<uint16_t>(g.Dp * g.HGp);
    kc = a.Take<uint16_t>(kTileKeys * g.Dp);
    vi = a.Take<uint16_t>(kChunk * g.Dp);
    pt = a.Take<uint16_t>(g.HGp * kChunk);
  }
  void Begin() { ConfigureTiles(); }
  void End() { TileRelease(); }
  void Prepare(const X* q_rows, int64_t count, const Geometry& g) {
    if constexpr (sizeof(X) == sizeof(float)) {
      StoreRow(q_rows, count * g.D, vi);  // rounded into vi (kChunk x Dp >= 64 heads x D; free until Output)
      PackQt(vi, count, g, qt);
    } else {
      PackQt(q_rows, count, g, qt);
    }
  }

  void Logits(const Geometry& g, TaskMemory& m, int64_t j0, int64_t j1, float scale, float* L) {
    // Prefetches run kPrefetchBlocks blocks ahead of the block being multiplied; the lines of one block are spread
    // over the tile steps of an earlier one.
    LinePrefetcher pf{m.rows + j0, j1 - j0, static_cast<size_t>(g.D) * g.elem};
    const int64_t lines_per_block = kTileKeys * ((g.D * 2 + 63) / 64);
    const int64_t steps_per_block = (g.HGp / 32 + (g.HGp % 32 != 0)) * (g.Dp / 32);
    const int per_step = static_cast<int>((lines_per_block + steps_per_block - 1) / steps_per_block);
    pf.Issue(static_cast<int>(lines_per_block * kPrefetchBlocks));
    for (int64_t j = j0; j < j1; j += kTileKeys) {
      const int64_t nb = MinI(kTileKeys, j1 - j);
      CopyKeyBlock<X>(m.rows + j, nb, g, kc);
      float* Lb = L + j * g.HGp;
      QkTiles(kc, qt, g, Lb, pf, per_step);
      const Vf vs = VSet1(scale);
      for (int64_t r = 0; r < nb; ++r) {
        for (int64_t l = 0; l < g.HGp; l += kLanes) VStore(Lb + r * g.HGp + l, VMul(VLoad(Lb + r * g.HGp + l), vs));
      }
    }
  }

  void Output(const Geometry& g, TaskMemory& m, int64_t count, int64_t j0, int64_t j1, const float* L, float* O) {
    const uint16_t* const pts[1] = {pt};
    const uint16_t* const vis[1] = {vi};
    for (int64_t c0 = j0; c0 < j1; c0 += kChunk) {
      const int64_t nk = MinI(kChunk, j1 - c0);
      const int64_t keys32 = RoundUp(nk, kTileKeys);
      for (int64_t jb = 0; jb < keys32; jb += kTileKeys) {
        const int64_t nb = MinI(kTileKeys, nk - jb);
        CopyKeyBlock<X>(m.rows + c0 + jb, nb, g, kc);
        for (int64_t p = 0; p < kTileKeys / 2; ++p) {
          InterleavePair(kc + 2 * p * g.Dp, kc + (2 * p + 1) * g.Dp, g.Dp, vi + (jb / 2 + p) * g.Dp * 2);
        }
        TransposeBlock(L + (c0 + jb) * g.HGp, nb, g, kChunk, pt + jb);
      }
      ChunkOutput(pts, vis, kPairs, kChunk, g, keys32 / kTileKeys, O);
    }
    (void)count;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// fp32 on tiles: every fp32 value x is split exactly into three bf16 pieces by truncation,
// x = hi + mid + lo (hi = the top 16 bits of x; mid = the top 16 bits of x - hi, which is exact; lo = the rest,
// which has at most 8 significant bits), and q . k is accumulated in fp32 from the six products whose pieces add up
// to at most "mid" order: hh + hm + hl + mh + mm + lh. The three dropped products are below 2^-24 of |q_d k_d|
// each (tiny pieces below 2^-126 are flushed by the tile unit), so the logits are as accurate as an fp32 dot
// product in another summation order. The same split serves both products (the Range policy of the fp32 drivers in
// sparse_attention_simd.inc). A range of keys (an item's, or one of a split item's) is streamed in chunks of 64:
//   split    each key row is fetched once and split into both layouts at once: kp [key][Dp] per piece (A of QK) and
//            vi [key pair][Dp][2] per piece (B of PV)
//   QK       32-key blocks as in the bf16 path (A = key pieces, B = query pieces), C = 32 keys x 32 heads into lc
//   softmax  online over the chunks: the running max per head grows to cover the chunk, the running sum and the
//            output rows are rescaled by exp(m_old - m_new) where it grew, and lc becomes exp(l - m)
//   PV       A = those values' pieces transposed (pt), B = vi, C = 2 x 2 tiles of 16 heads x 16 channels accumulated
//            into O (loaded and stored once per chunk)
// The heads are the tile columns, so in decode (one query, up to 64 heads per item) one split key block serves all
// of them. The range ends with its max, sum and unnormalised output, merged with the sink by the driver.

// hi / mid / lo bf16 pieces of src[0, n), zero in [n, np).
void SplitRow3(const float* src, int64_t n, int64_t np, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  int64_t i = 0;
#if !defined(DSV4_AMX_EMULATION)
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (; i < np; i += 16) {
    const __mmask16 m = TailMask(n - i > 0 ? n - i : 0);
    const __m512 x = _mm512_maskz_loadu_ps(m, src + i);
    const __m512i xb = _mm512_castps_si512(x);
    const __m512i hb = _mm512_and_si512(xb, top);
    const __m512 r1 = _mm512_sub_ps(x, _mm512_castsi512_ps(hb));
    const __m512i mb = _mm512_and_si512(_mm512_castps_si512(r1), top);
    const __m512 r2 = _mm512_sub_ps(r1, _mm512_castsi512_ps(mb));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(hb, 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(mid + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(mb, 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(r2), 16)));
  }
#endif
  for (; i < np; ++i) {
    const float x = i < n ? src[i] : 0.0f;
    uint32_t xb, r1b, r2b;
    std::memcpy(&xb, &x, 4);
    const uint32_t hb = xb & 0xffff0000u;
    float h, r1, mf, r2;
    std::memcpy(&h, &hb, 4);
    r1 = x - h;
    std::memcpy(&r1b, &r1, 4);
    const uint32_t mb = r1b & 0xffff0000u;
    std::memcpy(&mf, &mb, 4);
    r2 = r1 - mf;
    std::memcpy(&r2b, &r2, 4);
    hi[i] = static_cast<uint16_t>(hb >> 16);
    mid[i] = static_cast<uint16_t>(mb >> 16);
    lo[i] = static_cast<uint16_t>(r2b >> 16);
  }
}

// The pieces of two rows x and y (nullptr: a zero row) of n channels (zero in [n, np), np a multiple of 32): each
// row's pieces in row layout (kx[3], ky[3]: the A operand of QK) and both rows' pieces interleaved by channel,
// v[p][d] = (x_p[d], y_p[d]) (the B operand of PV: a pair of keys per 32-bit element). A piece keeps its value in
// the top 16 bits of a float, so the interleaved word is (x_p >> 16) | y_p, with no permutation.
void SplitPair3(const float* x, const float* y, int64_t n, int64_t np, uint16_t* const* kx, uint16_t* const* ky,
                uint16_t* const* v) {
  int64_t i = 0;
#if !defined(DSV4_AMX_EMULATION)
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (; i < np; i += 16) {
    const __mmask16 m = TailMask(n - i > 0 ? n - i : 0);
    const __m512 xv = x != nullptr ? _mm512_maskz_loadu_ps(m, x + i) : _mm512_setzero_ps();
    const __m512 yv = y != nullptr ? _mm512_maskz_loadu_ps(m, y + i) : _mm512_setzero_ps();
    __m512i px[3], py[3];
    px[0] = _mm512_and_si512(_mm512_castps_si512(xv), top);
    py[0] = _mm512_and_si512(_mm512_castps_si512(yv), top);
    const __m512 rx = _mm512_sub_ps(xv, _mm512_castsi512_ps(px[0]));
    const __m512 ry = _mm512_sub_ps(yv, _mm512_castsi512_ps(py[0]));
    px[1] = _mm512_and_si512(_mm512_castps_si512(rx), top);
    py[1] = _mm512_and_si512(_mm512_castps_si512(ry), top);
    px[2] = _mm512_castps_si512(_mm512_sub_ps(rx, _mm512_castsi512_ps(px[1])));
    py[2] = _mm512_castps_si512(_mm512_sub_ps(ry, _mm512_castsi512_ps(py[1])));
    for (int p = 0; p < 3; ++p) {
      const __m512i xs = _mm512_srli_epi32(px[p], 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(kx[p] + i), _mm512_cvtepi32_epi16(xs));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ky[p] + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(py[p], 16)));
      // y's piece is masked again: lo is the raw remainder, whose low 16 bits are zero only for normal values
      _mm512_storeu_si512(v[p] + 2 * i, _mm512_or_si512(xs, _mm512_and_si512(py[p], top)));
    }
  }
#else
  for (; i < np; ++i) {
    uint16_t xp[3] = {0, 0, 0}, yp[3] = {0, 0, 0};
    if (x != nullptr) SplitRow3(x + i, i < n ? 1 : 0, 1, &xp[0], &xp[1], &xp[2]);
    if (y != nullptr) SplitRow3(y + i, i < n ? 1 : 0, 1, &yp[0], &yp[1], &yp[2]);
    for (int p = 0; p < 3; ++p) {
      kx[p][i] = xp[p];
      ky[p][i] = yp[p];
      v[p][2 * i] = xp[p];
      v[p][2 * i + 1] = yp[p];
    }
  }
#endif
}

// Heads [h0, h0 + 16) of qt (VNNI, as PackQt) from `count` bf16 rows of Dp channels at stride `ld` (zero heads past
// count).
void PackQtRows16(const uint16_t* rows, int64_t ld, int64_t count, int64_t h0, const Geometry& g, uint16_t* qt) {
#if !defined(DSV4_AMX_EMULATION)
  for (int64_t d0 = 0; d0 < g.Dp; d0 += 32) {
    __m512i r[16];
    for (int h = 0; h < 16; ++h) r[h] = h < count ? _mm512_loadu_si512(rows + h * ld + d0) : _mm512_setzero_si512();
    Transpose16(r);
    for (int k = 0; k < 16; ++k) _mm512_storeu_si512(qt + ((d0 / 2 + k) * g.HGp + h0) * 2, r[k]);
  }
#else
  uint32_t* dst = reinterpret_cast<uint32_t*>(qt);
  for (int64_t h = 0; h < 16; ++h) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(rows + h * ld);
    for (int64_t k2 = 0; k2 < g.Dp / 2; ++k2) dst[k2 * g.HGp + h0 + h] = h < count ? src[k2] : 0u;
  }
#endif
}

struct TileQkF32 {
  static constexpr int64_t kChunk = 64;  // keys per chunk (2 tile steps; the scratch stays small)
  uint16_t* qt[3] = {};  // [Dp/2][HGp][2] per piece
  uint16_t* qs = nullptr;  // [16][Dp] x 3: the pieces of 16 query heads before packing
  uint16_t* kp[3] = {};  // [kChunk][Dp] per piece: the chunk's keys (A of QK), zero rows up to a multiple of 32
  uint16_t* vi[3] = {};  // [kChunk/2][Dp][2] per piece: the same keys, consecutive pairs interleaved (B of PV)
  uint16_t* pt[3] = {};  // [HGp][kChunk] per piece: the chunk's exp(l - m) transposed (A of PV)
  float* lc = nullptr;   // [kChunk][HGp]: the chunk's logits, then exp(l - m)
  float* fac = nullptr;  // [HGp]: rescale factors of the running output

  static size_t Bytes(const Geometry& g) {
    return 3 * (Arena::Bytes(g.Dp * g.HGp, 2) + Arena::Bytes(16 * g.Dp, 2) + Arena::Bytes(kChunk * g.Dp, 2) +
                Arena::Bytes(kChunk * g.Dp, 2) + Arena::Bytes(g.HGp * kChunk, 2)) +
           Arena::Bytes(kChunk * g.HGp, 4) + Arena::Bytes(g.HGp, 4);
  }
  void Init(Arena& a, const Geometry& g) {
    for (int p = 0; p < 3; ++p) qt[p] = a.Take<uint16_t>(g.Dp * g.HGp);
    qs = a.Take<uint16_t>(3 * 16 * g.Dp);
    for (int p = 0; p < 3; ++p) kp[p] = a.Take<uint16_t>(kChunk * g.Dp);
    for (int p = 0; p < 3; ++p) vi[p] = a.Take<uint16_t>(kChunk * g.Dp);
    for (int p = 0; p < 3; ++p) pt[p] = a.Take<uint16_t>(g.HGp * kChunk);
    lc = a.Take<float>(kChunk * g.HGp);
    fac = a.Take<float>(g.HGp);
  }
  void Begin() { ConfigureTiles(); }
  void End() { TileRelease(); }

  void Prepare(const float* q_rows, int64_t count, const Geometry& g) {
    uint16_t* piece[3] = {qs, qs + 16 * g.Dp, qs + 2 * 16 * g.Dp};
    for (int64_t h0 = 0; h0 < g.HGp; h0 += 16) {
      const int64_t n = MinI(16, MaxI(0, count - h0));
      for (int64_t h = 0; h < n; ++h) {
        SplitRow3(q_rows + (h0 + h) * g.D, g.D, g.Dp, piece[0] + h * g.Dp, piece[1] + h * g.Dp, piece[2] + h * g.Dp);
      }
      for (int p = 0; p < 3; ++p) PackQtRows16(piece[p], g.Dp, n, h0, g, qt[p]);
    }
  }

  // C tiles (2 x 2: 32 keys x 32 heads at head tile t) += the six piece products over all channel steps; the keys
  // are chunk rows [r0, r0 + 32). pf issues per_step prefetches per channel step.
  template <bool kTwoHeadTiles>
  void Products(const Geometry& g, int64_t r0, int64_t t, LinePrefetcher& pf, int per_step) {
    const size_t a_stride = g.Dp * sizeof(uint16_t), b_stride = g.HGp * 2 * sizeof(uint16_t);
    const int64_t steps = g.Dp / 32;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t b_off = (s * 16 * g.HGp + t * 16) * 2;
      // (a, b) piece pairs in an order that keeps one A pair loaded across several B pieces.
      constexpr int kPairs[6][2] = {{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {2, 0}};
      int loaded_a = -1;
      for (const auto& pr : kPairs) {
        if (pr[0] != loaded_a) {
          TileLoad<kA0>(kp[pr[0]] + r0 * g.Dp + s * 32, a_stride);
          TileLoad<kA1>(kp[pr[0]] + (r0 + 16) * g.Dp + s * 32, a_stride);
          loaded_a = pr[0];
        }
        TileLoad<kB0>(qt[pr[1]] + b_off, b_stride);
        if constexpr (kTwoHeadTiles) TileLoad<kB1>(qt[pr[1]] + b_off + 32, b_stride);
        TileDpbf16ps<kC0, kA0, kB0>();
        TileDpbf16ps<kC2, kA1, kB0>();
        if constexpr (kTwoHeadTiles) {
          TileDpbf16ps<kC1, kA0, kB1>();
          TileDpbf16ps<kC3, kA1, kB1>();
        }
      }
      pf.Issue<2>(per_step);
    }
  }

  // kp / vi pieces of the nk keys rows[0, nk) (zero keys up to the next multiple of 32), two keys at a time.
  void SplitChunk(const Geometry& g, const void* const* rows, int64_t nk) {
    const int64_t rows32 = RoundUp(nk, kTileKeys);
    for (int64_t r = 0; r < rows32; r += 2) {
      const float* x = r < nk ? static_cast<const float*>(rows[r]) : nullptr;
      const float* y = r + 1 < nk ? static_cast<const float*>(rows[r + 1]) : nullptr;
      uint16_t* const kx[3] = {kp[0] + r * g.Dp, kp[1] + r * g.Dp, kp[2] + r * g.Dp};
      uint16_t* const ky[3] = {kx[0] + g.Dp, kx[1] + g.Dp, kx[2] + g.Dp};
      uint16_t* const v[3] = {vi[0] + (r / 2) * g.Dp * 2, vi[1] + (r / 2) * g.Dp * 2, vi[2] + (r / 2) * g.Dp * 2};
      SplitPair3(x, y, g.D, g.Dp, kx, ky, v);
    }
  }

  // lc rows [0, 32 * blocks) = scale * the chunk's keys . q for every head.
  void ChunkLogits(const Geometry& g, int64_t blocks, float scale, LinePrefetcher& pf, int per_step) {
    const int64_t head_tiles = g.HGp / 16;
    const size_t c_stride = g.HGp * sizeof(float);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = b * kTileKeys;
      float* Lb = lc + r0 * g.HGp;
      int64_t t = 0;
      for (; t + 2 <= head_tiles; t += 2) {
        TileZero<kC0>();
        TileZero<kC1>();
        TileZero<kC2>();
        TileZero<kC3>();
        Products<true>(g, r0, t, pf, per_step);
        TileStore<kC0>(Lb + t * 16, c_stride);
        TileStore<kC1>(Lb + t * 16 + 16, c_stride);
        TileStore<kC2>(Lb + 16 * g.HGp + t * 16, c_stride);
        TileStore<kC3>(Lb + 16 * g.HGp + t * 16 + 16, c_stride);
      }
      if (t < head_tiles) {
        TileZero<kC0>();
        TileZero<kC2>();
        Products<false>(g, r0, t, pf, per_step);
        TileStore<kC0>(Lb + t * 16, c_stride);
        TileStore<kC2>(Lb + 16 * g.HGp + t * 16, c_stride);
      }
    }
    const Vf vs = VSet1(scale);
    for (int64_t i = 0; i < blocks * kTileKeys * g.HGp; i += kLanes) VStore(lc + i, VMul(VLoad(lc + i), vs));
  }

  // Keys [j0, j1) streamed in chunks: split (once, into both layouts), QK, online softmax, PV.
  void Range(const Geometry& g, TaskMemory& m, int64_t count, int64_t j0, int64_t j1, float scale, float* O,
             float* st_m, float* st_z) {
    static constexpr int kPairs[6][2] = {{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {2, 0}};
    const uint16_t* const pts[3] = {pt[0], pt[1], pt[2]};
    const uint16_t* const vis[3] = {vi[0], vi[1], vi[2]};
    for (int64_t l = 0; l < g.HGp; ++l) {
      st_m[l] = -__builtin_inff();
      st_z[l] = 0.0f;
    }
    // The rows are scattered and read once: the next chunk's lines are requested into L2 during this chunk's QK
    // tiles (a chunk ahead is more than L1 holds).
    LinePrefetcher pf{m.rows + j0, j1 - j0, static_cast<size_t>(g.D) * sizeof(float)};
    const int64_t lines_per_chunk = kChunk * ((g.D * 4 + 63) / 64);
    const int64_t steps_per_chunk = (kChunk / kTileKeys) * (g.HGp / 32 + (g.HGp % 32 != 0)) * (g.Dp / 32);
    const int per_step = static_cast<int>((lines_per_chunk + steps_per_chunk - 1) / steps_per_chunk);
    pf.Issue<2>(static_cast<int>(lines_per_chunk));
    for (int64_t c0 = j0; c0 < j1; c0 += kChunk) {
      const int64_t nk = MinI(kChunk, j1 - c0);
      const int64_t blocks = RoundUp(nk, kTileKeys) / kTileKeys;
      SplitChunk(g, m.rows + c0, nk);
      ChunkLogits(g, blocks, scale, pf, per_step);
      OnlineSoftmaxStep(lc, nk, g.HGp, count, g.Dp, O, st_m, st_z, fac);
      BuildProbabilities(g, lc, 0, nk);
      ChunkOutput(pts, vis, kPairs, kChunk, g, blocks, O);
    }
  }

  // pt pieces of the values in lc rows [c0, c0 + nk) (zero columns up to the next multiple of 32).
  void BuildProbabilities(const Geometry& g, const float* L, int64_t c0, int64_t nk) {
    const int64_t cols = RoundUp(nk, kTileKeys);
#if !defined(DSV4_AMX_EMULATION)
    const __m512i top = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t h0 = 0; h0 < g.HGp; h0 += 16) {
      for (int64_t jb = 0; jb < cols; jb += 16) {
        __m512i hi[16], mid[16], lo[16];  // the pieces' bits, for the 32-bit transpose
        for (int j = 0; j < 16; ++j) {
          const __m512 x = jb + j < nk ? _mm512_loadu_ps(L + (c0 + jb + j) * g.HGp + h0) : _mm512_setzero_ps();
          hi[j] = _mm512_and_si512(_mm512_castps_si512(x), top);
          const __m512 r1 = _mm512_sub_ps(x, _mm512_castsi512_ps(hi[j]));
          mid[j] = _mm512_and_si512(_mm512_castps_si512(r1), top);
          lo[j] = _mm512_castps_si512(_mm512_sub_ps(r1, _mm512_castsi512_ps(mid[j])));
        }
        __m512i* piece[3] = {hi, mid, lo};
        for (int pc = 0; pc < 3; ++pc) {
          Transpose16(piece[pc]);
          for (int h = 0; h < 16; ++h) {
            const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(piece[pc][h], 16));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt[pc] + (h0 + h) * kChunk + jb), b);
          }
        }
      }
    }
#else
    for (int64_t h = 0; h < g.HGp; ++h) {
      for (int64_t j = 0; j < cols; ++j) {
        uint16_t out[3] = {0, 0, 0};
        if (j < nk) SplitRow3(L + (c0 + j) * g.HGp + h, 1, 1, &out[0], &out[1], &out[2]);
        for (int pc = 0; pc < 3; ++pc) pt[pc][h * kChunk + j] = out[pc];
      }
    }
#endif
  }
};

void AttendF32(const float* q, const float* kv, const float* window, const float* entries, const int64_t* indices,
               const float* sink, const float* inv_freq, const int64_t* start_pos, const SparseAttentionDims& dims,
               float scale, float* o, const Parallel& par) {
  // Decode as well as prefill: the heads are the tile's column dimension, so one split key block serves every head
  // of the item, and each key is fetched and split once per item (or per range of a split item).
  Attend<float, TileQkF32>(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o, par);
}

void AttendBf16(const uint16_t* q, const uint16_t* kv, const uint16_t* window, const uint16_t* entries,
                const int64_t* indices, const float* sink, const float* inv_freq, const int64_t* start_pos,
                const SparseAttentionDims& dims, float scale, uint16_t* o, const Parallel& par) {
  Attend<uint16_t, TileQkBf16<uint16_t>>(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o,
                                         par);
}

void AttendF32Bf16(const float* q, const float* kv, const float* window, const float* entries, const int64_t* indices,
                   const float* sink, const float* inv_freq, const int64_t* start_pos, const SparseAttentionDims& dims,
                   float scale, float* o, const Parallel& par) {
  Attend<float, TileQkBf16<float>, uint16_t>(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale,
                                             o, par);
}

}  // namespace

const SparseAttentionKernels kSparseAttention = {&AttendF32, &AttendBf16, &WindowWrite, &AttendF32Bf16};

}  // namespace DSV4_AMX_NS
}  // namespace dsv4
