// Reading a torch archive's pickle (internal): torch::pickle_load, with every tensor checked against the
// archive record its storage was read from.
#pragma once
#include <ATen/core/ivalue.h>

#include <vector>

namespace dtrain::detail {

// The value torch::pickle_load(bytes) returns, read through a bounds-checked adapter, after checking that
// every tensor in it (sizes, strides, offset) lies inside the bytes of its storage's record and that
// nothing nests deeper than 32 levels. libtorch sets a storage's size from the pickle's claim, not from
// the record it reads (a damaged file gave a tensor that viewed bytes past its buffer: found by fuzzing).
// Throws std::runtime_error naming what is wrong, or libtorch's own error.
c10::IValue pickleLoadChecked(const std::vector<char>& bytes);

}  // namespace dtrain::detail
