// The CUDA and NCCL calls the NCCL communicator (nccl_comm.cc) makes, behind one interface. The CUDA
// build's implementation (cuda_api.cc) calls the libraries. The tests substitute a fake
// (tests/comm/nccl_fake_test.cc), so the communicator's watchdog, abort, failure and teardown paths run on
// any machine, and under the sanitizers too. This header sees no CUDA or NCCL header: streams, events and
// communicators are opaque handles.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/comm/types.h"

namespace dtrain::comm {
class ProcessGroup;
class NcclComm;
}  // namespace dtrain::comm

namespace dtrain::comm::nccl {

using Handle = void*;  // a cudaStream_t, a cudaEvent_t or an ncclComm_t

// What a call answered. `text` holds the library's own words when it failed: "CUDA error 700
// (cudaErrorIllegalAddress: an illegal memory access was encountered)", or "NCCL error 3 (internal error):"
// followed by ncclGetLastError's text.
struct Status {
  enum Kind : uint8_t {
    ok,
    in_progress,  // a non-blocking communicator is still working on it: poll asyncError
    not_ready,    // an event that has not fired yet
    failed,
  };
  Kind kind = ok;
  std::string text;
  static Status failure(std::string why) { return {failed, std::move(why)}; }
};

struct UniqueId {
  char bytes[128] = {};
};

enum class Call : uint8_t { allreduce, broadcast, allgather, reduce_scatter };

// One collective, as NCCL takes it (in == out for broadcast).
struct Launch {
  Call call = Call::allreduce;
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
};

class DeviceApi {
 public:
  virtual ~DeviceApi() = default;
  // CUDA.
  virtual Status deviceCount(int* n) = 0;
  virtual Status currentDevice(int* d) = 0;
  virtual Status setDevice(int d) = 0;
  virtual Status createStream(Handle* stream) = 0;  // non-blocking, the highest priority
  virtual Status destroyStream(Handle stream) = 0;
  virtual Status createEvent(Handle* event) = 0;  // without timing
  virtual Status recordEvent(Handle event, Handle stream) = 0;
  virtual Status queryEvent(Handle event) = 0;  // ok once it fired, not_ready before, failed on an error
  virtual Status destroyEvent(Handle event) = 0;
  virtual Status streamWaitEvent(Handle stream, Handle event) = 0;
  // NCCL (a non-blocking communicator: calls on it may answer in_progress).
  virtual Status uniqueId(UniqueId* id) = 0;
  virtual Status initComm(Handle* comm, int size, const UniqueId& id, int rank) = 0;
  virtual Status asyncError(Handle comm) = 0;  // ok, in_progress or failed
  virtual Status launch(Handle comm, Handle stream, const Launch& call) = 0;
  virtual Status abort(Handle comm) = 0;     // frees the communicator once it answers ok
  virtual Status finalize(Handle comm) = 0;  // flushes its operations; destroy() still frees it
  virtual Status destroy(Handle comm) = 0;
};

// The real calls (a CUDA build). Elsewhere: InvalidArgument saying that this dtrain has no CUDA, naming
// `rank` and `device`.
std::shared_ptr<DeviceApi> cudaNcclApi(int rank, int device);

// NcclComm::create over any DeviceApi (the tests' fake).
std::shared_ptr<NcclComm> createComm(ProcessGroup& pg, int device, std::shared_ptr<DeviceApi> api);

}  // namespace dtrain::comm::nccl
