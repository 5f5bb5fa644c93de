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

struct TableOp : OrtCustomOp {
  const optable::OpSpec* spec = nullptr;
  std::array<int, kMaxTypeVars> type_assignment{};  // concrete ONNX type of each type constraint
  IsaLevel isa = IsaLevel::kScalar;
  KernelFactory factory = nullptr;
};

// All variants of every op in the table for `isa`. Throws OpError when an op has no kernel registration.
std::vector<std::unique_ptr<TableOp>> BuildTableOps(IsaLevel isa);

}  // namespace dsv4::glue
