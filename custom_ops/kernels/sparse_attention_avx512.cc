// AVX512 SparseAttention (sparse_attention.h), two tables. kSparseAttention: fp32 products on 16-lane vectors for fp32
// and bf16 inputs (bf16 keys widened once per key block; the algorithm is in sparse_attention_simd.inc, this file
// supplies the vector layer). kSparseAttentionBf16Dot: the same for fp32, and for bf16 inputs with D a multiple of 32
// both products on VDPBF16PS (DotQkBf16 below), which takes the bf16 query, keys and probabilities as they are, two per
// 32-bit lane; its attend_f32_bf16 takes float inputs multiplied as bf16 (the op's compute="bf16") on the same
// products, rounding the query and each key block where it reads them. Which one a session uses is the CPU's
// (FamilyPlan::bf16_dot): VDPBF16PS does two fp32 FMAs' work in one instruction on AMD Zen 4, but runs at half the FMA
// rate on the Intel Xeon measured (246 against 493 GFLOP/s). AMD EPYC family 0x19 model 0x11, two threads, 64 heads x
// 512, top-512 plus a 128-row window, bf16: one query 0.57 -> 0.34 ms, 16 queries 7.7 -> 4.5 ms, a 64-token chunk 32.0
// -> 17.9 ms (146-173 -> 244-300 GFLOP/s; fp32 inputs 159-169; the VDPBF16PS peak measured 417-425, fp32 FMA 207). Must
// match sparse_attention_ref.cc within fp32 rounding (fp32 accumulation in a different order, exp within a few ulp;
// VDPBF16PS treats bf16 subnormals as zero); the bf16 rounding points are the spec's. Needs the avx512 level
// (AVX512F/BW/VL/DQ + AVX512-BF16).
#include "custom_ops/kernels/isa_prelude.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "custom_ops/kernels/sparse_attention.h"
#include "custom_ops/kernels/sparse_attention_keys.h"
#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace avx512 {
namespace {

constexpr int64_t kKeyBlock = 48;
constexpr int kQkSlabs = 4;
constexpr int kQkKeys = 6;
constexpr int kQkKeys1 = 12;
constexpr int kPvHeads = 8;
constexpr int kPvVecs = 3;

#include "custom_ops/kernels/simd_avx512.inc"

#include "custom_ops/kernels/sparse_attention_simd.inc"
#include "custom_ops/kernels/sparse_attention_pairs.inc"

// ---- bf16 products on VDPBF16PS ----
//
// Layouts (VNNI order, one product pair per 32-bit lane, as the AMX file uses them):
//   qt [Dp/2][HGp][2]  the query: channel pairs down, heads across (PackQt), packed once per item;
//   vi [kKeyBlock/2][Dp][2]  a key block with consecutive keys interleaved (InterleavePair): key pairs down,
//                      channels across; an odd block's last pair has a zero key;
//   pp [kKeyBlock/2][HGp]  the block's probabilities, two keys per lane (the softmax rounded them to bf16, so
//                      dropping the low halves is exact).
// QK broadcasts a key's channel pair (one 32-bit load) against 16 heads; PV broadcasts a head's probability pair
// against 16 channels. Same register blocks as the fp32 products (kQkSlabs x kQkKeys, kPvHeads x kPvVecs).

// out[i*ldo + s*16 + lane] = scale * sum_{d<D} q[s*16 + lane][d] * key_i[d] for i < KB, s < SL.
template <int SL, int KB>
void QkTileBf16(const uint16_t* qt, int64_t HGp, const uint16_t* const* keys, int64_t D, float scale, float* out,
                int64_t ldo) {
  __m512 acc[KB][SL];
  for (int i = 0; i < KB; ++i)
    for (int s = 0; s < SL; ++s) acc[i][s] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    __m512bh qv[SL];
    for (int s = 0; s < SL; ++s) qv[s] = (__m512bh)_mm512_loadu_si512(qt + (d2 * HGp + s * kLanes) * 2);
    for (int i = 0; i < KB; ++i) {
      int32_t pair;
      std::memcpy(&pair, keys[i] + 2 * d2, sizeof pair);
      const __m512bh kd = (__m512bh)_mm512_set1_epi32(pair);
      for (int s = 0; s < SL; ++s) acc[i][s] = _mm512_dpbf16_ps(acc[i][s], qv[s], kd);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int i = 0; i < KB; ++i) {
    for (int s = 0; s < SL; ++s) _mm512_storeu_ps(out + i * ldo + s * kLanes, _mm512_mul_ps(acc[i][s], vs));
  }
}

template <int SL, int KB>
void QkSlabsBf16(const uint16_t* qt, int64_t HGp, int64_t s0, const uint16_t* const* keys, int64_t nb, int64_t D,
                 float scale, float* L) {
  int64_t j = 0;
  for (; j + KB <= nb; j += KB) {
    QkTileBf16<SL, KB>(qt + s0 * kLanes * 2, HGp, keys + j, D, scale, L + j * HGp + s0 * kLanes, HGp);
  }
  if constexpr (KB > 1) {
    if (j < nb) QkSlabsBf16<SL, (KB / 2 > 0 ? KB / 2 : 1)>(qt, HGp, s0, keys + j, nb - j, D, scale, L + j * HGp);
  }
}

// O [HGp][Dp]: heads [h0, h0 + kPvHeads) x channels [d0, d0 + NV*16) += the np key pairs of vi times their
// probability pairs pp.
template <int NV>
void PvTileBf16(const uint32_t* pp, int64_t HGp, const uint16_t* vi, int64_t Dp, int64_t np, float* O, int64_t h0,
                int64_t d0) {
  __m512 acc[kPvHeads][NV];
  for (int r = 0; r < kPvHeads; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(O + (h0 + r) * Dp + d0 + v * kLanes);
  }
  for (int64_t p = 0; p < np; ++p) {
    __m512bh kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = (__m512bh)_mm512_loadu_si512(vi + (p * Dp + d0 + v * kLanes) * 2);
    const uint32_t* pr = pp + p * HGp + h0;
    for (int r = 0; r < kPvHeads; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pr[r]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], kv[v], pv);
    }
  }
  for (int r = 0; r < kPvHeads; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(O + (h0 + r) * Dp + d0 + v * kLanes, acc[r][v]);
  }
}

// The product policy of the driver (sparse_attention_simd.inc, VecQk) for D % 32 == 0 (so Dp == D and every key row
// holds whole 32-channel pieces). X = uint16_t: bf16 inputs, used as they are; X = float: float inputs multiplied as
// bf16 (compute="bf16", with the driver's R = bf16): the query rounded when packed, each key block rounded into kc.
template <class X>
struct DotQkBf16 {
  static constexpr bool kRound = sizeof(X) == sizeof(float);
  uint16_t* qt = nullptr;  // [Dp/2][HGp][2]
  uint16_t* vi = nullptr;  // [kKeyBlock/2][Dp][2]
  uint32_t* pp = nullptr;  // [kKeyBlock/2][HGp]
  uint16_t* zero = nullptr;  // [Dp]: the partner of an odd block's last key
  uint16_t* kc = nullptr;  // kRound: [kKeyBlock][Dp] a key block rounded to bf16; the query rows before packing

  static size_t Bytes(const Geometry& g) {
    return Arena::Bytes(g.Dp * g.HGp, 2) + Arena::Bytes(kKeyBlock * g.Dp, 2) + Arena::Bytes(kKeyBlock / 2 * g.HGp, 4) +
           Arena::Bytes(g.Dp, 2) + (kRound ? Arena::Bytes(MaxI(kKeyBlock, g.HGp) * g.Dp, 2) : 0);
  }
  void Init(Arena& a, const Geometry& g) {
    qt = a.Take<uint16_t>(g.Dp * g.HGp);
    vi = a.Take<uint16_t>(kKeyBlock * g.Dp);
    pp = a.Take<uint32_t>(kKeyBlock / 2 * g.HGp);
    zero = a.Take<uint16_t>(g.Dp);
    std::memset(zero, 0, sizeof(uint16_t) * g.Dp);
    if constexpr (kRound) kc = a.Take<uint16_t>(MaxI(kKeyBlock, g.HGp) * g.Dp);
  }
  void Begin() {}
  void End() {}
  void Prepare(const X* q_rows, int64_t count, const Geometry& g) {
    if constexpr (kRound) {
      // rounded to nearest even, as numerics/bf16.h
      for (int64_t h = 0; h < count; ++h) StoreRow(q_rows + h * g.D, g.D, kc + h * g.D);
      PackQt(kc, count, g, qt);
    } else {
      PackQt(q_rows, count, g, qt);
    }
  }
  // bf16 rows of keys [j, j + nb) into keys[]: the rows themselves, or rounded into kc.
  void KeyRows(const Geometry& g, const TaskMemory& m, int64_t j, int64_t nb, const uint16_t** keys) {
    for (int64_t r = 0; r < nb; ++r) {
      if constexpr (kRound) {
        StoreRow(static_cast<const float*>(m.rows[j + r]), g.D, kc + r * g.Dp);
        keys[r] = kc + r * g.Dp;
      } else {
        keys[r] = static_cast<const uint16_t*>(m.rows[j + r]);
      }
    }
  }

  void Logits(const Geometry& g, TaskMemory& m, int64_t j0, int64_t j1, float scale, float* L) {
    const uint16_t* keys[kKeyBlock];
    const int64_t slabs = g.HGp / kLanes;
    for (int64_t j = j0; j < j1; j += kKeyBlock) {
      const int64_t nb = MinI(kKeyBlock, j1 - j);
      if (j + kKeyBlock < j1) PrefetchRows(m.rows + j + kKeyBlock, MinI(kKeyBlock, j1 - j - kKeyBlock), g.D * g.elem);
      KeyRows(g, m, j, nb, keys);
      float* Lb = L + j * g.HGp;
      int64_t s0 = 0;
      for (; s0 + kQkSlabs <= slabs; s0 += kQkSlabs) {
        QkSlabsBf16<kQkSlabs, kQkKeys>(qt, g.HGp, s0, keys, nb, g.D, scale, Lb);
      }
      for (; s0 < slabs; ++s0) QkSlabsBf16<1, kQkKeys1>(qt, g.HGp, s0, keys, nb, g.D, scale, Lb);
    }
  }

  void Output(const Geometry& g, TaskMemory& m, int64_t count, int64_t j0, int64_t j1, const float* L, float* O) {
    const uint16_t* keys[kKeyBlock];
    const int64_t hend = RoundUp(count, kPvHeads);
    for (int64_t j = j0; j < j1; j += kKeyBlock) {
      const int64_t nb = MinI(kKeyBlock, j1 - j), np = (nb + 1) / 2;
      if (j + kKeyBlock < j1) PrefetchRows(m.rows + j + kKeyBlock, MinI(kKeyBlock, j1 - j - kKeyBlock), g.D * g.elem);
      KeyRows(g, m, j, nb, keys);
      for (int64_t p = 0; p < np; ++p) {
        InterleavePair(keys[2 * p], 2 * p + 1 < nb ? keys[2 * p + 1] : zero, g.Dp, vi + p * g.Dp * 2);
        // probability pairs: the low half from key 2p, the high half from key 2p + 1 (0 past the block)
        const float* la = L + (j + 2 * p) * g.HGp;
        const float* lb = 2 * p + 1 < nb ? la + g.HGp : nullptr;
        for (int64_t h = 0; h < g.HGp; h += kLanes) {
          const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(la + h)), 16);
          const __m512i hi = lb != nullptr ? _mm512_castps_si512(_mm512_loadu_ps(lb + h)) : _mm512_setzero_si512();
          _mm512_storeu_si512(pp + p * g.HGp + h, _mm512_or_si512(lo, _mm512_and_si512(hi, _mm512_set1_epi32(-65536))));
        }
      }
      const int64_t vecs = g.Dp / kLanes;
      int64_t v0 = 0;
      for (; v0 + kPvVecs <= vecs; v0 += kPvVecs) {
        for (int64_t h = 0; h < hend; h += kPvHeads) PvTileBf16<kPvVecs>(pp, g.HGp, vi, g.Dp, np, O, h, v0 * kLanes);
      }
      for (; v0 < vecs; v0 += 2) {
        if (v0 + 2 <= vecs) {
          for (int64_t h = 0; h < hend; h += kPvHeads) PvTileBf16<2>(pp, g.HGp, vi, g.Dp, np, O, h, v0 * kLanes);
        } else {
          for (int64_t h = 0; h < hend; h += kPvHeads) PvTileBf16<1>(pp, g.HGp, vi, g.Dp, np, O, h, v0 * kLanes);
        }
      }
    }
  }
};

void AttendF32(const float* q, const float* kv, const float* window, const float* entries, const int64_t* indices,
               const float* sink, const float* inv_freq, const int64_t* start_pos, const SparseAttentionDims& dims,
               float scale, float* o, const Parallel& par) {
  Attend(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o, par);
}

void AttendBf16(const uint16_t* q, const uint16_t* kv, const uint16_t* window, const uint16_t* entries,
                const int64_t* indices, const float* sink, const float* inv_freq, const int64_t* start_pos,
                const SparseAttentionDims& dims, float scale, uint16_t* o, const Parallel& par) {
  Attend(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o, par);
}

void AttendBf16Dot(const uint16_t* q, const uint16_t* kv, const uint16_t* window, const uint16_t* entries,
                   const int64_t* indices, const float* sink, const float* inv_freq, const int64_t* start_pos,
                   const SparseAttentionDims& dims, float scale, uint16_t* o, const Parallel& par) {
  if (dims.dim % 32 == 0) {
    Attend<uint16_t, DotQkBf16<uint16_t>>(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o,
                                          par);
  } else {
    Attend(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o, par);
  }
}

// compute="bf16" on fp32 inputs, D a multiple of 32: rounded to bf16 and multiplied on VDPBF16PS (AttendBf16Dot's
// path, bit for bit); other D on the widened products (AttendF32AsBf16, sparse_attention_simd.inc).
void AttendF32Bf16Dot(const float* q, const float* kv, const float* window, const float* entries,
                      const int64_t* indices, const float* sink, const float* inv_freq, const int64_t* start_pos,
                      const SparseAttentionDims& dims, float scale, float* o, const Parallel& par) {
  if (dims.dim % 32 != 0) {
    AttendF32AsBf16(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o, par);
    return;
  }
  Attend<float, DotQkBf16<float>, uint16_t>(q, kv, window, entries, indices, sink, inv_freq, start_pos, dims, scale, o,
                                            par);
}

}  // namespace

const SparseAttentionKernels kSparseAttention = {&AttendF32, &AttendBf16, &WindowWrite, &AttendF32AsBf16};
const SparseAttentionKernels kSparseAttentionBf16Dot = {&AttendF32, &AttendBf16Dot, &WindowWrite, &AttendF32Bf16Dot};

}  // namespace avx512
}  // namespace dsv4
