// AMX tile API for the *_amx.cc kernel sources, with two backends chosen at compile time.
//
//   real      built with -mamx-tile -mamx-bf16 -mamx-int8: every call is one AMX instruction (LDTILECFG,
//             TILELOADD, TILESTORED, TILEZERO, TDPBF16PS, TDPB[SU][SU]D, TILERELEASE). Namespace dsv4::amx.
//   emulated  built with -DDSV4_AMX_EMULATION and no AMX flag: a per-thread software tile register file that
//             reproduces the instructions bit for bit (see "Emulated semantics" below). Namespace dsv4::amx_emu.
//             Portable C++17; it runs on any CPU, so tile kernels are tested on machines without AMX.
//
// The same kernel source compiles both ways. It opens `namespace dsv4 { namespace DSV4_AMX_NS {` and calls only
// what this header declares in that namespace. Tile registers are template arguments (`TileLoad<4>(p, stride)`,
// `TileDpbf16ps<0, 4, 6>()`): the hardware encodes the register number in the instruction, so it must be a
// constant. Everything here is inside the ISA namespace, so inline functions built with AMX flags can never be
// merged by the linker with the emulated ones.
//
// Programming model (both backends):
//   - Before the first tile instruction on a thread: TileLoadConfig(cfg). The configuration is per thread (it is
//     part of the thread's register state), so a kernel that splits work over a thread pool configures inside
//     each task, on the thread that runs it, and calls TileRelease() when the task ends.
//   - TileLoadConfig zeroes all eight tiles. Palette 1 is the only palette: tiles tmm0..tmm7, each at most
//     16 rows x 64 bytes; rows[t] / colsb[t] set the shape tile t has for the whole configuration.
//   - TileLoad<t>(base, stride) reads rows[t] rows of colsb[t] bytes, row r starting at base + r * stride (bytes);
//     the rest of the tile is zeroed. TileStore<t> writes the same rectangle back. TileZero<t> clears the tile.
//   - Dot products accumulate into the first tile: C[m][n] += sum_k A[m][k] . B[k][n], where one "element" of A
//     and of B is a 32-bit group (2 bf16 or 4 int8 values, the VNNI pair/quad). Shapes must satisfy
//     C.rows == A.rows, A.colsb / 4 == B.rows, C.colsb == B.colsb, and all three tiles must differ.
//   - On Linux the process needs the operating system's permission before its first tile instruction
//     (dsv4::RequestAmxPermission(), platform/cpu_features.h); dispatch only selects an amx table once it is granted.
//
// Emulated semantics of TDPBF16PS (C fp32, A and B bf16 pairs). This is the Intel SDM pseudo-code; it matched an
// AMX Xeon (with AVX512-FP16, so Sapphire Rapids or later) bit for bit on every input tried: random tiles,
// cancellation-heavy exponent ranges, product underflow/overflow, denormal, Inf and NaN inputs (the hardware
// tests in tests/custom_ops/kernels/test_amx_tile.cc repeat this wherever AMX is usable):
//   for each (m, n):
//     even = +0, odd = +0                                   two fp32 partial sums, one per half of the pair
//     for k in 0 .. A.colsb/4 - 1:                          in increasing k
//       even = fma(a[m][2k],   b[k][2n],   even)            fused: the bf16 x bf16 product is exact, one rounding
//       odd  = fma(a[m][2k+1], b[k][2n+1], odd)
//     C[m][n] = C[m][n] + (even + odd)                      two more roundings: the pair sum, then the accumulate
//   Every rounding is to nearest-even at fp32 precision. Inputs (bf16 elements and the old C value) that are
//   denormal are read as zero of the same sign (DAZ). Each rounded result whose magnitude is below 2^-126 after
//   rounding to 24 significant bits with an unbounded exponent becomes a zero of the same sign (FTZ, tininess
//   detected after rounding, as x86 does): so an exact result just below 2^-126 that a gradual-underflow unit
//   would round up to 2^-126 still flushes. Overflow gives +-Inf. MXCSR is neither read nor written.
//   NaN: a NaN result carries the first NaN operand, quieted (bit 22 set), with the operand order fma(a, b, acc)
//   -> a, b, acc and x + y -> x, y (so the old C wins over the products, the even sum over the odd one, and a
//   later product over an earlier NaN in the same partial sum). Invalid operations without a NaN operand
//   (Inf x 0, Inf - Inf) give the x86 default NaN 0xFFC00000.
// Differences from the intrinsics guide: its pseudo-code accumulates both products straight into C in k order;
// the measured hardware does not (the two partial sums start at zero and meet C only at the end), and neither
// does this emulation. Not emulated: the start_row restart protocol (start_row must be 0) and faults (a bad
// configuration or shape aborts with a message instead of raising #GP/#UD).
// Host assumption of the emulation: double arithmetic in round-to-nearest mode (the default; nothing here is
// affected by DAZ/FTZ in MXCSR because no intermediate double is near the double subnormal range).
//
// Integer dot products (exact, int32 wrap-around, no saturation): C[m][n] += sum over k, i<4 of
// A[m][4k+i] * B[k][4n+i] with A/B bytes read as signed or unsigned per the instruction name:
// TDPBSSD (s8 x s8), TDPBSUD (s8 x u8), TDPBUSD (u8 x s8), TDPBUUD (u8 x u8).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(DSV4_AMX_EMULATION)
#include <cfloat>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#error "the AMX emulation needs plain IEEE double arithmetic (no x87 excess precision)"
#endif
#define DSV4_AMX_NS amx_emu
#else
#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__))
#error "amx_tile.h needs -mamx-tile -mamx-bf16 -mamx-int8, or -DDSV4_AMX_EMULATION for the software tiles"
#endif
#include <immintrin.h>
#define DSV4_AMX_NS amx
#endif

namespace dsv4 {
namespace DSV4_AMX_NS {

constexpr int kNumTiles = 8;       // tmm0..tmm7
constexpr int kTileMaxRows = 16;   // palette 1
constexpr int kTileMaxColsb = 64;  // bytes per tile row (16 fp32/int32, 32 bf16 = 16 pairs, 64 int8)

// The 64-byte LDTILECFG operand (Intel SDM vol. 1, "Tile configuration"). Unused tiles keep rows = colsb = 0.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void Set(int tile, int num_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(num_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads exactly 64 bytes");

template <int kC, int kA, int kB>
constexpr bool DistinctTiles() {
  return kC >= 0 && kC < kNumTiles && kA >= 0 && kA < kNumTiles && kB >= 0 && kB < kNumTiles && kC != kA &&
         kC != kB && kA != kB;
}

#if !defined(DSV4_AMX_EMULATION)
// ---------------------------------------------------------------------------------------------------------------
// Real backend.
//
// GCC's AMX intrinsics are macros that paste the tile number into the assembly text, so they only accept a
// literal; the DSV4_AMX_LIT* macros below turn a template argument into that literal with an `if constexpr` chain
// (resolved at compile time, one instruction remains). Clang and MSVC accept any constant expression.
// GCC's _tile_loadconfig / _tile_loadd asm statements also do not tell the compiler that they read the whole
// buffer, so compiler-only barriers surround them: stores that fill a config or a scratch tile before the load can
// then neither be dropped nor sunk past it, and stores that refill the scratch for the next load cannot be hoisted
// above it.

#if defined(__GNUC__) && !defined(__clang__)
#define DSV4_AMX_LITERAL_IDS 1
#define DSV4_AMX_READ_BARRIER() __asm__ __volatile__("" ::: "memory")
#else
#define DSV4_AMX_LITERAL_IDS 0
#define DSV4_AMX_READ_BARRIER() ((void)0)
#endif

#if DSV4_AMX_LITERAL_IDS
// DSV4_AMX_LIT8_x(V, OP, prefix...) expands to OP(prefix..., i) for the literal i == V. Three copies with different
// names so that they can nest (a macro cannot expand inside itself).
#define DSV4_AMX_LIT8_A(V, OP, ...) \
  if constexpr ((V) == 0) {         \
    OP(__VA_ARGS__ 0);              \
  } else if constexpr ((V) == 1) {  \
    OP(__VA_ARGS__ 1);              \
  } else if constexpr ((V) == 2) {  \
    OP(__VA_ARGS__ 2);              \
  } else if constexpr ((V) == 3) {  \
    OP(__VA_ARGS__ 3);              \
  } else if constexpr ((V) == 4) {  \
    OP(__VA_ARGS__ 4);              \
  } else if constexpr ((V) == 5) {  \
    OP(__VA_ARGS__ 5);              \
  } else if constexpr ((V) == 6) {  \
    OP(__VA_ARGS__ 6);              \
  } else {                          \
    OP(__VA_ARGS__ 7);              \
  }
#define DSV4_AMX_LIT8_B(V, OP, ...) \
  if constexpr ((V) == 0) {         \
    OP(__VA_ARGS__ 0);              \
  } else if constexpr ((V) == 1) {  \
    OP(__VA_ARGS__ 1);              \
  } else if constexpr ((V) == 2) {  \
    OP(__VA_ARGS__ 2);              \
  } else if constexpr ((V) == 3) {  \
    OP(__VA_ARGS__ 3);              \
  } else if constexpr ((V) == 4) {  \
    OP(__VA_ARGS__ 4);              \
  } else if constexpr ((V) == 5) {  \
    OP(__VA_ARGS__ 5);              \
  } else if constexpr ((V) == 6) {  \
    OP(__VA_ARGS__ 6);              \
  } else {                          \
    OP(__VA_ARGS__ 7);              \
  }
#define DSV4_AMX_LIT8_C(V, OP, ...) \
  if constexpr ((V) == 0) {         \
    OP(__VA_ARGS__ 0);              \
  } else if constexpr ((V) == 1) {  \
    OP(__VA_ARGS__ 1);              \
  } else if constexpr ((V) == 2) {  \
    OP(__VA_ARGS__ 2);              \
  } else if constexpr ((V) == 3) {  \
    OP(__VA_ARGS__ 3);              \
  } else if constexpr ((V) == 4) {  \
    OP(__VA_ARGS__ 4);              \
  } else if constexpr ((V) == 5) {  \
    OP(__VA_ARGS__ 5);              \
  } else if constexpr ((V) == 6) {  \
    OP(__VA_ARGS__ 6);              \
  } else {                          \
    OP(__VA_ARGS__ 7);              \
  }
// Three-register dot products: C, then A, then B are made literal. Only the branch with the requested
// (C, A, B) survives; the others are discarded statements of the template and never reach the assembler.
#define DSV4_AMX_DP_L3(INTRIN, c, a, b) INTRIN(c, a, b)
#define DSV4_AMX_DP_L2(INTRIN, c, a) DSV4_AMX_LIT8_C(kB, DSV4_AMX_DP_L3, INTRIN, c, a, )
#define DSV4_AMX_DP_L1(INTRIN, c) DSV4_AMX_LIT8_B(kA, DSV4_AMX_DP_L2, INTRIN, c, )
#define DSV4_AMX_DP(INTRIN) DSV4_AMX_LIT8_A(kC, DSV4_AMX_DP_L1, INTRIN, )
#endif  // DSV4_AMX_LITERAL_IDS

inline void TileLoadConfig(const TileConfig& cfg) {
  DSV4_AMX_READ_BARRIER();
  _tile_loadconfig(&cfg);
  DSV4_AMX_READ_BARRIER();
}

inline void TileRelease() { _tile_release(); }

template <int kT>
inline void TileZero() {
  static_assert(kT >= 0 && kT < kNumTiles, "tile register out of range");
#if DSV4_AMX_LITERAL_IDS
#define DSV4_AMX_ZERO_OP(t) _tile_zero(t)
  DSV4_AMX_LIT8_A(kT, DSV4_AMX_ZERO_OP, )
#undef DSV4_AMX_ZERO_OP
#else
  _tile_zero(kT);
#endif
}

template <int kT>
inline void TileLoad(const void* base, size_t stride_bytes) {
  static_assert(kT >= 0 && kT < kNumTiles, "tile register out of range");
  DSV4_AMX_READ_BARRIER();
#if DSV4_AMX_LITERAL_IDS
#define DSV4_AMX_LOAD_OP(t) _tile_loadd(t, base, static_cast<long>(stride_bytes))
  DSV4_AMX_LIT8_A(kT, DSV4_AMX_LOAD_OP, )
#undef DSV4_AMX_LOAD_OP
#else
  _tile_loadd(kT, base, stride_bytes);
#endif
  DSV4_AMX_READ_BARRIER();
}

template <int kT>
inline void TileStore(void* base, size_t stride_bytes) {
  static_assert(kT >= 0 && kT < kNumTiles, "tile register out of range");
#if DSV4_AMX_LITERAL_IDS
#define DSV4_AMX_STORE_OP(t) _tile_stored(t, base, static_cast<long>(stride_bytes))
  DSV4_AMX_LIT8_A(kT, DSV4_AMX_STORE_OP, )
#undef DSV4_AMX_STORE_OP
#else
  _tile_stored(kT, base, stride_bytes);
#endif
}

#if DSV4_AMX_LITERAL_IDS
#define DSV4_AMX_DEFINE_DP(Name, INTRIN)                                                   \
  template <int kC, int kA, int kB>                                                        \
  inline void Name() {                                                                     \
    static_assert(DistinctTiles<kC, kA, kB>(), "dot product needs three distinct tiles"); \
    DSV4_AMX_DP(INTRIN)                                                                    \
  }
#else
#define DSV4_AMX_DEFINE_DP(Name, INTRIN)                                                   \
  template <int kC, int kA, int kB>                                                        \
  inline void Name() {                                                                     \
    static_assert(DistinctTiles<kC, kA, kB>(), "dot product needs three distinct tiles"); \
    INTRIN(kC, kA, kB);                                                                    \
  }
#endif

DSV4_AMX_DEFINE_DP(TileDpbf16ps, _tile_dpbf16ps)
DSV4_AMX_DEFINE_DP(TileDpbssd, _tile_dpbssd)
DSV4_AMX_DEFINE_DP(TileDpbsud, _tile_dpbsud)
DSV4_AMX_DEFINE_DP(TileDpbusd, _tile_dpbusd)
DSV4_AMX_DEFINE_DP(TileDpbuud, _tile_dpbuud)
#undef DSV4_AMX_DEFINE_DP

// The helpers above were expanded when the templates were parsed; keep them out of the including file.
#if DSV4_AMX_LITERAL_IDS
#undef DSV4_AMX_LIT8_A
#undef DSV4_AMX_LIT8_B
#undef DSV4_AMX_LIT8_C
#undef DSV4_AMX_DP_L3
#undef DSV4_AMX_DP_L2
#undef DSV4_AMX_DP_L1
#undef DSV4_AMX_DP
#endif
#undef DSV4_AMX_LITERAL_IDS
#undef DSV4_AMX_READ_BARRIER

#else  // DSV4_AMX_EMULATION
// ---------------------------------------------------------------------------------------------------------------
// Emulated backend.

namespace emu {

// One thread's tile state: the configuration and 8 x 1 KiB of tile data (static TLS, no heap).
struct TileFile {
  bool configured = false;
  uint8_t rows[kNumTiles] = {};
  uint16_t colsb[kNumTiles] = {};
  alignas(64) uint8_t data[kNumTiles][kTileMaxRows][kTileMaxColsb] = {};
};

inline TileFile& Tiles() {
  thread_local TileFile file;
  return file;
}

[[noreturn]] inline void Fail(const char* instruction, const char* what, int value = -1) {
  if (value >= 0) {
    std::fprintf(stderr, "dsv4 AMX emulation: %s: %s (%d)\n", instruction, what, value);
  } else {
    std::fprintf(stderr, "dsv4 AMX emulation: %s: %s\n", instruction, what);
  }
  std::fflush(stderr);
  std::abort();
}

inline void RequireTile(const char* instruction, int t) {
  const TileFile& f = Tiles();
  if (!f.configured) Fail(instruction, "no tile configuration loaded on this thread (call TileLoadConfig first)");
  if (f.rows[t] == 0) Fail(instruction, "tile register is not configured (rows = colsb = 0)", t);
}

inline uint32_t F32Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float F32FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

constexpr uint32_t kDefaultNan = 0xFFC00000u;  // x86 "real indefinite"

inline bool IsNan(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
inline bool IsInf(uint32_t u) { return (u & 0x7FFFFFFFu) == 0x7F800000u; }
inline bool IsZero(uint32_t u) { return (u & 0x7FFFFFFFu) == 0; }

// DAZ: a denormal input reads as a zero of the same sign.
inline uint32_t Daz(uint32_t u) { return (u & 0x7F800000u) == 0 ? (u & 0x80000000u) : u; }

// Rounds the exact value x + y (x, y finite doubles, at most 2^256 in magnitude) to fp32 once: round-to-nearest-
// even at 24 significant bits with an unbounded exponent, then FTZ below 2^-126 and Inf above the fp32 range.
// x + y is first rounded to double with round-to-odd (TwoSum gives the exact error), which keeps the second
// rounding to 24 bits correct because 53 >= 24 + 2. FMA contraction by the compiler is harmless: the only product
// feeding these sums (bf16 x bf16 in Fma) is exact in double.
inline uint32_t RoundSumToF32(double x, double y) {
  const double s = x + y;
  const double y_virtual = s - x;
  const double err = (x - (s - y_virtual)) + (y - y_virtual);
  uint64_t u;
  std::memcpy(&u, &s, sizeof u);
  if (err != 0.0 && (u & 1u) == 0) u += ((err > 0.0) == (s > 0.0)) ? 1 : static_cast<uint64_t>(-1);
  const uint32_t sign = static_cast<uint32_t>(u >> 32) & 0x80000000u;
  uint64_t mag = u & 0x7FFFFFFFFFFFFFFFull;
  if (mag == 0) return sign;  // exact zero: IEEE sign rules already applied by the double addition
  constexpr int kDrop = 52 - 23;
  const uint64_t rem = mag & ((uint64_t{1} << kDrop) - 1);
  const uint64_t half = uint64_t{1} << (kDrop - 1);
  mag >>= kDrop;
  if (rem > half || (rem == half && (mag & 1u))) ++mag;  // a carry into the exponent field is correct
  const int exp = static_cast<int>(mag >> (52 - kDrop)) - 1023;
  if (exp < -126) return sign;                   // tiny after rounding: flush
  if (exp > 127) return sign | 0x7F800000u;      // overflow
  const uint32_t frac = static_cast<uint32_t>(mag & 0x7FFFFFu);
  return sign | (static_cast<uint32_t>(exp + 127) << 23) | frac;
}

// x + y with the NaN / Inf rules of the header comment; x and y never denormal here.
inline uint32_t Add(uint32_t x, uint32_t y) {
  if (IsNan(x)) return x | 0x00400000u;
  if (IsNan(y)) return y | 0x00400000u;
  if (IsInf(x) || IsInf(y)) {
    if (IsInf(x) && IsInf(y) && ((x ^ y) & 0x80000000u)) return kDefaultNan;
    return IsInf(x) ? x : y;
  }
  return RoundSumToF32(static_cast<double>(F32FromBits(x)), static_cast<double>(F32FromBits(y)));
}

// acc + a * b with one rounding; a and b are bf16 values widened to fp32 and already through DAZ.
inline uint32_t Fma(uint32_t acc, uint32_t a, uint32_t b) {
  if (IsNan(a)) return a | 0x00400000u;
  if (IsNan(b)) return b | 0x00400000u;
  if (IsNan(acc)) return acc | 0x00400000u;
  if (IsInf(a) || IsInf(b)) {
    if (IsZero(a) || IsZero(b)) return kDefaultNan;  // Inf x 0
    const uint32_t prod = ((a ^ b) & 0x80000000u) | 0x7F800000u;
    if (IsInf(acc) && acc != prod) return kDefaultNan;  // Inf - Inf
    return prod;
  }
  if (IsInf(acc)) return acc;
  // bf16 x bf16 has at most 16 significant bits and a magnitude in [2^-252, 2^256]: exact in double.
  const double prod = static_cast<double>(F32FromBits(a)) * static_cast<double>(F32FromBits(b));
  return RoundSumToF32(prod, static_cast<double>(F32FromBits(acc)));
}

inline uint32_t Bf16At(const uint8_t* row, int index) {
  uint16_t h;
  std::memcpy(&h, row + 2 * index, sizeof h);
  return static_cast<uint32_t>(h) << 16;
}

inline void CheckDpShapes(const char* instruction, int c, int a, int b) {
  RequireTile(instruction, c);
  RequireTile(instruction, a);
  RequireTile(instruction, b);
  const TileFile& f = Tiles();
  if (f.colsb[c] % 4 != 0) Fail(instruction, "C colsb must be a multiple of 4", f.colsb[c]);
  if (f.colsb[a] % 4 != 0) Fail(instruction, "A colsb must be a multiple of 4", f.colsb[a]);
  if (f.rows[c] != f.rows[a]) Fail(instruction, "C rows != A rows", f.rows[c] * 100 + f.rows[a]);
  if (f.colsb[a] / 4 != f.rows[b]) Fail(instruction, "A colsb / 4 != B rows", f.colsb[a] * 100 + f.rows[b]);
  if (f.colsb[c] != f.colsb[b]) Fail(instruction, "C colsb != B colsb", f.colsb[c] * 100 + f.colsb[b]);
}

// Zeroes the bytes of tile t outside its configured rows x colsb rectangle.
inline void ZeroOutside(int t) {
  TileFile& f = Tiles();
  for (int r = 0; r < kTileMaxRows; ++r) {
    const int from = r < f.rows[t] ? f.colsb[t] : 0;
    std::memset(&f.data[t][r][from], 0, static_cast<size_t>(kTileMaxColsb - from));
  }
}

inline void DpBf16(int c, int a, int b) {
  CheckDpShapes("TDPBF16PS", c, a, b);
  TileFile& f = Tiles();
  const int rows = f.rows[c], n_cols = f.colsb[c] / 4, k_pairs = f.colsb[a] / 4;
  for (int m = 0; m < rows; ++m) {
    const uint8_t* a_row = f.data[a][m];
    for (int n = 0; n < n_cols; ++n) {
      uint32_t even = 0, odd = 0;
      for (int k = 0; k < k_pairs; ++k) {
        const uint8_t* b_row = f.data[b][k];
        even = Fma(even, Daz(Bf16At(a_row, 2 * k)), Daz(Bf16At(b_row, 2 * n)));
        odd = Fma(odd, Daz(Bf16At(a_row, 2 * k + 1)), Daz(Bf16At(b_row, 2 * n + 1)));
      }
      uint32_t acc;
      std::memcpy(&acc, &f.data[c][m][4 * n], sizeof acc);
      acc = Add(Daz(acc), Add(even, odd));
      std::memcpy(&f.data[c][m][4 * n], &acc, sizeof acc);
    }
  }
  ZeroOutside(c);
}

template <bool kASigned, bool kBSigned>
inline void DpInt8(const char* instruction, int c, int a, int b) {
  CheckDpShapes(instruction, c, a, b);
  TileFile& f = Tiles();
  const int rows = f.rows[c], n_cols = f.colsb[c] / 4, k_quads = f.colsb[a] / 4;
  for (int m = 0; m < rows; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      uint32_t acc;  // unsigned arithmetic = the instruction's int32 wrap-around
      std::memcpy(&acc, &f.data[c][m][4 * n], sizeof acc);
      for (int k = 0; k < k_quads; ++k) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t ab = f.data[a][m][4 * k + i], bb = f.data[b][k][4 * n + i];
          const int32_t av = kASigned ? static_cast<int32_t>(static_cast<int8_t>(ab)) : static_cast<int32_t>(ab);
          const int32_t bv = kBSigned ? static_cast<int32_t>(static_cast<int8_t>(bb)) : static_cast<int32_t>(bb);
          acc += static_cast<uint32_t>(av * bv);  // |av * bv| <= 2^15: no overflow in int32
        }
      }
      std::memcpy(&f.data[c][m][4 * n], &acc, sizeof acc);
    }
  }
  ZeroOutside(c);
}

}  // namespace emu

// LDTILECFG: validates like the hardware (which raises #GP) and aborts on a bad configuration. Palette 0 returns
// the tiles to the unconfigured state, like TILERELEASE.
inline void TileLoadConfig(const TileConfig& cfg) {
  emu::TileFile& f = emu::Tiles();
  const char* kName = "LDTILECFG";
  if (cfg.palette_id > 1) emu::Fail(kName, "unsupported palette", cfg.palette_id);
  std::memset(f.data, 0, sizeof f.data);
  if (cfg.palette_id == 0) {
    f = emu::TileFile{};
    return;
  }
  if (cfg.start_row != 0) emu::Fail(kName, "start_row must be 0 (restart is not emulated)", cfg.start_row);
  for (uint8_t r : cfg.reserved) {
    if (r != 0) emu::Fail(kName, "reserved bytes 2..15 must be zero");
  }
  for (int t = 0; t < 16; ++t) {
    if (t >= kNumTiles) {
      if (cfg.rows[t] != 0 || cfg.colsb[t] != 0) emu::Fail(kName, "tiles 8..15 do not exist in palette 1", t);
      continue;
    }
    if (cfg.rows[t] > kTileMaxRows) emu::Fail(kName, "rows > 16", cfg.rows[t]);
    if (cfg.colsb[t] > kTileMaxColsb) emu::Fail(kName, "colsb > 64", cfg.colsb[t]);
    if ((cfg.rows[t] == 0) != (cfg.colsb[t] == 0)) emu::Fail(kName, "rows and colsb must be both zero or both set", t);
    f.rows[t] = cfg.rows[t];
    f.colsb[t] = cfg.colsb[t];
  }
  f.configured = true;
}

inline void TileRelease() { emu::Tiles() = emu::TileFile{}; }

// True while a configuration is loaded on the calling thread (emulation only; used by tests).
inline bool TilesConfigured() { return emu::Tiles().configured; }

template <int kT>
inline void TileZero() {
  static_assert(kT >= 0 && kT < kNumTiles, "tile register out of range");
  emu::RequireTile("TILEZERO", kT);
  std::memset(emu::Tiles().data[kT], 0, sizeof emu::Tiles().data[kT]);
}

template <int kT>
inline void TileLoad(const void* base, size_t stride_bytes) {
  static_assert(kT >= 0 && kT < kNumTiles, "tile register out of range");
  emu::RequireTile("TILELOADD", kT);
  if (base == nullptr) emu::Fail("TILELOADD", "null base pointer", kT);
  emu::TileFile& f = emu::Tiles();
  const uint8_t* src = static_cast<const uint8_t*>(base);
  for (int r = 0; r < f.rows[kT]; ++r) std::memcpy(f.data[kT][r], src + r * stride_bytes, f.colsb[kT]);
  emu::ZeroOutside(kT);
}

template <int kT>
inline void TileStore(void* base, size_t stride_bytes) {
  static_assert(kT >= 0 && kT < kNumTiles, "tile register out of range");
  emu::RequireTile("TILESTORED", kT);
  if (base == nullptr) emu::Fail("TILESTORED", "null base pointer", kT);
  const emu::TileFile& f = emu::Tiles();
  uint8_t* dst = static_cast<uint8_t*>(base);
  for (int r = 0; r < f.rows[kT]; ++r) std::memcpy(dst + r * stride_bytes, f.data[kT][r], f.colsb[kT]);
}

template <int kC, int kA, int kB>
inline void TileDpbf16ps() {
  static_assert(DistinctTiles<kC, kA, kB>(), "dot product needs three distinct tiles");
  emu::DpBf16(kC, kA, kB);
}

template <int kC, int kA, int kB>
inline void TileDpbssd() {
  static_assert(DistinctTiles<kC, kA, kB>(), "dot product needs three distinct tiles");
  emu::DpInt8<true, true>("TDPBSSD", kC, kA, kB);
}

template <int kC, int kA, int kB>
inline void TileDpbsud() {
  static_assert(DistinctTiles<kC, kA, kB>(), "dot product needs three distinct tiles");
  emu::DpInt8<true, false>("TDPBSUD", kC, kA, kB);
}

template <int kC, int kA, int kB>
inline void TileDpbusd() {
  static_assert(DistinctTiles<kC, kA, kB>(), "dot product needs three distinct tiles");
  emu::DpInt8<false, true>("TDPBUSD", kC, kA, kB);
}

template <int kC, int kA, int kB>
inline void TileDpbuud() {
  static_assert(DistinctTiles<kC, kA, kB>(), "dot product needs three distinct tiles");
  emu::DpInt8<false, false>("TDPBUUD", kC, kA, kB);
}

#endif  // DSV4_AMX_EMULATION

}  // namespace DSV4_AMX_NS
}  // namespace dsv4
