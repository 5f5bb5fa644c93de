// Scalar reference for kernels/compressor.h: the token-by-token state machine written out literally. Rows of the
// batch are independent and run in parallel; the tokens of a row run in order. Softmax, pooling, norm and RoPE are
// float32 in the order of the header. Baseline ISA; written for clarity, not speed.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "custom_ops/kernels/compressor.h"
#include "custom_ops/kernels/norm_rope.h"
#include "custom_ops/kernels/rope.h"
#include "custom_ops/numerics/element.h"

namespace dsv4 {
namespace ref {
namespace {

// The entry row store of each entries type: rounded to fp32 / bf16, or FP8-encoded as a whole row.
template <class E>
void WriteEntry(const float* e, const CompressorDims& d, int64_t c, int64_t b, int64_t i, E* entries) {
  E* out = entries + (b * d.capacity + i) * c;
  for (int64_t ch = 0; ch < c; ++ch) StoreAs(e[ch], out + ch);
}
void WriteEntry(const float* e, const CompressorDims& d, int64_t c, int64_t b, int64_t i,
                const state_fp8::EntryOut& entries) {
  state_fp8::StoreEntry(e, c, entries, d.capacity, b, i);
}

// Pools the block ending at the current token into pooled [c]. `state_kv` / `state_sc` are one row's state
// [coff*r, W]; `with_prev` includes the previous block's rows (overlap only).
void Pool(const float* state_kv, const float* state_sc, const CompressorDims& d, bool with_prev, float* pooled) {
  const int64_t r = d.ratio, W = d.width, c = W / d.coff;
  const bool overlap = d.coff == 2;
  // (row, channel offset) pairs in the spec's order: previous block first, then the current block.
  std::vector<const float*> kv_rows, sc_rows;
  if (overlap && with_prev) {
    for (int64_t k = 0; k < r; ++k) {
      kv_rows.push_back(state_kv + k * W);
      sc_rows.push_back(state_sc + k * W);
    }
  }
  const int64_t cur_row = overlap ? r : 0, cur_ch = overlap ? c : 0;
  for (int64_t k = 0; k < r; ++k) {
    kv_rows.push_back(state_kv + (cur_row + k) * W + cur_ch);
    sc_rows.push_back(state_sc + (cur_row + k) * W + cur_ch);
  }
  const size_t n = kv_rows.size();
  std::vector<float> w(n);
  for (int64_t ch = 0; ch < c; ++ch) {
    float m = -std::numeric_limits<float>::infinity();
    for (size_t k = 0; k < n; ++k) m = std::max(m, sc_rows[k][ch]);
    float sum = 0.0f;
    for (size_t k = 0; k < n; ++k) {
      w[k] = std::exp(sc_rows[k][ch] - m);
      sum += w[k];
    }
    float acc = 0.0f;
    for (size_t k = 0; k < n; ++k) acc += (w[k] / sum) * kv_rows[k][ch];
    pooled[ch] = acc;
  }
}

template <class E>
void Step(const float* kv, const float* score, const float* ape, const float* norm_weight, const float* inv_freq,
          const int64_t* start_pos, const CompressorDims& d, float rms_eps, E entries, float* kv_state,
          float* score_state, const Parallel& par) {
  assert((d.coff == 1 || d.coff == 2) && d.ratio >= 1 && d.width % d.coff == 0);
  const int64_t r = d.ratio, W = d.width, c = W / d.coff, rows = d.coff * r, rd = 2 * d.half;
  const int64_t off = d.coff == 2 ? r : 0;
  assert(rd <= c);
  par.For(static_cast<size_t>(d.batch), [&](size_t b) {
    float* st_kv = kv_state + b * rows * W;
    float* st_sc = score_state + b * rows * W;
    std::vector<float> e(c), cos(d.half), sin(d.half);
    for (int64_t t = 0; t < d.seq; ++t) {
      const int64_t p = start_pos[b] + t, j = p % r;
      const float* kv_t = kv + (b * d.seq + t) * W;
      const float* sc_t = score + (b * d.seq + t) * W;
      float* dst_kv = st_kv + (off + j) * W;
      float* dst_sc = st_sc + (off + j) * W;
      for (int64_t ch = 0; ch < W; ++ch) {
        dst_kv[ch] = kv_t[ch];
        dst_sc[ch] = sc_t[ch] + ape[j * W + ch];
      }
      if ((p + 1) % r != 0) continue;
      const int64_t i = p / r;
      assert(i < d.capacity);
      Pool(st_kv, st_sc, d, i >= 1, e.data());
      const float rs = RmsScale(e.data(), c, rms_eps);
      for (int64_t ch = 0; ch < c; ++ch) e[ch] = norm_weight[ch] * (e[ch] * rs);
      RopeCosSin(i * r, inv_freq, d.half, cos.data(), sin.data());
      RopeRotate(e.data() + c - rd, cos.data(), sin.data(), d.half, false);
      WriteEntry(e.data(), d, c, b, i, entries);
      if (d.coff == 2) {
        std::memcpy(st_kv, st_kv + r * W, sizeof(float) * r * W);
        std::memcpy(st_sc, st_sc + r * W, sizeof(float) * r * W);
      }
    }
  });
}

void StepF32(const float* kv, const float* score, const float* ape, const float* norm_weight, const float* inv_freq,
             const int64_t* start_pos, const CompressorDims& dims, float rms_eps, float* entries, float* kv_state,
             float* score_state, const Parallel& par) {
  Step(kv, score, ape, norm_weight, inv_freq, start_pos, dims, rms_eps, entries, kv_state, score_state, par);
}
void StepBf16(const float* kv, const float* score, const float* ape, const float* norm_weight, const float* inv_freq,
              const int64_t* start_pos, const CompressorDims& dims, float rms_eps, uint16_t* entries,
              float* kv_state, float* score_state, const Parallel& par) {
  Step(kv, score, ape, norm_weight, inv_freq, start_pos, dims, rms_eps, entries, kv_state, score_state, par);
}

void StepFp8(const float* kv, const float* score, const float* ape, const float* norm_weight, const float* inv_freq,
             const int64_t* start_pos, const CompressorDims& dims, float rms_eps, const state_fp8::EntryOut& entries,
             float* kv_state, float* score_state, const Parallel& par) {
  Step(kv, score, ape, norm_weight, inv_freq, start_pos, dims, rms_eps, entries, kv_state, score_state, par);
}

}  // namespace

const CompressorKernels kCompressor = {&StepF32, &StepBf16, &StepFp8};

}  // namespace ref
}  // namespace dsv4
