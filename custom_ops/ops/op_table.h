// C++ view of the op-contract table (export/op_table.json). The data itself is generated into op_table_gen.h.
//
// Type codes are ONNX TensorProto.DataType values (equal to ONNXTensorElementDataType); a negative code -(i+1)
// refers to the op's i-th type constraint. Shape rules are ';'-separated tokens (see op_table.json "doc").
#pragma once

#include <cstdint>

namespace dsv4::optable {

enum class AttrKind { kInt, kFloat, kString };

// One ONNX element type of the table's "element_types".
struct ElementType {
  const char* name;  // ONNX spelling ("float", "bfloat16", ...)
  int code;          // TensorProto.DataType (= ONNXTensorElementDataType)
  int bytes;         // per element; 0 = variable (string)
};

struct TypeVar {
  const char* name;
  const int* types;
  int num_types;
};

struct IoSpec {
  const char* name;
  int type;          // > 0: ONNX type; < 0: -(type constraint index + 1)
  bool optional;
  int rank;          // exact rank, -1 = any
  int min_rank;      // minimum rank when rank == -1
  const char* shape; // output shape rule, nullptr for inputs
};

struct AttrSpec {
  const char* name;
  AttrKind kind;
  bool required;
  long long int_default;
  double float_default;
  const char* string_default;
  bool has_min;
  double min;
  bool has_max;
  double max;
  const char* choices;  // '|'-separated allowed strings, or nullptr
};

struct OpSpec {
  const char* name;
  int since_version;
  const IoSpec* inputs;
  int num_inputs;
  const IoSpec* outputs;
  int num_outputs;
  const AttrSpec* attrs;
  int num_attrs;
  const TypeVar* type_vars;
  int num_type_vars;
};

}  // namespace dsv4::optable
