// Element-wise reduction kernels and half-precision conversions used by every collective.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dtrain/comm/element.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm {

// out[i] = a[i] op b[i] (out may alias a or b). avg reduces like sum (the caller divides once at the end).
void reduceTo(void* out, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);
// buf[i] /= n: the last step of avg (integer division for integer types).
void divideBy(void* buf, size_t count, DType dtype, int n);

// loadElement / storeElement (one element as a double) are public: dtrain/comm/element.h.

// IEEE binary16 and bfloat16 <-> float, round to nearest even.
float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);
inline float bf16ToFloat(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t floatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace dtrain::comm
