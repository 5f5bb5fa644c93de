// ORT-free parallel-for handed to kernels.
//
// Inside ONNX Runtime it is backed by OrtApi::KernelContext_ParallelFor (the session's intra-op pool); in the C++
// kernel tests by a serial loop or std::threads. Kernels never create threads of their own and never use OpenMP,
// so a session's `intra_op_num_threads` is the only knob. Tasks are coarse: a kernel splits its work into
// `num_tasks` independent chunks (typically a few per thread) and must not assume any task order.
#pragma once

#include <cstddef>
#include <type_traits>

namespace dsv4 {

struct Parallel {
  using TaskFn = void (*)(void* arg, size_t task);
  using RunFn = void (*)(void* backend, size_t num_tasks, TaskFn fn, void* arg);

  void* backend = nullptr;
  RunFn run = nullptr;  // nullptr -> run serially on the calling thread
  int num_threads = 1;  // a hint for choosing the number of tasks

  // Calls f(task) for task in [0, num_tasks). f must be safe to call concurrently for distinct tasks.
  template <class F>
  void For(size_t num_tasks, F&& f) const {
    if (num_tasks == 0) return;
    if (run == nullptr || num_tasks == 1) {
      for (size_t i = 0; i < num_tasks; ++i) f(i);
      return;
    }
    using Fn = typename std::remove_reference<F>::type;
    run(backend, num_tasks, [](void* a, size_t i) { (*static_cast<Fn*>(a))(i); }, const_cast<void*>(static_cast<const void*>(&f)));
  }

  // Splits [0, n) into at most num_chunks contiguous ranges and calls f(begin, end) for each.
  template <class F>
  void ForRange(size_t n, size_t num_chunks, F&& f) const {
    if (n == 0) return;
    if (num_chunks < 1) num_chunks = 1;
    if (num_chunks > n) num_chunks = n;
    const size_t base = n / num_chunks, extra = n % num_chunks;
    For(num_chunks, [&](size_t c) {
      const size_t begin = c * base + (c < extra ? c : extra);
      const size_t end = begin + base + (c < extra ? 1 : 0);
      f(begin, end);
    });
  }
};

// A serial Parallel (used by tests and as the default).
inline Parallel SerialParallel() { return Parallel{}; }

}  // namespace dsv4
