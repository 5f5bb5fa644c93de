// AVX2 panels (linear_avx2.cc has the level's overview): the level's tiles slot, for prefill (many activation rows),
// tokens in the lanes.
#include "custom_ops/kernels/isa_prelude.h"

#include <algorithm>

#include "custom_ops/kernels/linear_avx2_internal.h"

namespace dsv4 {
namespace avx2 {
namespace {

#include "custom_ops/kernels/simd_avx2.inc"
#include "custom_ops/kernels/linear_common_avx2.inc"

// ---------------------------------------------------------------------------------------------------------------
// Panel path (the level's tiles slot: prefill, many activation rows): the AVX512 level's panels
// (linear_panels_avx512.cc) on 8 lanes. Activations are prepared K-major in 8-token blocks ([Kp][8] fp32, columns
// in order); each group of 8 weight rows is decoded once into fp32 scratch in column order (whole rows, the values
// the rows path decodes: FP4 rows put back from [8 even, 8 odd] order, bf16 rows widened) and meets every token
// panel of up to three blocks. The microkernel keeps 4 rows x 3 blocks = 12 accumulators over the whole row: each
// output is one FMA chain over the columns in order, so results do not depend on how rows or tokens are grouped,
// nor on the thread split.

// kPanelGroup = 8 weight rows decoded at a time: linear_avx2_internal.h (the LinearBlocks table needs it).

int64_t PanelBlocks8(int64_t m) { return (m + 7) / 8; }

// Rows [n0, n0 + kPanelGroup) as fp32 in column order (kp columns, zero tails, zero rows past w.rows).
void DecodePanelGroup(ActType act, const WeightView& w, int64_t n0, int64_t kp, float* dst) {
  if (KindOf(act, w) == RowKind::kF32Direct) {  // fp32 weights meet fp32 activations as stored
    for (int64_t r = 0; r < kPanelGroup; ++r) {
      const bool row_live = n0 + r < w.rows;
      const float* src = row_live ? static_cast<const float*>(w.data) + (n0 + r) * w.cols : nullptr;
      for (int64_t k = 0; k < kp; k += 8) {
        _mm256_storeu_ps(dst + r * kp + k, row_live && k < w.cols ? _mm256_maskload_ps(src + k, LaneMask(w.cols - k))
                                                                  : _mm256_setzero_ps());
      }
    }
    return;
  }
  if (w.format != WeightFormat::kBf16) {
    DecodeRows(act, w, n0, kPanelGroup, kp, dst);
    if (EvenOdd(act, w)) {  // FP4: [8 even, 8 odd] per 16 columns -> column order
      for (int64_t i = 0; i < kPanelGroup * kp; i += 16) {
        const __m256 e = _mm256_loadu_ps(dst + i), o = _mm256_loadu_ps(dst + i + 8);
        const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);  // per 128-bit lane
        _mm256_storeu_ps(dst + i, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(dst + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
      }
    }
    return;
  }
  for (int64_t r = 0; r < kPanelGroup; ++r) {
    const int64_t row = n0 + r;
    float* out = dst + r * kp;
    if (row >= w.rows) {
      std::memset(out, 0, static_cast<size_t>(kp) * sizeof(float));
      continue;
    }
    const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * w.cols;
    for (int64_t c = 0; c < kp; c += 8) {
      __m128i v;
      if (w.cols - c >= 8) {
        v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
      } else {
        alignas(16) uint16_t tail[8] = {};
        for (int64_t i = 0; i < w.cols - c; ++i) tail[i] = src[c + i];
        v = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
      }
      _mm256_storeu_ps(out + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
    }
  }
}

// res[r][8 j + t] = sum over k < kp of w[r][k] * x_j[k][t] for 4 weight rows (kp floats apart) and NB token blocks
// (x_j = x + j * xs, [kp][8]).
template <int NB>
void PanelKernel(const float* w, int64_t kp, const float* x, int64_t xs, float res[4][24]) {
  __m256 acc[4][NB];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    __m256 xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = _mm256_loadu_ps(x + j * xs + k * 8);
    for (int r = 0; r < 4; ++r) {
      const __m256 b = _mm256_broadcast_ss(w + r * kp + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(b, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < NB; ++j) _mm256_storeu_ps(res[r] + 8 * j, acc[r][j]);
}

}  // namespace

bool PanelsSupported(ActType act, const WeightView& w) { return RowsSupported(act, w); }

size_t PanelXBytes(ActType, int64_t m, int64_t kw) {
  return static_cast<size_t>(PanelBlocks8(m) * Pad32(kw) * 8) * sizeof(float);
}

// The drivers hand out 16-row blocks: two 8-token blocks each.
int64_t PanelBlocksFn(ActType, int64_t m) { return (m + 15) / 16; }

void PreparePanels(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                   int64_t block_begin, int64_t block_end, void* dst) {
  const int64_t kp = Pad32(kw);
  for (int64_t bb = 2 * block_begin; bb < 2 * block_end && bb * 8 < m; ++bb) {
    float* out = static_cast<float*>(dst) + bb * kp * 8;
    std::memset(out, 0, static_cast<size_t>(kp * 8) * sizeof(float));
    for (int64_t t = 0; t < 8 && bb * 8 + t < m; ++t) {
      const int64_t tok = bb * 8 + t, src = index != nullptr ? index[tok] : tok;
      if (act == ActType::kF32) {
        const float* in = static_cast<const float*>(x) + src * ldx;
        for (int64_t k = 0; k < kw; ++k) out[k * 8 + t] = in[k];
      } else {
        const uint16_t* in = static_cast<const uint16_t*>(x) + src * ldx;
        for (int64_t k = 0; k < kw; ++k) out[k * 8 + t] = Bf16ToF32(in[k]);
      }
    }
  }
}

size_t PanelScratch(ActType, const WeightView& w, int64_t) {
  return static_cast<size_t>(kPanelGroup * Pad32(w.cols)) * sizeof(float);
}

void Panels(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
            void* scratch) {
  const int64_t kp = Pad32(w.cols), blocks = PanelBlocks8(m), xs = kp * 8;
  const int64_t panels = (blocks + 2) / 3;  // up to three blocks each, as even as possible
  const float* x = static_cast<const float*>(xp);
  float* wdec = static_cast<float*>(scratch);
  for (int64_t g0 = n0; g0 < n1; g0 += kPanelGroup) {
    const int64_t rows = std::min(kPanelGroup, n1 - g0);
    DecodePanelGroup(act, w, g0, kp, wdec);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t q0 = blocks * p / panels, nb = blocks * (p + 1) / panels - q0;
      for (int64_t r4 = 0; r4 < rows; r4 += 4) {
        float res[4][24];
        const float* xb = x + q0 * xs;
        if (nb == 1) PanelKernel<1>(wdec + r4 * kp, kp, xb, xs, res);
        else if (nb == 2) PanelKernel<2>(wdec + r4 * kp, kp, xb, xs, res);
        else PanelKernel<3>(wdec + r4 * kp, kp, xb, xs, res);
        for (int64_t q = 0; q < 4 && r4 + q < rows; ++q) {
          for (int64_t t = 0; t < nb * 8 && q0 * 8 + t < m; ++t) {
            const int64_t at = (q0 * 8 + t) * out.ld + (g0 - n0) + r4 + q;
            if (out.bf16) {
              static_cast<uint16_t*>(out.data)[at] = F32ToBf16(res[q][t]);
            } else {
              static_cast<float*>(out.data)[at] = res[q][t];
            }
          }
        }
      }
    }
  }
}

}  // namespace avx2
}  // namespace dsv4
