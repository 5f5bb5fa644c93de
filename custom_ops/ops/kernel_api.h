// The interface between the ORT glue (custom_op.cc) and each op's kernel class (ops/*_op.cc).
//
// An op class validates what the generic glue cannot (dimension agreement between inputs, index ranges), allocates
// its outputs (shaped by the op table's rules, evaluated by the glue) and calls the ORT-free kernels through the
// dispatch tables. It throws OpError with a message naming the input and the limit; the glue prefixes the op name
// and turns it into an OrtStatus. No exception ever crosses the C ABI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/op_table.h"
#include "platform/cpu_features.h"
#include "platform/kernel_tables.h"
#include "platform/parallel.h"

namespace dsv4::glue {

// ONNX element types used by the ops (codes of the op table's "element_types"; custom_op.cc checks them).
enum DType : int {
  kFloat = 1, kUint8 = 2, kInt8 = 3, kInt32 = 6, kInt64 = 7, kString = 8, kBFloat16 = 16, kFloat8E4M3FN = 17,
};
// Name and size of an element type, from the op table ("other" / 0 for a code it does not list).
const char* DTypeName(int dtype);
size_t ElementBytes(int dtype);

class OpError : public std::runtime_error {
 public:
  explicit OpError(const std::string& what) : std::runtime_error(what) {}
};

// Builds a message from streamable parts and throws OpError.
template <class... Args>
[[noreturn]] void Fail(const Args&... args);

std::string ShapeString(const std::vector<int64_t>& shape);

// A read-only view of one input tensor (absent optional inputs have present == false).
struct InputView {
  bool present = false;
  int dtype = 0;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t numel = 0;
  const char* name = "";

  int64_t dim(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
  int rank() const { return static_cast<int>(shape.size()); }
  template <class T>
  const T* as() const { return static_cast<const T*>(data); }
};

// Attribute values after validation against the table (defaults applied).
class Attributes {
 public:
  int64_t Int(const char* name) const;
  float Float(const char* name) const;
  const std::string& String(const char* name) const;

  struct Value {
    std::string name;
    int64_t i = 0;
    double f = 0;
    std::string s;
  };
  std::vector<Value> values;
};

class ComputeContext {
 public:
  virtual ~ComputeContext() = default;
  virtual const InputView& Input(int index) const = 0;
  virtual int NumInputs() const = 0;
  // Allocates output `index` with the shape of its rule in the op table (op_table.json "shape", evaluated for the
  // actual input shapes and attributes) and returns its buffer (nullptr when it has no elements). `numel` is the
  // element count the kernel writes: a rule that gives another count is an internal error (never an overrun).
  virtual void* Output(int index, int64_t numel) = 0;
  // Writes a string output (LibraryInfo only), shaped by its rule; `values` must fill it.
  virtual void OutputStrings(int index, const std::vector<std::string>& values) = 0;
  virtual const Parallel& Par() const = 0;

  template <class T>
  T* OutputAs(int index, int64_t numel) { return static_cast<T*>(Output(index, numel)); }
};

// Read-only access, at kernel creation, to inputs that are constant initializers (weights). Lets a kernel check
// or rearrange a weight once per session instead of on every call. The view stays valid for the session's life.
class ConstantInputs {
 public:
  virtual ~ConstantInputs() = default;
  // True and fills `out` when input `index` is present and a constant initializer; false otherwise.
  virtual bool Get(int index, InputView* out) const = 0;
};

struct KernelInit {
  const optable::OpSpec* spec;
  const Attributes* attrs;
  IsaLevel isa;                     // the session's ISA cap
  const KernelTables* tables;       // dispatch tables of the session's plan (a level per family)
  const ConstantInputs* constants;  // valid during the kernel's constructor only
};

class Kernel {
 public:
  virtual ~Kernel() = default;
  virtual void Compute(ComputeContext& ctx) = 0;
};

using KernelFactory = std::unique_ptr<Kernel> (*)(const KernelInit& init);

template <class K>
std::unique_ptr<Kernel> MakeKernel(const KernelInit& init) { return std::make_unique<K>(init); }

// One entry per op of the table; ops/registry.cc lists them.
struct KernelRegistration {
  const char* op_name;
  KernelFactory factory;
};
const KernelRegistration* FindKernel(const char* op_name);
const KernelRegistration* AllKernels(int* count);

}  // namespace dsv4::glue

#include <sstream>

namespace dsv4::glue {
template <class... Args>
[[noreturn]] void Fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw OpError(os.str());
}
}  // namespace dsv4::glue
