// The kernel class behind every op of the table. A table op without an entry here fails registration (and the
// op-table test); an entry without a table op is never reachable.
#include <cstring>

#include "ops/kernel_api.h"

namespace dsv4::glue {

std::unique_ptr<Kernel> MakeLibraryInfo(const KernelInit& init);
std::unique_ptr<Kernel> MakeMoeRouteTopK(const KernelInit& init);
std::unique_ptr<Kernel> MakeMoeRouteHash(const KernelInit& init);
std::unique_ptr<Kernel> MakeHcPre(const KernelInit& init);
std::unique_ptr<Kernel> MakeHcPost(const KernelInit& init);
std::unique_ptr<Kernel> MakeHcHead(const KernelInit& init);
std::unique_ptr<Kernel> MakeRmsNorm(const KernelInit& init);
std::unique_ptr<Kernel> MakeNormRope(const KernelInit& init);
std::unique_ptr<Kernel> MakeRope(const KernelInit& init);
std::unique_ptr<Kernel> MakeCompressor(const KernelInit& init);
std::unique_ptr<Kernel> MakeIndexer(const KernelInit& init);
std::unique_ptr<Kernel> MakeSparseAttention(const KernelInit& init);
std::unique_ptr<Kernel> MakeLinear(const KernelInit& init);
std::unique_ptr<Kernel> MakeLinearFp8(const KernelInit& init);
std::unique_ptr<Kernel> MakeLinearFp4(const KernelInit& init);
std::unique_ptr<Kernel> MakeMoeExperts(const KernelInit& init);
std::unique_ptr<Kernel> MakeMoeExpertsFp8(const KernelInit& init);
std::unique_ptr<Kernel> MakeMoeExpertsFp4(const KernelInit& init);

namespace {
const KernelRegistration kRegistrations[] = {
    {"LibraryInfo", &MakeLibraryInfo},
    {"MoeRouteTopK", &MakeMoeRouteTopK},
    {"MoeRouteHash", &MakeMoeRouteHash},
    {"HcPre", &MakeHcPre},
    {"HcPost", &MakeHcPost},
    {"HcHead", &MakeHcHead},
    {"RmsNorm", &MakeRmsNorm},
    {"NormRope", &MakeNormRope},
    {"Rope", &MakeRope},
    {"Compressor", &MakeCompressor},
    {"Indexer", &MakeIndexer},
    {"SparseAttention", &MakeSparseAttention},
    {"Linear", &MakeLinear},
    {"LinearFp8", &MakeLinearFp8},
    {"LinearFp4", &MakeLinearFp4},
    {"MoeExperts", &MakeMoeExperts},
    {"MoeExpertsFp8", &MakeMoeExpertsFp8},
    {"MoeExpertsFp4", &MakeMoeExpertsFp4},
};
}  // namespace

const KernelRegistration* FindKernel(const char* op_name) {
  for (const KernelRegistration& r : kRegistrations)
    if (std::strcmp(r.op_name, op_name) == 0) return &r;
  return nullptr;
}

const KernelRegistration* AllKernels(int* count) {
  *count = static_cast<int>(sizeof(kRegistrations) / sizeof(kRegistrations[0]));
  return kRegistrations;
}

}  // namespace dsv4::glue
