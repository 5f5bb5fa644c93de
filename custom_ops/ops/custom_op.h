// Table-driven OrtCustomOp: one instance per (op of the table, assignment of its type constraints, ISA level).
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_c_api.h>

#include <array>
#include <memory>
#include <vector>

#include "ops/kernel_api.h"

namespace dsv4::glue {

// The OrtApi this library was initialised with (set once in RegisterCustomOps).
const OrtApi& Api();
void SetApi(const OrtApi* api);

// The onnxruntime release the library runs in ("1.21.1", from OrtApiBase::GetVersionString). Releases before 1.24
// dereference the type of an absent optional input ("") while they build the shape-inference context of a custom
// op, before our InferOutputShape runs, and crash: on those, ops are registered without a shape-inference function
// (outputs then carry the shapes the exporter wrote into the graph).
void SetRuntimeVersion(const char* version);
bool RuntimeInfersCustomShapes();

constexpr int kMaxTypeVars = 4;

// One token of an output's shape rule (op_table.json "shape"), parsed once at registration.
struct RuleToken {
  enum Kind { kAttr, kLiteral, kDim, kSlice } kind = kLiteral;
  int input = -1;  // kDim / kSlice: the input whose dims are copied
  int attr = -1;   // kAttr: index of the int attribute
  int64_t begin = 0, end = 0;  // kLiteral: the value (begin); kDim: the index; kSlice: the bounds (Python rules)
  bool has_begin = false, has_end = false;
};
std::vector<RuleToken> ParseShapeRule(const optable::OpSpec& spec, const char* rule);

struct TableOp : OrtCustomOp {
  const optable::OpSpec* spec = nullptr;
  std::array<int, kMaxTypeVars> type_assignment{};  // concrete ONNX type of each type constraint
  IsaLevel isa = IsaLevel::kScalar;     // the plan's cap
  const KernelTables* tables = nullptr;  // the plan's dispatch tables
  std::vector<std::vector<RuleToken>> output_rules;  // parsed shape rule of each output (empty: none)
  KernelFactory factory = nullptr;
};

// All variants of every op in the table, dispatching by `plan`. Throws OpError when an op has no kernel
// registration.
std::vector<std::unique_ptr<TableOp>> BuildTableOps(const FamilyPlan& plan);

}  // namespace dsv4::glue
