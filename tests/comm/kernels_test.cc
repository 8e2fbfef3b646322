// The 16-bit float reduction kernels (src/comm/collectives/kernels.cc): on every f16 and bf16 bit
// pattern, reduceTo and divideBy (vectorised where the CPU allows) equal the element-by-element
// conversions (floatToHalf / floatToBf16 of the float result), bit for bit; a NaN result only has to be
// a NaN (the vector f16 conversion keeps a NaN's payload).
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "comm/collectives/kernels.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm {
namespace {

struct Kind {
  DType t;
  float (*to)(uint16_t);
  uint16_t (*from)(float);
};

float reference(ReduceOp op, float x, float y) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return x + y;
    case ReduceOp::prod: return x * y;
    case ReduceOp::min: return y < x ? y : x;
    case ReduceOp::max: return y > x ? y : x;
  }
  return 0;
}

void expectSame(const Kind& k, uint16_t got, float want, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(k.to(got))) << what;
  } else {
    EXPECT_EQ(got, k.from(want)) << what << ": want " << want << " got " << k.to(got);
  }
}

class Kernels16 : public ::testing::TestWithParam<int> {
 protected:
  Kind kind() const {
    return GetParam() == 0 ? Kind{DType::f16, halfToFloat, floatToHalf} : Kind{DType::bf16, bf16ToFloat, floatToBf16};
  }
};

TEST_P(Kernels16, ReduceEqualsElementByElementOnEveryBitPattern) {
  const Kind k = kind();
  const size_t n = 65536 + 5;  // every pattern, and a tail that is not a multiple of 8
  std::vector<uint16_t> a(n), b(n), out(n);
  std::mt19937 rng(11);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<uint16_t>(i);
    b[i] = static_cast<uint16_t>(rng());
  }
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max}) {
    reduceTo(out.data(), a.data(), b.data(), n, k.t, op);
    for (size_t i = 0; i < n; ++i) {
      expectSame(k, out[i], reference(op, k.to(a[i]), k.to(b[i])),
                 "op " + std::to_string(static_cast<int>(op)) + " a=" + std::to_string(a[i]) + " b=" + std::to_string(b[i]));
      if (HasFailure()) return;
    }
  }
  // In place (out aliases a), as the collectives call it.
  std::vector<uint16_t> c = a;
  reduceTo(c.data(), c.data(), b.data(), n, k.t, ReduceOp::sum);
  for (size_t i = 0; i < n && !HasFailure(); ++i) expectSame(k, c[i], k.to(a[i]) + k.to(b[i]), "in place");
}

TEST_P(Kernels16, DivideEqualsElementByElementOnEveryBitPattern) {
  const Kind k = kind();
  for (int d : {2, 3, 7}) {
    std::vector<uint16_t> p(65536 + 3);
    for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint16_t>(i * 40503u);
    const std::vector<uint16_t> before = p;
    divideBy(p.data(), p.size(), k.t, d);
    for (size_t i = 0; i < p.size() && !HasFailure(); ++i)
      expectSame(k, p[i], k.to(before[i]) / static_cast<float>(d), "divide by " + std::to_string(d));
  }
}

TEST_P(Kernels16, BulkConversionsEqualElementByElement) {
  const Kind k = kind();
  std::vector<float> in(100003);
  std::mt19937 rng(5);
  for (size_t i = 0; i < in.size(); ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    std::memcpy(&in[i], &u, 4);  // every kind of float: subnormals, infinities, NaNs, overflow
    if (i % 3 == 0) in[i] = std::ldexp(static_cast<float>(rng() % 4096) - 2048, static_cast<int>(rng() % 40) - 30);
  }
  std::vector<uint16_t> half(in.size());
  floatsTo16(in.data(), half.data(), in.size(), k.t);
  for (size_t i = 0; i < in.size() && !HasFailure(); ++i) expectSame(k, half[i], in[i], "to16 " + std::to_string(in[i]));
  std::vector<float> back(in.size());
  floatsFrom16(half.data(), back.data(), half.size(), k.t);
  for (size_t i = 0; i < in.size() && !HasFailure(); ++i) {
    const float want = k.to(half[i]);
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(back[i]));
    else EXPECT_EQ(back[i], want) << i;
  }
  EXPECT_THROW(floatsTo16(in.data(), half.data(), 1, DType::f32), InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Types, Kernels16, ::testing::Values(0, 1),
                         [](const auto& p) { return p.param == 0 ? std::string("f16") : std::string("bf16"); });

// Integer sums and products wrap around (two's complement), as NCCL's and PyTorch's do; they used to
// overflow as signed ints (undefined behaviour, found by UBSan in collectives_test: a sum doubled 300
// times). u8 wraps modulo 256.
TEST(Kernels, IntegerSumsAndProductsWrapAround) {
  const int32_t a32[] = {INT32_MAX, INT32_MIN, 1 << 30, -7}, b32[] = {1, -1, 1 << 30, 3};
  int32_t o32[4];
  reduceTo(o32, a32, b32, 4, DType::i32, ReduceOp::sum);
  EXPECT_EQ(o32[0], INT32_MIN);
  EXPECT_EQ(o32[1], INT32_MAX);
  EXPECT_EQ(o32[2], INT32_MIN);
  EXPECT_EQ(o32[3], -4);
  reduceTo(o32, a32, b32, 4, DType::i32, ReduceOp::prod);
  EXPECT_EQ(o32[0], INT32_MAX);
  EXPECT_EQ(o32[2], 0);  // 2^60 mod 2^32
  EXPECT_EQ(o32[3], -21);
  const int64_t a64[] = {INT64_MAX, INT64_MIN}, b64[] = {1, -1};
  int64_t o64[2];
  reduceTo(o64, a64, b64, 2, DType::i64, ReduceOp::sum);
  EXPECT_EQ(o64[0], INT64_MIN);
  EXPECT_EQ(o64[1], INT64_MAX);
  const uint8_t a8[] = {250, 16}, b8[] = {10, 17};
  uint8_t o8[2];
  reduceTo(o8, a8, b8, 2, DType::u8, ReduceOp::sum);
  EXPECT_EQ(o8[0], 4);
  reduceTo(o8, a8, b8, 2, DType::u8, ReduceOp::prod);
  EXPECT_EQ(o8[1], static_cast<uint8_t>(16 * 17));
}

}  // namespace
}  // namespace dtrain::comm
