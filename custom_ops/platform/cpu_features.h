// CPU feature probe and ISA levels.
//
// The probe (cpu_features.cc) is compiled at the x86-64 baseline, without any -m flag and without LTO, so nothing
// in it can execute an instruction the CPU lacks. It reads CPUID for the instruction sets, XCR0 (xgetbv) for
// whether the OS saves the wider register state, and on Linux asks for permission to use AMX tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM), which a process needs before its first tile instruction.
#pragma once

namespace dsv4 {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_avx = false;     // XCR0: xmm + ymm state saved
  bool os_avx512 = false;  // XCR0: opmask + zmm state saved
  bool os_amx = false;     // XCR0: tile config + tile data saved
  bool amx_permitted = false;  // arch_prctl granted XTILEDATA (Linux)
  // CPUID leaf 0 vendor ("GenuineIntel", "AuthenticAMD", ...; empty off x86) and leaf 1 display family / model
  // (base + extended fields, as the vendors document them: Zen 4 is family 0x19, Sapphire Rapids family 6 model
  // 0x8f). The dispatcher's per-CPU policy (kernel_tables.cc) reads them.
  char vendor[13] = {};
  int family = 0, model = 0;
};

bool IsAmd(const CpuFeatures& f);

// Ordered levels: each includes everything below it.
//   kAvx2   : AVX2 + FMA + F16C
//   kAvx512 : AVX512 F/BW/VL/DQ + AVX512-BF16 + AVX512-VNNI (Cooper Lake, Sapphire Rapids, Zen 4 and later)
//   kAmx    : kAvx512 + AMX-TILE/BF16/INT8, OS support and permission
enum class IsaLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };
constexpr int kNumIsaLevels = 4;

// Probed once (thread-safe static); never changes afterwards.
const CpuFeatures& GetCpuFeatures();

// Highest level this CPU and OS support.
IsaLevel MaxSupportedIsa();

// "scalar", "avx2", "avx512", "amx".
const char* IsaName(IsaLevel level);

// Parses one of the names above (case-sensitive). Returns false on anything else.
bool ParseIsa(const char* name, IsaLevel* level);

// Asks the kernel for AMX tile-data permission once per process (amx_permission.cc); false where unavailable.
bool RequestAmxPermission();

}  // namespace dsv4
