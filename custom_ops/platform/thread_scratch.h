// Per-thread scratch memory for kernels: a buffer owned by the calling thread that is kept between calls, so a
// kernel called once per token does not map and fault in fresh pages every time (large malloc blocks come from
// mmap and go back to the system on free).
//
// Built at the baseline (thread_scratch.cc); ISA files call it, it never runs ISA code.
#pragma once

#include <cstddef>

namespace dsv4 {

// Slots let one thread hold several live buffers (a driver's shared arrays and a task's own workspace).
constexpr int kThreadScratchSlots = 4;

// A 64-byte aligned block of at least `bytes` for slot `slot` (< kThreadScratchSlots) of the calling thread. Valid
// until the next ThreadScratch call of this thread for the same slot; contents are not preserved when it grows.
// Freed when the thread exits. Throws std::bad_alloc when memory runs out.
void* ThreadScratch(int slot, size_t bytes);

}  // namespace dsv4
