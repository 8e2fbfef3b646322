// The bridge between torch tensors and dtrain::comm buffers: dtype mapping and checks. A contiguous
// CPU tensor is passed to a collective as (data_ptr, numel, dtype), without a copy.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

#include "dtrain/comm/types.h"

namespace dtrain {

// float32/64, float16, bfloat16, int32/64 and uint8 map to their comm types; others throw
// InvalidArgument naming the dtype and `what`.
comm::DType toCommDType(c10::ScalarType t, const char* what = "tensor");

// Throws InvalidArgument (naming `what`) unless t is a defined, contiguous CPU tensor of a mapped dtype.
void checkCommTensor(const at::Tensor& t, const char* what);

}  // namespace dtrain
