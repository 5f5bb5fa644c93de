// dsv4_generate: greedy generation from an exported dsv4-ort model with onnxruntime's C++ API, no Python.
//
//   dsv4_generate --library /path/libdsv4_ort.so [--max-new-tokens N] [--threads T] [--model-file model.onnx]
//                 MODEL_DIR ID [ID ...]
//
// MODEL_DIR is what `dsv4-ort export` writes (model.onnx + model.onnx.data + dsv4_ort.json), or a directory holding
// an ORT-format conversion (model.ort, --model-file model.ort) beside dsv4_ort.json. The prompt is token ids. Prints
//   tokens: <generated ids, space separated>
//   prefill: <n> tokens, <ms> ms, <tokens/s> tokens/s
//   decode: <n> tokens, <ms> ms, <tokens/s> tokens/s
// Errors go to stderr with exit status 2.
//
// How the graph is driven (dsv4_ort.json "state"): inputs input_ids [batch, seq] int64 and start_pos [batch] int64
// (each row's absolute position of input_ids[:, 0]), plus per layer past.L.<name>; outputs logits [batch, seq or 1,
// vocab] float32 and present.L.<name>, each the same shape and type as its past.L.<name>. One zeroed buffer per
// state tensor is allocated once and bound through IoBinding as BOTH past and present: the custom ops write only the
// new slots in place, so nothing is copied between steps. Zeroed state is valid for any row at start_pos 0.
// Batch 1 here; the symbolic batch dimension (state.batch_dim) is replaced by 1.

#include <onnxruntime_cxx_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "json_reader.h"

namespace {

using dsv4_example::Json;

struct Options {
  std::string model_dir;
  std::string model_file = "model.onnx";
  std::string library;
  int64_t max_new_tokens = 32;
  int threads = 0;  // 0: onnxruntime's default (one per physical core)
  std::vector<int64_t> prompt;
};

[[noreturn]] void Usage(const std::string& why) {
  throw std::invalid_argument(why + "\nusage: dsv4_generate --library LIBDSV4_ORT.so [--max-new-tokens N] "
                              "[--threads T] [--model-file model.onnx|model.ort] MODEL_DIR ID [ID ...]");
}

// A whole decimal integer in [lo, hi]; anything else (sign junk, trailing text, overflow) is an error.
int64_t ParseInt(const std::string& text, int64_t lo, int64_t hi, const char* what) {
  if (text.empty() || text.size() > 19) Usage(std::string(what) + " '" + text + "' is not an integer");
  for (char c : text) {
    if (c < '0' || c > '9') Usage(std::string(what) + " '" + text + "' is not a non-negative integer");
  }
  int64_t v = std::strtoll(text.c_str(), nullptr, 10);
  if (v < lo || v > hi) {
    Usage(std::string(what) + " " + text + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return v;
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  if (const char* env = std::getenv("DSV4_ORT_LIBRARY")) o.library = env;
  std::vector<std::string> rest;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--library") o.library = value();
    else if (a == "--model-file") o.model_file = value();
    else if (a == "--max-new-tokens") o.max_new_tokens = ParseInt(value(), 0, 1 << 20, "--max-new-tokens");
    else if (a == "--threads") o.threads = static_cast<int>(ParseInt(value(), 0, 1024, "--threads"));
    else if (a == "-h" || a == "--help") Usage("greedy generation with a dsv4-ort model");
    else if (a.size() > 1 && a[0] == '-' && a[1] == '-') Usage("unknown option " + a);
    else rest.push_back(a);
  }
  if (o.library.empty()) Usage("--library (or DSV4_ORT_LIBRARY) must name libdsv4_ort.so");
  if (rest.size() < 2) Usage("need MODEL_DIR and at least one prompt token id");
  o.model_dir = rest[0];
  for (size_t i = 1; i < rest.size(); ++i) {
    o.prompt.push_back(ParseInt(rest[i], 0, std::numeric_limits<int64_t>::max(), "token id"));
  }
  if (o.model_file.empty() || o.model_file.find('/') != std::string::npos) {
    Usage("--model-file must be a file name inside MODEL_DIR");
  }
  return o;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The element types a state tensor may have (dsv4_ort.json spells them as ONNX does), with their sizes.
struct ElementType {
  const char* name;
  ONNXTensorElementDataType onnx;
  size_t bytes;
};
constexpr ElementType kStateTypes[] = {
    {"float", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, 4},
    {"bfloat16", ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16, 2},
    {"float16", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, 2},
    {"float8e4m3fn", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN, 1},
    {"uint8", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, 1},
    {"int64", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, 8},
};

const ElementType& StateType(const std::string& name, const std::string& tensor) {
  for (const auto& t : kStateTypes) {
    if (name == t.name) return t;
  }
  throw std::runtime_error("state tensor " + tensor + " has unsupported element type '" + name + "'");
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// One state tensor: its buffer (64-byte aligned, zeroed, allocated once) and the OrtValue viewing it.
struct StateTensor {
  std::string input, output;
  std::vector<int64_t> shape;
  const ElementType* type = nullptr;
  size_t bytes = 0;
  std::unique_ptr<void, FreeDeleter> data;
  Ort::Value value{nullptr};
};

size_t CheckedMul(size_t a, size_t b) {
  if (b != 0 && a > std::numeric_limits<size_t>::max() / b) throw std::runtime_error("state tensor too large");
  return a * b;
}

struct Model {
  std::vector<StateTensor> state;
  int64_t vocab = 0;
  int64_t max_seq_len = 0;
  bool logits_all = false;  // "all": logits for every input position; "last": [batch, 1, vocab]
  std::string export_id;
};

// Reads what the runtime needs from dsv4_ort.json and checks it: every state entry is a past.X / present.X pair of a
// known element type with a positive fixed shape apart from the batch dimension.
Model ReadModel(const std::string& json_path) {
  Json meta = Json::Parse(ReadFile(json_path));
  if (!meta.is_object() || meta.at("format").str("format") != "dsv4-ort") {
    throw std::runtime_error(json_path + " does not describe a dsv4-ort model");
  }
  Model m;
  m.vocab = meta.at("config").at("vocab_size").integer("config.vocab_size");
  m.max_seq_len = meta.at("max_seq_len").integer("max_seq_len");
  const std::string& logits = meta.at("logits").str("logits");
  if (logits != "all" && logits != "last") throw std::runtime_error("logits must be 'all' or 'last'");
  m.logits_all = logits == "all";
  m.export_id = meta.at("export_id").str("export_id");
  if (m.vocab < 1 || m.max_seq_len < 1) throw std::runtime_error("vocab_size and max_seq_len must be positive");

  const Json& st = meta.at("state");
  const std::string& batch_dim = st.at("batch_dim").str("state.batch_dim");
  for (const Json& t : st.at("tensors").array("state.tensors")) {
    StateTensor s;
    s.input = t.at("input").str("state tensor input");
    s.output = t.at("output").str("state tensor output");
    // one buffer is bound as both names: a pair of other names would bind one layer's output to another's input
    if (s.input.rfind("past.", 0) != 0 || s.output != "present." + s.input.substr(5)) {
      throw std::runtime_error("state pair " + s.input + " / " + s.output + " is not past.X / present.X");
    }
    s.type = &StateType(t.at("dtype").str("state tensor dtype"), s.input);
    size_t elems = 1;
    for (const Json& d : t.at("shape").array("state tensor shape")) {
      int64_t n = 0;
      if (d.is_string() && d.str("dim") == batch_dim) n = 1;  // batch 1
      else n = d.integer("state tensor dimension");
      if (n < 1) throw std::runtime_error("state tensor " + s.input + " has a dimension < 1");
      s.shape.push_back(n);
      elems = CheckedMul(elems, static_cast<size_t>(n));
    }
    s.bytes = CheckedMul(elems, s.type->bytes);
    m.state.push_back(std::move(s));
  }
  if (m.state.empty()) throw std::runtime_error(json_path + " lists no state tensors");
  return m;
}

// The graph must have the inputs and outputs the JSON names, with the same element types.
void CheckAgainstSession(const Model& m, Ort::Session& session) {
  Ort::AllocatorWithDefaultOptions alloc;
  auto types_of = [&](bool inputs) {
    std::vector<std::pair<std::string, ONNXTensorElementDataType>> out;
    size_t n = inputs ? session.GetInputCount() : session.GetOutputCount();
    for (size_t i = 0; i < n; ++i) {
      auto name = inputs ? session.GetInputNameAllocated(i, alloc) : session.GetOutputNameAllocated(i, alloc);
      auto info = inputs ? session.GetInputTypeInfo(i) : session.GetOutputTypeInfo(i);
      out.emplace_back(name.get(), info.GetTensorTypeAndShapeInfo().GetElementType());
    }
    return out;
  };
  auto ins = types_of(true), outs = types_of(false);
  auto type_in = [](const auto& list, const std::string& name) {
    for (const auto& [n, t] : list) {
      if (n == name) return t;
    }
    throw std::runtime_error("the graph has no input or output named " + name);
  };
  for (const auto& s : m.state) {
    if (type_in(ins, s.input) != s.type->onnx || type_in(outs, s.output) != s.type->onnx) {
      throw std::runtime_error("state tensor " + s.input + " has another element type in the graph");
    }
  }
  if (type_in(ins, "input_ids") != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ||
      type_in(ins, "start_pos") != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ||
      type_in(outs, "logits") != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
    throw std::runtime_error("input_ids / start_pos must be int64 and logits float32");
  }
  if (ins.size() != m.state.size() + 2 || outs.size() != m.state.size() + 1) {
    throw std::runtime_error("the graph has state tensors dsv4_ort.json does not list");
  }
  // The export id ties dsv4_ort.json to the graph it was written with.
  auto recorded = session.GetModelMetadata().LookupCustomMetadataMapAllocated("dsv4_ort.export_id", alloc);
  if (!recorded || m.export_id != recorded.get()) {
    throw std::runtime_error("dsv4_ort.json (export " + m.export_id + ") does not belong to this graph (export " +
                             std::string(recorded ? recorded.get() : "none") + ")");
  }
}

// Greedy choice over one row of logits: the first maximum (numpy's argmax), like dsv4_ort's Python sampler.
// NaN or +inf logits are an error rather than a token.
int64_t Argmax(const float* row, int64_t vocab) {
  int64_t best = -1;
  float best_v = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < vocab; ++v) {
    float x = row[v];
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) {
      throw std::runtime_error("non-finite logit at token " + std::to_string(v));
    }
    if (best < 0 ? x > -std::numeric_limits<float>::infinity() : x > best_v) { best = v; best_v = x; }
  }
  if (best < 0) throw std::runtime_error("no finite logit in the row");
  return best;
}

int Run(const Options& o) {
  const std::string dir = o.model_dir + "/";
  Model m = ReadModel(dir + "dsv4_ort.json");
  for (int64_t id : o.prompt) {
    if (id >= m.vocab) throw std::invalid_argument("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                                   std::to_string(m.vocab) + ")");
  }
  const int64_t prompt_len = static_cast<int64_t>(o.prompt.size());
  if (prompt_len + o.max_new_tokens > m.max_seq_len) {
    throw std::invalid_argument("prompt + new tokens exceed the model's capacity of " +
                                std::to_string(m.max_seq_len) + " positions");
  }

  Ort::Env env(ORT_LOGGING_LEVEL_ERROR, "dsv4_generate");
  Ort::SessionOptions so;
  if (o.threads > 0) so.SetIntraOpNumThreads(o.threads);
  // The library reads DSV4_ORT_ISA / DSV4_ORT_KERNELS from the environment here, when it is registered.
  so.RegisterCustomOpsLibrary(o.library.c_str());
  Ort::Session session(env, (dir + o.model_file).c_str(), so);
  CheckAgainstSession(m, session);

  Ort::MemoryInfo cpu = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
  Ort::IoBinding io(session);

  // State: allocated and bound once, as both past.X and present.X (same OrtValue, so onnxruntime writes in place).
  for (auto& s : m.state) {
    size_t alloc = (s.bytes + 63) / 64 * 64;  // aligned_alloc needs a multiple of the alignment
    s.data.reset(std::aligned_alloc(64, alloc));
    if (!s.data) throw std::runtime_error("out of memory for state tensor " + s.input);
    std::memset(s.data.get(), 0, alloc);
    s.value = Ort::Value::CreateTensor(cpu, s.data.get(), s.bytes, s.shape.data(), s.shape.size(), s.type->onnx);
    io.BindInput(s.input.c_str(), s.value);
    io.BindOutput(s.output.c_str(), s.value);
  }
  // start_pos [1]: bound once over this variable, which is updated before each run.
  int64_t start_pos = 0;
  const int64_t one = 1;
  Ort::Value start_value = Ort::Value::CreateTensor<int64_t>(cpu, &start_pos, 1, &one, 1);
  io.BindInput("start_pos", start_value);

  // input_ids and logits change shape between prefill ([1, S]) and decode ([1, 1]): rebound per run over buffers
  // sized for the prompt.
  std::vector<int64_t> ids(o.prompt.begin(), o.prompt.end());
  std::vector<float> logits(static_cast<size_t>((m.logits_all ? prompt_len : 1) * m.vocab));
  Ort::RunOptions run_options;

  // One forward of ids[0:n] at start_pos; returns the last position's logits row.
  auto forward = [&](int64_t n) -> const float* {
    const int64_t ids_shape[2] = {1, n};
    Ort::Value ids_value = Ort::Value::CreateTensor<int64_t>(cpu, ids.data(), static_cast<size_t>(n), ids_shape, 2);
    const int64_t rows = m.logits_all ? n : 1;
    const int64_t logits_shape[3] = {1, rows, m.vocab};
    Ort::Value logits_value = Ort::Value::CreateTensor<float>(cpu, logits.data(), static_cast<size_t>(rows * m.vocab),
                                                              logits_shape, 3);
    io.BindInput("input_ids", ids_value);
    io.BindOutput("logits", logits_value);
    session.Run(run_options, io);
    start_pos += n;
    return logits.data() + (rows - 1) * m.vocab;
  };

  using Clock = std::chrono::steady_clock;
  std::vector<int64_t> out;
  auto t0 = Clock::now();
  const float* row = forward(prompt_len);
  auto t1 = Clock::now();
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    int64_t tok = Argmax(row, m.vocab);
    out.push_back(tok);
    if (i + 1 == o.max_new_tokens) break;
    ids[0] = tok;
    row = forward(1);
  }
  auto t2 = Clock::now();

  std::cout << "tokens:";
  for (int64_t t : out) std::cout << ' ' << t;
  std::cout << '\n';
  auto report = [](const char* what, int64_t n, Clock::duration d) {
    double ms = std::chrono::duration<double, std::milli>(d).count();
    std::printf("%s: %lld tokens, %.3f ms, %.2f tokens/s\n", what, static_cast<long long>(n), ms,
                ms > 0 ? n * 1000.0 / ms : 0.0);
  };
  std::cout.flush();
  report("prefill", prompt_len, t1 - t0);
  report("decode", out.empty() ? 0 : static_cast<int64_t>(out.size()) - 1, t2 - t1);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(ParseArgs(argc, argv));
  } catch (const Ort::Exception& e) {
    std::cerr << "dsv4_generate: onnxruntime: " << e.what() << '\n';
  } catch (const std::exception& e) {
    std::cerr << "dsv4_generate: " << e.what() << '\n';
  }
  return 2;
}
