// Per-thread scratch memory (thread_scratch.h). Baseline ISA.
#include "platform/thread_scratch.h"

#include <cstdlib>
#include <new>

namespace dsv4 {
namespace {

struct Slots {
  void* ptr[kThreadScratchSlots] = {};
  size_t size[kThreadScratchSlots] = {};
  ~Slots() {
    for (void* p : ptr) std::free(p);
  }
};

thread_local Slots slots;

}  // namespace

void* ThreadScratch(int slot, size_t bytes) {
  Slots& s = slots;
  if (bytes <= s.size[slot] && s.ptr[slot] != nullptr) return s.ptr[slot];
  std::free(s.ptr[slot]);
  s.ptr[slot] = nullptr;
  s.size[slot] = 0;
  // Grow geometrically so that slowly increasing sizes (a context growing token by token) reallocate rarely.
  size_t want = bytes + bytes / 4;
  want = (want + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(64, want);
  if (p == nullptr) throw std::bad_alloc();
  s.ptr[slot] = p;
  s.size[slot] = want;
  return p;
}

}  // namespace dsv4
