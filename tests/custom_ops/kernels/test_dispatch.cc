// Tests for the dispatch plan (custom_ops/platform/kernel_tables.h): the CPU policy on synthetic CPUs, the
// DSV4_ORT_KERNELS syntax, clamping to the cap, and the tables a plan builds.
#include <cstring>
#include <stdexcept>
#include <string>

#include "custom_ops/kernels/sparse_attention.h"
#include "custom_ops/platform/cpu_features.h"
#include "custom_ops/platform/kernel_tables.h"
#include "kt.h"

namespace {

using dsv4::CpuFeatures;
using dsv4::FamilyPlan;
using dsv4::IsaLevel;
using dsv4::LevelSource;

CpuFeatures Cpu(const char* vendor, int family, int model) {
  CpuFeatures f;
  std::strncpy(f.vendor, vendor, sizeof(f.vendor) - 1);
  f.family = family;
  f.model = model;
  return f;
}

int Index(const char* family) {
  for (int i = 0; i < dsv4::kNumFamilies; ++i)
    if (std::strcmp(dsv4::kFamilyNames[i], family) == 0) return i;
  return -1;
}

bool Throws(const char* forced, const char* needle) {
  try {
    dsv4::MakePlan(IsaLevel::kScalar, forced);
  } catch (const std::invalid_argument& e) {
    return std::string(e.what()).find(needle) != std::string::npos;
  }
  return false;
}

}  // namespace

KT_TEST(dispatch_family_names) {
  KT_CHECK(dsv4::kNumFamilies == 8) << dsv4::kNumFamilies;
  KT_CHECK(Index("linear") >= 0 && Index("indexer") >= 0 && Index("sparse_attention") >= 0);
}

KT_TEST(dispatch_cpu_policy_keeps_the_cap_and_turns_prefetch_off_on_zen4) {
  // every family at the cap (AVX512 measured as fast or faster per family on Zen 4, kernel_tables.cc)
  for (const auto& [cpu, cap] : {std::pair{Cpu("GenuineIntel", 6, 0x8f), IsaLevel::kAmx},
                                 std::pair{Cpu("GenuineIntel", 6, 0xcf), IsaLevel::kAvx512},
                                 std::pair{Cpu("AuthenticAMD", 0x19, 0x11), IsaLevel::kAvx512},
                                 std::pair{Cpu("AuthenticAMD", 0x1a, 0x02), IsaLevel::kAvx512},
                                 std::pair{Cpu("AuthenticAMD", 0x19, 0x11), IsaLevel::kAvx2}}) {
    const auto levels = dsv4::CpuPolicy(cap, cpu);
    for (int i = 0; i < dsv4::kNumFamilies; ++i) KT_CHECK(levels[i] == cap) << cpu.vendor << " " << i;
  }
  // the rows path's weight prefetch: off on AMD family 0x19 only
  KT_CHECK(!dsv4::CpuPrefetch(Cpu("AuthenticAMD", 0x19, 0x11)));
  KT_CHECK(dsv4::CpuPrefetch(Cpu("AuthenticAMD", 0x1a, 0x02)));
  KT_CHECK(dsv4::CpuPrefetch(Cpu("GenuineIntel", 6, 0x8f)));
  KT_CHECK(dsv4::CpuPrefetch(Cpu("GenuineIntel", 6, 0xcf)));
  // bf16 attention products on VDPBF16PS: AMD family 0x19 only
  KT_CHECK(dsv4::CpuBf16Dot(Cpu("AuthenticAMD", 0x19, 0x11)));
  KT_CHECK(!dsv4::CpuBf16Dot(Cpu("AuthenticAMD", 0x1a, 0x02)));
  KT_CHECK(!dsv4::CpuBf16Dot(Cpu("GenuineIntel", 6, 0x8f)));
  KT_CHECK(!dsv4::CpuBf16Dot(Cpu("GenuineIntel", 6, 0xcf)));
}

KT_TEST(dispatch_forced_prefetch) {
  const FamilyPlan def = dsv4::MakePlan(IsaLevel::kScalar, nullptr);
  KT_CHECK(def.weight_prefetch == dsv4::CpuPrefetch(dsv4::GetCpuFeatures()));
  KT_CHECK(def.prefetch_source == (def.weight_prefetch ? LevelSource::kCap : LevelSource::kCpu));
  for (const char* value : {"on", "off"}) {
    const FamilyPlan p = dsv4::MakePlan(IsaLevel::kAvx2, (std::string("linear=avx2, prefetch=") + value).c_str());
    KT_CHECK(p.weight_prefetch == (std::strcmp(value, "on") == 0) && p.prefetch_source == LevelSource::kForced);
    KT_CHECK(p.level[Index("linear")] == IsaLevel::kAvx2 && p.source[Index("linear")] == LevelSource::kForced);
    const dsv4::KernelTables& t = dsv4::GetKernelTables(p);
    KT_CHECK(t.weight_prefetch == p.weight_prefetch && t.prefetch_source == LevelSource::kForced);
  }
  KT_CHECK(!(dsv4::MakePlan(IsaLevel::kAvx2, "prefetch=on") == dsv4::MakePlan(IsaLevel::kAvx2, "prefetch=off")));
  KT_CHECK(Throws("prefetch=maybe", "prefetch='maybe' is neither on nor off"));
}

// bf16dot=on|off: the plan's flag, and the sparse_attention table where the family runs at avx512 (only there).
KT_TEST(dispatch_forced_bf16_dot) {
  const FamilyPlan def = dsv4::MakePlan(IsaLevel::kScalar, nullptr);
  KT_CHECK(def.bf16_dot == dsv4::CpuBf16Dot(dsv4::GetCpuFeatures()));
  KT_CHECK(def.bf16_dot_source == (def.bf16_dot ? LevelSource::kCpu : LevelSource::kCap));
  for (const char* value : {"on", "off"}) {
    const bool on = std::strcmp(value, "on") == 0;
    for (const char* level : {"avx2", "avx512"}) {
      const std::string forced = std::string("sparse_attention=") + level + ", bf16dot=" + value;
      const FamilyPlan p = dsv4::MakePlan(dsv4::MaxSupportedIsa(), forced.c_str());
      KT_CHECK(p.bf16_dot == on && p.bf16_dot_source == LevelSource::kForced);
      const dsv4::KernelTables& t = dsv4::GetKernelTables(p);
      KT_CHECK(t.bf16_dot == on && t.bf16_dot_source == LevelSource::kForced);
#if DSV4_X86_VARIANTS
      if (t.sparse_attention_level == IsaLevel::kAvx512) {
        KT_CHECK(t.sparse_attention == (on ? &dsv4::avx512::kSparseAttentionBf16Dot : &dsv4::avx512::kSparseAttention))
            << level << " " << value;
      } else {
        KT_CHECK(t.sparse_attention != &dsv4::avx512::kSparseAttentionBf16Dot) << level << " " << value;
      }
#endif
    }
  }
  KT_CHECK(Throws("bf16dot=yes", "bf16dot='yes' is neither on nor off"));
}

KT_TEST(dispatch_forced_levels_and_clamping) {
  const FamilyPlan p = dsv4::MakePlan(IsaLevel::kAvx2, " linear = scalar ,indexer=amx,,");
  KT_CHECK(p.cap == IsaLevel::kAvx2);
  KT_CHECK(p.level[Index("linear")] == IsaLevel::kScalar && p.source[Index("linear")] == LevelSource::kForced);
  // above the cap: clamped, still reported as forced
  KT_CHECK(p.level[Index("indexer")] == IsaLevel::kAvx2 && p.source[Index("indexer")] == LevelSource::kForced);
  KT_CHECK(p.source[Index("moe_experts")] != LevelSource::kForced);
  KT_CHECK(Throws("linear", "not family=level"));
  KT_CHECK(Throws("lineer=avx2", "unknown kernel family 'lineer'"));
  KT_CHECK(Throws("linear=avx3", "'avx3' (for linear) is not an ISA level"));
  KT_CHECK(dsv4::MakePlan(IsaLevel::kScalar, nullptr) == dsv4::MakePlan(IsaLevel::kScalar, ""));
}

KT_TEST(dispatch_tables_follow_the_plan) {
  const IsaLevel cap = dsv4::MaxSupportedIsa();
  const FamilyPlan plain = dsv4::MakePlan(cap, nullptr);
  const FamilyPlan forced = dsv4::MakePlan(cap, "linear=scalar");
  const dsv4::KernelTables& a = dsv4::GetKernelTables(plain);
  const dsv4::KernelTables& b = dsv4::GetKernelTables(forced);
  KT_CHECK(&a == &dsv4::GetKernelTables(plain));  // built once per plan
  KT_CHECK(b.linear_level == IsaLevel::kScalar && b.linear_source == LevelSource::kForced);
  KT_CHECK(b.moe_experts == a.moe_experts && b.moe_experts_level == a.moe_experts_level);
  for (const dsv4::FamilyLevel& f : dsv4::DescribeFamilies(a)) {
    KT_CHECK(static_cast<int>(f.level) <= static_cast<int>(cap)) << f.family;
  }
}
