// Tests for the dispatch plan (custom_ops/platform/kernel_tables.h): the CPU policy on synthetic CPUs, the
// DSV4_ORT_KERNELS syntax, clamping to the cap, and the tables a plan builds.
#include <cstring>
#include <stdexcept>
#include <string>

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

KT_TEST(dispatch_cpu_policy_zen4_lowers_indexer_and_attention) {
  const auto zen4 = dsv4::CpuPolicy(IsaLevel::kAvx512, Cpu("AuthenticAMD", 0x19, 0x11));
  for (int i = 0; i < dsv4::kNumFamilies; ++i) {
    const bool lowered = i == Index("indexer") || i == Index("sparse_attention");
    KT_CHECK(zen4[i] == (lowered ? IsaLevel::kAvx2 : IsaLevel::kAvx512)) << dsv4::kFamilyNames[i];
  }
  // nothing to lower below AVX512, on Intel, on Zen 5 (family 0x1a) or under an AVX2 cap
  for (const auto& [cpu, cap] : {std::pair{Cpu("GenuineIntel", 6, 0x8f), IsaLevel::kAmx},
                                 std::pair{Cpu("GenuineIntel", 6, 0xcf), IsaLevel::kAvx512},
                                 std::pair{Cpu("AuthenticAMD", 0x1a, 0x02), IsaLevel::kAvx512},
                                 std::pair{Cpu("AuthenticAMD", 0x19, 0x11), IsaLevel::kAvx2}}) {
    const auto levels = dsv4::CpuPolicy(cap, cpu);
    for (int i = 0; i < dsv4::kNumFamilies; ++i) KT_CHECK(levels[i] == cap) << cpu.vendor << " " << i;
  }
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
