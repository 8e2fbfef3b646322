/// @file
/// NCCL for CUDA buffers: one communicator per process group, each rank on a GPU of its own.
///
/// \code
///   auto nccl = dtrain::comm::NcclComm::create(*pg, /*device=*/local_rank);   // collective over pg
///   nccl->allreduce(d_buf, d_buf, n, DType::f32, ReduceOp::sum, stream)->wait();
/// \endcode
///
/// The torch layer (dtrain/device.h) picks this path by itself for CUDA tensors; this header is for code
/// that holds raw device pointers. Like the rest of the comm layer it sees no libtorch and no CUDA
/// header: a device buffer is a pointer, a count and a dtype, a stream is a cudaStream_t passed as void*.
///
/// - Made from a unique id that rank 0 draws and sends to the others over pg (which the store set up), as
///   a non-blocking communicator (NCCL >= 2.14) on `device`, with the group's deadline (GroupOptions::timeout).
/// - Ops run on the communicator's own stream, after what was issued on the caller's `stream` before the
///   call. Each returns a Work that completes when the GPU has finished the op (a watchdog thread polls
///   its event and NCCL's asynchronous error); wait() blocks the host until then, so work queued on any
///   stream afterwards sees the result. Buffers must stay valid until the Work completes.
/// - With GroupOptions::check_fingerprints (DTRAIN_DEBUG=detail), every op first compares its fingerprint
///   (op, dtype, count, reduce op, root, sequence number) with the other ranks' over pg: ranks that
///   disagree all fail with a ProtocolError naming both calls, and a dead peer is named by pg's transport
///   before any kernel waits for it. Without it no host exchange runs per op (DDP issues them from
///   autograd's thread), and a mismatch or a dead peer is found at the deadline.
/// - Ops may be issued from several threads: each is issued whole (check, launch, queue) before the next.
/// - Past the deadline (a peer stuck inside a kernel), on an asynchronous NCCL error, or on any failure
///   while issuing, the communicator is aborted (ncclCommAbort) first, and then the op and every op still
///   pending fail with an error naming the op, its sequence number, the GPU and the group's ranks; later
///   ops fail at once with the same error.
/// - The calls leave the calling thread's current CUDA device as they found it.
/// - The destructor waits for the pending ops (each fails at its deadline at the latest), then ends the
///   communicator with ncclCommFinalize and ncclCommDestroy (an abort if it broke), each bounded in time.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "dtrain/comm/types.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

class ProcessGroup;
class NcclComm;
namespace nccl {
class DeviceApi;
// Internal (src/comm/nccl/device_api.h): create() over the CUDA and NCCL calls given, for the tests.
std::shared_ptr<NcclComm> createComm(ProcessGroup& pg, int device, std::shared_ptr<DeviceApi> api);
}  // namespace nccl

/// True when dtrain was built with NCCL (a CUDA build: DTRAIN_CUDA). Says nothing about GPUs being there.
bool ncclBuilt();
/// NCCL's version as loaded ("2.30.7"), or "" when not built with it.
std::string ncclVersionText();

/// An NCCL communicator over the ranks of a ProcessGroup, one GPU per rank, for raw device buffers.
class NcclComm {
 public:
  /// Collective over pg's ranks. InvalidArgument without NCCL in this build; an Error naming CUDA's
  /// or NCCL's reason when the device or the communicator cannot be set up (two ranks on one GPU:
  /// NCCL's "Duplicate GPU detected"); TimeoutError past pg's deadline.
  static std::shared_ptr<NcclComm> create(ProcessGroup& pg, int device);
  /// Waits for the pending ops (each fails at its deadline at the latest), then ends the communicator.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  /// out = op over every rank's in (count elements each); in == out reduces in place.
  WorkPtr allreduce(const void* in, void* out, size_t count, DType t, ReduceOp op, void* stream);
  /// Root's buf (count elements) into every rank's buf.
  WorkPtr broadcast(void* buf, size_t count, DType t, int root, void* stream);
  /// out holds size() * count elements, rank r's block at r * count.
  WorkPtr allgather(const void* in, void* out, size_t count, DType t, void* stream);
  /// in holds size() * count elements; out gets this rank's reduced block.
  WorkPtr reduceScatter(const void* in, void* out, size_t count, DType t, ReduceOp op, void* stream);

  /// The CUDA device this communicator runs on.
  int device() const;
  /// This rank in the communicator (its rank in the group).
  int rank() const;
  /// The number of ranks.
  int size() const;

  struct Impl;

 private:
  friend std::shared_ptr<NcclComm> nccl::createComm(ProcessGroup&, int, std::shared_ptr<nccl::DeviceApi>);
  explicit NcclComm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::comm
