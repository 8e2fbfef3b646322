// Torch tensors as comm buffers (see tensor.h).
#include "dtrain/tensor.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)

#include "dtrain/comm/error.h"

namespace dtrain {

std::optional<comm::DType> commDTypeOf(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return comm::DType::f32;
    case c10::kDouble: return comm::DType::f64;
    case c10::kHalf: return comm::DType::f16;
    case c10::kBFloat16: return comm::DType::bf16;
    case c10::kInt: return comm::DType::i32;
    case c10::kLong: return comm::DType::i64;
    case c10::kByte: return comm::DType::u8;
    default: return std::nullopt;
  }
}

comm::DType toCommDType(c10::ScalarType t, const char* what) {
  if (auto d = commDTypeOf(t)) return *d;
  throw InvalidArgument(fmt::format("{}: dtype {} cannot be communicated (use float32/64, float16, bfloat16, "
                                    "int32/64 or uint8)", what, c10::toString(t)));
}

void checkCommTensor(const at::Tensor& t, const char* what) {
  DTRAIN_CHECK(t.defined(), InvalidArgument, "{}: undefined tensor", what);
  DTRAIN_CHECK(t.device().is_cpu(), InvalidArgument, "{}: tensor is on {}, dtrain communicates CPU tensors", what,
               t.device().str());
  DTRAIN_CHECK(t.is_contiguous(), InvalidArgument, "{}: tensor of shape {} is not contiguous", what,
               fmt::format("{}", fmt::join(t.sizes(), "x")));
  toCommDType(t.scalar_type(), what);
}

}  // namespace dtrain
