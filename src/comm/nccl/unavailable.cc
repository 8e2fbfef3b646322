// The NCCL backend of a build without CUDA (dtrain/comm/nccl.h): it says so. The communicator itself
// (nccl_comm.cc) is built everywhere, so that its tests drive it through a fake (device_api.h).
#include "comm/nccl/device_api.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"

namespace dtrain::comm {

bool ncclBuilt() { return false; }
std::string ncclVersionText() { return ""; }

std::shared_ptr<nccl::DeviceApi> nccl::cudaNcclApi(int rank, int device) {
  throw InvalidArgument(fmt::format("[rank {}] NCCL on cuda:{}: this dtrain was built without CUDA (DTRAIN_CUDA=OFF: "
                                    "the libtorch it was built with is CPU-only)", rank, device));
}

}  // namespace dtrain::comm
