// Resident copies of large constant inputs (the weights) in anonymous memory backed by transparent huge pages.
//
// onnxruntime maps each external initializer from the data file with 4 KiB pages. A decode step streams every weight
// once, so each 4 KiB of weights costs a TLB miss, and under virtualisation a miss is a two-level page walk. Copied
// once into 2 MiB-aligned anonymous memory advised MADV_HUGEPAGE, the same bytes stream like the machine's read
// roof: AMD EPYC family 0x19 model 0x11 (a VM), two threads reading 512 MiB of bf16 rows, 4 KiB pages 37-56 GB/s
// against 57-63 GB/s on huge pages, measured alternately. The copy is exact (a byte copy), so results do not change.
//
// Policy (DSV4_ORT_RESIDENT_WEIGHTS): "auto" (default) copies a constant input of at least kResidentMinBytes when
// the kernel offers transparent huge pages to madvised memory and the copy leaves a quarter of the machine's memory
// available (MemAvailable of /proc/meminfo, read per copy); "1" copies whenever the input is large enough, "0"
// never. Where no copy is made the input is used where onnxruntime put it, as before. After copying, the source
// range is advised MADV_COLD: its page-cache pages stay (a restart finds the model file cached) but are the first
// reclaimed when memory runs short, so the resident copy does not keep two hot copies of the weights.
//
// Built at the baseline; no ISA code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace dsv4 {

constexpr size_t kResidentMinBytes = size_t{1} << 20;

enum class ResidentPolicy { kOff, kAuto, kOn };

// The policy of DSV4_ORT_RESIDENT_WEIGHTS (read at each call: sessions created later see a change). Throws
// std::invalid_argument naming the variable for any other value.
ResidentPolicy ResidentPolicyFromEnv();

struct ResidentRegion;

// One constant input's copy (or none). Copies are shared: kernels adopting the same source (an initializer that
// several nodes of a session read) hold one copy, freed with the last of them.
class ResidentCopy {
 public:
  ResidentCopy();
  ResidentCopy(ResidentCopy&&) noexcept;
  ResidentCopy& operator=(ResidentCopy&&) noexcept;
  ResidentCopy(const ResidentCopy&) = delete;
  ResidentCopy& operator=(const ResidentCopy&) = delete;
  ~ResidentCopy();

  // Copies `bytes` at `src` (or shares an existing copy of it) if the policy allows (see above); false when it
  // keeps no copy. Throws std::bad_alloc only from bookkeeping; a failed mapping just keeps no copy.
  bool Adopt(const void* src, size_t bytes, ResidentPolicy policy);

  // The copy's address for `data` == the adopted source, else `data` itself.
  const void* Map(const void* data) const { return data != nullptr && data == src_ ? copy_ : data; }

 private:
  std::shared_ptr<ResidentRegion> region_;
  const void* src_ = nullptr;
  const void* copy_ = nullptr;
};

// Bytes held in resident copies by this process now (all sessions), for LibraryInfo and the tests.
uint64_t ResidentBytes();

// Whether the kernel gives transparent huge pages to madvised anonymous memory (what "auto" requires).
bool HugePagesOffered();

// "off", "auto" or "on".
const char* ResidentPolicyName(ResidentPolicy policy);

}  // namespace dsv4
