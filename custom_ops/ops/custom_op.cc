// ORT glue: turns each op of the generated table into OrtCustomOp instances (C API only), reads and validates
// attributes against the table, checks ranks, infers output types/shapes from the table's shape rules, runs the
// op's kernel class with an ORT-backed ComputeContext (which allocates outputs by the same rules), and converts
// every C++ exception into an OrtStatus.
#include "ops/custom_op.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <sstream>
#include <string>
#include <thread>

#include "op_table_gen.h"
#include "ops/op_checks.h"
#include "platform/resident_weights.h"

namespace dsv4::glue {
namespace {

const OrtApi* g_api = nullptr;

// Throws OpError if an ORT call failed.
void Check(OrtStatus* status) {
  if (status == nullptr) return;
  std::string msg = Api().GetErrorMessage(status);
  Api().ReleaseStatus(status);
  throw OpError(msg);
}

OrtStatus* MakeStatus(OrtErrorCode code, const std::string& msg) { return Api().CreateStatus(code, msg.c_str()); }

const TableOp& AsTableOp(const OrtCustomOp* op) { return *static_cast<const TableOp*>(op); }

int ResolveType(const TableOp& op, int code) { return code > 0 ? code : op.type_assignment[-code - 1]; }

// ---- Element types -----------------------------------------------------------------------------------------------

const optable::ElementType* FindElementType(int code) {
  for (const optable::ElementType& t : optable::kElementTypes)
    if (t.code == code) return &t;
  return nullptr;
}

constexpr bool SameName(const char* a, const char* b) {
  for (; *a != '\0' && *a == *b; ++a, ++b) {
  }
  return *a == *b;
}

constexpr int TableCode(const char* name) {
  for (const optable::ElementType& t : optable::kElementTypes)
    if (SameName(t.name, name)) return t.code;
  return 0;
}

static_assert(TableCode("float") == kFloat && TableCode("uint8") == kUint8 && TableCode("int8") == kInt8 &&
                  TableCode("int32") == kInt32 && TableCode("int64") == kInt64 && TableCode("string") == kString &&
                  TableCode("bfloat16") == kBFloat16 && TableCode("float8e4m3fn") == kFloat8E4M3FN,
              "kernel_api.h's DType codes must be those of the op table's element_types");

// ---- Attributes --------------------------------------------------------------------------------------------------

bool ReadIntAttr(const OrtKernelInfo* info, const char* name, int64_t* out) {
  OrtStatus* s = Api().KernelInfoGetAttribute_int64(info, name, out);
  if (s == nullptr) return true;
  Api().ReleaseStatus(s);
  return false;
}

bool ReadFloatAttr(const OrtKernelInfo* info, const char* name, float* out) {
  OrtStatus* s = Api().KernelInfoGetAttribute_float(info, name, out);
  if (s == nullptr) return true;
  Api().ReleaseStatus(s);
  return false;
}

bool ReadStringAttr(const OrtKernelInfo* info, const char* name, std::string* out) {
  size_t size = 0;
  OrtStatus* s = Api().KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (s != nullptr) {
    Api().ReleaseStatus(s);
    if (size == 0) return false;
  }
  std::string buf(size, '\0');
  Check(Api().KernelInfoGetAttribute_string(info, name, buf.data(), &size));
  buf.resize(size > 0 ? size - 1 : 0);  // size includes the terminating NUL
  *out = buf;
  return true;
}

// The length of the list attribute `name` as the array readers report it (a size query: nothing is copied), or -1
// when the reader refuses the name. onnxruntime's array readers do not check the attribute's kind: they accept an
// attribute of any kind by that name and report the length of its list of their element type (0 when it has none).
int64_t IntsAttrSize(const OrtKernelInfo* info, const char* name) {
  size_t size = 0;
  OrtStatus* s = Api().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (s == nullptr) return static_cast<int64_t>(size);
  Api().ReleaseStatus(s);
  return -1;
}

int64_t FloatsAttrSize(const OrtKernelInfo* info, const char* name) {
  size_t size = 0;
  OrtStatus* s = Api().KernelInfoGetAttributeArray_float(info, name, nullptr, &size);
  if (s == nullptr) return static_cast<int64_t>(size);
  Api().ReleaseStatus(s);
  return -1;
}

bool HasTensorAttr(const OrtKernelInfo* info, const char* name) {
  OrtAllocator* allocator = nullptr;
  Check(Api().GetAllocatorWithDefaultOptions(&allocator));
  OrtValue* value = nullptr;
  OrtStatus* s = Api().KernelInfoGetAttribute_tensor(info, name, allocator, &value);
  if (s == nullptr) {
    Api().ReleaseValue(value);
    return true;
  }
  Api().ReleaseStatus(s);
  return false;
}

// What an attribute the node has under `name` holds when it is not of the declared kind ("" when it is absent).
// The C API reads attributes by name and kind only, so a node's attribute of another kind reads as absent: without
// this check an int written for a float attribute (what onnx.helper.make_attribute does for a Python int), a list
// or a tensor would silently take the default.
const char* OtherKindPresent(const OrtKernelInfo* info, const char* name, optable::AttrKind declared) {
  int64_t i = 0;
  float f = 0;
  std::string str;
  if (declared != optable::AttrKind::kInt && ReadIntAttr(info, name, &i)) return "an int";
  if (declared != optable::AttrKind::kFloat && ReadFloatAttr(info, name, &f)) return "a float";
  if (declared != optable::AttrKind::kString && ReadStringAttr(info, name, &str)) return "a string";
  if (HasTensorAttr(info, name)) return "a tensor";
  const int64_t ints = IntsAttrSize(info, name), floats = FloatsAttrSize(info, name);
  if (ints > 0) return "a list of ints";
  if (floats > 0) return "a list of floats";
  if (ints == 0 || floats == 0) return "an empty list or an attribute of another kind (strings, a graph, ...)";
  return "";
}

Attributes ReadAttributes(const optable::OpSpec& spec, const OrtKernelInfo* info) {
  Attributes attrs;
  for (int i = 0; i < spec.num_attrs; ++i) {
    const optable::AttrSpec& a = spec.attrs[i];
    Attributes::Value v;
    v.name = a.name;
    bool found = false;
    double numeric = 0;
    switch (a.kind) {
      case optable::AttrKind::kInt:
        found = ReadIntAttr(info, a.name, &v.i);
        if (!found) v.i = a.int_default;
        numeric = static_cast<double>(v.i);
        break;
      case optable::AttrKind::kFloat: {
        float f = 0;
        int64_t as_int = 0;
        found = ReadFloatAttr(info, a.name, &f);
        if (!found && ReadIntAttr(info, a.name, &as_int)) {  // an int for a float attribute: its value
          found = true;
          f = static_cast<float>(as_int);
        }
        v.f = found ? f : a.float_default;
        numeric = v.f;
        if (!std::isfinite(numeric)) Fail("attribute '", a.name, "' must be finite (got ", v.f, ")");
        break;
      }
      case optable::AttrKind::kString:
        found = ReadStringAttr(info, a.name, &v.s);
        if (!found && a.string_default != nullptr) v.s = a.string_default;
        break;
    }
    if (!found) {
      const char* other = OtherKindPresent(info, a.name, a.kind);
      if (*other != '\0') {
        const char* want = a.kind == optable::AttrKind::kInt ? "an int" : a.kind == optable::AttrKind::kFloat
                                                                             ? "a float" : "a string";
        Fail("attribute '", a.name, "' must be ", want, " (the node has ", other, ")");
      }
    }
    if (!found && a.required) Fail("required attribute '", a.name, "' is missing");
    if (a.kind != optable::AttrKind::kString) {
      if (a.has_min && numeric < a.min) Fail("attribute '", a.name, "' must be >= ", a.min, " (got ", numeric, ")");
      if (a.has_max && numeric > a.max) Fail("attribute '", a.name, "' must be <= ", a.max, " (got ", numeric, ")");
    } else if (a.choices != nullptr) {
      bool ok = false;
      std::string choices = a.choices;
      std::istringstream is(choices);
      for (std::string c; std::getline(is, c, '|');) ok = ok || c == v.s;
      if (!ok) Fail("attribute '", a.name, "' must be one of {", choices, "} (got '", v.s, "')");
    }
    attrs.values.push_back(std::move(v));
  }
  return attrs;
}

// ---- Shape rules -------------------------------------------------------------------------------------------------

struct Dim {
  int64_t value = -1;  // -1 = unknown
  std::string symbol;  // symbolic name when unknown
};

int InputIndex(const optable::OpSpec& spec, const std::string& name) {
  for (int i = 0; i < spec.num_inputs; ++i)
    if (name == spec.inputs[i].name) return i;
  return -1;
}

}  // namespace

// Parses one output's shape rule (op_table.json "shape": tokens joined by ';'). Done once per op at registration
// (BuildTableOps), so running an op never re-reads the text. A malformed rule is an internal error.
std::vector<RuleToken> ParseShapeRule(const optable::OpSpec& spec, const char* rule) {
  std::vector<RuleToken> tokens;
  if (rule == nullptr) return tokens;
  std::string all = rule;
  std::istringstream is(all);
  auto number = [&](const std::string& text) -> int64_t {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != text.size()) Fail("internal error: bad number '", text, "' in shape rule '", rule, "'");
    return v;
  };
  for (std::string tok; std::getline(is, tok, ';');) {
    if (tok.empty()) continue;
    RuleToken t;
    if (tok[0] == '@') {
      t.kind = RuleToken::kAttr;
      for (int a = 0; a < spec.num_attrs; ++a)
        if (tok.substr(1) == spec.attrs[a].name && spec.attrs[a].kind == optable::AttrKind::kInt) t.attr = a;
      if (t.attr < 0) Fail("internal error: shape rule '", rule, "' names no int attribute '", tok.substr(1), "'");
      tokens.push_back(t);
      continue;
    }
    const size_t lb = tok.find('[');
    if (lb == std::string::npos) {
      t.kind = RuleToken::kLiteral;
      t.begin = number(tok);
      tokens.push_back(t);
      continue;
    }
    t.input = InputIndex(spec, tok.substr(0, lb));
    if (t.input < 0 || tok.back() != ']') Fail("internal error: shape rule '", rule, "' has a bad token '", tok, "'");
    const std::string inside = tok.substr(lb + 1, tok.size() - lb - 2);
    const size_t colon = inside.find(':');
    if (colon == std::string::npos) {
      t.kind = RuleToken::kDim;
      t.begin = number(inside);
    } else {
      t.kind = RuleToken::kSlice;
      const std::string a = inside.substr(0, colon), b = inside.substr(colon + 1);
      t.has_begin = !a.empty();
      t.has_end = !b.empty();
      if (t.has_begin) t.begin = number(a);
      if (t.has_end) t.end = number(b);
    }
    tokens.push_back(t);
  }
  return tokens;
}

namespace {

// Evaluates one output's parsed shape rule. `input_dims(i)` gives input i's dims (nullptr: absent or unknown
// rank), `attr_int(index, &v)` the value of the op's attribute `index`. Returns false when the shape cannot be
// determined (unknown ranks, an index outside the rank).
template <class GetDims, class GetAttr>
bool EvalShapeRule(const std::vector<RuleToken>& rule, GetDims&& input_dims, GetAttr&& attr_int,
                   std::vector<Dim>* out) {
  for (const RuleToken& t : rule) {
    if (t.kind == RuleToken::kAttr) {
      int64_t v = 0;
      if (!attr_int(t.attr, &v)) return false;
      out->push_back({v, ""});
      continue;
    }
    if (t.kind == RuleToken::kLiteral) {
      out->push_back({t.begin, ""});
      continue;
    }
    const std::vector<Dim>* dims = input_dims(t.input);
    if (dims == nullptr) return false;
    const int64_t rank = static_cast<int64_t>(dims->size());
    auto norm = [rank](int64_t i) { return i < 0 ? i + rank : i; };
    if (t.kind == RuleToken::kDim) {
      const int64_t i = norm(t.begin);
      if (i < 0 || i >= rank) return false;
      out->push_back((*dims)[static_cast<size_t>(i)]);
    } else {
      const int64_t begin = t.has_begin ? norm(t.begin) : 0, end = t.has_end ? norm(t.end) : rank;
      for (int64_t i = std::max<int64_t>(begin, 0); i < std::min(end, rank); ++i)
        out->push_back((*dims)[static_cast<size_t>(i)]);
    }
  }
  return true;
}

// An output's shape by its rule for the concrete shapes of `inputs` and the node's attributes (defaults applied).
std::vector<int64_t> RuleShape(const TableOp& op, int index, const std::vector<InputView>& inputs,
                               const Attributes& attrs) {
  const optable::OpSpec& spec = *op.spec;
  if (index < 0 || index >= spec.num_outputs) Fail("internal error: output index ", index, " out of range");
  std::vector<std::vector<Dim>> dims(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    for (int64_t d : inputs[i].shape) dims[i].push_back({d, ""});
  auto input_dims = [&](int i) -> const std::vector<Dim>* { return inputs[i].present ? &dims[i] : nullptr; };
  auto attr_int = [&](int a, int64_t* v) {
    *v = attrs.Int(spec.attrs[a].name);
    return true;
  };
  const optable::IoSpec& io = spec.outputs[index];
  std::vector<Dim> out;
  if (io.shape == nullptr || !EvalShapeRule(op.output_rules[index], input_dims, attr_int, &out)) {
    Fail("internal error: the shape rule of output '", io.name, "' (", io.shape ? io.shape : "none",
         ") cannot be evaluated for these inputs");
  }
  std::vector<int64_t> shape;
  for (const Dim& d : out) {
    if (d.value < 0) Fail("internal error: negative output dimension for '", io.name, "'");
    shape.push_back(d.value);
  }
  return shape;
}

// ---- OrtCustomOp callbacks ---------------------------------------------------------------------------------------

const char* ORT_API_CALL GetName(const OrtCustomOp* op) { return AsTableOp(op).spec->name; }
const char* ORT_API_CALL GetEp(const OrtCustomOp*) { return "CPUExecutionProvider"; }

ONNXTensorElementDataType ORT_API_CALL GetInputType(const OrtCustomOp* op, size_t i) {
  const TableOp& t = AsTableOp(op);
  return static_cast<ONNXTensorElementDataType>(ResolveType(t, t.spec->inputs[i].type));
}
size_t ORT_API_CALL GetInputTypeCount(const OrtCustomOp* op) { return AsTableOp(op).spec->num_inputs; }
ONNXTensorElementDataType ORT_API_CALL GetOutputType(const OrtCustomOp* op, size_t i) {
  const TableOp& t = AsTableOp(op);
  return static_cast<ONNXTensorElementDataType>(ResolveType(t, t.spec->outputs[i].type));
}
size_t ORT_API_CALL GetOutputTypeCount(const OrtCustomOp* op) { return AsTableOp(op).spec->num_outputs; }
OrtCustomOpInputOutputCharacteristic ORT_API_CALL GetInputCharacteristic(const OrtCustomOp* op, size_t i) {
  return AsTableOp(op).spec->inputs[i].optional ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
OrtCustomOpInputOutputCharacteristic ORT_API_CALL GetOutputCharacteristic(const OrtCustomOp* op, size_t i) {
  return AsTableOp(op).spec->outputs[i].optional ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
OrtMemType ORT_API_CALL GetInputMemoryType(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int ORT_API_CALL GetVariadicMinArity(const OrtCustomOp*) { return 1; }
int ORT_API_CALL GetVariadicHomogeneity(const OrtCustomOp*) { return 1; }
int ORT_API_CALL GetStartVersion(const OrtCustomOp* op) { return AsTableOp(op).spec->since_version; }
int ORT_API_CALL GetEndVersion(const OrtCustomOp*) { return std::numeric_limits<int>::max(); }

std::string Prefix(const optable::OpSpec& spec) { return std::string(spec.name) + ": "; }

struct KernelState {
  const TableOp* op;
  Attributes attrs;
  std::unique_ptr<Kernel> kernel;
  std::vector<ResidentCopy> resident;  // per input: a huge-page copy of a large constant (resident_weights.h)
};

// Constant initializers seen from CreateKernel (OrtApi::KernelInfoGetConstantInput_tensor).
class OrtConstantInputs final : public ConstantInputs {
 public:
  // resident: the kernel's copies, whose addresses Get reports in place of the initializers' own.
  OrtConstantInputs(const TableOp& op, const OrtKernelInfo* info, const std::vector<ResidentCopy>* resident)
      : op_(op), info_(info), resident_(resident) {}

  bool Get(int index, InputView* out) const override {
    if (index < 0 || index >= op_.spec->num_inputs) return false;
    size_t count = 0;
    Check(Api().KernelInfo_GetInputCount(info_, &count));
    if (static_cast<size_t>(index) >= count) return false;
    int is_constant = 0;
    const OrtValue* value = nullptr;
    Check(Api().KernelInfoGetConstantInput_tensor(info_, index, &is_constant, &value));
    if (!is_constant || value == nullptr) return false;
    OrtTensorTypeAndShapeInfo* ti = nullptr;
    Check(Api().GetTensorTypeAndShape(value, &ti));
    ONNXTensorElementDataType type;
    size_t rank = 0;
    OrtStatus* s = Api().GetTensorElementType(ti, &type);
    if (s == nullptr) s = Api().GetDimensionsCount(ti, &rank);
    InputView v;
    v.shape.resize(rank);
    if (s == nullptr) s = Api().GetDimensions(ti, v.shape.data(), rank);
    Api().ReleaseTensorTypeAndShapeInfo(ti);
    Check(s);
    v.present = true;
    v.dtype = type;
    v.name = op_.spec->inputs[index].name;
    v.numel = ShapeProduct(v.shape, "the element count");
    void* data = nullptr;
    if (v.numel > 0) Check(Api().GetTensorMutableData(const_cast<OrtValue*>(value), &data));
    v.data = resident_ != nullptr ? (*resident_)[static_cast<size_t>(index)].Map(data) : data;
    *out = std::move(v);
    return true;
  }

 private:
  const TableOp& op_;
  const OrtKernelInfo* info_;
  const std::vector<ResidentCopy>* resident_;
};

OrtStatus* ORT_API_CALL CreateKernelV2(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info,
                                       void** kernel) {
  const TableOp& t = AsTableOp(op);
  try {
    auto state = std::make_unique<KernelState>();
    state->op = &t;
    state->attrs = ReadAttributes(*t.spec, info);
    // Large constant inputs get their resident copy first, so the kernel's creation-time checks see the addresses
    // Compute will pass it.
    state->resident.resize(static_cast<size_t>(t.spec->num_inputs));
    const ResidentPolicy policy = ResidentPolicyFromEnv();
    if (policy != ResidentPolicy::kOff) {
      OrtConstantInputs originals(t, info, nullptr);
      for (int i = 0; i < t.spec->num_inputs; ++i) {
        InputView v;
        if (!originals.Get(i, &v) || v.data == nullptr) continue;
        const size_t bytes = static_cast<size_t>(v.numel) * ElementBytes(v.dtype);
        state->resident[static_cast<size_t>(i)].Adopt(v.data, bytes, policy);
      }
    }
    OrtConstantInputs constants(t, info, &state->resident);
    KernelInit init{t.spec, &state->attrs, t.isa, t.tables, &constants};
    state->kernel = t.factory(init);
    *kernel = state.release();
    return nullptr;
  } catch (const std::exception& e) {
    return MakeStatus(ORT_INVALID_ARGUMENT, Prefix(*t.spec) + e.what());
  } catch (...) {
    return MakeStatus(ORT_FAIL, Prefix(*t.spec) + "unknown error while creating the kernel");
  }
}

void ORT_API_CALL KernelDestroy(void* kernel) { delete static_cast<KernelState*>(kernel); }

// Runs a kernel's task list on the session's intra-op pool.
void RunOnOrtPool(void* backend, size_t num_tasks, Parallel::TaskFn fn, void* arg) {
  Check(Api().KernelContext_ParallelFor(static_cast<const OrtKernelContext*>(backend), fn, num_tasks, 0, arg));
}

int HardwareThreads() {
  static const int n = [] {
    const unsigned h = std::thread::hardware_concurrency();
    return h == 0 ? 1 : static_cast<int>(h);
  }();
  return n;
}

class OrtComputeContext final : public ComputeContext {
 public:
  OrtComputeContext(const TableOp& op, const Attributes& attrs, const std::vector<ResidentCopy>& resident,
                    OrtKernelContext* ctx)
      : op_(op), attrs_(attrs), ctx_(ctx) {
    size_t n = 0;
    Check(Api().KernelContext_GetInputCount(ctx, &n));
    inputs_.resize(op.spec->num_inputs);
    for (int i = 0; i < op.spec->num_inputs; ++i) {
      InputView& v = inputs_[i];
      v.name = op.spec->inputs[i].name;
      const OrtValue* value = nullptr;
      if (static_cast<size_t>(i) < n) Check(Api().KernelContext_GetInput(ctx, i, &value));
      if (value == nullptr) {
        if (!op.spec->inputs[i].optional) Fail("input '", v.name, "' is missing");
        continue;
      }
      v.present = true;
      OrtTensorTypeAndShapeInfo* info = nullptr;
      Check(Api().GetTensorTypeAndShape(value, &info));
      ONNXTensorElementDataType type;
      size_t rank = 0;
      OrtStatus* s = Api().GetTensorElementType(info, &type);
      if (s == nullptr) s = Api().GetDimensionsCount(info, &rank);
      if (s == nullptr) {
        v.shape.resize(rank);
        s = Api().GetDimensions(info, v.shape.data(), rank);
      }
      Api().ReleaseTensorTypeAndShapeInfo(info);
      Check(s);
      v.dtype = type;
      v.numel = ShapeProduct(v.shape, "the element count");
      void* data = nullptr;
      if (v.numel > 0 && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING) {
        Check(Api().GetTensorMutableData(const_cast<OrtValue*>(value), &data));
      }
      v.data = static_cast<size_t>(i) < resident.size() ? resident[static_cast<size_t>(i)].Map(data) : data;
      const optable::IoSpec& io = op.spec->inputs[i];
      if (io.rank >= 0 && v.rank() != io.rank) {
        Fail("input '", v.name, "' must have rank ", io.rank, ", got shape ", ShapeString(v.shape));
      }
      if (io.rank < 0 && v.rank() < io.min_rank) {
        Fail("input '", v.name, "' must have rank >= ", io.min_rank, ", got shape ", ShapeString(v.shape));
      }
    }
    par_.backend = ctx;
    par_.run = &RunOnOrtPool;
    par_.num_threads = HardwareThreads();
  }

  const InputView& Input(int index) const override { return inputs_.at(index); }
  int NumInputs() const override { return static_cast<int>(inputs_.size()); }
  const Parallel& Par() const override { return par_; }

  void* Output(int index, int64_t numel) override {
    OrtValue* value = GetOutput(index, numel);
    if (numel == 0) return nullptr;
    void* data = nullptr;
    Check(Api().GetTensorMutableData(value, &data));
    return data;
  }

  void OutputStrings(int index, const std::vector<std::string>& values) override {
    OrtValue* value = GetOutput(index, static_cast<int64_t>(values.size()));
    std::vector<const char*> ptrs;
    for (const std::string& s : values) ptrs.push_back(s.c_str());
    Check(Api().FillStringTensor(value, ptrs.data(), ptrs.size()));
  }

 private:
  // Output `index` allocated with its rule's shape, which must hold the `numel` elements the kernel writes.
  OrtValue* GetOutput(int index, int64_t numel) {
    const std::vector<int64_t> shape = RuleShape(op_, index, inputs_, attrs_);
    const int64_t rule_numel = ShapeProduct(shape, "the element count");
    if (rule_numel != numel) {
      Fail("internal error: output '", op_.spec->outputs[index].name, "' has shape ", ShapeString(shape),
           " by the op table's rule (", op_.spec->outputs[index].shape, ") but the kernel writes ", numel,
           " elements");
    }
    OrtValue* value = nullptr;
    Check(Api().KernelContext_GetOutput(ctx_, index, shape.data(), shape.size(), &value));
    return value;
  }

  const TableOp& op_;
  const Attributes& attrs_;
  OrtKernelContext* ctx_;
  std::vector<InputView> inputs_;
  Parallel par_;
};

OrtStatus* ORT_API_CALL KernelComputeV2(void* kernel, OrtKernelContext* context) {
  auto* state = static_cast<KernelState*>(kernel);
  const optable::OpSpec& spec = *state->op->spec;
  try {
    OrtComputeContext ctx(*state->op, state->attrs, state->resident, context);
    state->kernel->Compute(ctx);
    return nullptr;
  } catch (const OpError& e) {
    return MakeStatus(ORT_INVALID_ARGUMENT, Prefix(spec) + e.what());
  } catch (const std::bad_alloc&) {
    return MakeStatus(ORT_FAIL, Prefix(spec) + "out of memory");
  } catch (const std::exception& e) {
    return MakeStatus(ORT_FAIL, Prefix(spec) + e.what());
  } catch (...) {
    return MakeStatus(ORT_FAIL, Prefix(spec) + "unknown error");
  }
}

// V1 entry points are never used (ORT >= 1.16 prefers V2) but must not be null for older code paths.
void* ORT_API_CALL CreateKernelV1(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  void* kernel = nullptr;
  OrtStatus* s = CreateKernelV2(op, api, info, &kernel);
  if (s != nullptr) Api().ReleaseStatus(s);
  return kernel;
}
void ORT_API_CALL KernelComputeV1(void* kernel, OrtKernelContext* context) {
  OrtStatus* s = KernelComputeV2(kernel, context);
  if (s != nullptr) Api().ReleaseStatus(s);
}

// Shape inference from the table's shape rules; element types from the op's type constraints, resolved against
// the node's actual input types.
OrtStatus* ORT_API_CALL InferOutputShape(const OrtCustomOp* op, OrtShapeInferContext* ctx) {
  const TableOp& t = AsTableOp(op);
  const optable::OpSpec& spec = *t.spec;
  try {
    size_t n_in = 0;
    Check(Api().ShapeInferContext_GetInputCount(ctx, &n_in));
    std::vector<std::vector<Dim>> dims(spec.num_inputs);
    std::vector<bool> known(spec.num_inputs, false);
    std::vector<int> types(spec.num_inputs, 0);
    for (int i = 0; i < spec.num_inputs && static_cast<size_t>(i) < n_in; ++i) {
      OrtTensorTypeAndShapeInfo* info = nullptr;
      OrtStatus* s = Api().ShapeInferContext_GetInputTypeShape(ctx, i, &info);
      if (s != nullptr) {  // absent optional input
        Api().ReleaseStatus(s);
        continue;
      }
      if (info == nullptr) continue;
      ONNXTensorElementDataType type;
      Check(Api().GetTensorElementType(info, &type));
      // how some releases describe an absent optional input (the info belongs to the context: never released)
      if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED) continue;
      types[i] = type;
      size_t rank = 0;
      Check(Api().GetDimensionsCount(info, &rank));
      std::vector<int64_t> values(rank);
      std::vector<const char*> symbols(rank, nullptr);
      Check(Api().GetDimensions(info, values.data(), rank));
      Check(Api().GetSymbolicDimensions(info, symbols.data(), rank));
      for (size_t d = 0; d < rank; ++d) dims[i].push_back({values[d], symbols[d] ? symbols[d] : ""});
      known[i] = true;
    }
    auto input_dims = [&](int i) -> const std::vector<Dim>* { return known[i] ? &dims[i] : nullptr; };
    auto attr_int = [&](int a, int64_t* v) {
      const OrtOpAttr* attr = nullptr;
      OrtStatus* s = Api().ShapeInferContext_GetAttribute(ctx, spec.attrs[a].name, &attr);
      if (s != nullptr) Api().ReleaseStatus(s);
      if (s != nullptr || attr == nullptr) {
        if (spec.attrs[a].required) return false;
        *v = spec.attrs[a].int_default;
        return true;
      }
      size_t size = 0;
      Check(Api().ReadOpAttr(attr, ORT_OP_ATTR_INT, v, sizeof(*v), &size));
      return true;
    };
    for (int o = 0; o < spec.num_outputs; ++o) {
      const optable::IoSpec& io = spec.outputs[o];
      int type = io.type;
      if (type < 0) {  // first present input bound to the same type constraint
        type = 0;
        for (int i = 0; i < spec.num_inputs && type == 0; ++i)
          if (spec.inputs[i].type == io.type && types[i] != 0) type = types[i];
        if (type == 0) continue;
      }
      std::vector<Dim> out;
      OrtTensorTypeAndShapeInfo* info = nullptr;
      Check(Api().CreateTensorTypeAndShapeInfo(&info));
      OrtStatus* s = Api().SetTensorElementType(info, static_cast<ONNXTensorElementDataType>(type));
      if (s == nullptr && io.shape != nullptr && EvalShapeRule(t.output_rules[o], input_dims, attr_int, &out)) {
        std::vector<int64_t> values;
        std::vector<const char*> symbols;
        for (const Dim& d : out) {
          values.push_back(d.value);
          symbols.push_back(d.symbol.c_str());
        }
        s = Api().SetDimensions(info, values.data(), values.size());
        if (s == nullptr) s = Api().SetSymbolicDimensions(info, symbols.data(), symbols.size());
      }
      if (s == nullptr) s = Api().ShapeInferContext_SetOutputTypeShape(ctx, o, info);
      Api().ReleaseTensorTypeAndShapeInfo(info);
      Check(s);
    }
    return nullptr;
  } catch (const std::exception& e) {
    return MakeStatus(ORT_INVALID_GRAPH, Prefix(spec) + e.what());
  }
}

void Enumerate(const optable::OpSpec& spec, int var, std::array<int, kMaxTypeVars>& current,
               std::vector<std::array<int, kMaxTypeVars>>* out) {
  if (var >= spec.num_type_vars || var >= kMaxTypeVars) {
    out->push_back(current);
    return;
  }
  for (int i = 0; i < spec.type_vars[var].num_types; ++i) {
    current[var] = spec.type_vars[var].types[i];
    Enumerate(spec, var + 1, current, out);
  }
}

}  // namespace

const OrtApi& Api() { return *g_api; }
void SetApi(const OrtApi* api) { g_api = api; }

namespace {
bool g_infers_custom_shapes = true;
}  // namespace

void SetRuntimeVersion(const char* version) {
  int major = 0, minor = 0;
  if (version == nullptr || std::sscanf(version, "%d.%d", &major, &minor) != 2) return;  // unknown: assume current
  g_infers_custom_shapes = major > 1 || (major == 1 && minor >= 24);
}
bool RuntimeInfersCustomShapes() { return g_infers_custom_shapes; }

std::vector<std::unique_ptr<TableOp>> BuildTableOps(const FamilyPlan& plan) {
  const KernelTables* tables = &GetKernelTables(plan);
  std::vector<std::unique_ptr<TableOp>> ops;
  for (int k = 0; k < optable::kNumOps; ++k) {
    const optable::OpSpec& spec = optable::kOps[k];
    const KernelRegistration* reg = FindKernel(spec.name);
    if (reg == nullptr) Fail("op '", spec.name, "' of the op table has no kernel in this library");
    if (spec.num_type_vars > kMaxTypeVars) Fail("op '", spec.name, "' has too many type constraints");
    std::vector<std::array<int, kMaxTypeVars>> assignments;
    std::array<int, kMaxTypeVars> current{};
    Enumerate(spec, 0, current, &assignments);
    for (const auto& assignment : assignments) {
      auto op = std::make_unique<TableOp>();
      OrtCustomOp& c = *op;
      std::memset(static_cast<void*>(&c), 0, sizeof(OrtCustomOp));
      c.version = optable::kOrtApiVersion;
      c.CreateKernel = &CreateKernelV1;
      c.GetName = &GetName;
      c.GetExecutionProviderType = &GetEp;
      c.GetInputType = &GetInputType;
      c.GetInputTypeCount = &GetInputTypeCount;
      c.GetOutputType = &GetOutputType;
      c.GetOutputTypeCount = &GetOutputTypeCount;
      c.KernelCompute = &KernelComputeV1;
      c.KernelDestroy = &KernelDestroy;
      c.GetInputCharacteristic = &GetInputCharacteristic;
      c.GetOutputCharacteristic = &GetOutputCharacteristic;
      c.GetInputMemoryType = &GetInputMemoryType;
      c.GetVariadicInputMinArity = &GetVariadicMinArity;
      c.GetVariadicInputHomogeneity = &GetVariadicHomogeneity;
      c.GetVariadicOutputMinArity = &GetVariadicMinArity;
      c.GetVariadicOutputHomogeneity = &GetVariadicHomogeneity;
      c.CreateKernelV2 = &CreateKernelV2;
      c.KernelComputeV2 = &KernelComputeV2;
      c.InferOutputShapeFn = RuntimeInfersCustomShapes() ? &InferOutputShape : nullptr;
      c.GetStartVersion = &GetStartVersion;
      c.GetEndVersion = &GetEndVersion;
      op->spec = &spec;
      op->type_assignment = assignment;
      op->isa = plan.cap;
      op->tables = tables;
      for (int o = 0; o < spec.num_outputs; ++o) op->output_rules.push_back(ParseShapeRule(spec, spec.outputs[o].shape));
      op->factory = reg->factory;
      ops.push_back(std::move(op));
    }
  }
  return ops;
}

const char* DTypeName(int dtype) {
  const optable::ElementType* t = FindElementType(dtype);
  return t != nullptr ? t->name : "other";
}

size_t ElementBytes(int dtype) {
  const optable::ElementType* t = FindElementType(dtype);
  if (t == nullptr || t->bytes == 0) Fail("internal error: element type ", DTypeName(dtype), " has no fixed size");
  return static_cast<size_t>(t->bytes);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

int64_t Attributes::Int(const char* name) const {
  for (const Value& v : values)
    if (v.name == name) return v.i;
  Fail("internal error: unknown attribute '", name, "'");
}
float Attributes::Float(const char* name) const {
  for (const Value& v : values)
    if (v.name == name) return static_cast<float>(v.f);
  Fail("internal error: unknown attribute '", name, "'");
}
const std::string& Attributes::String(const char* name) const {
  for (const Value& v : values)
    if (v.name == name) return v.s;
  Fail("internal error: unknown attribute '", name, "'");
}

}  // namespace dsv4::glue
