// Resident copies (platform/resident_weights.cc): a copy is exact, Map swaps only the adopted source, adopting the
// same source again shares one copy, small inputs and the "off" policy keep none, and the bytes are counted while
// a copy lives.
#include <cstdint>
#include <cstring>
#include <vector>

#include "kt.h"
#include "platform/resident_weights.h"

namespace {

KT_TEST(resident_weights_copy_map_share_free) {
  using dsv4::ResidentCopy;
  using dsv4::ResidentPolicy;
  const uint64_t base = dsv4::ResidentBytes();
  std::vector<uint8_t> src(3 * dsv4::kResidentMinBytes + 123);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
  {
    ResidentCopy a;
    KT_CHECK(a.Adopt(src.data(), src.size(), ResidentPolicy::kOn));
    const void* copy = a.Map(src.data());
    KT_CHECK(copy != src.data());
    KT_CHECK(reinterpret_cast<uintptr_t>(copy) % (2u << 20) == 0) << "the copy starts on a huge-page boundary";
    KT_CHECK(std::memcmp(copy, src.data(), src.size()) == 0);
    KT_CHECK(a.Map(src.data() + 1) == src.data() + 1) << "only the adopted address maps";
    KT_CHECK(a.Map(nullptr) == nullptr);
    KT_CHECK(dsv4::ResidentBytes() == base + src.size());
    ResidentCopy b;
    KT_CHECK(b.Adopt(src.data(), src.size(), ResidentPolicy::kOn));
    KT_CHECK(b.Map(src.data()) == copy) << "a second adopter shares the copy";
    KT_CHECK(dsv4::ResidentBytes() == base + src.size());
    ResidentCopy moved(static_cast<ResidentCopy&&>(a));
    KT_CHECK(moved.Map(src.data()) == copy && a.Map(src.data()) == src.data());
  }
  KT_CHECK(dsv4::ResidentBytes() == base) << "freed with the last holder";

  ResidentCopy off, small;
  KT_CHECK(!off.Adopt(src.data(), src.size(), ResidentPolicy::kOff));
  KT_CHECK(off.Map(src.data()) == src.data());
  KT_CHECK(!small.Adopt(src.data(), dsv4::kResidentMinBytes - 1, ResidentPolicy::kOn));
  KT_CHECK(small.Map(src.data()) == src.data());
  KT_CHECK(dsv4::ResidentBytes() == base);
}

}  // namespace
