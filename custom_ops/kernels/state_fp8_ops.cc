// FP8-state readers and ring writer (state_fp8_ops.h). Baseline ISA: decode into scratch, then the level's kernel.
#include "custom_ops/kernels/state_fp8_ops.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "custom_ops/kernels/sparse_attention_keys.h"
#include "custom_ops/kernels/state_fp8.h"
#include "custom_ops/numerics/element.h"

namespace dsv4 {
namespace state_fp8 {
namespace {

void RunAttend(const SparseAttentionKernels& k, const float* q, const float* kv, const float* window,
               const float* entries, const int64_t* indices, const float* sink, const float* inv_freq,
               const int64_t* start_pos, const SparseAttentionDims& d, float scale, float* o, const Parallel& par) {
  k.attend_f32(q, kv, window, entries, indices, sink, inv_freq, start_pos, d, scale, o, par);
}
void RunAttend(const SparseAttentionKernels& k, const uint16_t* q, const uint16_t* kv, const uint16_t* window,
               const uint16_t* entries, const int64_t* indices, const float* sink, const float* inv_freq,
               const int64_t* start_pos, const SparseAttentionDims& d, float scale, uint16_t* o, const Parallel& par) {
  k.attend_bf16(q, kv, window, entries, indices, sink, inv_freq, start_pos, d, scale, o, par);
}

// Readers of state rows (row r of the [B * rows, ...] state) into T[D]: FP8 entries decoded exactly, float rows
// rounded to bf16.
struct Fp8StateRows {
  const uint8_t* base;
  int64_t dim, rope;
  template <class T>
  void Decode(int64_t r, T* dst) const { DecodeEntry(base + r * EntryBytes(dim, rope), dim, rope, dst); }
};
// dst[0, n) = bf16(src[0, n)) (numerics/bf16.h).
void RoundToBf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = F32ToBf16(src[i]);
}

struct F32StateRowsAsBf16 {
  const float* base;
  int64_t dim;
  void Decode(int64_t r, uint16_t* dst) const { RoundToBf16(base + r * dim, dim, dst); }
};

// Decodes the listed rows (state row, destination) on the pool, in a few chunks per thread.
template <class T, class Rows>
void DecodeRows(const Rows& rows, const std::vector<std::pair<int64_t, T*>>& jobs, const Parallel& par) {
  const size_t chunks = static_cast<size_t>(4 * (par.num_threads > 1 ? par.num_threads : 1));
  par.ForRange(jobs.size(), chunks, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) rows.Decode(jobs[i].first, jobs[i].second);
  });
}

// The level's kernel on the rows the call can read (the header's list), gathered by `rows` into T scratch.
template <class T, class Rows>
void AttendT(const SparseAttentionKernels& k, const T* q, const T* kv, const Rows& window, const Rows* entries,
             const int64_t* indices, const float* sink, const float* inv_freq, const int64_t* start_pos,
             const SparseAttentionDims& d, float scale, T* o, const Parallel& par) {
  const int64_t B = d.batch, S = d.seq, D = d.dim, n_win = d.window;
  // The ring: slots the chunk's first query can see (later queries see a subset of them).
  std::vector<T> win(static_cast<size_t>(B * n_win * D), T{});
  std::vector<std::pair<int64_t, T*>> jobs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p0 = start_pos[b];
    for (int64_t j = 0; j < n_win; ++j) {
      const int64_t rp = p0 - 1 - attn_keys::FloorMod(p0 - 1 - j, n_win);
      if (rp >= 0 && rp > p0 - n_win) jobs.emplace_back(b * n_win + j, win.data() + (b * n_win + j) * D);
    }
  }
  DecodeRows(window, jobs, par);
  SparseAttentionDims dd = d;
  std::vector<T> ent;
  std::vector<int64_t> remapped;
  const T* ent_ptr = nullptr;
  const int64_t* idx_ptr = nullptr;
  if (entries != nullptr && d.ratio > 0 && d.capacity > 0) {
    const int64_t N = d.capacity;
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(B));  // entry ids to decode, ascending, per row
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int64_t>& r = rows[b];
      if (indices == nullptr) {
        const int64_t visible = std::min((start_pos[b] + S) / d.ratio, N);
        for (int64_t i = 0; i < visible; ++i) r.push_back(i);
        continue;
      }
      for (int64_t s = 0; s < S; ++s) {
        const int64_t visible = std::min((start_pos[b] + s + 1) / d.ratio, N);
        const int64_t* sel = indices + (b * S + s) * d.topk;
        for (int64_t t = 0; t < d.topk; ++t)
          if (sel[t] >= 0 && sel[t] < visible) r.push_back(sel[t]);
      }
      std::sort(r.begin(), r.end());
      r.erase(std::unique(r.begin(), r.end()), r.end());
    }
    int64_t used = 0;
    for (const auto& r : rows) used = std::max<int64_t>(used, static_cast<int64_t>(r.size()));
    if (indices != nullptr) {
      // Selections renumbered to their rank among the row's decoded entries; invisible ones dropped (-1).
      remapped.assign(static_cast<size_t>(B * S * d.topk), -1);
      for (int64_t b = 0; b < B; ++b) {
        const std::vector<int64_t>& r = rows[b];
        for (int64_t s = 0; s < S; ++s) {
          const int64_t visible = std::min((start_pos[b] + s + 1) / d.ratio, N);
          const int64_t base = (b * S + s) * d.topk;
          for (int64_t t = 0; t < d.topk; ++t) {
            const int64_t i = indices[base + t];
            if (i >= 0 && i < visible) remapped[base + t] = std::lower_bound(r.begin(), r.end(), i) - r.begin();
          }
        }
      }
      idx_ptr = remapped.data();
    }
    ent.assign(static_cast<size_t>(B * used * D), T{});
    jobs.clear();
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<int64_t>& r = rows[b];
      for (size_t u = 0; u < r.size(); ++u) {
        jobs.emplace_back(b * N + r[u], ent.data() + (b * used + static_cast<int64_t>(u)) * D);
      }
    }
    DecodeRows(*entries, jobs, par);
    dd.capacity = used;
    if (used > 0) ent_ptr = ent.data();
    if (used == 0) {
      dd.capacity = 0;
      idx_ptr = nullptr;
      dd.topk = 0;
    }
  } else {
    dd.capacity = 0;
    dd.topk = 0;
  }
  RunAttend(k, q, kv, win.data(), ent_ptr, idx_ptr, sink, inv_freq, start_pos, dd, scale, o, par);
}

template <class T>
void WindowWriteT(const T* kv, const int64_t* start_pos, const SparseAttentionDims& d, uint8_t* window) {
  const int64_t D = d.dim, rope = 2 * d.half, row_bytes = EntryBytes(D, rope);
  std::vector<float> x(static_cast<size_t>(D));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t t = std::max<int64_t>(0, d.seq - d.window); t < d.seq; ++t) {
      const int64_t slot = (start_pos[b] + t) % d.window;
      const T* src = kv + (b * d.seq + t) * D;
      for (int64_t i = 0; i < D; ++i) x[i] = ToF32(src[i]);
      EncodeEntry(x.data(), D, rope, window + (b * d.window + slot) * row_bytes);
    }
  }
}

template <class T>
void IndexerT(const IndexerKernels& k, const T* q, const float* weights, const uint8_t* keys,
              const int64_t* start_pos, const IndexerDims& d, int64_t* indices, const Parallel& par) {
  const int64_t B = d.batch, cI = d.head_dim, row_bytes = IndexKeyBytes(cI);
  int64_t used = 0;
  for (int64_t b = 0; b < B; ++b) used = std::max(used, std::min((start_pos[b] + d.seq) / d.ratio, d.capacity));
  std::vector<T> dec(static_cast<size_t>(std::max<int64_t>(1, B * used) * cI), T{});
  for (int64_t b = 0; b < B; ++b) {
    const int64_t visible = std::min((start_pos[b] + d.seq) / d.ratio, d.capacity);
    for (int64_t i = 0; i < visible; ++i) {
      DecodeIndexKey(keys + (b * d.capacity + i) * row_bytes, cI, dec.data() + (b * used + i) * cI);
    }
  }
  IndexerDims dd = d;
  dd.capacity = used;
  if constexpr (sizeof(T) == sizeof(float)) {
    k.topk_f32(q, weights, dec.data(), start_pos, dd, indices, par);
  } else {
    k.topk_bf16(q, weights, dec.data(), start_pos, dd, indices, par);
  }
}

}  // namespace

void Attend(const SparseAttentionKernels& k, bool bf16, const void* q, const void* kv, const uint8_t* window,
            const uint8_t* entries, const int64_t* indices, const float* sink, const float* inv_freq,
            const int64_t* start_pos, const SparseAttentionDims& d, float scale, void* o, const Parallel& par) {
  const int64_t rope = 2 * d.half;
  const Fp8StateRows win{window, d.dim, rope}, ent{entries, d.dim, rope};
  const Fp8StateRows* ent_rows = entries != nullptr ? &ent : nullptr;
  if (bf16) {
    AttendT(k, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(kv), win, ent_rows, indices, sink,
            inv_freq, start_pos, d, scale, static_cast<uint16_t*>(o), par);
  } else {
    AttendT(k, static_cast<const float*>(q), static_cast<const float*>(kv), win, ent_rows, indices, sink, inv_freq,
            start_pos, d, scale, static_cast<float*>(o), par);
  }
}

void AttendBf16Products(const SparseAttentionKernels& k, const float* q, const float* kv, const void* window,
                        const void* entries, bool fp8_state, const int64_t* indices, const float* sink,
                        const float* inv_freq, const int64_t* start_pos, const SparseAttentionDims& d, float scale,
                        float* o, const Parallel& par) {
  const size_t nq = static_cast<size_t>(d.batch * d.seq * d.heads * d.dim);
  const size_t nkv = static_cast<size_t>(d.batch * d.seq * d.dim);
  std::vector<uint16_t> qb(nq), kvb(nkv), ob(nq);
  const size_t chunks = static_cast<size_t>(4 * (par.num_threads > 1 ? par.num_threads : 1)), piece = 4096;
  par.ForRange((nq + piece - 1) / piece, chunks, [&](size_t begin, size_t end) {
    const size_t lo = begin * piece, hi = std::min(end * piece, nq);
    RoundToBf16(q + lo, static_cast<int64_t>(hi - lo), qb.data() + lo);
  });
  RoundToBf16(kv, static_cast<int64_t>(nkv), kvb.data());
  if (fp8_state) {
    const int64_t rope = 2 * d.half;
    const Fp8StateRows win{static_cast<const uint8_t*>(window), d.dim, rope},
        ent{static_cast<const uint8_t*>(entries), d.dim, rope};
    AttendT(k, qb.data(), kvb.data(), win, entries != nullptr ? &ent : nullptr, indices, sink, inv_freq, start_pos, d,
            scale, ob.data(), par);
  } else {
    const F32StateRowsAsBf16 win{static_cast<const float*>(window), d.dim},
        ent{static_cast<const float*>(entries), d.dim};
    AttendT(k, qb.data(), kvb.data(), win, entries != nullptr ? &ent : nullptr, indices, sink, inv_freq, start_pos, d,
            scale, ob.data(), par);
  }
  par.ForRange((nq + piece - 1) / piece, chunks, [&](size_t begin, size_t end) {
    for (size_t i = begin * piece, hi = std::min(end * piece, nq); i < hi; ++i) o[i] = Bf16ToF32(ob[i]);
  });
}

void WindowWrite(const void* kv, bool bf16, const int64_t* start_pos, const SparseAttentionDims& d,
                 uint8_t* window) {
  if (bf16) {
    WindowWriteT(static_cast<const uint16_t*>(kv), start_pos, d, window);
  } else {
    WindowWriteT(static_cast<const float*>(kv), start_pos, d, window);
  }
}

void IndexerTopk(const IndexerKernels& k, bool bf16, const void* q, const float* weights, const uint8_t* keys,
                 const int64_t* start_pos, const IndexerDims& d, int64_t* indices, const Parallel& par) {
  if (bf16) {
    IndexerT(k, static_cast<const uint16_t*>(q), weights, keys, start_pos, d, indices, par);
  } else {
    IndexerT(k, static_cast<const float*>(q), weights, keys, start_pos, d, indices, par);
  }
}

}  // namespace state_fp8
}  // namespace dsv4
