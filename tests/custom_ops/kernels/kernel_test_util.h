// Helpers shared by the kernel tests: a deterministic RNG, a std::thread-backed Parallel, ISA-level gating and
// array comparisons with a short failure report.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "custom_ops/kernels/linear.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/platform/cpu_features.h"
#include "custom_ops/platform/parallel.h"
#include "kt.h"

namespace dsv4_test {

// splitmix64: small, fast, identical on every platform (std:: distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi).
  float Uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(static_cast<double>(Next() >> 11) * 0x1.0p-53);
  }
  // Standard normal (Box-Muller).
  float Normal() {
    const double u1 = (static_cast<double>(Next() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(Next() >> 11) * 0x1.0p-53;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  // Uniform integer in [0, n).
  int64_t Index(int64_t n) { return static_cast<int64_t>(Next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

// A Parallel whose tasks run on `threads` std::threads (the caller included), handed out by an atomic counter, so
// task order and thread assignment vary from run to run.
class ThreadParallel {
 public:
  explicit ThreadParallel(int threads) : threads_(threads) {}
  dsv4::Parallel Get() const {
    dsv4::Parallel p;
    p.backend = const_cast<ThreadParallel*>(this);
    p.run = &Run;
    p.num_threads = threads_;
    return p;
  }

 private:
  static void Run(void* backend, size_t num_tasks, dsv4::Parallel::TaskFn fn, void* arg) {
    const int threads = static_cast<ThreadParallel*>(backend)->threads_;
    std::atomic<size_t> next{0};
    const auto worker = [&] {
      for (size_t i = next++; i < num_tasks; i = next++) fn(arg, i);
    };
    std::vector<std::thread> pool;
    const size_t extra = std::min(num_tasks, static_cast<size_t>(threads)) - 1;
    for (size_t t = 0; t < extra; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
  }
  int threads_;
};

// The accelerated levels that have kernel tables in the test binary, in increasing order.
inline std::vector<dsv4::IsaLevel> VariantLevels() {
#if DSV4_X86_VARIANTS
  return {dsv4::IsaLevel::kAvx2, dsv4::IsaLevel::kAvx512};
#else
  return {};
#endif
}

// Ends the running test as skipped unless this CPU (and OS) supports `level`.
inline void RequireIsa(dsv4::IsaLevel level) {
  if (static_cast<int>(dsv4::MaxSupportedIsa()) < static_cast<int>(level)) {
    kt::Skip(std::string(dsv4::IsaName(level)) + " is not supported by this CPU (highest level: " +
             dsv4::IsaName(dsv4::MaxSupportedIsa()) + ")");
  }
}

// What the ops set at load for a constant weight's scales: WeightView::fp8_scaled_range from a scan of the E8M0
// scale bytes of `matrices` consecutive matrices laid out like w (a stacked expert tensor).
inline void SetScaledRangeAsOps(dsv4::WeightView& w, int64_t matrices = 1) {
  w.fp8_scaled_range = w.format == dsv4::WeightFormat::kFp8E4M3 && w.scale_format == dsv4::ScaleFormat::kE8M0 &&
                       w.scale != nullptr &&
                       dsv4::Fp8ScalesScaledRange(static_cast<const uint8_t*>(w.scale),
                                                  dsv4::WeightScaleBytes(w) * static_cast<size_t>(matrices));
}

inline bool Verbose() { return std::getenv("DSV4_KT_VERBOSE") != nullptr; }

// Compares got against want element-wise: |got - want| <= atol + rtol * |want| (NaN matches NaN). Reports the
// first failures with their index and returns the largest |got - want| / (atol + rtol * |want|) seen.
inline double ExpectClose(const std::string& what, const float* got, const float* want, size_t n, double atol,
                          double rtol) {
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double g = got[i], w = want[i];
    if (std::isnan(g) || std::isnan(w)) {
      KT_CHECK(std::isnan(g) && std::isnan(w)) << what << "[" << i << "]: got " << g << ", want " << w;
      continue;
    }
    if (g == w) continue;
    const double ratio = std::fabs(g - w) / (atol + rtol * std::fabs(w));
    worst = std::max(worst, ratio);
    KT_CHECK(ratio <= 1.0) << what << "[" << i << "]: got " << g << ", want " << w << " (|diff| " << std::fabs(g - w)
                           << ", atol " << atol << ", rtol " << rtol << ")";
  }
  if (Verbose()) std::printf("    %s: worst error / tolerance = %.3g\n", what.c_str(), worst);
  return worst;
}

inline void ExpectClose(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                        double atol, double rtol) {
  KT_CHECK_EQ(got.size(), want.size()) << what;
  if (got.size() == want.size()) ExpectClose(what, got.data(), want.data(), got.size(), atol, rtol);
}

// Bitwise equality (for results that must not depend on threads or batching).
template <class T>
void ExpectIdentical(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  KT_CHECK_EQ(got.size(), want.size()) << what;
  if (got.size() != want.size()) return;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = std::memcmp(&got[i], &want[i], sizeof(T)) == 0;
    KT_CHECK(same) << what << "[" << i << "]: " << +got[i] << " vs " << +want[i];
  }
}

// bf16 outputs rounded from fp32 values that differ by a few fp32 ulps: each element within one bf16 ulp of the
// expected one (relative 2^-7 covers one ulp anywhere in a binade) and at most 2 + max_fraction * n of them not
// bit-identical. NaN matches NaN.
inline void ExpectBf16Close(const std::string& what, const std::vector<uint16_t>& got,
                            const std::vector<uint16_t>& want, double atol, double max_fraction) {
  KT_CHECK_EQ(got.size(), want.size()) << what;
  if (got.size() != want.size()) return;
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    ++differ;
    const double g = dsv4::Bf16ToF32(got[i]), w = dsv4::Bf16ToF32(want[i]);
    if (std::isnan(g) && std::isnan(w)) continue;
    KT_CHECK(std::fabs(g - w) <= atol + std::ldexp(std::fabs(w), -7))
        << what << "[" << i << "]: got " << g << ", want " << w << " (more than one bf16 ulp apart)";
  }
  const double allowed = 2.0 + max_fraction * static_cast<double>(got.size());  // slack for short outputs
  KT_CHECK(static_cast<double>(differ) <= allowed) << what << ": " << differ << " of " << got.size()
                                                   << " bf16 values not bit-identical";
  if (Verbose()) std::printf("    %s: %zu of %zu bf16 values differ by one ulp\n", what.c_str(), differ, got.size());
}

inline std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = dsv4::F32ToBf16(v[i]);
  return out;
}

inline std::vector<float> FromBf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = dsv4::Bf16ToF32(v[i]);
  return out;
}

}  // namespace dsv4_test
