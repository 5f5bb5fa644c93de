// Tests for the AMX tile layer (custom_ops/numerics/amx_tile.h): tile configuration, load, dot products and store.
//
//   amx_tile_emu_*      the emulated tiles against an independent scalar model of the instruction semantics
//                       documented in amx_tile.h (soft-float with integer significands here, TwoSum/round-to-odd
//                       there), bit for bit, on random tiles of every shape including denormal, Inf and NaN
//                       inputs; chains of dot products over several K blocks into one C tile; hand cases with
//                       values measured on AMX hardware; configuration/shape validation.
//   amx_tile_hw_*       only where AMX is usable (CPUID + XCR0 + kernel permission): the real instructions vs the
//                       emulation, bit for bit. Elsewhere they end as skipped with the reason.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#if defined(__unix__)
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#endif

#define DSV4_AMX_EMULATION 1
#include "custom_ops/numerics/amx_tile.h"
#undef DSV4_AMX_EMULATION

#include "custom_ops/platform/cpu_features.h"
#include "kt.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DSV4_TEST_HW_AMX 1
#else
#define DSV4_TEST_HW_AMX 0
#endif

namespace {

namespace emu = dsv4::amx_emu;

std::string Hex(uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", u);
  return buf;
}

// ---------------------------------------------------------------------------------------------------------------
// Scalar model of TDPBF16PS / TDPB[SU][SU]D, written from the semantics in amx_tile.h.

namespace model {

constexpr uint32_t kSign = 0x80000000u;
constexpr uint32_t kQuietBit = 0x00400000u;
constexpr uint32_t kIndefinite = 0xFFC00000u;

bool IsNan(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
bool IsInf(uint32_t u) { return (u & 0x7FFFFFFFu) == 0x7F800000u; }
bool IsZero(uint32_t u) { return (u & 0x7FFFFFFFu) == 0; }
uint32_t FlushDenormal(uint32_t u) { return (u & 0x7F800000u) == 0 ? (u & kSign) : u; }

// A finite value: zero (with sign) or sign * sig * 2^exp with sig > 0.
struct Value {
  uint32_t sign = 0;
  uint64_t sig = 0;
  int exp = 0;
};

Value FromF32(uint32_t u) {  // normal or zero (inputs are flushed first)
  Value v;
  v.sign = u & kSign;
  if (IsZero(u)) return v;
  v.sig = (u & 0x7FFFFFu) | 0x800000u;
  v.exp = static_cast<int>((u >> 23) & 0xFFu) - 150;
  return v;
}

int TopBit(uint64_t x) {
  int t = -1;
  while (x != 0) {
    x >>= 1;
    ++t;
  }
  return t;
}

// sign * r * 2^e (r > 0) -> fp32: 24-bit round-to-nearest-even with an unbounded exponent, then flush below
// 2^-126 (keeping the sign) or overflow to Inf.
uint32_t Round(uint32_t sign, uint64_t r, int e) {
  const int top = TopBit(r);
  if (top > 23) {
    const int sh = top - 23;
    const uint64_t rem = r & ((uint64_t{1} << sh) - 1), half = uint64_t{1} << (sh - 1);
    r >>= sh;
    e += sh;
    if (rem > half || (rem == half && (r & 1u))) {
      ++r;
      if (r == (uint64_t{1} << 24)) {
        r >>= 1;
        ++e;
      }
    }
  } else {
    r <<= (23 - top);
    e -= 23 - top;
  }
  const int unbiased = e + 23;
  if (unbiased < -126) return sign;
  if (unbiased > 127) return sign | 0x7F800000u;
  return sign | (static_cast<uint32_t>(unbiased + 127) << 23) | (static_cast<uint32_t>(r) & 0x7FFFFFu);
}

// Exact x + y, rounded once.
uint32_t Sum(Value x, Value y) {
  if (x.sig == 0 && y.sig == 0) return x.sign & y.sign;  // -0 only for -0 + -0
  if (x.sig == 0) return Round(y.sign, y.sig, y.exp);
  if (y.sig == 0) return Round(x.sign, x.sig, x.exp);
  for (Value* v : {&x, &y}) {  // top bit to position 60
    const int shift = 60 - TopBit(v->sig);
    v->sig <<= shift;
    v->exp -= shift;
  }
  Value big = x, small = y;
  if (y.exp > x.exp || (y.exp == x.exp && y.sig > x.sig)) {
    big = y;
    small = x;
  }
  const int d = big.exp - small.exp;
  uint64_t f = 0;
  bool sticky = false;
  if (d < 64) {
    f = small.sig >> d;
    sticky = d > 0 && (small.sig & ((uint64_t{1} << d) - 1)) != 0;
  } else {
    sticky = true;
  }
  uint64_t r;
  if (big.sign == small.sign) {
    r = big.sig + f;
    if (sticky) r |= 1u;
  } else {
    r = big.sig - f;
    if (sticky) r = (r - 1) | 1u;  // floor of the exact difference, then the sticky bit
  }
  if (r == 0) return 0;  // exact cancellation: +0
  return Round(big.sign, r, big.exp);
}

uint32_t Add(uint32_t x, uint32_t y) {
  if (IsNan(x)) return x | kQuietBit;
  if (IsNan(y)) return y | kQuietBit;
  if (IsInf(x) && IsInf(y)) return x == y ? x : kIndefinite;
  if (IsInf(x)) return x;
  if (IsInf(y)) return y;
  return Sum(FromF32(x), FromF32(y));
}

uint32_t Fma(uint32_t acc, uint32_t a, uint32_t b) {
  if (IsNan(a)) return a | kQuietBit;
  if (IsNan(b)) return b | kQuietBit;
  if (IsNan(acc)) return acc | kQuietBit;
  const uint32_t prod_sign = (a ^ b) & kSign;
  if (IsInf(a) || IsInf(b)) {
    if (IsZero(a) || IsZero(b)) return kIndefinite;
    if (IsInf(acc) && (acc & kSign) != prod_sign) return kIndefinite;
    return prod_sign | 0x7F800000u;
  }
  if (IsInf(acc)) return acc;
  const Value va = FromF32(a), vb = FromF32(b);
  Value p;
  p.sign = prod_sign;
  p.sig = va.sig * vb.sig;
  p.exp = va.exp + vb.exp;
  return Sum(p, FromF32(acc));
}

// Tiles as 16 rows of 64 bytes. C: rows x (4 n_cols) bytes, A: rows x (4 k_groups), B: k_groups x (4 n_cols).
void Dpbf16ps(uint8_t* c, const uint8_t* a, const uint8_t* b, int rows, int k_groups, int n_cols) {
  const auto bf16 = [](const uint8_t* row, int i) {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    return FlushDenormal(static_cast<uint32_t>(h) << 16);
  };
  for (int m = 0; m < rows; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      uint32_t even = 0, odd = 0;
      for (int k = 0; k < k_groups; ++k) {
        even = Fma(even, bf16(a + 64 * m, 2 * k), bf16(b + 64 * k, 2 * n));
        odd = Fma(odd, bf16(a + 64 * m, 2 * k + 1), bf16(b + 64 * k, 2 * n + 1));
      }
      uint32_t old;
      std::memcpy(&old, c + 64 * m + 4 * n, 4);
      const uint32_t result = Add(FlushDenormal(old), Add(even, odd));
      std::memcpy(c + 64 * m + 4 * n, &result, 4);
    }
  }
}

void DpInt8(bool a_signed, bool b_signed, uint8_t* c, const uint8_t* a, const uint8_t* b, int rows, int k_groups,
            int n_cols) {
  for (int m = 0; m < rows; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      int32_t old;
      std::memcpy(&old, c + 64 * m + 4 * n, 4);
      int64_t sum = old;
      for (int k = 0; k < 4 * k_groups; ++k) {
        const uint8_t x = a[64 * m + k], y = b[64 * (k / 4) + 4 * n + k % 4];
        sum += static_cast<int64_t>(a_signed ? static_cast<int8_t>(x) : x) * (b_signed ? static_cast<int8_t>(y) : y);
      }
      const uint32_t wrapped = static_cast<uint32_t>(static_cast<uint64_t>(sum));
      std::memcpy(c + 64 * m + 4 * n, &wrapped, 4);
    }
  }
}

}  // namespace model

// ---------------------------------------------------------------------------------------------------------------
// One dot-product instruction on explicit tiles, through the emulation or the hardware.

enum class DpOp { kBf16, kSS, kSU, kUS, kUU };
constexpr DpOp kAllOps[] = {DpOp::kBf16, DpOp::kSS, DpOp::kSU, DpOp::kUS, DpOp::kUU};

const char* OpName(DpOp op) {
  switch (op) {
    case DpOp::kBf16: return "TDPBF16PS";
    case DpOp::kSS: return "TDPBSSD";
    case DpOp::kSU: return "TDPBSUD";
    case DpOp::kUS: return "TDPBUSD";
    case DpOp::kUU: return "TDPBUUD";
  }
  return "?";
}

struct TileCase {
  int rows = 16, k_groups = 16, n_cols = 16;  // C rows x n_cols 32-bit, A rows x k_groups 32-bit groups
  alignas(64) uint8_t a[1024];
  alignas(64) uint8_t b[1024];
  alignas(64) uint8_t c[1024];
};

emu::TileConfig ConfigFor(const TileCase& t) {
  emu::TileConfig cfg;
  cfg.Set(0, t.rows, 4 * t.n_cols);
  cfg.Set(1, t.rows, 4 * t.k_groups);
  cfg.Set(2, t.k_groups, 4 * t.n_cols);
  return cfg;
}

// Returns C after the instruction, as 16 rows x 64 bytes (only the configured rectangle is meaningful).
std::vector<uint8_t> RunEmulated(DpOp op, const TileCase& t) {
  std::vector<uint8_t> out(t.c, t.c + 1024);
  emu::TileLoadConfig(ConfigFor(t));
  emu::TileLoad<0>(t.c, 64);
  emu::TileLoad<1>(t.a, 64);
  emu::TileLoad<2>(t.b, 64);
  switch (op) {
    case DpOp::kBf16: emu::TileDpbf16ps<0, 1, 2>(); break;
    case DpOp::kSS: emu::TileDpbssd<0, 1, 2>(); break;
    case DpOp::kSU: emu::TileDpbsud<0, 1, 2>(); break;
    case DpOp::kUS: emu::TileDpbusd<0, 1, 2>(); break;
    case DpOp::kUU: emu::TileDpbuud<0, 1, 2>(); break;
  }
  emu::TileStore<0>(out.data(), 64);
  emu::TileRelease();
  return out;
}

std::vector<uint8_t> RunModel(DpOp op, const TileCase& t) {
  std::vector<uint8_t> out(t.c, t.c + 1024);
  switch (op) {
    case DpOp::kBf16: model::Dpbf16ps(out.data(), t.a, t.b, t.rows, t.k_groups, t.n_cols); break;
    case DpOp::kSS: model::DpInt8(true, true, out.data(), t.a, t.b, t.rows, t.k_groups, t.n_cols); break;
    case DpOp::kSU: model::DpInt8(true, false, out.data(), t.a, t.b, t.rows, t.k_groups, t.n_cols); break;
    case DpOp::kUS: model::DpInt8(false, true, out.data(), t.a, t.b, t.rows, t.k_groups, t.n_cols); break;
    case DpOp::kUU: model::DpInt8(false, false, out.data(), t.a, t.b, t.rows, t.k_groups, t.n_cols); break;
  }
  return out;
}

#if DSV4_TEST_HW_AMX
// The real instruction, written with the intrinsics directly (independent of amx_tile.h). Only called when
// AmxUsable(); the target attribute lets this baseline-built file contain it.
__attribute__((target("amx-tile,amx-bf16,amx-int8"), noinline)) void HwDp(DpOp op, const void* cfg, void* c,
                                                                           const void* a, const void* b) {
  __asm__ __volatile__("" ::: "memory");
  _tile_loadconfig(cfg);
  _tile_loadd(0, c, 64);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  switch (op) {
    case DpOp::kBf16: _tile_dpbf16ps(0, 1, 2); break;
    case DpOp::kSS: _tile_dpbssd(0, 1, 2); break;
    case DpOp::kSU: _tile_dpbsud(0, 1, 2); break;
    case DpOp::kUS: _tile_dpbusd(0, 1, 2); break;
    case DpOp::kUU: _tile_dpbuud(0, 1, 2); break;
  }
  _tile_stored(0, c, 64);
  _tile_release();
  __asm__ __volatile__("" ::: "memory");
}

std::vector<uint8_t> RunHardware(DpOp op, const TileCase& t) {
  std::vector<uint8_t> out(t.c, t.c + 1024);
  const emu::TileConfig cfg = ConfigFor(t);  // same 64-byte LDTILECFG layout
  HwDp(op, &cfg, out.data(), t.a, t.b);
  return out;
}
#endif

// AMX instructions may run here: CPU (CPUID), OS (XCR0) and kernel permission, and the amx table was built.
bool AmxUsable(std::string* why) {
#if DSV4_TEST_HW_AMX && defined(DSV4_X86_VARIANTS)
  const dsv4::CpuFeatures& f = dsv4::GetCpuFeatures();
  if (!(f.amx_tile && f.amx_bf16 && f.amx_int8)) {
    *why = "this CPU has no AMX-TILE/BF16/INT8";
    return false;
  }
  if (!f.os_amx) {
    *why = "the OS does not enable AMX tile state (XCR0 bits 17/18)";
    return false;
  }
  if (!f.amx_permitted || !dsv4::RequestAmxPermission()) {
    *why = "the kernel refused AMX tile permission (arch_prctl ARCH_REQ_XCOMP_PERM)";
    return false;
  }
  return true;
#else
  *why = "not an x86-64 build with the AMX kernels";
  return false;
#endif
}

// Compares the configured rectangle of two C tiles; returns the number of differing 32-bit elements.
int CompareC(const TileCase& t, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
             std::string* first) {
  int bad = 0;
  for (int m = 0; m < t.rows; ++m) {
    for (int n = 0; n < t.n_cols; ++n) {
      uint32_t g, w;
      std::memcpy(&g, &got[64 * m + 4 * n], 4);
      std::memcpy(&w, &want[64 * m + 4 * n], 4);
      if (g != w) {
        if (bad++ == 0) {
          *first = "C[" + std::to_string(m) + "][" + std::to_string(n) + "] = " + Hex(g) + ", expected " + Hex(w) +
                   " (rows " + std::to_string(t.rows) + ", k groups " + std::to_string(t.k_groups) + ", cols " +
                   std::to_string(t.n_cols) + ")";
        }
      }
    }
  }
  return bad;
}

// ---------------------------------------------------------------------------------------------------------------
// Random tiles.

enum class Dist { kMixed, kCancel, kWide, kTiny, kHuge, kSpecial };
constexpr Dist kAllDists[] = {Dist::kMixed, Dist::kCancel, Dist::kWide, Dist::kTiny, Dist::kHuge, Dist::kSpecial};

const char* DistName(Dist d) {
  switch (d) {
    case Dist::kMixed: return "mixed";
    case Dist::kCancel: return "cancel";
    case Dist::kWide: return "wide";
    case Dist::kTiny: return "tiny";
    case Dist::kHuge: return "huge";
    case Dist::kSpecial: return "special";
  }
  return "?";
}

uint16_t RandomBf16(std::mt19937& rng, int exp_lo, int exp_hi) {
  const uint32_t sign = rng() & 1u;
  const uint32_t exp = static_cast<uint32_t>(exp_lo + static_cast<int>(rng() % (exp_hi - exp_lo + 1)));
  return static_cast<uint16_t>((sign << 15) | (exp << 7) | (rng() & 0x7Fu));
}

uint16_t SpecialBf16(std::mt19937& rng) {
  const uint16_t sign = static_cast<uint16_t>((rng() & 1u) << 15);
  switch (rng() % 7) {
    case 0: return sign;                                                        // +-0
    case 1: return static_cast<uint16_t>(sign | (1 + rng() % 0x7F));            // denormal
    case 2: return static_cast<uint16_t>(sign | 0x7F80);                        // +-Inf
    case 3: return static_cast<uint16_t>(sign | 0x7FC0 | (rng() & 0x3F));       // quiet NaN, payload
    case 4: return static_cast<uint16_t>(sign | 0x7F80 | (1 + rng() % 0x3F));   // signalling NaN
    case 5: return static_cast<uint16_t>(sign | (0xFE << 7) | (rng() & 0x7F));  // near the top of the range
    default: return static_cast<uint16_t>(sign | (1 << 7) | (rng() & 0x7F));    // smallest normals
  }
}

uint16_t DrawBf16(std::mt19937& rng, Dist d) {
  switch (d) {
    case Dist::kMixed: return RandomBf16(rng, 119, 135);
    case Dist::kCancel: return RandomBf16(rng, 125, 129);
    case Dist::kWide: return RandomBf16(rng, 1, 254);
    case Dist::kTiny: return RandomBf16(rng, 127 - 72, 127 - 56);  // products around 2^-126
    case Dist::kHuge: return RandomBf16(rng, 127 + 56, 127 + 72);  // products around 2^128
    case Dist::kSpecial: return rng() % 6 == 0 ? SpecialBf16(rng) : RandomBf16(rng, 119, 135);
  }
  return 0;
}

uint32_t DrawC(std::mt19937& rng, Dist d) {
  const uint32_t sign = rng() & 0x80000000u;
  switch (d) {
    case Dist::kTiny: return sign | (rng() % 0x01800000u);  // denormals and the smallest normals
    case Dist::kWide: return rng() % 8 == 0 ? 0 : (sign | (rng() % 0x7F800000u));
    case Dist::kSpecial:
      if (rng() % 5 == 0) {
        switch (rng() % 4) {
          case 0: return sign | (1 + rng() % 0x7FFFFFu);         // denormal
          case 1: return sign | 0x7F800000u;                     // Inf
          case 2: return sign | 0x7FC00000u | (rng() & 0x3FFFFFu);  // quiet NaN
          default: return sign | 0x7F800000u | (1 + rng() % 0x3FFFFFu);  // signalling NaN
        }
      }
      [[fallthrough]];
    default: {
      const Dist base = d == Dist::kSpecial ? Dist::kMixed : d;
      return (static_cast<uint32_t>(DrawBf16(rng, base)) << 16) | (rng() & 0xFFFFu);
    }
  }
}

void FillTile(std::mt19937& rng, DpOp op, Dist d, TileCase* t, bool full_shape) {
  t->rows = full_shape ? 16 : 1 + static_cast<int>(rng() % 16);
  t->k_groups = full_shape ? 16 : 1 + static_cast<int>(rng() % 16);
  t->n_cols = full_shape ? 16 : 1 + static_cast<int>(rng() % 16);
  for (auto* buf : {t->a, t->b, t->c}) {
    for (int i = 0; i < 1024; ++i) buf[i] = static_cast<uint8_t>(rng());  // garbage outside the shape
  }
  if (op == DpOp::kBf16) {
    for (int i = 0; i < 512; ++i) {
      const uint16_t x = DrawBf16(rng, d), y = DrawBf16(rng, d);
      std::memcpy(t->a + 2 * i, &x, 2);
      std::memcpy(t->b + 2 * i, &y, 2);
    }
    for (int i = 0; i < 256; ++i) {
      const uint32_t v = DrawC(rng, d);
      std::memcpy(t->c + 4 * i, &v, 4);
    }
  } else if (d == Dist::kHuge) {  // accumulators near the int32 limits, to exercise the wrap-around
    for (int i = 0; i < 256; ++i) {
      const uint32_t v = (rng() & 1u) ? 0x7FFFFF00u + (rng() & 0xFFu) : 0x80000000u + (rng() & 0xFFu);
      std::memcpy(t->c + 4 * i, &v, 4);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Hand cases: one output element, values measured on AMX hardware (a Sapphire Rapids or later Xeon).
// pairs = (a, b) bf16 per K element, K index 0, 1, 2, ... (even indices form the even partial sum).

struct HandCase {
  const char* what;
  uint32_t c;
  std::vector<std::pair<uint16_t, uint16_t>> pairs;
  uint32_t expected;
};

std::vector<HandCase> HandCases() {
  const uint16_t kOne = 0x3F80;
  return {
      {"partial sums meet C last: 1 + (2^-24 + 2^-24)", 0x3F800000u, {{0x3380, kOne}, {0x3380, kOne}}, 0x3F800001u},
      {"tiny after rounding flushes: 2^-126 - 1.5*2^-151", 0, {{0x2000, 0x2000}, {0, 0}, {0x99C0, 0x1A00}}, 0},
      {"fused: product overflows, sum does not", 0, {{0xFF7F, kOne}, {0, 0}, {0x5FC0, 0x5F80}}, 0x7F010000u},
      {"product overflow alone is Inf", 0, {{0x5FC0, 0x5F80}}, 0x7F800000u},
      {"FTZ keeps the sign: -1.5*2^-126 + 2^-126", 0x80C00000u, {{0x2000, 0x2000}}, 0x80000000u},
      {"denormal C reads as zero", 0x00000001u, {{0, 0}}, 0},
      {"-0 C plus +0 partial sums is +0", 0x80000000u, {{0x8000, kOne}}, 0},
      {"denormal bf16 input is zero: Inf x denormal = default NaN", 0, {{0x7F80, 0x0001}}, 0xFFC00000u},
      {"Inf x 0 = default NaN", 0, {{0x7F80, 0}}, 0xFFC00000u},
      {"Inf - Inf across the partial sums", 0, {{0x7F80, kOne}, {0xFF80, kOne}}, 0xFFC00000u},
      {"NaN: C wins over the products", 0x7FD33333u, {{0x7FD1, kOne}}, 0x7FD33333u},
      {"NaN: a wins over b", 0, {{0x7FD1, 0x7FD2}}, 0x7FD10000u},
      {"NaN: even partial sum wins over odd", 0, {{0x7FD1, kOne}, {0x7FD2, kOne}}, 0x7FD10000u},
      {"NaN: a later product wins within a partial sum", 0, {{0x7FD1, kOne}, {0, 0}, {0x7FD2, kOne}}, 0x7FD20000u},
      {"NaN: signalling NaN is quieted, sign kept", 0, {{0xFF81, kOne}}, 0xFFC10000u},
      {"NaN beats Inf x 0 later in the same partial sum", 0, {{0x7FD1, kOne}, {0, 0}, {0x7F80, 0}}, 0x7FD10000u},
      {"signalling NaN in C is quieted", 0x7F833333u, {{0, 0}}, 0x7FC33333u},
  };
}

TileCase FromHand(const HandCase& h) {
  TileCase t;
  std::memset(t.a, 0, sizeof t.a);
  std::memset(t.b, 0, sizeof t.b);
  std::memset(t.c, 0, sizeof t.c);
  t.rows = 1;
  t.n_cols = 1;
  t.k_groups = static_cast<int>((h.pairs.size() + 1) / 2);
  for (size_t i = 0; i < h.pairs.size(); ++i) {
    std::memcpy(t.a + 2 * i, &h.pairs[i].first, 2);                          // A row 0, bf16 element i
    std::memcpy(t.b + 64 * (i / 2) + 2 * (i % 2), &h.pairs[i].second, 2);  // B row i/2, column 0, half i%2
  }
  std::memcpy(t.c, &h.c, 4);
  return t;
}

uint32_t FirstC(const std::vector<uint8_t>& c) {
  uint32_t u;
  std::memcpy(&u, c.data(), 4);
  return u;
}

// ---------------------------------------------------------------------------------------------------------------
// Emulation vs model.

KT_TEST(amx_tile_emu_hand_cases) {
  for (const HandCase& h : HandCases()) {
    const TileCase t = FromHand(h);
    const uint32_t got = FirstC(RunEmulated(DpOp::kBf16, t)), modelled = FirstC(RunModel(DpOp::kBf16, t));
    KT_CHECK(got == h.expected) << h.what << ": emulation " << Hex(got) << ", hardware " << Hex(h.expected);
    KT_CHECK(modelled == h.expected) << h.what << ": model " << Hex(modelled) << ", hardware " << Hex(h.expected);
  }
}

KT_TEST(amx_tile_emu_dpbf16ps_matches_model) {
  std::mt19937 rng(20260);
  int trials = 0;
  for (Dist d : kAllDists) {
    for (int trial = 0; trial < 60; ++trial, ++trials) {
      static TileCase t;
      FillTile(rng, DpOp::kBf16, d, &t, trial % 3 == 0);
      std::string first;
      const int bad = CompareC(t, RunEmulated(DpOp::kBf16, t), RunModel(DpOp::kBf16, t), &first);
      KT_CHECK(bad == 0) << DistName(d) << " trial " << trial << ": " << bad << " elements differ, first " << first;
    }
  }
  KT_CHECK(trials == 360);
}

KT_TEST(amx_tile_emu_int8_matches_model) {
  std::mt19937 rng(777);
  for (DpOp op : kAllOps) {
    if (op == DpOp::kBf16) continue;
    for (int trial = 0; trial < 40; ++trial) {
      static TileCase t;
      FillTile(rng, op, trial % 2 ? Dist::kHuge : Dist::kMixed, &t, trial % 4 == 0);
      std::string first;
      const int bad = CompareC(t, RunEmulated(op, t), RunModel(op, t), &first);
      KT_CHECK(bad == 0) << OpName(op) << " trial " << trial << ": " << bad << " elements differ, first " << first;
    }
  }
}

KT_TEST(amx_tile_emu_dpbf16ps_chains_k_blocks) {
  // One C tile accumulated over several K blocks, as a GEMM runs it: C is loaded once, each block's A and B tiles
  // are loaded and multiplied into it, and C is stored once; the model applies the blocks one after another.
  std::mt19937 rng(4242);
  for (Dist d : {Dist::kMixed, Dist::kCancel, Dist::kSpecial}) {
    for (int trial = 0; trial < 8; ++trial) {
      constexpr int kBlocks = 5;
      static TileCase t[kBlocks];
      for (int blk = 0; blk < kBlocks; ++blk) {
        FillTile(rng, DpOp::kBf16, d, &t[blk], trial % 2 == 0);
        t[blk].rows = t[0].rows;
        t[blk].k_groups = t[0].k_groups;
        t[blk].n_cols = t[0].n_cols;
      }
      std::vector<uint8_t> got(t[0].c, t[0].c + 1024);
      emu::TileLoadConfig(ConfigFor(t[0]));
      emu::TileLoad<0>(got.data(), 64);
      for (const TileCase& blk : t) {
        emu::TileLoad<1>(blk.a, 64);
        emu::TileLoad<2>(blk.b, 64);
        emu::TileDpbf16ps<0, 1, 2>();
      }
      emu::TileStore<0>(got.data(), 64);
      emu::TileRelease();
      std::vector<uint8_t> want(t[0].c, t[0].c + 1024);
      for (const TileCase& blk : t) {
        model::Dpbf16ps(want.data(), blk.a, blk.b, blk.rows, blk.k_groups, blk.n_cols);
      }
      std::string first;
      const int bad = CompareC(t[0], got, want, &first);
      KT_CHECK(bad == 0) << DistName(d) << " trial " << trial << ": " << bad << " elements differ, first " << first;
    }
  }
}

KT_TEST(amx_tile_emu_load_store_and_zeroing) {
  // A 5 x 12-byte tile: load reads exactly the rectangle, store writes exactly it, the rest of the tile is zero.
  alignas(64) uint8_t src[16 * 80], dst[16 * 80], full[1024];
  for (int i = 0; i < 16 * 80; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  std::memset(dst, 0xEE, sizeof dst);
  emu::TileConfig cfg;
  cfg.Set(3, 5, 12);
  cfg.Set(4, 16, 64);
  emu::TileLoadConfig(cfg);
  KT_CHECK(emu::TilesConfigured());
  emu::TileLoad<3>(src, 80);
  emu::TileStore<3>(dst, 80);
  for (int r = 0; r < 16; ++r) {
    for (int col = 0; col < 80; ++col) {
      const bool inside = r < 5 && col < 12;
      KT_CHECK(dst[r * 80 + col] == (inside ? src[r * 80 + col] : 0xEE)) << "row " << r << " byte " << col;
    }
  }
  // TILEZERO clears the whole 16 x 64-byte tile.
  emu::TileLoad<4>(src, 80);
  emu::TileZero<4>();
  emu::TileStore<4>(full, 64);
  int nonzero = 0;
  for (uint8_t v : full) nonzero += v != 0;
  KT_CHECK(nonzero == 0) << "TILEZERO left " << nonzero << " bytes";
  emu::TileRelease();
  KT_CHECK(!emu::TilesConfigured());
}

#if defined(__unix__)
// Runs `fn` in a child process and expects it to abort with a message containing `needle` on stderr.
void ExpectAbort(const char* what, const char* needle, void (*fn)()) {
  int fds[2];
  KT_CHECK(pipe(fds) == 0);
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    fn();
    _exit(0);  // did not abort
  }
  close(fds[1]);
  std::string err;
  char buf[256];
  for (ssize_t r; (r = read(fds[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<size_t>(r));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  KT_CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT) << what << ": the child did not abort";
  KT_CHECK(err.find(needle) != std::string::npos) << what << ": stderr was \"" << err << "\"";
}

KT_TEST(amx_tile_emu_rejects_bad_configuration) {
  ExpectAbort("17 rows", "rows > 16", [] {
    emu::TileConfig cfg;
    cfg.Set(0, 17, 64);
    emu::TileLoadConfig(cfg);
  });
  ExpectAbort("68-byte rows", "colsb > 64", [] {
    emu::TileConfig cfg;
    cfg.Set(1, 16, 68);
    emu::TileLoadConfig(cfg);
  });
  ExpectAbort("tile 8", "tiles 8..15", [] {
    emu::TileConfig cfg;
    cfg.Set(8, 16, 64);
    emu::TileLoadConfig(cfg);
  });
  ExpectAbort("rows without colsb", "both zero or both set", [] {
    emu::TileConfig cfg;
    cfg.rows[2] = 4;
    emu::TileLoadConfig(cfg);
  });
  ExpectAbort("palette 2", "unsupported palette", [] {
    emu::TileConfig cfg;
    cfg.palette_id = 2;
    emu::TileLoadConfig(cfg);
  });
  ExpectAbort("reserved bytes", "reserved", [] {
    emu::TileConfig cfg;
    cfg.reserved[3] = 1;
    emu::TileLoadConfig(cfg);
  });
  ExpectAbort("load before configuration", "no tile configuration", [] {
    alignas(64) uint8_t buf[1024] = {};
    emu::TileRelease();
    emu::TileLoad<0>(buf, 64);
  });
  ExpectAbort("unconfigured tile", "not configured", [] {
    emu::TileConfig cfg;
    cfg.Set(0, 16, 64);
    emu::TileLoadConfig(cfg);
    emu::TileZero<5>();
  });
  ExpectAbort("C rows != A rows", "C rows != A rows", [] {
    emu::TileConfig cfg;
    cfg.Set(0, 16, 64);
    cfg.Set(1, 8, 64);
    cfg.Set(2, 16, 64);
    emu::TileLoadConfig(cfg);
    emu::TileDpbf16ps<0, 1, 2>();
  });
  ExpectAbort("A colsb / 4 != B rows", "A colsb / 4 != B rows", [] {
    emu::TileConfig cfg;
    cfg.Set(0, 16, 64);
    cfg.Set(1, 16, 32);
    cfg.Set(2, 16, 64);
    emu::TileLoadConfig(cfg);
    emu::TileDpbusd<0, 1, 2>();
  });
  ExpectAbort("C colsb != B colsb", "C colsb != B colsb", [] {
    emu::TileConfig cfg;
    cfg.Set(0, 16, 64);
    cfg.Set(1, 16, 64);
    cfg.Set(2, 16, 32);
    emu::TileLoadConfig(cfg);
    emu::TileDpbssd<0, 1, 2>();
  });
  ExpectAbort("A colsb not a multiple of 4", "A colsb must be a multiple of 4", [] {
    emu::TileConfig cfg;
    cfg.Set(0, 16, 64);
    cfg.Set(1, 16, 30);
    cfg.Set(2, 7, 64);
    emu::TileLoadConfig(cfg);
    emu::TileDpbf16ps<0, 1, 2>();
  });
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Real AMX.

KT_TEST(amx_tile_hw_matches_emulation) {
  std::string why;
  if (!AmxUsable(&why)) kt::Skip("real AMX not usable: " + why);
#if DSV4_TEST_HW_AMX
  for (const HandCase& h : HandCases()) {
    const uint32_t hw = FirstC(RunHardware(DpOp::kBf16, FromHand(h)));
    KT_CHECK(hw == h.expected) << h.what << ": hardware now gives " << Hex(hw) << ", recorded " << Hex(h.expected);
  }
  std::mt19937 rng(1234);
  for (DpOp op : kAllOps) {
    for (Dist d : kAllDists) {
      if (op != DpOp::kBf16 && d != Dist::kMixed && d != Dist::kHuge) continue;
      for (int trial = 0; trial < 40; ++trial) {
        static TileCase t;
        FillTile(rng, op, d, &t, trial % 3 == 0);
        std::string first;
        const int bad = CompareC(t, RunHardware(op, t), RunEmulated(op, t), &first);
        KT_CHECK(bad == 0) << OpName(op) << " " << DistName(d) << " trial " << trial << ": " << bad
                           << " elements differ (hardware vs emulation), first " << first;
      }
    }
  }
#endif
}

}  // namespace
