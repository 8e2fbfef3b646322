// torch::pickle_save's steps (torch/csrc/jit/serialization/pickle.cpp) with an untagged pickle of plain
// containers: see pickle_save.h.
#include "pickle_save.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cstring>

namespace dtrain::detail {

namespace {

// `v` with every list, at any depth, a List[Any] (the Pickler writes a typed list of ints, floats,
// bools or tensors with a build_*list call whatever its type tagging) and every dict's values
// converted the same way. Strings, numbers, tensors and None are kept as they are.
c10::IValue plainContainers(const c10::IValue& v) {
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    out.reserve(v.toListRef().size());
    for (const auto& e : v.toListRef()) out.push_back(plainContainers(e));
    return out;
  }
  if (v.isGenericDict()) {
    const auto in = v.toGenericDict();
    c10::impl::GenericDict out(in.keyType(), c10::AnyType::get());
    out.reserve(in.size());
    for (const auto& e : in) out.insert(e.key(), plainContainers(e.value()));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : v.toTupleRef().elements()) elements.push_back(plainContainers(e));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return v;
}

}  // namespace

std::vector<char> torchSave(const c10::IValue& value) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* p, size_t n) { pickle.insert(pickle.end(), p, p + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(plainContainers(value));
  pickler.stop();

  std::vector<char> archive;
  archive.reserve(pickle.size());
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
    const char* bytes = static_cast<const char*>(p);
    archive.insert(archive.end(), bytes, bytes + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return archive;
}

}  // namespace dtrain::detail
