// The Linear driver on a level's blocks (linear_blocks.h), the portable rows path and tile layouts (the
// specification of what the vectorised versions write, used by amx_emu), and the LinearKernels tables of the
// accelerated levels. Baseline ISA: nothing here runs a vector instruction of a level; the level functions are
// reached through the LinearBlocks pointers.
#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "custom_ops/kernels/linear_blocks.h"
#include "custom_ops/kernels/linear_buffer.h"
#include "custom_ops/numerics/bf16.h"
#include "custom_ops/numerics/fp4.h"
#include "custom_ops/numerics/fp8.h"

namespace dsv4 {

int64_t PaddedCols(int64_t cols) { return (cols + 31) / 32 * 32; }

TileLayout TileLayoutOf(ActType act, int64_t m) {
  if (act == ActType::kBf16) return {1, m, (m + 15) / 16, false};
  if (m <= kFoldRows) return {1, 3 * m, (3 * m + 15) / 16, true};
  return {3, m, (m + 15) / 16, false};
}

size_t TileXBytes(ActType act, int64_t m, int64_t kw) {
  const TileLayout l = TileLayoutOf(act, m);
  return static_cast<size_t>(l.parts * l.blocks * (PaddedCols(kw) / 32)) * 1024;
}

namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// fp32 -> bf16 as VCVTNEPS2BF16 does it: nearest-even, NaN quietened, denormal inputs to a zero of the same sign.
uint16_t Bf16Hw(float f) {
  const uint32_t u = Bits(f);
  if ((u & 0x7f800000u) == 0 && (u & 0x007fffffu) != 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
  return F32ToBf16(f);
}

}  // namespace

void SplitBf16x3(float x, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  const uint16_t h = Bf16Hw(x);
  if ((Bits(x) & 0x7f800000u) == 0x7f800000u) {  // Inf / NaN: the value itself, no residual
    *hi = h;
    *mid = *lo = 0;
    return;
  }
  const float r1 = x - Bf16ToF32(h);
  const uint16_t m = Bf16Hw(r1);
  const float r2 = r1 - Bf16ToF32(m);
  *hi = h;
  *mid = m;
  *lo = Bf16Hw(r2);
}

namespace portable {
namespace {

// The exact value of W[row][k] (linear.h), for 0 <= row < w.rows, 0 <= k < w.cols.
float DecodeElement(const WeightView& w, int64_t row, int64_t k) {
  switch (w.format) {
    case WeightFormat::kF32: return static_cast<const float*>(w.data)[row * w.cols + k];
    case WeightFormat::kBf16: return Bf16ToF32(static_cast<const uint16_t*>(w.data)[row * w.cols + k]);
    case WeightFormat::kFp8E4M3: {
      const uint8_t code = static_cast<const uint8_t*>(w.data)[row * w.cols + k];
      const int64_t s = (row / w.block) * ((w.cols + w.block - 1) / w.block) + k / w.block;
      const float scale = w.scale_format == ScaleFormat::kE8M0 ? E8M0ToF32(static_cast<const uint8_t*>(w.scale)[s])
                                                               : static_cast<const float*>(w.scale)[s];
      return Fp8E4M3ToF32(code) * scale;
    }
    case WeightFormat::kFp4E2M1: {
      const uint8_t* packed = static_cast<const uint8_t*>(w.data) + row * (w.cols / 2);
      const uint8_t scale = static_cast<const uint8_t*>(w.scale)[row * (w.cols / kFp4Block) + k / kFp4Block];
      return Fp4E2M1ToF32(Fp4Code(packed, k)) * E8M0ToF32(scale);
    }
  }
  return 0.0f;
}

// Rows path: activations widened to fp32 rows of PaddedCols(kw); each weight row decoded to fp32 (rounded to bf16
// for bf16 activations, like the reference) and dotted in k order.
bool RowsSupported(ActType, const WeightView&) { return true; }

size_t RowBytes(ActType, const WeightView& w) { return static_cast<size_t>(PaddedCols(w.cols)) * sizeof(float); }

void PrepareRows(ActType act, const WeightView& w, const void* x, int64_t ldx, const int64_t* index, int64_t m,
                 void* dst) {
  const int64_t kp = PaddedCols(w.cols);
  float* out = static_cast<float*>(dst);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t src = index != nullptr ? index[i] : i;
    float* row = out + i * kp;
    for (int64_t k = 0; k < w.cols; ++k) {
      row[k] = act == ActType::kF32 ? static_cast<const float*>(x)[src * ldx + k]
                                    : Bf16ToF32(static_cast<const uint16_t*>(x)[src * ldx + k]);
    }
    for (int64_t k = w.cols; k < kp; ++k) row[k] = 0.0f;
  }
}

size_t RowsScratch(ActType, const WeightView& w, int64_t) {
  return static_cast<size_t>(PaddedCols(w.cols)) * sizeof(float);
}

void StoreOut(const MatOut& out, int64_t i, int64_t j, float v) {
  if (out.bf16) {
    static_cast<uint16_t*>(out.data)[i * out.ld + j] = F32ToBf16(v);
  } else {
    static_cast<float*>(out.data)[i * out.ld + j] = v;
  }
}

void Rows(ActType act, const void* xp, int64_t m, const WeightView& w, int64_t n0, int64_t n1, const MatOut& out,
          void* scratch) {
  const int64_t kp = PaddedCols(w.cols);
  float* wrow = static_cast<float*>(scratch);
  const float* x = static_cast<const float*>(xp);
  for (int64_t j = n0; j < n1; ++j) {
    for (int64_t k = 0; k < w.cols; ++k) {
      const float v = DecodeElement(w, j, k);
      wrow[k] = act == ActType::kBf16 ? Bf16ToF32(F32ToBf16(v)) : v;
    }
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.0f;
      for (int64_t k = 0; k < w.cols; ++k) acc += x[i * kp + k] * wrow[k];
      StoreOut(out, i, j - n0, acc);
    }
  }
}

}  // namespace

extern const LinearBlocks kRowBlocks = {
    "portable", RowsSupported, RowBytes, PrepareRows, RowsScratch, Rows, nullptr, nullptr, nullptr, nullptr,
    nullptr, nullptr,    {0, 0},        0,       nullptr, nullptr,
};

void DecodeRowsBf16(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, uint16_t* dst,
                    int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = n0 + r;
    for (int64_t c = 0; c < kc; ++c) {
      const int64_t k = k0 + c;
      dst[r * ld + c] = row < w.rows && k < w.cols ? Bf16Hw(DecodeElement(w, row, k)) : uint16_t{0};
    }
  }
}

// Layout (linear_amx.cc): element (part p, tile row v, column k) at pair slot
//   ((((p * blocks + v / 16) * steps + k / 32) * 16 + (k % 32) / 2) * 16 + v % 16) * 2 + k % 2
// with TileLayoutOf(act, m) = {parts, rows, blocks}, steps = PaddedCols(kw) / 32; tile row v holds part p of
// activation row v (folded: part v / m of activation row v % m, in part slot 0); tile rows >= rows and columns
// >= kw are zeros.
void PrepareTileBlocks(ActType act, const void* x, int64_t ldx, const int64_t* index, int64_t m, int64_t kw,
                       int64_t block_begin, int64_t block_end, void* dst) {
  const TileLayout l = TileLayoutOf(act, m);
  const int64_t steps = PaddedCols(kw) / 32;
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t b = block_begin; b < block_end; ++b) {
    for (int64_t p = 0; p < l.parts; ++p) {
      std::memset(out + ((p * l.blocks + b) * steps) * 512, 0, static_cast<size_t>(steps) * 1024);
    }
    for (int64_t vl = 0; vl < 16 && b * 16 + vl < l.rows; ++vl) {
      const int64_t v = b * 16 + vl;
      const int64_t t = l.folded ? v % m : v, fold_part = l.folded ? v / m : -1;
      const int64_t src = index != nullptr ? index[t] : t;
      for (int64_t k = 0; k < kw; ++k) {
        uint16_t part[3] = {0, 0, 0};
        if (act == ActType::kF32) {
          SplitBf16x3(static_cast<const float*>(x)[src * ldx + k], &part[0], &part[1], &part[2]);
        } else {
          part[0] = static_cast<const uint16_t*>(x)[src * ldx + k];
        }
        for (int64_t p = 0; p < l.parts; ++p) {
          const uint16_t value = l.folded ? part[fold_part] : part[p];
          out[((((p * l.blocks + b) * steps + k / 32) * 16 + (k % 32) / 2) * 16 + vl) * 2 + k % 2] = value;
        }
      }
    }
  }
}

}  // namespace portable

// ---------------------------------------------------------------------------------------------------------------
// Driver.

namespace {

int64_t TargetTasks(const Parallel& par) { return par.num_threads > 1 ? 4 * static_cast<int64_t>(par.num_threads) : 1; }

// The reference slot for the weight's format.
void RunReference(ActType act, const void* x, int64_t m, const WeightView& w, int64_t groups, void* y,
                  const Parallel& par) {
  const LinearKernels& r = ref::kLinear;
  const bool fp8 = w.format == WeightFormat::kFp8E4M3, fp4 = w.format == WeightFormat::kFp4E2M1;
  if (act == ActType::kF32) {
    (fp8 ? r.f32_fp8 : fp4 ? r.f32_fp4 : r.f32_dense)(static_cast<const float*>(x), m, w, groups,
                                                       static_cast<float*>(y), par);
  } else {
    (fp8 ? r.bf16_fp8 : fp4 ? r.bf16_fp4 : r.bf16_dense)(static_cast<const uint16_t*>(x), m, w, groups,
                                                         static_cast<uint16_t*>(y), par);
  }
}

}  // namespace

void RunLinear(const LinearBlocks& b, ActType act, const void* x, int64_t m, const WeightView& w, int64_t groups,
               void* y, const Parallel& par, bool f32_out) {
  const int64_t n = w.rows, kw = w.cols, k = groups * kw;
  const bool out_bf16 = act == ActType::kBf16 && !f32_out;
  assert(groups >= 1 && n % groups == 0 && m >= 0 && kw >= 0);
  if (m == 0 || n == 0) return;
  if (kw == 0) {  // every output is an empty sum
    std::memset(y, 0, static_cast<size_t>(m * n) * (out_bf16 ? sizeof(uint16_t) : sizeof(float)));
    return;
  }
  if (!b.rows_supported(act, w)) {
    if (f32_out && act == ActType::kBf16) {  // only reached through RunLinearBf16Products
      const LinearKernels& r = ref::kLinear;
      const bool fp8 = w.format == WeightFormat::kFp8E4M3, fp4 = w.format == WeightFormat::kFp4E2M1;
      std::vector<float> xf(static_cast<size_t>(m * k));
      for (size_t i = 0; i < xf.size(); ++i) xf[i] = Bf16ToF32(static_cast<const uint16_t*>(x)[i]);
      (fp8 ? r.f32bf16_fp8 : fp4 ? r.f32bf16_fp4 : r.f32bf16_dense)(xf.data(), m, w, groups, static_cast<float*>(y),
                                                                    par);
      return;
    }
    RunReference(act, x, m, w, groups, y, par);
    return;
  }
  const bool in_place = w.format == WeightFormat::kBf16 || w.format == WeightFormat::kF32;
  const int64_t min_rows = std::max(b.tile_min_rows[static_cast<int>(act)],
                                    in_place ? b.tile_min_rows_in_place[static_cast<int>(act)] : int64_t{0});
  const bool tiles = b.tiles != nullptr && m >= min_rows && m > w.invariant_rows && b.tiles_supported(act, w);
  const size_t elem = act == ActType::kF32 ? sizeof(float) : sizeof(uint16_t);
  const size_t out_elem = out_bf16 ? sizeof(uint16_t) : sizeof(float);
  const int64_t per_group = n / groups;
  const size_t x_bytes = RoundUp64(tiles ? b.tile_x_bytes(act, m, kw) : static_cast<size_t>(m) * b.row_bytes(act, w));

  // Weight-row units (tasks take whole units) and per-task scratch, all allocated before the parallel regions.
  const int64_t unit = !tiles ? 16 : b.tile_task_rows > 0 ? b.tile_task_rows : b.tile_rows;
  const int64_t units = (n + unit - 1) / unit;
  const int64_t tasks = std::max<int64_t>(1, std::min(units, TargetTasks(par)));
  const size_t scratch_bytes = RoundUp64(tiles ? b.tiles_scratch(act, w, m) : b.rows_scratch(act, w, m));
  AlignedBuffer buffer(x_bytes * static_cast<size_t>(groups) + scratch_bytes * static_cast<size_t>(tasks));
  uint8_t* xp = buffer.bytes();
  uint8_t* scratch = xp + x_bytes * static_cast<size_t>(groups);

  // Activations, per group (columns [g * kw, (g + 1) * kw) of each row).
  const uint8_t* xb = static_cast<const uint8_t*>(x);
  if (tiles) {
    const int64_t blocks = b.tile_blocks(act, m);
    const int64_t chunk = std::max<int64_t>(1, (blocks * groups + TargetTasks(par) - 1) / TargetTasks(par));
    const int64_t items = (blocks + chunk - 1) / chunk;
    par.For(static_cast<size_t>(items * groups), [&](size_t i) {
      const int64_t g = static_cast<int64_t>(i) / items, c = static_cast<int64_t>(i) % items;
      b.prepare_tiles(act, xb + static_cast<size_t>(g * kw) * elem, k, nullptr, m, kw, c * chunk,
                      std::min(blocks, (c + 1) * chunk), xp + x_bytes * static_cast<size_t>(g));
    });
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      b.prepare_rows(act, w, xb + static_cast<size_t>(g * kw) * elem, k, nullptr, m, xp + x_bytes * static_cast<size_t>(g));
    }
  }

  par.For(static_cast<size_t>(tasks), [&](size_t task) {
    const int64_t t = static_cast<int64_t>(task);
    const int64_t r0 = units * t / tasks * unit, r1 = std::min(n, units * (t + 1) / tasks * unit);
    void* s = scratch + scratch_bytes * task;
    for (int64_t s0 = r0; s0 < r1;) {  // one call per group segment
      const int64_t g = s0 / per_group, s1 = std::min(r1, (g + 1) * per_group);
      const MatOut out{static_cast<uint8_t*>(y) + static_cast<size_t>(s0) * out_elem, n, out_bf16};
      (tiles ? b.tiles : b.rows)(act, xp + x_bytes * static_cast<size_t>(g), m, w, s0, s1, out, s);
      s0 = s1;
    }
  });
}

void RunLinearBf16Products(const LinearBlocks& b, const float* x, int64_t m, const WeightView& w, int64_t groups,
                           float* y, const Parallel& par) {
  // x rounded to bf16 once (nearest-even, as linear.h's bf16 compute mode specifies), then the bf16-activation
  // path with fp32 outputs: the same products and sums as bf16 activations, without the final rounding.
  const int64_t k = groups * w.cols;
  AlignedBuffer xb(static_cast<size_t>(m * k) * sizeof(uint16_t));
  uint16_t* xh = reinterpret_cast<uint16_t*>(xb.bytes());
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(m, TargetTasks(par)));
  par.For(static_cast<size_t>(tasks), [&](size_t t) {
    const int64_t i0 = m * static_cast<int64_t>(t) / tasks, i1 = m * static_cast<int64_t>(t + 1) / tasks;
    for (int64_t i = i0 * k; i < i1 * k; ++i) xh[i] = F32ToBf16(x[i]);
  });
  RunLinear(b, ActType::kBf16, xh, m, w, groups, y, par, /*f32_out=*/true);
}

// ---------------------------------------------------------------------------------------------------------------
// Tables of the accelerated levels: every slot runs the driver on the level's blocks.

#if DSV4_X86_VARIANTS
namespace {

template <const LinearBlocks* B>
void F32Slot(const float* x, int64_t m, const WeightView& w, int64_t groups, float* y, const Parallel& par) {
  RunLinear(*B, ActType::kF32, x, m, w, groups, y, par);
}

template <const LinearBlocks* B>
void Bf16Slot(const uint16_t* x, int64_t m, const WeightView& w, int64_t groups, uint16_t* y, const Parallel& par) {
  RunLinear(*B, ActType::kBf16, x, m, w, groups, y, par);
}

template <const LinearBlocks* B>
void F32Bf16Slot(const float* x, int64_t m, const WeightView& w, int64_t groups, float* y, const Parallel& par) {
  RunLinearBf16Products(*B, x, m, w, groups, y, par);
}

template <const LinearBlocks* B>
constexpr LinearKernels MakeTable() {
  return {F32Slot<B>,  F32Slot<B>,     F32Slot<B>,     Bf16Slot<B>,    Bf16Slot<B>,
          Bf16Slot<B>, F32Bf16Slot<B>, F32Bf16Slot<B>, F32Bf16Slot<B>};
}

}  // namespace

namespace avx2 {
extern const LinearKernels kLinear = MakeTable<&kLinearBlocks>();
}  // namespace avx2
namespace avx512 {
extern const LinearKernels kLinear = MakeTable<&kLinearBlocks>();
}  // namespace avx512
namespace amx {
extern const LinearKernels kLinear = MakeTable<&kLinearBlocks>();
}  // namespace amx
#endif

}  // namespace dsv4
