// Scalar reference for the mHC kernels (hyper_connection.h): HcPre (RMS-scaled projection, sigmoid gates, Sinkhorn
// normalisation, stream collapse), HcPost (stream expansion + residual mixing) and HcHead (final collapse). It is the
// spec the AVX2/AVX512 variants are tested against and follows HF transformers' DeepseekV4HyperConnection,
// DeepseekV4HyperHead and DeepseekV4DecoderLayer term by term. The two reductions of length hc*d (sum of squares and
// the projection dot products) accumulate in double so that this reference sits within fp32 rounding of the exact
// value; everything else is fp32 in the order written in the header. Baseline ISA; written for clarity, not speed.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>

#include "custom_ops/kernels/hyper_connection.h"
#include "custom_ops/numerics/bf16.h"

namespace dsv4 {
namespace ref {
namespace {

float ToF32(float v) { return v; }
float ToF32(uint16_t v) { return Bf16ToF32(v); }
void FromF32(float v, float* dst) { *dst = v; }
void FromF32(float v, uint16_t* dst) { *dst = F32ToBf16(v); }

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// r = 1 / sqrt(mean(v^2) + eps) over the hc*d values of one token.
template <class T>
float RmsScale(const T* v, int64_t n, float rms_eps) {
  double sum_sq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = ToF32(v[i]);
    sum_sq += a * a;
  }
  const float mean = static_cast<float>(sum_sq) / static_cast<float>(n);
  return 1.0f / std::sqrt(mean + rms_eps);
}

// mix[m] = dot(fn[m, :], v) * r for m in [0, rows).
template <class T>
void Project(const T* v, int64_t n, const float* fn, int64_t rows, float r, float* mix) {
  for (int64_t m = 0; m < rows; ++m) {
    double dot = 0.0;
    for (int64_t i = 0; i < n; ++i) dot += static_cast<double>(fn[m * n + i]) * ToF32(v[i]);
    mix[m] = static_cast<float>(dot) * r;
  }
}

// out[i] = sum_k pre[k] * X[k][i]; X is [hc, d].
template <class T>
void Collapse(const T* x, const float* pre, int64_t hc, int64_t d, T* out) {
  for (int64_t i = 0; i < d; ++i) {
    float acc = 0.0f;
    for (int64_t k = 0; k < hc; ++k) acc += pre[k] * ToF32(x[k * d + i]);
    FromF32(acc, out + i);
  }
}

size_t NumChunks(const Parallel& par, int64_t items, int64_t cost_per_item) {
  const int64_t by_cost = std::max<int64_t>(1, items * std::max<int64_t>(1, cost_per_item) / 16384);
  const int64_t by_threads = 4 * std::max(1, par.num_threads);
  return static_cast<size_t>(std::max<int64_t>(1, std::min({items, by_cost, by_threads})));
}

template <class T>
void HcPre(const T* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
           int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, T* h, float* post, float* comb,
           const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  const int64_t K = hc * dim, M = (2 + hc) * hc;
  par.ForRange(static_cast<size_t>(num_tokens), NumChunks(par, num_tokens, M * K), [&](size_t begin, size_t end) {
    float mix[(2 + kHcMaxStreams) * kHcMaxStreams];
    float pre[kHcMaxStreams];
    for (size_t n = begin; n < end; ++n) {
      const T* xn = x + n * K;
      const float r = RmsScale(xn, K, rms_eps);
      Project(xn, K, fn, M, r, mix);
      HcPreWeights(mix, scale, base, hc, hc_eps, sinkhorn_iters, pre, post + n * hc, comb + n * hc * hc);
      Collapse(xn, pre, hc, dim, h + n * dim);
    }
  });
}

template <class T>
void HcPost(const T* f, const T* residual, const float* post, const float* comb, int64_t num_tokens, int64_t hc,
            int64_t dim, T* out, const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  par.ForRange(static_cast<size_t>(num_tokens), NumChunks(par, num_tokens, hc * hc * dim),
               [&](size_t begin, size_t end) {
                 for (size_t n = begin; n < end; ++n) {
                   const T* fv = f + n * dim;
                   const T* rn = residual + n * hc * dim;
                   const float* pn = post + n * hc;
                   const float* cn = comb + n * hc * hc;
                   for (int64_t j = 0; j < hc; ++j) {
                     for (int64_t i = 0; i < dim; ++i) {
                       float acc = pn[j] * ToF32(fv[i]);
                       for (int64_t k = 0; k < hc; ++k) acc += cn[k * hc + j] * ToF32(rn[k * dim + i]);
                       FromF32(acc, out + (n * hc + j) * dim + i);
                     }
                   }
                 }
               });
}

template <class T>
void HcHead(const T* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
            int64_t dim, float rms_eps, float hc_eps, T* y, const Parallel& par) {
  assert(hc >= 1 && hc <= kHcMaxStreams && dim >= 1 && num_tokens >= 0);
  const int64_t K = hc * dim;
  par.ForRange(static_cast<size_t>(num_tokens), NumChunks(par, num_tokens, hc * K), [&](size_t begin, size_t end) {
    float mix[kHcMaxStreams];
    float pre[kHcMaxStreams];
    for (size_t n = begin; n < end; ++n) {
      const T* xn = x + n * K;
      const float r = RmsScale(xn, K, rms_eps);
      Project(xn, K, fn, hc, r, mix);
      HcHeadWeights(mix, scale, base, hc, hc_eps, pre);
      Collapse(xn, pre, hc, dim, y + n * dim);
    }
  });
}

}  // namespace

void HcPreWeights(const float* mix, const float* scale, const float* base, int64_t hc, float hc_eps,
                  int64_t sinkhorn_iters, float* pre, float* post, float* comb) {
  for (int64_t k = 0; k < hc; ++k) pre[k] = Sigmoid(mix[k] * scale[0] + base[k]) + hc_eps;
  for (int64_t j = 0; j < hc; ++j) post[j] = 2.0f * Sigmoid(mix[hc + j] * scale[1] + base[hc + j]);

  float* c = comb;  // c[k * hc + j]: row k = source stream, column j = target stream
  for (int64_t e = 0; e < hc * hc; ++e) c[e] = mix[2 * hc + e] * scale[2] + base[2 * hc + e];

  const auto normalise_rows = [&] {
    for (int64_t k = 0; k < hc; ++k) {
      float sum = 0.0f;
      for (int64_t j = 0; j < hc; ++j) sum += c[k * hc + j];
      for (int64_t j = 0; j < hc; ++j) c[k * hc + j] = c[k * hc + j] / (sum + hc_eps);
    }
  };
  const auto normalise_columns = [&] {
    for (int64_t j = 0; j < hc; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < hc; ++k) sum += c[k * hc + j];
      for (int64_t k = 0; k < hc; ++k) c[k * hc + j] = c[k * hc + j] / (sum + hc_eps);
    }
  };

  // Row softmax, then + eps.
  for (int64_t k = 0; k < hc; ++k) {
    float* row = c + k * hc;
    float row_max = row[0];
    for (int64_t j = 1; j < hc; ++j) row_max = std::max(row_max, row[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < hc; ++j) {
      row[j] = std::exp(row[j] - row_max);
      sum += row[j];
    }
    for (int64_t j = 0; j < hc; ++j) row[j] = row[j] / sum + hc_eps;
  }
  normalise_columns();
  for (int64_t it = 1; it < sinkhorn_iters; ++it) {
    normalise_rows();
    normalise_columns();
  }
}

void HcHeadWeights(const float* mix, const float* scale, const float* base, int64_t hc, float hc_eps, float* pre) {
  for (int64_t k = 0; k < hc; ++k) pre[k] = Sigmoid(mix[k] * scale[0] + base[k]) + hc_eps;
}

void HcPreF32(const float* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
              int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, float* h, float* post, float* comb,
              const Parallel& par) {
  HcPre(x, fn, scale, base, num_tokens, hc, dim, rms_eps, hc_eps, sinkhorn_iters, h, post, comb, par);
}

void HcPreBf16(const uint16_t* x, const float* fn, const float* scale, const float* base, int64_t num_tokens,
               int64_t hc, int64_t dim, float rms_eps, float hc_eps, int64_t sinkhorn_iters, uint16_t* h, float* post,
               float* comb, const Parallel& par) {
  HcPre(x, fn, scale, base, num_tokens, hc, dim, rms_eps, hc_eps, sinkhorn_iters, h, post, comb, par);
}

void HcPostF32(const float* f, const float* residual, const float* post, const float* comb, int64_t num_tokens,
               int64_t hc, int64_t dim, float* out, const Parallel& par) {
  HcPost(f, residual, post, comb, num_tokens, hc, dim, out, par);
}

void HcPostBf16(const uint16_t* f, const uint16_t* residual, const float* post, const float* comb, int64_t num_tokens,
                int64_t hc, int64_t dim, uint16_t* out, const Parallel& par) {
  HcPost(f, residual, post, comb, num_tokens, hc, dim, out, par);
}

void HcHeadF32(const float* x, const float* fn, const float* scale, const float* base, int64_t num_tokens, int64_t hc,
               int64_t dim, float rms_eps, float hc_eps, float* y, const Parallel& par) {
  HcHead(x, fn, scale, base, num_tokens, hc, dim, rms_eps, hc_eps, y, par);
}

void HcHeadBf16(const uint16_t* x, const float* fn, const float* scale, const float* base, int64_t num_tokens,
                int64_t hc, int64_t dim, float rms_eps, float hc_eps, uint16_t* y, const Parallel& par) {
  HcHead(x, fn, scale, base, num_tokens, hc, dim, rms_eps, hc_eps, y, par);
}

const HyperConnectionKernels kHyperConnection = {&HcPreF32, &HcPreBf16, &HcPostF32,
                                                 &HcPostBf16, &HcHeadF32, &HcHeadBf16};

}  // namespace ref
}  // namespace dsv4
