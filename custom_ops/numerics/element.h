// Element access for kernels templated on the activation type: float32 or bfloat16 (uint16_t bit patterns).
//
// ToF32 widens exactly; StoreAs narrows with round-to-nearest-even (numerics/bf16.h); RoundTo<T> is the value a
// float takes after a store to T and a reload, i.e. the rounding a PyTorch `.to(dtype)` applies between stages.
#pragma once

#include <cstdint>

#include "custom_ops/numerics/bf16.h"

namespace dsv4 {

inline float ToF32(float v) { return v; }
inline float ToF32(uint16_t v) { return Bf16ToF32(v); }

inline void StoreAs(float v, float* dst) { *dst = v; }
inline void StoreAs(float v, uint16_t* dst) { *dst = F32ToBf16(v); }

template <class T>
inline float RoundTo(float v) {
  T t;
  StoreAs(v, &t);
  return ToF32(t);
}

}  // namespace dsv4
