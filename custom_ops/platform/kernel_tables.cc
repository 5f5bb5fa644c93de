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
  t.weight_prefetch = plan.weight_prefetch;
  t.prefetch_source = plan.prefetch_source;
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
  t.bf16_dot = plan.bf16_dot;
  t.bf16_dot_source = plan.bf16_dot_source;
#if DSV4_X86_VARIANTS
  if (plan.bf16_dot && t.sparse_attention_level == IsaLevel::kAvx512) {
    t.sparse_attention = &avx512::kSparseAttentionBf16Dot;
  }
#endif
  return t;
}

IsaLevel Lower(IsaLevel a, IsaLevel b) { return static_cast<int>(a) < static_cast<int>(b) ? a : b; }

// The value of a DSV4_ORT_KERNELS switch (`name=on|off`).
bool OnOff(const std::string& name, const std::string& value) {
  if (value != "on" && value != "off") {
    throw std::invalid_argument("DSV4_ORT_KERNELS: " + name + "='" + value + "' is neither on nor off");
  }
  return value == "on";
}

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
  // Nothing to lower on the CPUs measured. On an AMD EPYC Zen 4 (family 0x19 model 0x11, 2 cores; each family at
  // AVX512 against AVX2 in one process, decode M = 1 at context 4096 and prefill M = 128), AVX512 was as fast or
  // faster in every family: indexer 1.2x, CSA sparse attention 1.25x, FP4 experts 1.5x, FP8 linears 1.1-1.4x, the
  // bf16 LM head equal with the weight prefetch off (CpuPrefetch). An earlier build lowered the indexer and
  // sparse attention to AVX2 there; their AVX512 variants have since been reworked and now win. A CPU that needs a
  // family lowered gets an entry here, with the figures behind it.
  (void)f;
  return level;
}

bool CpuPrefetch(const CpuFeatures& f) {
  // Measured on an AMD EPYC Zen 4 (family 0x19 model 0x11, 2 cores; bf16 LM head slice 16384 x 4096 at M = 1,
  // weights streamed from DRAM, interleaved in one process): the AVX512 rows loop read 16-17 GB/s with a prefetch
  // 2 KiB ahead on each of its four rows, 19-20 GB/s with one linear stream 16 KiB ahead, and 21-22 GB/s with none,
  // the machine's sequential read speed then. (The in-register FP8 / FP4 decode loops were faster with their
  // prefetch there too, so they keep it on every CPU.) On the Intel Xeon the prefetch was measured a gain, so only
  // family 0x19 (Zen 3 / Zen 4; Zen 3 has no AVX512, whose rows loop is the one that prefetches) goes without; Zen 5
  // (family 0x1a) has not been measured.
  return !(IsAmd(f) && f.family == 0x19);
}

bool CpuBf16Dot(const CpuFeatures& f) {
  // VDPBF16PS does the work of two fp32 FMAs in one instruction on AMD Zen 4 (AMD EPYC family 0x19 model 0x11:
  // 451-468 GFLOP/s against 233 of fp32 FMA on two cores), where bf16 SparseAttention on it ran 1.7-1.8x the widened
  // fp32 products (sparse_attention_avx512.cc). The Intel Xeon measured (AVX512-BF16, no AMX exposed) ran it at half
  // its FMA rate (246 against 493 GFLOP/s), so only family 0x19 takes it; Zen 5 (family 0x1a) has not been measured.
  return IsAmd(f) && f.family == 0x19;
}

FamilyPlan MakePlan(IsaLevel cap, const char* forced) {
  FamilyPlan plan;
  plan.cap = cap;
  plan.weight_prefetch = CpuPrefetch(GetCpuFeatures());
  plan.prefetch_source = plan.weight_prefetch ? LevelSource::kCap : LevelSource::kCpu;
  plan.bf16_dot = CpuBf16Dot(GetCpuFeatures());
  plan.bf16_dot_source = plan.bf16_dot ? LevelSource::kCpu : LevelSource::kCap;
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
    if (family == "prefetch") {
      plan.weight_prefetch = OnOff(family, level_name);
      plan.prefetch_source = LevelSource::kForced;
      continue;
    }
    if (family == "bf16dot") {
      plan.bf16_dot = OnOff(family, level_name);
      plan.bf16_dot_source = LevelSource::kForced;
      continue;
    }
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
