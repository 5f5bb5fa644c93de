// Permission to use AMX tile data (declared in platform/cpu_features.h).
//
// Linux keeps the 8 KiB XTILEDATA register state out of a process's signal frames and context switches until the
// process asks for it; the first tile instruction without permission raises SIGILL (seen in the wild as
// kvcache-ai/ktransformers#320). ARCH_REQ_XCOMP_PERM grants it to the whole process (every thread, present and
// future), and ARCH_GET_XCOMP_PERM confirms the grant. Note the codes: REQ is 0x1023, GET is 0x1022 (some public
// snippets swap them). Windows enables the state for every process when XCR0 has it, which the CPUID/XGETBV probe
// already checks. Other systems report false: their protocol is not implemented here.
//
// Built at the x86-64 baseline without LTO (custom_ops/CMakeLists.txt): this file runs before any ISA decision.
#include "platform/cpu_features.h"

#if defined(__linux__) && (defined(__x86_64__) || defined(__i386__))
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#endif

namespace dsv4 {
namespace {

bool AskOnce() {
#if defined(__linux__) && (defined(__x86_64__) || defined(__i386__))
  constexpr long kArchGetXcompPerm = 0x1022;
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;  // old kernel or no AMX
  uint64_t permitted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted) != 0) return false;
  return (permitted >> kXfeatureXtiledata) & 1u;
#elif defined(_WIN32) && (defined(_M_X64) || defined(__x86_64__))
  return true;
#else
  return false;
#endif
}

}  // namespace

bool RequestAmxPermission() {
  static const bool granted = AskOnce();  // thread-safe one-time initialisation
  return granted;
}

}  // namespace dsv4
