// LibraryInfo: reports, as JSON, what this library was built with and what it chose on this CPU for the session
// that runs it (after the DSV4_ORT_ISA cap). `dsv4-ort info` and the tests read it through a one-node model, so
// the answer comes from the library itself rather than from a re-implementation of the probe.
#include <sstream>

#include "op_table_gen.h"
#include "ops/kernel_api.h"
#include "platform/resident_weights.h"

namespace dsv4::glue {
namespace {

class LibraryInfoKernel final : public Kernel {
 public:
  explicit LibraryInfoKernel(const KernelInit& init) : isa_(init.isa), tables_(init.tables) {}

  void Compute(ComputeContext& ctx) override {
    const CpuFeatures& f = GetCpuFeatures();
    std::ostringstream js;
    auto flag = [&](const char* name, bool v, bool last = false) {
      js << '"' << name << "\": " << (v ? "true" : "false") << (last ? "" : ", ");
    };
    js << "{\"domain\": \"" << optable::kDomain << "\", \"op_table_version\": " << optable::kTableVersion
       << ", \"ort_api_version\": " << optable::kOrtApiVersion << ", \"num_ops\": " << optable::kNumOps
       << ", \"ops\": [";
    for (int i = 0; i < optable::kNumOps; ++i) js << (i ? ", " : "") << '"' << optable::kOps[i].name << '"';
    js << "], \"kernels\": [";
    int num_kernels = 0;
    const KernelRegistration* kernels = AllKernels(&num_kernels);
    for (int i = 0; i < num_kernels; ++i) js << (i ? ", " : "") << '"' << kernels[i].op_name << '"';
    js << "], \"isa_max\": \"" << IsaName(MaxSupportedIsa()) << "\", \"isa\": \"" << IsaName(isa_)
       << "\", \"features\": {";
    flag("avx2", f.avx2);
    flag("fma", f.fma);
    flag("f16c", f.f16c);
    flag("avx512f", f.avx512f);
    flag("avx512bw", f.avx512bw);
    flag("avx512vl", f.avx512vl);
    flag("avx512dq", f.avx512dq);
    flag("avx512_bf16", f.avx512_bf16);
    flag("avx512_vnni", f.avx512_vnni);
    flag("amx_tile", f.amx_tile);
    flag("amx_bf16", f.amx_bf16);
    flag("amx_int8", f.amx_int8);
    flag("os_avx", f.os_avx);
    flag("os_avx512", f.os_avx512);
    flag("os_amx", f.os_amx);
    flag("amx_permitted", f.amx_permitted, true);
    js << "}, \"families\": {";
    const auto families = DescribeFamilies(*tables_);
    for (size_t i = 0; i < families.size(); ++i) {
      js << (i ? ", " : "") << '"' << families[i].family << "\": \"" << IsaName(families[i].level) << '"';
    }
    js << "}, \"family_source\": {";
    for (size_t i = 0; i < families.size(); ++i) {
      js << (i ? ", " : "") << '"' << families[i].family << "\": \"" << LevelSourceName(families[i].source) << '"';
    }
    js << "}, \"batch_invariant_rows\": " << tables_->invariant_rows;
    js << ", \"weight_prefetch\": " << (tables_->weight_prefetch ? "true" : "false")
       << ", \"weight_prefetch_source\": \"" << LevelSourceName(tables_->prefetch_source) << '"';
    js << ", \"bf16_dot\": " << (tables_->bf16_dot ? "true" : "false") << ", \"bf16_dot_source\": \""
       << LevelSourceName(tables_->bf16_dot_source) << '"';
    js << ", \"resident_weights\": {\"policy\": \"" << ResidentPolicyName(ResidentPolicyFromEnv())
       << "\", \"huge_pages_offered\": " << (HugePagesOffered() ? "true" : "false")
       << ", \"min_bytes\": " << kResidentMinBytes << ", \"bytes_now\": " << ResidentBytes() << '}';
    js << ", \"cpu\": {\"vendor\": \"" << f.vendor << "\", \"family\": " << f.family << ", \"model\": " << f.model
       << "}}";
    ctx.OutputStrings(0, {js.str()});
  }

 private:
  IsaLevel isa_;
  const KernelTables* tables_;
};

}  // namespace

std::unique_ptr<Kernel> MakeLibraryInfo(const KernelInit& init) { return std::make_unique<LibraryInfoKernel>(init); }

}  // namespace dsv4::glue
