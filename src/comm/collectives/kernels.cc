// Reduction kernels. Plain loops that GCC vectorises at -O3 (with runtime alias checks, since out may alias a); f16 and bf16
// are widened to float in blocks so the inner loop still vectorises. On x86-64 CPUs with AVX2 and F16C
// (checked at run time), f16 and bf16 are converted 8 at a time in registers instead: the portable
// conversions cost some 6 ns an element for f16 (a 16-bit allreduce ran slower than a 32-bit one).
#include "comm/collectives/kernels.h"

#include <algorithm>
#include <type_traits>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define DTRAIN_X86_SIMD 1
#endif

#include "dtrain/comm/error.h"

namespace dtrain::comm {

namespace {

// Integer sums and products wrap around (two's complement), as NCCL's and PyTorch's do: computed in unsigned
// arithmetic of at least int's width, since signed overflow (and a promoted uint16 product) is undefined.
template <typename T>
using Wrapping = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
template <typename T>
T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<Wrapping<T>>(a) + static_cast<Wrapping<T>>(b));
  else return static_cast<T>(a + b);
}
template <typename T>
T mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<Wrapping<T>>(a) * static_cast<Wrapping<T>>(b));
  else return static_cast<T>(a * b);
}

template <typename T>
void reduceT(T* out, const T* a, const T* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      for (size_t i = 0; i < n; ++i) out[i] = add(a[i], b[i]);
      break;
    case ReduceOp::prod:
      for (size_t i = 0; i < n; ++i) out[i] = mul(a[i], b[i]);
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

#if DTRAIN_X86_SIMD
bool haveAvx2F16c() {
  // F16C through cpuid: clang (14) does not know __builtin_cpu_supports("f16c").
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  }();
  return ok;
}

// 8 lanes of 16-bit floats <-> 8 floats. f16 through F16C (round to nearest even, as floatToHalf; a NaN
// keeps its payload where floatToHalf makes it 0x7e00); bf16 by shifting, rounding to nearest even as
// floatToBf16 (NaN: quiet, as floatToBf16).
__attribute__((target("avx2,f16c"))) inline __m256 load8(const uint16_t* p, bool bf16) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (!bf16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,f16c"))) inline void store8(uint16_t* p, __m256 v, bool bf16) {
  __m128i h;
  if (!bf16) {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, nan);
    // 8 x 32-bit -> 8 x 16-bit (values fit: no saturation), lanes back in order.
    const __m256i packed = _mm256_packus_epi32(r, r);
    h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

// out = a op b for n elements, 8 at a time; returns how many it did (the caller does the rest).
__attribute__((target("avx2,f16c"))) size_t reduce16Simd(uint16_t* out, const uint16_t* a, const uint16_t* b,
                                                          size_t n, ReduceOp op, bool bf16) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(a + i, bf16), y = load8(b + i, bf16);
    __m256 r;
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: r = _mm256_add_ps(x, y); break;
      case ReduceOp::prod: r = _mm256_mul_ps(x, y); break;
      case ReduceOp::min: r = _mm256_min_ps(y, x); break;  // b < a ? b : a, as reduceT
      case ReduceOp::max: r = _mm256_max_ps(y, x); break;  // b > a ? b : a
      default: return i;
    }
    store8(out + i, r, bf16);
  }
  return i;
}

__attribute__((target("avx2,f16c"))) size_t divide16Simd(uint16_t* p, size_t n, float d, bool bf16) {
  const __m256 dv = _mm256_set1_ps(d);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8(p + i, _mm256_div_ps(load8(p + i, bf16), dv), bf16);
  return i;
}
#endif

#if DTRAIN_X86_SIMD
__attribute__((target("avx2,f16c"))) size_t to16Simd(const float* in, uint16_t* out, size_t n, bool bf16) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, _mm256_loadu_ps(in + i), bf16);
  return i;
}
__attribute__((target("avx2,f16c"))) size_t from16Simd(const uint16_t* in, float* out, size_t n, bool bf16) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(in + i, bf16));
  return i;
}
#endif

bool is16(DType t, const char* what) {
  DTRAIN_CHECK(t == DType::f16 || t == DType::bf16, InvalidArgument, "{}: dtype code {} is not f16 or bf16", what,
               static_cast<int>(t));
  return t == DType::bf16;
}

// The 16-bit float kernels: SIMD where the CPU has it, the portable loops for the rest.
void reduce16Any(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op, bool bf16);
void divide16Any(uint16_t* p, size_t n, int d, bool bf16);

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
    case DType::bf16:
      return reduce16Any(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), n,
                         op, t == DType::bf16);
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
    case DType::f16:
    case DType::bf16:
      return divide16Any(static_cast<uint16_t*>(buf), n, d, t == DType::bf16);
  }
}

namespace {

void reduce16Any(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op, bool bf16) {
  size_t done = 0;
#if DTRAIN_X86_SIMD
  if (haveAvx2F16c()) done = reduce16Simd(out, a, b, n, op, bf16);
#endif
  if (bf16) reduce16<bf16ToFloat, floatToBf16>(out + done, a + done, b + done, n - done, op);
  else reduce16<halfToFloat, floatToHalf>(out + done, a + done, b + done, n - done, op);
}

}  // namespace

void floatsTo16(const float* in, void* out, size_t n, DType t) {
  const bool bf16 = is16(t, "floatsTo16");
  auto* o = static_cast<uint16_t*>(out);
  size_t i = 0;
#if DTRAIN_X86_SIMD
  if (haveAvx2F16c()) i = to16Simd(in, o, n, bf16);
#endif
  for (; i < n; ++i) o[i] = bf16 ? floatToBf16(in[i]) : floatToHalf(in[i]);
}

void floatsFrom16(const void* in, float* out, size_t n, DType t) {
  const bool bf16 = is16(t, "floatsFrom16");
  const auto* p = static_cast<const uint16_t*>(in);
  size_t i = 0;
#if DTRAIN_X86_SIMD
  if (haveAvx2F16c()) i = from16Simd(p, out, n, bf16);
#endif
  for (; i < n; ++i) out[i] = bf16 ? bf16ToFloat(p[i]) : halfToFloat(p[i]);
}

namespace {

void divide16Any(uint16_t* p, size_t n, int d, bool bf16) {
  size_t i = 0;
  const float df = static_cast<float>(d);
#if DTRAIN_X86_SIMD
  if (haveAvx2F16c()) i = divide16Simd(p, n, df, bf16);
#endif
  for (; i < n; ++i) p[i] = bf16 ? floatToBf16(bf16ToFloat(p[i]) / df) : floatToHalf(halfToFloat(p[i]) / df);
}

}  // namespace

}  // namespace dtrain::comm
