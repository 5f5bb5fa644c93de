// AVX512 Compressor step (compressor.h) on 16-lane vectors; the algorithm is in compressor_simd.inc. Entries match
// compressor_ref.cc within a few fp32 ulps (bf16 entries: one bf16 ulp, rarely); the state is bit-identical.
#include "custom_ops/kernels/isa_prelude.h"

#include "custom_ops/kernels/compressor.h"
#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace avx512 {
namespace {

#include "custom_ops/kernels/simd_avx512.inc"

#include "custom_ops/kernels/compressor_simd.inc"

}  // namespace

const CompressorKernels kCompressor = {&StepF32, &StepBf16, &StepFp8};

}  // namespace avx512
}  // namespace dsv4
