// The device a rank trains on (dtrain/device.h).
#include "dtrain/device.h"

#include <fmt/format.h>

#include "dtrain/build_info.h"
#include "dtrain/comm/error.h"

#ifdef DTRAIN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace dtrain {

bool cudaBuilt() {
#ifdef DTRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace {

// The count and, when it is 0, the reason.
std::pair<int, std::string> probe() {
#ifdef DTRAIN_WITH_CUDA
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: the probe must not poison later CUDA calls
    return {0, fmt::format("{} (CUDA error {}: {})", cudaGetErrorString(e), static_cast<int>(e), cudaGetErrorName(e))};
  }
  if (n == 0) return {0, "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"};
  return {n, ""};
#else
  return {0, fmt::format("this dtrain was built without CUDA (DTRAIN_CUDA=OFF: libtorch {} is CPU-only)",
                         build_info::kTorchVersion)};
#endif
}

}  // namespace

int cudaDeviceCount() { return probe().first; }
std::string cudaUnavailableReason() { return probe().second; }

c10::Device selectDevice(const std::string& spec, int local_rank) {
  if (spec == "cpu") return c10::Device(c10::kCPU);
  auto [n, why] = probe();
  if (spec == "auto") return n > 0 ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % n)) : c10::Device(c10::kCPU);
  if (spec == "cuda" || spec.rfind("cuda:", 0) == 0) {
    DTRAIN_CHECK(n > 0, InvalidArgument, "device '{}': no GPU can be used: {}", spec, why);
    int index = local_rank % n;
    if (spec != "cuda") {
      try {
        size_t used = 0;
        index = std::stoi(spec.substr(5), &used);
        DTRAIN_CHECK(used == spec.size() - 5, InvalidArgument, "device '{}'", spec);
      } catch (const std::logic_error&) {
        throw InvalidArgument(fmt::format("device '{}': expected cuda:N with N a number", spec));
      }
      DTRAIN_CHECK(index >= 0 && index < n, InvalidArgument, "device '{}': {} GPU(s) visible (cuda:0..cuda:{})", spec, n, n - 1);
    }
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  throw InvalidArgument(fmt::format("device '{}' (expected cpu, cuda, cuda:N or auto)", spec));
}

}  // namespace dtrain
