// Writing a torch archive (internal): what torch::pickle_save writes, with a pickle that the weights-only
// torch.load of PyTorch 2.6 and later reads by default.
#pragma once
#include <ATen/core/ivalue.h>

#include <vector>

namespace dtrain::detail {

// A zip archive as torch.save writes ("archive/data.pkl" and the tensors under "archive/data/"), of `value`
// with its lists and dicts pickled as Python's plain list and dict. torch::pickle_save records a container's
// C++ type with torch.jit._pickle's restore_type_tag and rebuilds int, float, bool and tensor lists with
// its build_*list functions, which the weights-only unpickler refuses; this pickle names only what it
// allows (torch._utils._rebuild_tensor_v2, the storage types, collections.OrderedDict). libtorch reads
// the lists back as List[Any] and the dicts as Dict[Any, Any]: dtrain's readers take them by value
// (IValue::toListRef, toGenericDict), never as typed containers.
std::vector<char> torchSave(const c10::IValue& value);

}  // namespace dtrain::detail
