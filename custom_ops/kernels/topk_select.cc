// Radix top-k selection (topk_select.h). Baseline ISA.
#include "custom_ops/kernels/topk_select.h"

#include <cstring>

#include "custom_ops/platform/thread_scratch.h"

namespace dsv4 {
namespace {

// Unsigned key in score order: NaN -> 0xFFFFFFFF, -0 -> +0, negatives below positives.
uint32_t OrderKey(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;  // NaN
  if (bits == 0x80000000u) bits = 0;                             // -0 == +0
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct Level {
  int shift, bits;
};
constexpr Level kLevels[3] = {{21, 11}, {10, 11}, {0, 10}};

}  // namespace

void SelectTopKRadix(const float* score, int64_t n, int64_t k, int64_t* out) {
  if (k <= 0) return;
  const size_t n_sz = static_cast<size_t>(n), k_sz = static_cast<size_t>(k);
  // scratch: keys [n] | sort buffers 2 x [k] (key, index) | histogram [2048]
  unsigned char* mem = static_cast<unsigned char*>(
      ThreadScratch(3, n_sz * 4 + 2 * k_sz * 12 + 2048 * 4 + 256));
  uint32_t* key = reinterpret_cast<uint32_t*>(mem);
  // Each int64 run starts 8-byte aligned: key counts are rounded up to even (the 256 bytes of slack cover it).
  uint32_t* sel_key = key + ((n_sz + 1) & ~size_t{1});
  int64_t* sel_idx = reinterpret_cast<int64_t*>(sel_key + ((k_sz + 1) & ~size_t{1}));
  uint32_t* tmp_key = reinterpret_cast<uint32_t*>(sel_idx + k_sz);
  int64_t* tmp_idx = reinterpret_cast<int64_t*>(tmp_key + ((k_sz + 1) & ~size_t{1}));
  uint32_t* hist = reinterpret_cast<uint32_t*>(tmp_idx + k_sz);
  for (int64_t i = 0; i < n; ++i) key[i] = OrderKey(score[i]);

  // Radix select: after the loop, keys > threshold number `above` (< k) and the k-th largest key is `threshold`.
  uint32_t prefix = 0, prefix_mask = 0;
  int64_t need = k;  // winners still to place among the keys matching prefix
  for (const Level& lv : kLevels) {
    const uint32_t bins = 1u << lv.bits;
    std::memset(hist, 0, sizeof(uint32_t) * bins);
    for (int64_t i = 0; i < n; ++i) {
      if ((key[i] & prefix_mask) == prefix) ++hist[(key[i] >> lv.shift) & (bins - 1)];
    }
    uint32_t b = bins;
    while (b > 0) {
      --b;
      if (static_cast<int64_t>(hist[b]) >= need) break;
      need -= hist[b];
    }
    prefix |= b << lv.shift;
    prefix_mask |= (bins - 1) << lv.shift;
  }
  const uint32_t threshold = prefix;  // all 32 bits fixed; `need` winners equal it, k - need are above it

  // Collect in index order: everything above the threshold, and the first `need` equal to it.
  size_t m = 0;
  int64_t equal_left = need;
  for (int64_t i = 0; i < n; ++i) {
    if (key[i] > threshold || (key[i] == threshold && equal_left-- > 0)) {
      sel_key[m] = key[i];
      sel_idx[m] = i;
      ++m;
    }
  }

  // Stable LSD radix sort by key, descending (bytes of ~key ascending).
  uint32_t* src_k = sel_key;
  int64_t* src_i = sel_idx;
  uint32_t* dst_k = tmp_key;
  int64_t* dst_i = tmp_idx;
  for (int shift = 0; shift < 32; shift += 8) {
    uint32_t count[257] = {};
    bool trivial = true;
    const uint32_t first = (~src_k[0] >> shift) & 0xffu;
    for (size_t i = 0; i < m; ++i) {
      const uint32_t d = (~src_k[i] >> shift) & 0xffu;
      ++count[d + 1];
      trivial &= d == first;
    }
    if (trivial) continue;  // one digit value: the pass would not move anything
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (size_t i = 0; i < m; ++i) {
      const uint32_t d = (~src_k[i] >> shift) & 0xffu;
      const uint32_t pos = count[d]++;
      dst_k[pos] = src_k[i];
      dst_i[pos] = src_i[i];
    }
    uint32_t* tk = src_k;
    src_k = dst_k;
    dst_k = tk;
    int64_t* ti = src_i;
    src_i = dst_i;
    dst_i = ti;
  }
  std::memcpy(out, src_i, sizeof(int64_t) * m);
}

}  // namespace dsv4
