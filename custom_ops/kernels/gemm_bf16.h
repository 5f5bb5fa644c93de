// bf16 GEMM with fp32 output for Linear layers: y = x W^T.
//
//   C[m][n] = sum_k A[m][k] * B[n][k]        A = activations, B = the Linear weight in its checkpoint layout
//
// Products and sums are fp32 (bf16 x bf16 is exact in fp32 apart from range limits). The weight is repacked once
// (pack_b, when the model is loaded) into whatever layout the table's gemm wants; a packed buffer is only valid for the
// gemm of the SAME table that packed it (the reference keeps [N, K]; the AMX tables use a VNNI tile layout, see
// gemm_bf16_amx.cc). Tables:
//   ref      scalar, the spec: one fp32 sum per output, k in increasing order (gemm_bf16_ref.cc).
//   amx      AMX-BF16 tiles (TDPBF16PS), for prefill-sized M; needs AMX permission (gemm_bf16_amx.cc).
//   amx_emu  the same source on emulated tiles; test builds only (tests/custom_ops/amx_emulation.cmake).
// amx and amx_emu give bit-identical results. Versus ref they differ by accumulation order (two fp32 partial sums
// per 32-wide K block, see numerics/amx_tile.h) and by flushing denormal inputs/results to zero; the bound used
// by the tests is |amx - ref| <= 2 (K + 2) 2^-24 sum_k |A[m][k] B[n][k]| for finite, normal inputs.
//
// Shapes (bf16 = uint16_t bit patterns, row-major):
//   a         [M, K]   bf16, row stride lda >= K (elements)
//   b         [N, K]   bf16, row stride ldb >= K (elements)           (pack_b input only)
//   packed_b  packed_b_size(N, K) bytes, written by pack_b, 64-byte alignment recommended
//   c         [M, N]   fp32, row stride ldc >= N (elements), overwritten (not accumulated)
// M, N, K >= 0; K = 0 gives C = 0. Outputs must not alias inputs. gemm splits its work through `par`
// (blocks of rows x columns); it allocates nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "custom_ops/platform/parallel.h"

namespace dsv4 {

struct GemmBf16Kernels {
  // Size in bytes of the packed form of an [n, k] weight.
  size_t (*packed_b_size)(size_t n, size_t k);
  // Packs b [n, k] (row stride ldb) into packed (packed_b_size(n, k) bytes).
  void (*pack_b)(const uint16_t* b, size_t ldb, size_t n, size_t k, void* packed);
  // c [m, n] = a [m, k] x b^T, with b given in the packed form of this table.
  void (*gemm)(const uint16_t* a, size_t lda, const void* packed_b, size_t m, size_t n, size_t k, float* c,
               size_t ldc, const Parallel& par);
};

namespace ref {
extern const GemmBf16Kernels kGemmBf16;
}  // namespace ref

namespace amx {
extern const GemmBf16Kernels kGemmBf16;
}  // namespace amx

namespace amx_emu {
extern const GemmBf16Kernels kGemmBf16;
}  // namespace amx_emu

}  // namespace dsv4
