// Machine limits for the roofline model of the benchmark suite (dsv4_ort.bench.machine loads this library with
// ctypes; it is not part of the ONNX Runtime custom-op library).
//
//   * sustained DRAM read bandwidth: every thread streams through its own slice of one buffer (sized by the caller
//     well beyond the last-level cache) with the widest loads the CPU has; the slices are first touched by the
//     threads that read them;
//   * peak arithmetic throughput of the instruction paths the kernels use, from register-resident loops (no memory
//     traffic inside the timed loop): fp32 mul+add at the x86-64 baseline (SSE2, what the scalar reference kernels
//     are compiled for), fp32 FMA on ymm (AVX2) and zmm (AVX-512F), AVX512-BF16 vdpbf16ps, AMX-BF16 tdpbf16ps, and
//     for the int8 paths of ONNX Runtime's own quantised MatMul: AVX512-VNNI vpdpbusd and AMX-INT8 tdpbusd.
//
// The file is compiled at the x86-64 baseline; each ISA-specific function carries its own target attribute and runs
// only after a CPUID + XCR0 check (and, for AMX, after Linux granted the tile-data permission), so the library loads
// and answers on any x86-64 CPU. All functions are plain C exports; every call is self-contained (threads are
// created and joined inside the call).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define DSV4RL_X86 1
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "platform/cpu_features.h"

#define DSV4RL_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ------------------------------------------------------------------------------------------------ CPU probe

enum Feature : uint32_t {
  kFeatSse2 = 1u << 0,
  kFeatAvx2Fma = 1u << 1,
  kFeatAvx512F = 1u << 2,
  kFeatAvx512Bf16 = 1u << 3,
  kFeatAvx512Vnni = 1u << 4,
  kFeatAmxBf16 = 1u << 5,
  kFeatAmxInt8 = 1u << 6,
};

// Kinds of peak measurements (the order is part of the C interface; see dsv4rl_kind_name).
enum Kind : int {
  kFp32Sse = 0,     // mulps + addps on xmm, dependent pair per accumulator (x86-64 baseline)
  kFp32FmaYmm = 1,  // vfmadd on ymm
  kFp32FmaZmm = 2,  // vfmadd on zmm
  kBf16DotZmm = 3,  // vdpbf16ps on zmm (2 bf16 products per fp32 lane)
  kAmxBf16 = 4,     // tdpbf16ps, 16x16 fp32 tiles, K = 32 bf16
  kInt8VnniZmm = 5,  // vpdpbusd on zmm (4 u8*s8 products per int32 lane)
  kAmxInt8 = 6,     // tdpbusd, K = 64 int8
  kNumKinds = 7,
};

const char* const kKindNames[kNumKinds] = {"fp32_sse_muladd", "fp32_fma_ymm", "fp32_fma_zmm", "bf16_dp_zmm",
                                           "amx_bf16",        "int8_vnni_zmm", "amx_int8"};

#if DSV4RL_X86
// The library's probe (platform/cpu_features.cc: CPUID, XCR0 and, on Linux, the AMX tile-data permission).
uint32_t Probe() {
  uint32_t f = kFeatSse2;  // part of x86-64
  const dsv4::CpuFeatures& c = dsv4::GetCpuFeatures();
  if (c.os_avx && c.avx2 && c.fma) f |= kFeatAvx2Fma;
  if (c.os_avx512 && c.avx512f) {
    f |= kFeatAvx512F;
    if (c.avx512_bf16) f |= kFeatAvx512Bf16;
    if (c.avx512_vnni) f |= kFeatAvx512Vnni;
  }
  if (c.os_amx && c.amx_tile && (c.amx_bf16 || c.amx_int8) && c.amx_permitted) {
    if (c.amx_bf16) f |= kFeatAmxBf16;
    if (c.amx_int8) f |= kFeatAmxInt8;
  }
  return f;
}
#else
uint32_t Probe() { return 0; }
#endif

uint32_t Features() {
  static const uint32_t f = Probe();
  return f;
}

bool KindSupported(int kind) {
  const uint32_t f = Features();
  switch (kind) {
    case kFp32Sse: return f & kFeatSse2;
    case kFp32FmaYmm: return f & kFeatAvx2Fma;
    case kFp32FmaZmm: return f & kFeatAvx512F;
    case kBf16DotZmm: return f & kFeatAvx512Bf16;
    case kAmxBf16: return f & kFeatAmxBf16;
    case kInt8VnniZmm: return f & kFeatAvx512Vnni;
    case kAmxInt8: return f & kFeatAmxInt8;
    default: return false;
  }
}

using Clock = std::chrono::steady_clock;

// Runs body(t) on `threads` threads (the caller's thread is thread 0) released together; returns the seconds from
// the release to the end of the slowest thread. Thread start-up is not timed.
template <class Body>
double RunTogether(int threads, Body body) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<Clock::time_point> ends(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
#if DSV4RL_X86
        _mm_pause();
#endif
      }
      body(t);
      ends[static_cast<size_t>(t)] = Clock::now();
    });
  }
  while (ready.load() != threads - 1) std::this_thread::yield();
  const Clock::time_point start = Clock::now();
  go.store(true, std::memory_order_release);
  body(0);
  ends[0] = Clock::now();
  for (auto& th : pool) th.join();
  const Clock::time_point end = *std::max_element(ends.begin(), ends.end());
  return std::chrono::duration<double>(end - start).count();
}

// ------------------------------------------------------------------------------------------------ read streams

// Each returns a value that depends on every byte read, so no load can be dropped. n is a multiple of 256 bytes.
uint64_t ReadBaseline(const uint8_t* p, size_t n) {
#if DSV4RL_X86
  __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 64) {
    a0 = _mm_xor_si128(a0, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i)));
    a1 = _mm_xor_si128(a1, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 16)));
    a2 = _mm_xor_si128(a2, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 32)));
    a3 = _mm_xor_si128(a3, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 48)));
  }
  const __m128i s = _mm_xor_si128(_mm_xor_si128(a0, a1), _mm_xor_si128(a2, a3));
  return static_cast<uint64_t>(_mm_cvtsi128_si64(s)) ^ static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_unpackhi_epi64(s, s)));
#else
  uint64_t acc = 0;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    acc ^= v;
  }
  return acc;
#endif
}

#if DSV4RL_X86
__attribute__((target("avx2"))) uint64_t ReadAvx2(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i s = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}

__attribute__((target("avx512f"))) uint64_t ReadAvx512(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
  }
  const __m512i s = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, s);
  uint64_t r = 0;
  for (uint64_t v : lanes) r ^= v;
  return r;
}
#endif

using ReadFn = uint64_t (*)(const uint8_t*, size_t);

ReadFn PickRead(int* width_bits) {
#if DSV4RL_X86
  const uint32_t f = Features();
  if (f & kFeatAvx512F) {
    *width_bits = 512;
    return ReadAvx512;
  }
  if (f & kFeatAvx2Fma) {
    *width_bits = 256;
    return ReadAvx2;
  }
  *width_bits = 128;
#else
  *width_bits = 64;
#endif
  return ReadBaseline;
}

// ------------------------------------------------------------------------------------------------ peak loops

// Every loop runs `iters` iterations of an unrolled block of independent operations on register-resident values
// and stores its accumulators to `sink` (so nothing is dead). Returns the arithmetic operations per iteration
// (one FMA or one multiply-add pair = 2 operations per product). Twelve named accumulators (not an array, which
// compilers may keep on the stack) cover the 4-cycle FMA latency on two ports; the empty asm statements make each
// accumulator opaque to the optimiser without touching memory.
#define DSV4RL_ACC12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DSV4RL_ACC24(X) DSV4RL_ACC12(X) X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
constexpr int kAcc = 12;

double LoopFp32Sse(int64_t iters, const float* in, float* sink) {
#if DSV4RL_X86
  const __m128 a = _mm_set1_ps(in[0]), b = _mm_set1_ps(in[1]);
#define DSV4RL_INIT(i) __m128 acc##i = _mm_set1_ps(in[2] + static_cast<float>(i));
  DSV4RL_ACC12(DSV4RL_INIT)
#undef DSV4RL_INIT
  for (int64_t it = 0; it < iters; ++it) {
#define DSV4RL_STEP(i) acc##i = _mm_add_ps(_mm_mul_ps(acc##i, a), b); __asm__ volatile("" : "+x"(acc##i));
    DSV4RL_ACC12(DSV4RL_STEP)
#undef DSV4RL_STEP
  }
#define DSV4RL_STORE(i) _mm_storeu_ps(sink + 4 * i, acc##i);
  DSV4RL_ACC12(DSV4RL_STORE)
#undef DSV4RL_STORE
  return 2.0 * 4 * kAcc;
#else
  (void)iters, (void)in, (void)sink;
  return 0.0;
#endif
}

#if DSV4RL_X86
__attribute__((target("avx2,fma"))) double LoopFp32FmaYmm(int64_t iters, const float* in, float* sink) {
  const __m256 a = _mm256_set1_ps(in[0]), b = _mm256_set1_ps(in[1]);
#define DSV4RL_INIT(i) __m256 acc##i = _mm256_set1_ps(in[2] + static_cast<float>(i));
  DSV4RL_ACC12(DSV4RL_INIT)
#undef DSV4RL_INIT
  for (int64_t it = 0; it < iters; ++it) {
#define DSV4RL_STEP(i) acc##i = _mm256_fmadd_ps(acc##i, a, b); __asm__ volatile("" : "+v"(acc##i));
    DSV4RL_ACC12(DSV4RL_STEP)
#undef DSV4RL_STEP
  }
#define DSV4RL_STORE(i) _mm256_storeu_ps(sink + 8 * i, acc##i);
  DSV4RL_ACC12(DSV4RL_STORE)
#undef DSV4RL_STORE
  return 2.0 * 8 * kAcc;
}

__attribute__((target("avx512f"))) double LoopFp32FmaZmm(int64_t iters, const float* in, float* sink) {
  const __m512 a = _mm512_set1_ps(in[0]), b = _mm512_set1_ps(in[1]);
#define DSV4RL_INIT(i) __m512 acc##i = _mm512_set1_ps(in[2] + static_cast<float>(i));
  DSV4RL_ACC12(DSV4RL_INIT)
#undef DSV4RL_INIT
  for (int64_t it = 0; it < iters; ++it) {
#define DSV4RL_STEP(i) acc##i = _mm512_fmadd_ps(acc##i, a, b); __asm__ volatile("" : "+v"(acc##i));
    DSV4RL_ACC12(DSV4RL_STEP)
#undef DSV4RL_STEP
  }
#define DSV4RL_STORE(i) _mm512_storeu_ps(sink + 16 * i, acc##i);
  DSV4RL_ACC12(DSV4RL_STORE)
#undef DSV4RL_STORE
  return 2.0 * 16 * kAcc;
}

__attribute__((target("avx512f,avx512bf16"))) double LoopBf16DotZmm(int64_t iters, const float* in, float* sink) {
  // Small operands: the accumulators grow by ~1e-6 per step and stay normal numbers. 24 accumulators: the
  // instruction has a longer latency than an FMA on some CPUs.
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(in[3]), _mm512_set1_ps(in[3]));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(in[4]), _mm512_set1_ps(in[4]));
#define DSV4RL_INIT(i) __m512 acc##i = _mm512_set1_ps(in[2] + static_cast<float>(i));
  DSV4RL_ACC24(DSV4RL_INIT)
#undef DSV4RL_INIT
  for (int64_t it = 0; it < iters; ++it) {
#define DSV4RL_STEP(i) acc##i = _mm512_dpbf16_ps(acc##i, a, b); __asm__ volatile("" : "+v"(acc##i));
    DSV4RL_ACC24(DSV4RL_STEP)
#undef DSV4RL_STEP
  }
#define DSV4RL_STORE(i) _mm512_storeu_ps(sink + 16 * i, acc##i);
  DSV4RL_ACC24(DSV4RL_STORE)
#undef DSV4RL_STORE
  return 2.0 * 32 * 2 * kAcc;  // 16 lanes x 2 products
}

__attribute__((target("avx512f,avx512vnni"))) double LoopInt8VnniZmm(int64_t iters, const float* in, float* sink) {
  const __m512i a = _mm512_set1_epi8(static_cast<char>(1 + static_cast<int>(in[5])));
  const __m512i b = _mm512_set1_epi8(static_cast<char>(1 + static_cast<int>(in[5])));
#define DSV4RL_INIT(i) __m512i acc##i = _mm512_set1_epi32(i);
  DSV4RL_ACC12(DSV4RL_INIT)
#undef DSV4RL_INIT
  for (int64_t it = 0; it < iters; ++it) {
#define DSV4RL_STEP(i) acc##i = _mm512_dpbusd_epi32(acc##i, a, b); __asm__ volatile("" : "+v"(acc##i));
    DSV4RL_ACC12(DSV4RL_STEP)
#undef DSV4RL_STEP
  }
  alignas(64) int32_t lanes[16];
#define DSV4RL_STORE(i) _mm512_store_si512(lanes, acc##i); sink[i] += static_cast<float>(lanes[i]);
  DSV4RL_ACC12(DSV4RL_STORE)
#undef DSV4RL_STORE
  return 2.0 * 64 * kAcc;  // 16 lanes x 4 products
}

// AMX: tiles 0-3 accumulate C (16 x 16 fp32/int32), tiles 4-5 hold A (16 rows x 64 bytes), 6-7 hold B; a 2 x 2
// block of tile products per iteration, all operands resident in tile registers.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

__attribute__((target("amx-tile"))) void ConfigureTiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile,amx-bf16"))) double LoopAmxBf16(int64_t iters, const float* in, float* sink) {
  alignas(64) uint16_t ab[16 * 32];
  uint32_t bits;
  const float v = in[3];
  std::memcpy(&bits, &v, 4);
  for (auto& x : ab) x = static_cast<uint16_t>(bits >> 16);
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 256; ++i) c[i] = in[2];
  ConfigureTiles();
  _tile_loadd(0, c, 64);
  _tile_loadd(1, c, 64);
  _tile_loadd(2, c, 64);
  _tile_loadd(3, c, 64);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, sink, 64);
  _tile_release();
  sink[0] += c[0];
  return 4.0 * 2 * 16 * 16 * 32;  // 4 tile products of 16 x 16 x 32 multiply-adds
}

__attribute__((target("amx-tile,amx-int8"))) double LoopAmxInt8(int64_t iters, const float* in, float* sink) {
  alignas(64) uint8_t ab[16 * 64];
  std::memset(ab, 1 + static_cast<int>(in[5]), sizeof(ab));
  alignas(64) int32_t c[16 * 16] = {};
  ConfigureTiles();
  _tile_loadd(0, c, 64);
  _tile_loadd(1, c, 64);
  _tile_loadd(2, c, 64);
  _tile_loadd(3, c, 64);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, sink, 64);
  _tile_release();
  sink[0] += static_cast<float>(c[0]);
  return 4.0 * 2 * 16 * 16 * 64;
}
#endif

using LoopFn = double (*)(int64_t, const float*, float*);

LoopFn PickLoop(int kind) {
  if (!KindSupported(kind)) return nullptr;
  switch (kind) {
    case kFp32Sse: return LoopFp32Sse;
#if DSV4RL_X86
    case kFp32FmaYmm: return LoopFp32FmaYmm;
    case kFp32FmaZmm: return LoopFp32FmaZmm;
    case kBf16DotZmm: return LoopBf16DotZmm;
    case kAmxBf16: return LoopAmxBf16;
    case kInt8VnniZmm: return LoopInt8VnniZmm;
    case kAmxInt8: return LoopAmxInt8;
#endif
    default: return nullptr;
  }
}

// Operands the compiler cannot see at build time: a in (0, 1) keeps acc*a + b bounded, b small.
volatile float g_operands[8] = {0.999f, 1e-3f, 0.5f, 1e-3f, 1e-3f, 0.0f, 0.0f, 0.0f};
// Results land here so that no measured loop is dead code.
volatile uint64_t g_read_sink = 0;
volatile float g_peak_sink = 0.0f;

}  // namespace

// ------------------------------------------------------------------------------------------------ C interface

DSV4RL_EXPORT int dsv4rl_abi_version(void) { return 1; }

// Bit mask of usable paths: 1 SSE2, 2 AVX2+FMA, 4 AVX-512F, 8 AVX512-BF16, 16 AVX512-VNNI, 32 AMX-BF16, 64 AMX-INT8
// (each includes the OS register-state support; AMX also the Linux tile-data permission).
DSV4RL_EXPORT uint32_t dsv4rl_features(void) { return Features(); }

DSV4RL_EXPORT int dsv4rl_num_kinds(void) { return kNumKinds; }

DSV4RL_EXPORT const char* dsv4rl_kind_name(int kind) {
  return kind >= 0 && kind < kNumKinds ? kKindNames[kind] : "";
}

DSV4RL_EXPORT int dsv4rl_kind_supported(int kind) { return KindSupported(kind) ? 1 : 0; }

// Streams `threads` slices of one `bytes`-byte buffer `reps` times (after one untimed pass that also faults the
// pages in, each slice first touched by its reader). gbs[r] = bytes / seconds / 1e9 of repetition r. *width_bits
// receives the load width used. Returns 0, or -1 for bad arguments, -2 when the buffer cannot be allocated.
DSV4RL_EXPORT int dsv4rl_read_bandwidth(uint64_t bytes, int threads, int reps, double* gbs, int* width_bits) {
  if (threads < 1 || reps < 1 || gbs == nullptr || bytes < 4096) return -1;
  constexpr size_t kAlign = 2u << 20;
  const size_t per = static_cast<size_t>(bytes) / static_cast<size_t>(threads) / 4096 * 4096;
  if (per == 0) return -1;
  const size_t total = (per * static_cast<size_t>(threads) + kAlign - 1) / kAlign * kAlign;
  void* mem = std::aligned_alloc(kAlign, total);
  if (mem == nullptr) return -2;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(mem, total, MADV_HUGEPAGE);  // fewer TLB misses; a hint only
#endif
  auto* buf = static_cast<uint8_t*>(mem);
  int width = 0;
  ReadFn read = PickRead(&width);
  if (width_bits != nullptr) *width_bits = width;
  std::vector<uint64_t> sinks(static_cast<size_t>(threads) * 8, 0);
  RunTogether(threads, [&](int t) {
    uint8_t* p = buf + static_cast<size_t>(t) * per;
    for (size_t i = 0; i < per; i += 4096) std::memset(p + i, static_cast<int>((i >> 12) * 131 + t), 4096);
    sinks[static_cast<size_t>(t) * 8] ^= read(p, per);
  });
  for (int r = 0; r < reps; ++r) {
    const double sec = RunTogether(threads, [&](int t) {
      sinks[static_cast<size_t>(t) * 8] ^= read(buf + static_cast<size_t>(t) * per, per);
    });
    gbs[r] = static_cast<double>(per) * threads / sec / 1e9;
  }
  uint64_t all = 0;
  for (uint64_t s : sinks) all ^= s;
  g_read_sink = g_read_sink ^ all;
  std::free(mem);
  return 0;
}

// Peak throughput of path `kind` on `threads` threads: each repetition runs, on every thread at once, enough
// iterations for about `seconds` of work (calibrated on one thread first). gflops[r] = operations of all threads /
// seconds / 1e9 (an FMA or a multiply-add pair counts 2). Returns 0, -1 for bad arguments, -3 when the CPU or OS
// lacks the path.
DSV4RL_EXPORT int dsv4rl_peak(int kind, int threads, double seconds, int reps, double* gflops) {
  if (threads < 1 || reps < 1 || gflops == nullptr || !(seconds > 0)) return -1;
  if (kind < 0 || kind >= kNumKinds) return -1;
  LoopFn loop = PickLoop(kind);
  if (loop == nullptr) return -3;
  float in[8];
  for (int i = 0; i < 8; ++i) in[i] = g_operands[i];
  // Per-thread sink regions: the widest loop stores 24 zmm accumulators (384 floats), AMX one 1 KiB tile.
  constexpr size_t kSinkFloats = 512;
  std::vector<float> sinks(static_cast<size_t>(threads) * kSinkFloats, 0.0f);
  // Calibration: grow the iteration count until one call lasts >= 20 ms.
  int64_t iters = 1 << 12;
  double per_iter = 0.0;
  for (;;) {
    const Clock::time_point t0 = Clock::now();
    loop(iters, in, sinks.data());
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    if (sec >= 0.02 || iters >= (int64_t{1} << 40)) {
      per_iter = sec / static_cast<double>(iters);
      break;
    }
    iters *= 4;
  }
  iters = std::max<int64_t>(1, static_cast<int64_t>(seconds / per_iter));
  double ops_per_iter = 0.0;
  for (int r = 0; r < reps; ++r) {
    std::vector<double> ops(static_cast<size_t>(threads), 0.0);
    const double sec = RunTogether(threads, [&](int t) {
      ops[static_cast<size_t>(t)] = loop(iters, in, sinks.data() + static_cast<size_t>(t) * kSinkFloats);
    });
    ops_per_iter = ops[0];
    gflops[r] = ops_per_iter * static_cast<double>(iters) * threads / sec / 1e9;
  }
  float all = 0.0f;
  for (float s : sinks) all += s;
  g_peak_sink = g_peak_sink + all;
  return 0;
}
