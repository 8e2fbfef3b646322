// The NCCL backend of a build without CUDA (dtrain/comm/nccl.h): it says so.
#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::comm {

struct NcclComm::Impl {};

bool ncclBuilt() { return false; }
std::string ncclVersionText() { return ""; }

std::shared_ptr<NcclComm> NcclComm::create(ProcessGroup& pg, int device) {
  throw InvalidArgument(fmt::format("[rank {}] NCCL on cuda:{}: this dtrain was built without CUDA (DTRAIN_CUDA=OFF: "
                                    "the libtorch it was built with is CPU-only)", pg.rank(), device));
}

NcclComm::NcclComm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclComm::~NcclComm() = default;
WorkPtr NcclComm::allreduce(const void*, void*, size_t, DType, ReduceOp, void*) { return nullptr; }
WorkPtr NcclComm::broadcast(void*, size_t, DType, int, void*) { return nullptr; }
WorkPtr NcclComm::allgather(const void*, void*, size_t, DType, void*) { return nullptr; }
WorkPtr NcclComm::reduceScatter(const void*, void*, size_t, DType, ReduceOp, void*) { return nullptr; }
int NcclComm::device() const { return -1; }
int NcclComm::rank() const { return 0; }
int NcclComm::size() const { return 1; }

}  // namespace dtrain::comm
