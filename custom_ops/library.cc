// Library entry point: RegisterCustomOps, the only exported symbol (exports.lds).
//
// ONNX Runtime calls it once per SessionOptions that registers the library. It initialises the C API at the
// table's pinned version (21 = ONNX Runtime 1.21: older runtimes get a readable error instead of a crash), reads
// DSV4_ORT_ISA to cap the ISA level, DSV4_ORT_KERNELS to force families to levels (kernel_tables.h, MakePlan) and
// DSV4_ORT_BATCH_INVARIANT for the batch-invariance bound (FamilyPlan::invariant_rows), and adds the domain holding that plan's ops. Domains and op objects are created once per distinct plan and live
// until the process exits, since every session that used them must outlive nothing they own.
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "op_table_gen.h"
#include "ops/custom_op.h"

namespace dsv4::glue {
namespace {

struct PlanDomain {
  FamilyPlan plan;
  OrtCustomOpDomain* domain = nullptr;
  std::vector<std::unique_ptr<TableOp>> ops;
};

std::mutex g_mutex;
std::vector<std::unique_ptr<PlanDomain>> g_domains;  // one per distinct plan (a few at most)

std::string ValidIsaNames() {
  std::string s;
  for (int l = 0; l < kNumIsaLevels; ++l) s += std::string(l ? ", " : "") + IsaName(static_cast<IsaLevel>(l));
  return s;
}

// The level sessions registered now will use: min(CPU maximum, DSV4_ORT_ISA).
IsaLevel EffectiveIsa() {
  IsaLevel level = MaxSupportedIsa();
  const char* env = std::getenv("DSV4_ORT_ISA");
  if (env != nullptr && *env != '\0') {
    IsaLevel cap;
    if (!ParseIsa(env, &cap)) {
      Fail("DSV4_ORT_ISA='", env, "' is not a valid ISA level; valid values: ", ValidIsaNames());
    }
    if (static_cast<int>(cap) < static_cast<int>(level)) level = cap;
  }
  return level;
}

// DSV4_ORT_BATCH_INVARIANT: the row bound of batch invariance (kernels/linear.h, WeightView::invariant_rows);
// unset, empty or 0: off.
int64_t InvariantRows() {
  const char* env = std::getenv("DSV4_ORT_BATCH_INVARIANT");
  if (env == nullptr || *env == '\0') return 0;
  int64_t rows = 0;
  for (const char* c = env; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9' || rows > (int64_t{1} << 40)) {
      Fail("DSV4_ORT_BATCH_INVARIANT='", env, "' is not a row count (a non-negative integer; 0 turns it off)");
    }
    rows = rows * 10 + (*c - '0');
  }
  return rows;
}

OrtStatus* Register(OrtSessionOptions* options) {
  const char* forced = std::getenv("DSV4_ORT_KERNELS");
  FamilyPlan plan = MakePlan(EffectiveIsa(), forced != nullptr && *forced != '\0' ? forced : nullptr);
  plan.invariant_rows = InvariantRows();
  std::lock_guard<std::mutex> lock(g_mutex);
  PlanDomain* found = nullptr;
  for (auto& d : g_domains)
    if (d->plan == plan) found = d.get();
  if (found == nullptr) {
    g_domains.push_back(std::make_unique<PlanDomain>());
    found = g_domains.back().get();
    found->plan = plan;
  }
  PlanDomain& d = *found;
  if (d.domain == nullptr) {
    std::vector<std::unique_ptr<TableOp>> ops = BuildTableOps(plan);
    OrtCustomOpDomain* domain = nullptr;
    if (OrtStatus* s = Api().CreateCustomOpDomain(optable::kDomain, &domain)) return s;
    for (auto& op : ops) {
      if (OrtStatus* s = Api().CustomOpDomain_Add(domain, op.get())) {
        Api().ReleaseCustomOpDomain(domain);
        return s;
      }
    }
    d.domain = domain;
    d.ops = std::move(ops);
  }
  return Api().AddCustomOpDomain(options, d.domain);
}

}  // namespace
}  // namespace dsv4::glue

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  using namespace dsv4::glue;
  const OrtApi* api = api_base->GetApi(dsv4::optable::kOrtApiVersion);
  if (api == nullptr) {
    // GetApi(1) exists in every release; use it only to report the mismatch.
    const OrtApi* any = api_base->GetApi(1);
    std::string msg = std::string("dsv4_ort custom-op library needs ONNX Runtime API version ") +
                      std::to_string(dsv4::optable::kOrtApiVersion) + " (onnxruntime >= 1." +
                      std::to_string(dsv4::optable::kOrtApiVersion) + "), but this runtime is " +
                      api_base->GetVersionString();
    return any != nullptr ? any->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  // Once per process (one onnxruntime per process): kernels of earlier sessions may be reading the API pointer.
  static std::once_flag api_once;
  std::call_once(api_once, [&] {
    SetApi(api);
    SetRuntimeVersion(api_base->GetVersionString());
  });
  try {
    return Register(options);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string("dsv4_ort: ") + e.what()).c_str());
  } catch (...) {
    return api->CreateStatus(ORT_FAIL, "dsv4_ort: unknown error while registering custom ops");
  }
}
