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

namespace {
const KernelRegistration kRegistrations[] = {
    {"LibraryInfo", &MakeLibraryInfo},
    {"MoeRouteTopK", &MakeMoeRouteTopK},
    {"MoeRouteHash", &MakeMoeRouteHash},
    {"HcPre", &MakeHcPre},
    {"HcPost", &MakeHcPost},
    {"HcHead", &MakeHcHead},
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
