// Memory read bandwidth of this machine: every thread streams through its own slice of one large buffer (well
// beyond the last-level cache) with 512-bit loads, summing the data so the loads cannot be removed. Prints the
// best and the median of the repetitions in GB/s (1e9 bytes per second).
//
//   g++ -O2 -mavx512f -pthread bench/stream_read.cc -o /tmp/stream_read && /tmp/stream_read [GiB] [threads] [reps]
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

double ReadSlice(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

}  // namespace

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 2.0;
  const int threads = argc > 2 ? std::atoi(argv[2]) : static_cast<int>(std::thread::hardware_concurrency());
  const int reps = argc > 3 ? std::atoi(argv[3]) : 10;
  const size_t bytes = static_cast<size_t>(gib * (1ull << 30)) / 4096 * 4096;
  const size_t n = bytes / sizeof(float);
  float* buf = static_cast<float*>(std::aligned_alloc(4096, bytes));
  for (size_t i = 0; i < n; ++i) buf[i] = 1.0f;  // fault every page in
  std::vector<double> gbs;
  std::atomic<double> sink{0.0};
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    const size_t per = n / threads / 64 * 64;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const double s = ReadSlice(buf + t * per, per);
        double cur = sink.load();
        while (!sink.compare_exchange_weak(cur, cur + s)) {
        }
      });
    }
    for (auto& t : pool) t.join();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gbs.push_back(static_cast<double>(per * threads * sizeof(float)) / sec / 1e9);
  }
  std::sort(gbs.begin(), gbs.end());
  std::printf("stream read: %.2f GiB, %d threads, %d reps: best %.1f GB/s, median %.1f GB/s (checksum %.0f)\n", gib,
              threads, reps, gbs.back(), gbs[gbs.size() / 2], sink.load());
  std::free(buf);
  return 0;
}
