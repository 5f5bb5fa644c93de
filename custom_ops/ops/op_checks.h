// Validation and state-buffer helpers shared by the attention-side op classes (norm_rope_op.cc, compressor_op.cc,
// indexer_op.cc, sparse_attention_op.cc), plus the overflow-checked dimension product every op class uses. Every
// failure throws OpError naming the input and the limit; the glue prefixes the op name.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "custom_ops/numerics/bf16.h"
#include "ops/kernel_api.h"

namespace dsv4::glue {

// Largest accepted position: start_pos + S must stay far from int64 overflow in index arithmetic.
constexpr int64_t kMaxPosition = int64_t{1} << 48;

// a * b for dimension arithmetic. An input may carry any dimension up to INT64_MAX when another of its dimensions
// is 0 (an empty tensor), and attributes are unbounded, so a product of a dimension with a factor can overflow:
// that is an error naming `what`, never undefined behaviour.
inline int64_t CheckedMul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) Fail(what, " = ", a, " * ", b, " overflows int64");
  return r;
}

// Product of shape[begin, end) (the whole shape by default). Any zero factor gives 0 (an empty tensor may carry
// huge dimensions beside its zero); otherwise an overflow is an error naming `what`.
inline int64_t ShapeProduct(const std::vector<int64_t>& shape, size_t begin, size_t end, const char* what) {
  for (size_t i = begin; i < end; ++i) {
    if (shape[i] == 0) return 0;
  }
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n = CheckedMul(n, shape[i], what);
  return n;
}
inline int64_t ShapeProduct(const std::vector<int64_t>& shape, const char* what) {
  return ShapeProduct(shape, 0, shape.size(), what);
}

inline void RequireShape(const InputView& t, const std::vector<int64_t>& want) {
  if (t.shape != want) Fail("input '", t.name, "' must have shape ", ShapeString(want), ", got ", ShapeString(t.shape));
}

// start_pos [batch], every value in [0, kMaxPosition - seq]. Returns the values.
inline const int64_t* CheckStartPos(const InputView& start_pos, int64_t batch, int64_t seq) {
  RequireShape(start_pos, {batch});
  const int64_t* sp = start_pos.as<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    if (sp[b] < 0) Fail("input 'start_pos'[", b, "]=", sp[b], " must be >= 0");
    if (sp[b] > kMaxPosition - seq) {
      Fail("input 'start_pos'[", b, "]=", sp[b], " exceeds the position limit ", kMaxPosition, " (minus ", seq,
           " new tokens)");
    }
  }
  return sp;
}

// inv_freq [half] with 2*half <= width (the rope channels are the last 2*half of `width`). Returns half.
inline int64_t CheckInvFreq(const InputView& inv_freq, int64_t width, const char* width_what) {
  const int64_t half = inv_freq.dim(0);
  if (2 * half > width) {
    Fail("input 'inv_freq' has ", half, " frequencies (", 2 * half, " rope channels) but ", width_what, " is only ",
         width);
  }
  return half;
}

// A float32 view of a float32 or bfloat16 vector input (absent -> nullptr).
class F32Vector {
 public:
  explicit F32Vector(const InputView& t) {
    if (!t.present) return;
    if (t.dtype == kBFloat16) {
      storage_.resize(static_cast<size_t>(t.numel));
      for (int64_t i = 0; i < t.numel; ++i) storage_[i] = Bf16ToF32(t.as<uint16_t>()[i]);
      data_ = storage_.data();
    } else {
      data_ = t.as<float>();
    }
  }
  const float* data() const { return data_; }

 private:
  std::vector<float> storage_;
  const float* data_ = nullptr;
};

// Makes `present` (an output of the same shape and type as `past`) hold past's contents. When the runtime bound one
// buffer to both (IOBinding with the same OrtValue) there is nothing to do and the call returns true: the kernel
// then updates the state in place. A present buffer that overlaps past without being the same buffer is an error.
inline bool PreparePresent(const InputView& past, void* present, const char* present_name) {
  const size_t bytes = static_cast<size_t>(past.numel) * ElementBytes(past.dtype);
  if (bytes == 0 || present == past.data) return true;
  const auto* a = static_cast<const unsigned char*>(past.data);
  const auto* p = static_cast<const unsigned char*>(present);
  if (p < a + bytes && a < p + bytes) {
    Fail("output '", present_name, "' partially overlaps input '", past.name, "'; bind the same buffer to both or ",
         "separate buffers");
  }
  std::memcpy(present, past.data, bytes);
  return false;
}

}  // namespace dsv4::glue
