// CPUID/XGETBV probe. Built at the x86-64 baseline (no -m flags, no LTO): see cpu_features.h.
#include "platform/cpu_features.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define DSV4_X86 1
#endif

namespace dsv4 {
namespace {

#if DSV4_X86
struct Regs {
  uint32_t a = 0, b = 0, c = 0, d = 0;
};

Regs Cpuid(uint32_t leaf, uint32_t subleaf) {
  Regs r;
  __cpuid_count(leaf, subleaf, r.a, r.b, r.c, r.d);
  return r;
}

uint64_t Xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

inline bool Bit(uint32_t v, int i) { return (v >> i) & 1u; }
#endif

CpuFeatures Probe() {
  CpuFeatures f;
#if DSV4_X86
  const Regs l0 = Cpuid(0, 0);
  std::memcpy(f.vendor, &l0.b, 4);
  std::memcpy(f.vendor + 4, &l0.d, 4);
  std::memcpy(f.vendor + 8, &l0.c, 4);
  const uint32_t max_leaf = l0.a;
  if (max_leaf < 1) return f;
  const Regs l1 = Cpuid(1, 0);
  const int base_family = (l1.a >> 8) & 0xf, base_model = (l1.a >> 4) & 0xf;
  f.family = base_family == 0xf ? base_family + static_cast<int>((l1.a >> 20) & 0xff) : base_family;
  f.model = (base_family == 0x6 || base_family == 0xf) ? (static_cast<int>((l1.a >> 16) & 0xf) << 4) | base_model
                                                       : base_model;
  if (max_leaf < 7) return f;
  const Regs l7 = Cpuid(7, 0);
  const Regs l7_1 = Cpuid(7, 1);
  const bool osxsave = Bit(l1.c, 27);
  const uint64_t xcr0 = osxsave ? Xgetbv0() : 0;
  f.os_avx = (xcr0 & 0x6) == 0x6;                  // SSE + AVX state
  f.os_avx512 = f.os_avx && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  f.os_amx = (xcr0 & 0x60000) == 0x60000;          // XTILECFG (17) + XTILEDATA (18)

  f.fma = Bit(l1.c, 12);
  f.f16c = Bit(l1.c, 29);
  f.avx2 = Bit(l7.b, 5);
  f.avx512f = Bit(l7.b, 16);
  f.avx512dq = Bit(l7.b, 17);
  f.avx512bw = Bit(l7.b, 30);
  f.avx512vl = Bit(l7.b, 31);
  f.avx512_vnni = Bit(l7.c, 11);
  f.avx512_bf16 = Bit(l7_1.a, 5);
  f.amx_bf16 = Bit(l7.d, 22);
  f.amx_tile = Bit(l7.d, 24);
  f.amx_int8 = Bit(l7.d, 25);
  // Permission is only worth asking for when the hardware and the OS both support tiles.
  if (f.amx_tile && f.os_amx) f.amx_permitted = RequestAmxPermission();
#endif
  return f;
}

}  // namespace

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = Probe();
  return features;
}

bool IsAmd(const CpuFeatures& f) { return std::strcmp(f.vendor, "AuthenticAMD") == 0; }

IsaLevel MaxSupportedIsa() {
  const CpuFeatures& f = GetCpuFeatures();
  if (!(f.os_avx && f.avx2 && f.fma && f.f16c)) return IsaLevel::kScalar;
  if (!(f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512_bf16 && f.avx512_vnni)) {
    return IsaLevel::kAvx2;
  }
  if (!(f.amx_tile && f.amx_bf16 && f.amx_int8 && f.os_amx && f.amx_permitted)) return IsaLevel::kAvx512;
  return IsaLevel::kAmx;
}

const char* IsaName(IsaLevel level) {
  switch (level) {
    case IsaLevel::kScalar: return "scalar";
    case IsaLevel::kAvx2: return "avx2";
    case IsaLevel::kAvx512: return "avx512";
    case IsaLevel::kAmx: return "amx";
  }
  return "unknown";
}

bool ParseIsa(const char* name, IsaLevel* level) {
  if (name == nullptr) return false;
  for (int i = 0; i < kNumIsaLevels; ++i) {
    const IsaLevel l = static_cast<IsaLevel>(i);
    if (std::strcmp(name, IsaName(l)) == 0) {
      *level = l;
      return true;
    }
  }
  return false;
}

}  // namespace dsv4
