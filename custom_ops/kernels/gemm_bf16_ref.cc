// Scalar reference for the bf16 GEMM (gemm_bf16.h): C[m][n] = sum_k A[m][k] * B[n][k], each product and each
// partial sum rounded to fp32, k in increasing order, starting from +0. This is the spec the AMX tables are tested
// against. Its packed weight is simply B with the row stride removed ([N, K] contiguous). Baseline ISA.
#include <cstring>

#include "custom_ops/kernels/gemm_bf16.h"
#include "custom_ops/numerics/bf16.h"

namespace dsv4 {
namespace ref {
namespace {

size_t PackedBSize(size_t n, size_t k) { return n * k * sizeof(uint16_t); }

void PackB(const uint16_t* b, size_t ldb, size_t n, size_t k, void* packed) {
  uint16_t* out = static_cast<uint16_t*>(packed);
  for (size_t j = 0; j < n; ++j) std::memcpy(out + j * k, b + j * ldb, k * sizeof(uint16_t));
}

void Gemm(const uint16_t* a, size_t lda, const void* packed_b, size_t m, size_t n, size_t k, float* c, size_t ldc,
          const Parallel& par) {
  const uint16_t* b = static_cast<const uint16_t*>(packed_b);
  const size_t chunks = static_cast<size_t>(par.num_threads > 1 ? 4 * par.num_threads : 1);
  par.ForRange(m, chunks, [&](size_t row_begin, size_t row_end) {
    for (size_t i = row_begin; i < row_end; ++i) {
      for (size_t j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (size_t p = 0; p < k; ++p) {
          const float prod = Bf16ToF32(a[i * lda + p]) * Bf16ToF32(b[j * k + p]);
          acc += prod;
        }
        c[i * ldc + j] = acc;
      }
    }
  });
}

}  // namespace

extern const GemmBf16Kernels kGemmBf16 = {PackedBSize, PackB, Gemm};

}  // namespace ref
}  // namespace dsv4
