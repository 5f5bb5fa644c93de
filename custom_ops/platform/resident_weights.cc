// Resident copies of constant inputs (resident_weights.h).
#include "platform/resident_weights.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dsv4 {
namespace {

std::atomic<uint64_t> g_resident_bytes{0};  // bytes held in copies, all sessions

constexpr size_t kHugePage = size_t{2} << 20;

#if defined(__linux__)
// Whether the kernel gives transparent huge pages to madvised anonymous memory ("always" or "madvise" selected).
bool Offered() {
  static const bool offered = [] {
    FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (f == nullptr) return false;
    char buf[128] = {0};
    const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    const std::string s(buf, n);
    return s.find("[always]") != std::string::npos || s.find("[madvise]") != std::string::npos;
  }();
  return offered;
}

// MemTotal and MemAvailable of /proc/meminfo in bytes (0 when unreadable).
void MemInfo(uint64_t* total, uint64_t* available) {
  *total = *available = 0;
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return;
  char line[256];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long kb = 0;
    if (std::sscanf(line, "MemTotal: %llu kB", &kb) == 1) *total = kb * 1024;
    if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) *available = kb * 1024;
  }
  std::fclose(f);
}
#endif

}  // namespace

ResidentPolicy ResidentPolicyFromEnv() {
  const char* v = std::getenv("DSV4_ORT_RESIDENT_WEIGHTS");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return ResidentPolicy::kAuto;
  if (std::strcmp(v, "0") == 0) return ResidentPolicy::kOff;
  if (std::strcmp(v, "1") == 0) return ResidentPolicy::kOn;
  throw std::invalid_argument(std::string("DSV4_ORT_RESIDENT_WEIGHTS must be auto, 0 or 1, got '") + v + "'");
}

// One copy in huge-page memory; unmapped with its last holder.
struct ResidentRegion {
  void* copy = nullptr;
  size_t bytes = 0;   // bytes copied
  size_t mapped = 0;  // bytes mapped (rounded up to 2 MiB)

  ~ResidentRegion() {
#if defined(__linux__)
    if (copy != nullptr) {
      munmap(copy, mapped);
      g_resident_bytes.fetch_sub(bytes);
    }
#endif
  }
};

namespace {

// Live copies by source address (and size): a second kernel reading the same initializer shares the copy.
std::mutex g_registry_mutex;
std::map<std::pair<const void*, size_t>, std::weak_ptr<ResidentRegion>>& Registry() {
  static auto* registry = new std::map<std::pair<const void*, size_t>, std::weak_ptr<ResidentRegion>>();
  return *registry;
}

// A fresh copy of src in 2 MiB-aligned anonymous memory advised MADV_HUGEPAGE, or null if it cannot be mapped.
std::shared_ptr<ResidentRegion> MakeRegion(const void* src, size_t bytes) {
#if defined(__linux__)
  const size_t mapped = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  // Over-map by one huge page so the copy can start on a 2 MiB boundary (a huge page needs an aligned range).
  void* raw = mmap(nullptr, mapped + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > base) munmap(raw, aligned - base);
  const uintptr_t end = base + mapped + kHugePage;
  if (end > aligned + mapped) munmap(reinterpret_cast<void*>(aligned + mapped), end - (aligned + mapped));
  auto region = std::make_shared<ResidentRegion>();
  region->copy = reinterpret_cast<void*>(aligned);
  region->mapped = mapped;
  region->bytes = bytes;
  madvise(region->copy, mapped, MADV_HUGEPAGE);  // a hint: without huge pages the copy is still correct
  std::memcpy(region->copy, src, bytes);
  g_resident_bytes.fetch_add(bytes);
#ifdef MADV_COLD
  // the source's whole pages (a hint, never a change of contents)
  const uintptr_t s0 = (reinterpret_cast<uintptr_t>(src) + 4095) / 4096 * 4096;
  const uintptr_t s1 = (reinterpret_cast<uintptr_t>(src) + bytes) / 4096 * 4096;
  if (s1 > s0) madvise(reinterpret_cast<void*>(s0), s1 - s0, MADV_COLD);
#endif
  return region;
#else
  (void)src;
  (void)bytes;
  return nullptr;
#endif
}

}  // namespace

ResidentCopy::ResidentCopy() = default;
ResidentCopy::ResidentCopy(ResidentCopy&& o) noexcept { *this = static_cast<ResidentCopy&&>(o); }
// The moved-from copy maps nothing (its addresses would outlive the region it no longer holds).
ResidentCopy& ResidentCopy::operator=(ResidentCopy&& o) noexcept {
  if (this != &o) {
    region_ = std::move(o.region_);
    src_ = o.src_;
    copy_ = o.copy_;
    o.src_ = o.copy_ = nullptr;
  }
  return *this;
}
ResidentCopy::~ResidentCopy() = default;

bool ResidentCopy::Adopt(const void* src, size_t bytes, ResidentPolicy policy) {
  region_.reset();
  src_ = copy_ = nullptr;
  if (policy == ResidentPolicy::kOff || src == nullptr || bytes < kResidentMinBytes) return false;
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto& registry = Registry();
  const auto key = std::make_pair(src, bytes);
  auto it = registry.find(key);
  std::shared_ptr<ResidentRegion> region = it != registry.end() ? it->second.lock() : nullptr;
  if (region == nullptr) {
#if defined(__linux__)
    if (policy == ResidentPolicy::kAuto) {
      if (!Offered()) return false;
      uint64_t total = 0, available = 0;
      MemInfo(&total, &available);
      if (total == 0 || available < bytes || available - bytes < total / 4) return false;
    }
#endif
    region = MakeRegion(src, bytes);
    if (region == nullptr) return false;
    for (auto e = registry.begin(); e != registry.end();) e = e->second.expired() ? registry.erase(e) : std::next(e);
    registry[key] = region;
  }
  region_ = region;
  src_ = src;
  copy_ = region->copy;
  return true;
}

uint64_t ResidentBytes() { return g_resident_bytes.load(); }

bool HugePagesOffered() {
#if defined(__linux__)
  return Offered();
#else
  return false;
#endif
}

const char* ResidentPolicyName(ResidentPolicy policy) {
  switch (policy) {
    case ResidentPolicy::kOff: return "off";
    case ResidentPolicy::kAuto: return "auto";
    case ResidentPolicy::kOn: return "on";
  }
  return "auto";
}

}  // namespace dsv4
