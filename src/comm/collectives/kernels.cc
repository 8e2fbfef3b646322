// Reduction kernels. Plain loops that GCC vectorises at -O3 (with runtime alias checks, since out may alias a); f16 and bf16
// are widened to float in blocks so the inner loop still vectorises.
#include "comm/collectives/kernels.h"

#include <algorithm>

#include "dtrain/comm/error.h"

namespace dtrain::comm {

namespace {

template <typename T>
void reduceT(T* out, const T* a, const T* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[i] + b[i]);
      break;
    case ReduceOp::prod:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[i] * b[i]);
      break;
    case ReduceOp::min:
      for (size_t i = 0; i < n; ++i) out[i] = b[i] < a[i] ? b[i] : a[i];
      break;
    case ReduceOp::max:
      for (size_t i = 0; i < n; ++i) out[i] = b[i] > a[i] ? b[i] : a[i];
      break;
  }
}

// 16-bit floats: convert a block to float, reduce, convert back.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce16(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  constexpr size_t kBlock = 256;
  float fa[kBlock], fb[kBlock];
  for (size_t off = 0; off < n; off += kBlock) {
    size_t m = std::min(kBlock, n - off);
    for (size_t i = 0; i < m; ++i) {
      fa[i] = ToF(a[off + i]);
      fb[i] = ToF(b[off + i]);
    }
    reduceT<float>(fa, fa, fb, m, op);
    for (size_t i = 0; i < m; ++i) out[off + i] = FromF(fa[i]);
  }
}

}  // namespace

float halfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absu >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absu < 0x38800000u) {  // subnormal or zero in half
    if (absu < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = absu >> 23;
    uint32_t man = (absu & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (113 - e) - 1
    uint32_t r = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = absu + 0xfffu + ((absu >> 13) & 1u);  // round to nearest even on bit 13
  r -= 112u << 23;
  return static_cast<uint16_t>(sign | (r >> 13));
}

void reduceTo(void* out, const void* a, const void* b, size_t n, DType t, ReduceOp op) {
  switch (t) {
    case DType::f32:
      return reduceT(static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b), n, op);
    case DType::f64:
      return reduceT(static_cast<double*>(out), static_cast<const double*>(a), static_cast<const double*>(b), n, op);
    case DType::i32:
      return reduceT(static_cast<int32_t*>(out), static_cast<const int32_t*>(a), static_cast<const int32_t*>(b), n, op);
    case DType::i64:
      return reduceT(static_cast<int64_t*>(out), static_cast<const int64_t*>(a), static_cast<const int64_t*>(b), n, op);
    case DType::u8:
      return reduceT(static_cast<uint8_t*>(out), static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), n, op);
    case DType::f16:
      return reduce16<halfToFloat, floatToHalf>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                                                static_cast<const uint16_t*>(b), n, op);
    case DType::bf16:
      return reduce16<bf16ToFloat, floatToBf16>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                                                static_cast<const uint16_t*>(b), n, op);
  }
  throw InvalidArgument(fmt::format("reduce: unknown dtype code {}", static_cast<int>(t)));
}

double loadElement(const void* buf, DType t, size_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(buf)[i];
    case DType::f64: return static_cast<const double*>(buf)[i];
    case DType::f16: return halfToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DType::bf16: return bf16ToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DType::i32: return static_cast<const int32_t*>(buf)[i];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DType::u8: return static_cast<const uint8_t*>(buf)[i];
  }
  return 0;
}

void storeElement(void* buf, DType t, size_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(buf)[i] = static_cast<float>(v); return;
    case DType::f64: static_cast<double*>(buf)[i] = v; return;
    case DType::f16: static_cast<uint16_t*>(buf)[i] = floatToHalf(static_cast<float>(v)); return;
    case DType::bf16: static_cast<uint16_t*>(buf)[i] = floatToBf16(static_cast<float>(v)); return;
    case DType::i32: static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v); return;
    case DType::i64: static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v); return;
    case DType::u8: static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(v); return;
  }
}

void divideBy(void* buf, size_t n, DType t, int d) {
  switch (t) {
    case DType::f32: {
      auto* p = static_cast<float*>(buf);
      float inv = 1.0f / static_cast<float>(d);
      for (size_t i = 0; i < n; ++i) p[i] *= inv;
      return;
    }
    case DType::f64: {
      auto* p = static_cast<double*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] /= d;
      return;
    }
    case DType::i32: {
      auto* p = static_cast<int32_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] /= d;
      return;
    }
    case DType::i64: {
      auto* p = static_cast<int64_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] /= d;
      return;
    }
    case DType::u8: {
      auto* p = static_cast<uint8_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(p[i] / d);
      return;
    }
    case DType::f16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = floatToHalf(halfToFloat(p[i]) / static_cast<float>(d));
      return;
    }
    case DType::bf16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = floatToBf16(bf16ToFloat(p[i]) / static_cast<float>(d));
      return;
    }
  }
}

}  // namespace dtrain::comm
