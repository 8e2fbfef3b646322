/// @file
/// The bridge between torch tensors and dtrain::comm buffers: dtype mapping and checks. A contiguous
/// CPU tensor is passed to a collective as (data_ptr, numel, dtype), without a copy.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "dtrain/comm/types.h"

namespace dtrain {

/// The comm type of a torch dtype: float32/64, float16, bfloat16, int32/64 and uint8 map to their comm
/// types; any other dtype gives nullopt.
std::optional<comm::DType> commDTypeOf(c10::ScalarType t);

/// As commDTypeOf, but an unmapped dtype throws InvalidArgument naming the dtype and `what`.
comm::DType toCommDType(c10::ScalarType t, const char* what = "tensor");

/// Throws InvalidArgument (naming `what`) unless t is a defined, contiguous CPU tensor of a mapped dtype.
void checkCommTensor(const at::Tensor& t, const char* what);

}  // namespace dtrain
