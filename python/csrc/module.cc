// The extension module dtrain._C: the backend's creator, for python/dtrain/__init__.py to register.
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include "backend.h"
#include "dtrain/build_info.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "dtrain's torch.distributed backend (docs/PYTHON.md)";
  // Releases the GIL: the rendezvous waits for the other ranks.
  m.def(
      "create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
         const std::string& name) { return dtrain::python::createBackend(store, rank, size, timeout, name); },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("name") = "",
      py::call_guard<py::gil_scoped_release>());
  m.attr("torch_version") = dtrain::build_info::kTorchVersion;
  m.attr("version") = dtrain::build_info::kVersion;
}
