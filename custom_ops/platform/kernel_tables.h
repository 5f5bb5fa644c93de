// Dispatch: one table of kernels per op family, chosen once per plan.
//
// Every family has a scalar reference table (the spec) and optional AVX2 / AVX512 / AMX tables, each complete (an
// ISA file points the slots it does not accelerate at the reference). A plan (MakePlan) gives each family a level:
// the session's cap (min(CPU maximum, DSV4_ORT_ISA)), lowered where the CPU policy knows a lower variant is faster
// on this CPU, or forced per family (DSV4_ORT_KERNELS). The family uses its highest table at or below that level.
// Tables are constant data; picking them runs no ISA code.
#pragma once

#include <array>
#include <cstdint>
#include <string>
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

#define DSV4_COUNT_FAMILY(member, Type, name) +1
constexpr int kNumFamilies = 0 DSV4_KERNEL_FAMILIES(DSV4_COUNT_FAMILY);
#undef DSV4_COUNT_FAMILY

// Family names in DSV4_KERNEL_FAMILIES order (the index of a family in a FamilyPlan).
extern const char* const kFamilyNames[kNumFamilies];

// Why a family runs at its level.
enum class LevelSource : int {
  kCap = 0,     // the session's cap (or the best variant below it)
  kCpu = 1,     // the CPU policy: a lower variant measured faster on this CPU model
  kForced = 2,  // DSV4_ORT_KERNELS
};
const char* LevelSourceName(LevelSource source);  // "cap", "cpu", "forced"

struct FamilyPlan {
  IsaLevel cap = IsaLevel::kScalar;
  std::array<IsaLevel, kNumFamilies> level{};
  std::array<LevelSource, kNumFamilies> source{};
  // Batch invariance (DSV4_ORT_BATCH_INVARIANT, 0 = off): linear and MoE expert calls of at most this many rows
  // compute every row as a one-row call does (kernels/linear.h, WeightView::invariant_rows).
  int64_t invariant_rows = 0;
  // Software prefetch of bf16 / fp32 weight rows in the linear and expert rows path (WeightView::prefetch): the CPU
  // policy's choice (CpuPrefetch) unless DSV4_ORT_KERNELS has `prefetch=on|off`.
  bool weight_prefetch = true;
  LevelSource prefetch_source = LevelSource::kCap;
  // bf16 SparseAttention inputs multiplied on VDPBF16PS where the family runs at avx512 (avx512::
  // kSparseAttentionBf16Dot) instead of widened to fp32 FMAs: the CPU policy's choice (CpuBf16Dot) unless
  // DSV4_ORT_KERNELS has `bf16dot=on|off`.
  bool bf16_dot = false;
  LevelSource bf16_dot_source = LevelSource::kCap;
  bool operator==(const FamilyPlan& o) const {
    return cap == o.cap && level == o.level && source == o.source && invariant_rows == o.invariant_rows &&
           weight_prefetch == o.weight_prefetch && prefetch_source == o.prefetch_source && bf16_dot == o.bf16_dot &&
           bf16_dot_source == o.bf16_dot_source;
  }
};

// The plan for `cap` (already clamped to MaxSupportedIsa()) on this CPU. `forced` is DSV4_ORT_KERNELS or nullptr:
// comma-separated `family=level` entries (e.g. "linear=avx2,indexer=scalar") and optionally `prefetch=on|off` and
// `bf16dot=on|off`; a forced level above the cap is clamped to the cap (the cap stays the ceiling). Throws
// std::invalid_argument naming a malformed entry, an unknown family or level.
FamilyPlan MakePlan(IsaLevel cap, const char* forced);

// The levels the CPU policy lowers under `cap` on the CPU `f` (kCap entries where it has nothing to say).
std::array<IsaLevel, kNumFamilies> CpuPolicy(IsaLevel cap, const CpuFeatures& f);

// Whether the CPU `f` streams weight rows faster with the decode loops' software prefetch (FamilyPlan).
bool CpuPrefetch(const CpuFeatures& f);

// Whether the CPU `f` multiplies bf16 faster on VDPBF16PS than widened to fp32 FMAs (FamilyPlan::bf16_dot).
bool CpuBf16Dot(const CpuFeatures& f);

struct KernelTables {
  IsaLevel level = IsaLevel::kScalar;  // the plan's cap
  int64_t invariant_rows = 0;          // the plan's batch-invariance bound
  bool weight_prefetch = true;         // the plan's weight prefetch
  LevelSource prefetch_source = LevelSource::kCap;
  bool bf16_dot = false;               // the plan's bf16_dot (whether sparse_attention took its Bf16Dot table)
  LevelSource bf16_dot_source = LevelSource::kCap;
#define DSV4_TABLE_MEMBER(member, Type, name) \
  const Type* member = nullptr;               \
  IsaLevel member##_level = IsaLevel::kScalar; \
  LevelSource member##_source = LevelSource::kCap;
  DSV4_KERNEL_FAMILIES(DSV4_TABLE_MEMBER)
#undef DSV4_TABLE_MEMBER
};

// Tables for a plan. Built once per distinct plan (thread-safe; they live until the process exits); the
// reference is used for families without a variant at or below their level.
const KernelTables& GetKernelTables(const FamilyPlan& plan);

struct FamilyLevel {
  const char* family;
  IsaLevel level;       // the table actually used
  LevelSource source;
};
std::vector<FamilyLevel> DescribeFamilies(const KernelTables& tables);

}  // namespace dsv4
