// Dispatch: one table of kernels per op family and ISA level, chosen once.
//
// Every family has a scalar reference table (the spec) and optional AVX2 / AVX512 / AMX tables, each complete (an
// ISA file points the slots it does not accelerate at the reference). For a given effective level the family
// uses the highest table at or below it. Tables are constant data; picking them runs no ISA code.
#pragma once

#include <vector>

#include "platform/cpu_features.h"

namespace dsv4 {

struct MoeRoutingKernels;
struct HyperConnectionKernels;
struct NormRopeKernels;
struct CompressorKernels;
struct IndexerKernels;
struct SparseAttentionKernels;
struct LinearKernels;
struct MoeExpertsKernels;

// X(member, TableType, display name)
#define DSV4_KERNEL_FAMILIES(X)                                  \
  X(moe_routing, MoeRoutingKernels, "moe_routing")               \
  X(hyper_connection, HyperConnectionKernels, "hyper_connection") \
  X(norm_rope, NormRopeKernels, "norm_rope")                   \
  X(compressor, CompressorKernels, "compressor")               \
  X(indexer, IndexerKernels, "indexer")                        \
  X(sparse_attention, SparseAttentionKernels, "sparse_attention") \
  X(linear, LinearKernels, "linear")                           \
  X(moe_experts, MoeExpertsKernels, "moe_experts")

struct KernelTables {
  IsaLevel level = IsaLevel::kScalar;
#define DSV4_TABLE_MEMBER(member, Type, name) \
  const Type* member = nullptr;               \
  IsaLevel member##_level = IsaLevel::kScalar;
  DSV4_KERNEL_FAMILIES(DSV4_TABLE_MEMBER)
#undef DSV4_TABLE_MEMBER
};

// Tables for `level`, which is clamped to MaxSupportedIsa(). Built once per level; the reference is returned
// for families without a variant at or below the level.
const KernelTables& GetKernelTables(IsaLevel level);

struct FamilyLevel {
  const char* family;
  IsaLevel level;
};
std::vector<FamilyLevel> DescribeFamilies(const KernelTables& tables);

}  // namespace dsv4
