// The real CUDA and NCCL calls behind nccl::DeviceApi (device_api.h), for the CUDA build. Each call is
// one library call; the communicator (nccl_comm.cc) holds the logic: ordering, watching, aborting.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

#include "comm/nccl/device_api.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "dtrain's NCCL backend needs NCCL 2.14 or later (non-blocking communicators, ncclCommInitRankConfig)"
#endif

namespace dtrain::comm {

bool ncclBuilt() { return true; }

std::string ncclVersionText() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
}

namespace nccl {
namespace {

Status cuda(cudaError_t e) {
  if (e == cudaSuccess) return {};
  if (e == cudaErrorNotReady) return {Status::not_ready, ""};
  return Status::failure(
      fmt::format("CUDA error {} ({}: {})", static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e)));
}

Status fromNccl(ncclResult_t r, ncclComm_t comm) {
  if (r == ncclSuccess) return {};
  if (r == ncclInProgress) return {Status::in_progress, ""};
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  return Status::failure(fmt::format("NCCL error {} ({}){}{}", static_cast<int>(r), ncclGetErrorString(r),
                                     last && *last ? ": " : "", last ? last : ""));
}

ncclDataType_t ncclType(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t ncclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::prod: return ncclProd;
  }
  return ncclSum;
}

ncclComm_t C(Handle h) { return static_cast<ncclComm_t>(h); }
cudaStream_t S(Handle h) { return static_cast<cudaStream_t>(h); }
cudaEvent_t E(Handle h) { return static_cast<cudaEvent_t>(h); }

class CudaNcclApi final : public DeviceApi {
 public:
  Status deviceCount(int* n) override { return cuda(cudaGetDeviceCount(n)); }
  Status currentDevice(int* d) override { return cuda(cudaGetDevice(d)); }
  Status setDevice(int d) override { return cuda(cudaSetDevice(d)); }
  Status createStream(Handle* stream) override {
    int lo = 0, hi = 0;
    cudaDeviceGetStreamPriorityRange(&lo, &hi);
    cudaStream_t s = nullptr;
    Status st = cuda(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, hi));
    *stream = s;
    return st;
  }
  Status destroyStream(Handle stream) override { return cuda(cudaStreamDestroy(S(stream))); }
  Status createEvent(Handle* event) override {
    cudaEvent_t e = nullptr;
    Status st = cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *event = e;
    return st;
  }
  Status recordEvent(Handle event, Handle stream) override { return cuda(cudaEventRecord(E(event), S(stream))); }
  Status queryEvent(Handle event) override { return cuda(cudaEventQuery(E(event))); }
  Status destroyEvent(Handle event) override { return cuda(cudaEventDestroy(E(event))); }
  Status streamWaitEvent(Handle stream, Handle event) override {
    return cuda(cudaStreamWaitEvent(S(stream), E(event), 0));
  }
  Status uniqueId(UniqueId* id) override {
    static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId::bytes), "NCCL's unique id is 128 bytes");
    ncclUniqueId u;
    Status st = fromNccl(ncclGetUniqueId(&u), nullptr);
    std::memcpy(id->bytes, &u, sizeof(u));
    return st;
  }
  Status initComm(Handle* comm, int size, const UniqueId& id, int rank) override {
    ncclUniqueId u;
    std::memcpy(&u, id.bytes, sizeof(u));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t c = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&c, size, u, rank, &config);
    *comm = c;
    return fromNccl(r, c);
  }
  Status asyncError(Handle comm) override {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(C(comm), &async);
    return fromNccl(r != ncclSuccess ? r : async, C(comm));
  }
  Status launch(Handle comm, Handle stream, const Launch& l) override {
    const ncclDataType_t t = ncclType(l.dtype);
    ncclResult_t r = ncclSuccess;
    switch (l.call) {
      case Call::allreduce: r = ncclAllReduce(l.in, l.out, l.count, t, ncclOp(l.op), C(comm), S(stream)); break;
      case Call::broadcast: r = ncclBroadcast(l.in, l.out, l.count, t, l.root, C(comm), S(stream)); break;
      case Call::allgather: r = ncclAllGather(l.in, l.out, l.count, t, C(comm), S(stream)); break;
      case Call::reduce_scatter:
        r = ncclReduceScatter(l.in, l.out, l.count, t, ncclOp(l.op), C(comm), S(stream));
        break;
    }
    return fromNccl(r, C(comm));
  }
  Status abort(Handle comm) override { return fromNccl(ncclCommAbort(C(comm)), nullptr); }
  Status finalize(Handle comm) override { return fromNccl(ncclCommFinalize(C(comm)), C(comm)); }
  Status destroy(Handle comm) override { return fromNccl(ncclCommDestroy(C(comm)), nullptr); }
};

}  // namespace

std::shared_ptr<DeviceApi> cudaNcclApi(int, int) { return std::make_shared<CudaNcclApi>(); }

}  // namespace nccl
}  // namespace dtrain::comm
