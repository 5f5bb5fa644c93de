// Fills the per-level kernel tables (see kernel_tables.h). Built at the baseline: it only takes addresses of
// constant tables defined in the ISA files; no ISA code runs here.
#include "platform/kernel_tables.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernels/compressor.h"
#include "kernels/hyper_connection.h"
#include "kernels/indexer.h"
#include "kernels/linear.h"
#include "kernels/linear_blocks.h"
#include "kernels/moe_experts.h"
#include "kernels/moe_routing.h"
#include "kernels/norm_rope.h"
#include "kernels/sparse_attention.h"

namespace dsv4 {
namespace {

#if DSV4_X86_VARIANTS
#define DSV4_X86_TABLE(ns, name) &ns::name
#else
#define DSV4_X86_TABLE(ns, name) nullptr
#endif

// Variants per family, indexed by IsaLevel (scalar, avx2, avx512, amx); nullptr = no variant at that level.
template <class T>
using Variants = std::array<const T*, kNumIsaLevels>;

const Variants<MoeRoutingKernels> kMoeRoutingVariants = {
    &ref::kMoeRouting, DSV4_X86_TABLE(avx2, kMoeRouting), DSV4_X86_TABLE(avx512, kMoeRouting), nullptr};
const Variants<HyperConnectionKernels> kHyperConnectionVariants = {
    &ref::kHyperConnection, DSV4_X86_TABLE(avx2, kHyperConnection), DSV4_X86_TABLE(avx512, kHyperConnection),
    nullptr};
const Variants<NormRopeKernels> kNormRopeVariants = {&ref::kNormRope, DSV4_X86_TABLE(avx2, kNormRope),
                                                     DSV4_X86_TABLE(avx512, kNormRope), nullptr};
const Variants<CompressorKernels> kCompressorVariants = {&ref::kCompressor, DSV4_X86_TABLE(avx2, kCompressor),
                                                         DSV4_X86_TABLE(avx512, kCompressor), nullptr};
const Variants<IndexerKernels> kIndexerVariants = {&ref::kIndexer, DSV4_X86_TABLE(avx2, kIndexer),
                                                   DSV4_X86_TABLE(avx512, kIndexer), DSV4_X86_TABLE(amx, kIndexer)};
const Variants<SparseAttentionKernels> kSparseAttentionVariants = {
    &ref::kSparseAttention, DSV4_X86_TABLE(avx2, kSparseAttention), DSV4_X86_TABLE(avx512, kSparseAttention),
    DSV4_X86_TABLE(amx, kSparseAttention)};
const Variants<LinearKernels> kLinearVariants = {&ref::kLinear, DSV4_X86_TABLE(avx2, kLinear),
                                                 DSV4_X86_TABLE(avx512, kLinear), DSV4_X86_TABLE(amx, kLinear)};
const Variants<MoeExpertsKernels> kMoeExpertsVariants = {&ref::kMoeExperts, DSV4_X86_TABLE(avx2, kMoeExperts),
                                                         DSV4_X86_TABLE(avx512, kMoeExperts),
                                                         DSV4_X86_TABLE(amx, kMoeExperts)};

template <class T>
void Pick(const Variants<T>& variants, IsaLevel level, const T** table, IsaLevel* chosen) {
  if (static_cast<int>(level) > static_cast<int>(MaxSupportedIsa())) level = MaxSupportedIsa();
  for (int l = static_cast<int>(level); l >= 0; --l) {
    if (variants[l] != nullptr) {
      *table = variants[l];
      *chosen = static_cast<IsaLevel>(l);
      return;
    }
  }
}

enum FamilyIndex : int {
#define DSV4_FAMILY_INDEX(member, Type, name) k_##member,
  DSV4_KERNEL_FAMILIES(DSV4_FAMILY_INDEX)
#undef DSV4_FAMILY_INDEX
};

KernelTables Build(const FamilyPlan& plan) {
  KernelTables t;
  t.level = plan.cap;
  t.invariant_rows = plan.invariant_rows;
#define DSV4_PICK(member, Type, name)                                                              \
  Pick(k##Type##Variants, plan.level[k_##member], &t.member, &t.member##_level);                 \
  t.member##_source = plan.source[k_##member];
  DSV4_PICK(moe_routing, MoeRouting, "")
  DSV4_PICK(hyper_connection, HyperConnection, "")
  DSV4_PICK(norm_rope, NormRope, "")
  DSV4_PICK(compressor, Compressor, "")
  DSV4_PICK(indexer, Indexer, "")
  DSV4_PICK(sparse_attention, SparseAttention, "")
  DSV4_PICK(linear, Linear, "")
  DSV4_PICK(moe_experts, MoeExperts, "")
#undef DSV4_PICK
  return t;
}

IsaLevel Lower(IsaLevel a, IsaLevel b) { return static_cast<int>(a) < static_cast<int>(b) ? a : b; }

std::string Trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

}  // namespace

const char* const kFamilyNames[kNumFamilies] = {
#define DSV4_FAMILY_NAME(member, Type, name) name,
    DSV4_KERNEL_FAMILIES(DSV4_FAMILY_NAME)
#undef DSV4_FAMILY_NAME
};

const char* LevelSourceName(LevelSource source) {
  switch (source) {
    case LevelSource::kCap: return "cap";
    case LevelSource::kCpu: return "cpu";
    case LevelSource::kForced: return "forced";
  }
  return "unknown";
}

std::array<IsaLevel, kNumFamilies> CpuPolicy(IsaLevel cap, const CpuFeatures& f) {
  std::array<IsaLevel, kNumFamilies> level;
  level.fill(cap);
  // AMD Zen 4 (family 0x19 with AVX512; Zen 3 has none, Zen 5 is family 0x1a with full-width 512-bit units)
  // executes 512-bit operations as two 256-bit halves. Measured on an EPYC Zen 4 (2 cores, M = 1, context
  // 4096): the AVX2 indexer took 241 us against 556 us for AVX512, AVX2 sparse attention 906 us against 982 us.
  // The linear and expert families stay at AVX512 there: their AVX512 decode is the faster end to end.
  if (IsAmd(f) && f.family == 0x19 && static_cast<int>(cap) >= static_cast<int>(IsaLevel::kAvx512)) {
    level[k_indexer] = IsaLevel::kAvx2;
    level[k_sparse_attention] = IsaLevel::kAvx2;
  }
  return level;
}

FamilyPlan MakePlan(IsaLevel cap, const char* forced) {
  FamilyPlan plan;
  plan.cap = cap;
  const std::array<IsaLevel, kNumFamilies> policy = CpuPolicy(cap, GetCpuFeatures());
  for (int i = 0; i < kNumFamilies; ++i) {
    plan.level[i] = Lower(policy[i], cap);
    plan.source[i] = plan.level[i] == cap ? LevelSource::kCap : LevelSource::kCpu;
  }
  if (forced == nullptr) return plan;
  const std::string text(forced);
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string entry = Trim(text.substr(start, end - start));
    start = end + 1;
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) {
      throw std::invalid_argument("DSV4_ORT_KERNELS entry '" + entry + "' is not family=level");
    }
    const std::string family = Trim(entry.substr(0, eq)), level_name = Trim(entry.substr(eq + 1));
    int index = -1;
    for (int i = 0; i < kNumFamilies; ++i)
      if (family == kFamilyNames[i]) index = i;
    if (index < 0) {
      std::string known;
      for (int i = 0; i < kNumFamilies; ++i) known += std::string(i ? ", " : "") + kFamilyNames[i];
      throw std::invalid_argument("DSV4_ORT_KERNELS names unknown kernel family '" + family + "'; families: " + known);
    }
    IsaLevel level;
    if (!ParseIsa(level_name.c_str(), &level)) {
      throw std::invalid_argument("DSV4_ORT_KERNELS: '" + level_name + "' (for " + family +
                                  ") is not an ISA level; levels: scalar, avx2, avx512, amx");
    }
    plan.level[index] = Lower(level, cap);
    plan.source[index] = LevelSource::kForced;
  }
  return plan;
}

const KernelTables& GetKernelTables(const FamilyPlan& plan) {
  static std::mutex mutex;
  static std::vector<std::pair<FamilyPlan, std::unique_ptr<KernelTables>>>* built =
      new std::vector<std::pair<FamilyPlan, std::unique_ptr<KernelTables>>>();  // never freed: sessions may outlive
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [p, t] : *built)
    if (p == plan) return *t;
  built->emplace_back(plan, std::make_unique<KernelTables>(Build(plan)));
  return *built->back().second;
}

std::vector<FamilyLevel> DescribeFamilies(const KernelTables& t) {
  std::vector<FamilyLevel> out;
#define DSV4_DESCRIBE(member, Type, name) out.push_back({name, t.member##_level, t.member##_source});
  DSV4_KERNEL_FAMILIES(DSV4_DESCRIBE)
#undef DSV4_DESCRIBE
  return out;
}

}  // namespace dsv4
