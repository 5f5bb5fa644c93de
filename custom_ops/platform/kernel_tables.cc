// Fills the per-level kernel tables (see kernel_tables.h). Built at the baseline: it only takes addresses of
// constant tables defined in the ISA files; no ISA code runs here.
#include "platform/kernel_tables.h"

#include <array>

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
  for (int l = static_cast<int>(level); l >= 0; --l) {
    if (variants[l] != nullptr) {
      *table = variants[l];
      *chosen = static_cast<IsaLevel>(l);
      return;
    }
  }
}

KernelTables Build(IsaLevel level) {
  KernelTables t;
  t.level = level;
  Pick(kMoeRoutingVariants, level, &t.moe_routing, &t.moe_routing_level);
  Pick(kHyperConnectionVariants, level, &t.hyper_connection, &t.hyper_connection_level);
  Pick(kNormRopeVariants, level, &t.norm_rope, &t.norm_rope_level);
  Pick(kCompressorVariants, level, &t.compressor, &t.compressor_level);
  Pick(kIndexerVariants, level, &t.indexer, &t.indexer_level);
  Pick(kSparseAttentionVariants, level, &t.sparse_attention, &t.sparse_attention_level);
  Pick(kLinearVariants, level, &t.linear, &t.linear_level);
  Pick(kMoeExpertsVariants, level, &t.moe_experts, &t.moe_experts_level);
  return t;
}

}  // namespace

const KernelTables& GetKernelTables(IsaLevel level) {
  static const std::array<KernelTables, kNumIsaLevels> tables = [] {
    std::array<KernelTables, kNumIsaLevels> all;
    const int max = static_cast<int>(MaxSupportedIsa());
    for (int l = 0; l < kNumIsaLevels; ++l) all[l] = Build(static_cast<IsaLevel>(l <= max ? l : max));
    return all;
  }();
  return tables[static_cast<int>(level)];
}

std::vector<FamilyLevel> DescribeFamilies(const KernelTables& t) {
  std::vector<FamilyLevel> out;
#define DSV4_DESCRIBE(member, Type, name) out.push_back({name, t.member##_level});
  DSV4_KERNEL_FAMILIES(DSV4_DESCRIBE)
#undef DSV4_DESCRIBE
  return out;
}

}  // namespace dsv4
