// Per-call scratch for the Linear / MoE drivers (linear_fast.cc, moe_experts_fast.cc): one 64-byte-aligned
// allocation, released when the call returns. Baseline files only (it allocates; ISA files never do).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace dsv4 {

inline size_t RoundUp64(size_t bytes) { return (bytes + 63) / 64 * 64; }

class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t bytes) {
    if (bytes == 0) return;
    data_ = static_cast<uint8_t*>(std::aligned_alloc(64, RoundUp64(bytes)));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  uint8_t* bytes() const { return data_; }
  template <class T>
  T* as(size_t byte_offset = 0) const { return reinterpret_cast<T*>(data_ + byte_offset); }

 private:
  uint8_t* data_ = nullptr;
};

}  // namespace dsv4
