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
// With `python_dicts`, the pickle is first rewritten so that what Python's torch.save wrote for an
// OrderedDict (a state_dict) reads as a plain dict: libtorch's unpickler turns collections.OrderedDict
// into None and has no POP. An OrderedDict instance with items becomes an empty dict that its SETITEMS
// fill, an empty one None (a tensor's backward hooks, as libtorch reads them), and the state_dict's
// _metadata (set by BUILD) is dropped. Protocol 2, as torch.save writes it; protocol 4 is refused.
c10::IValue pickleLoadChecked(const std::vector<char>& bytes, bool python_dicts = false);

}  // namespace dtrain::detail
