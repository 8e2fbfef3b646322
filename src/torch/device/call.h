// One collective on tensors, as the device paths run it (tensor_comm.h): what it is and how to hand it to
// a ProcessGroup on host buffers, which the staged path shares with the host path.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>

#include "dtrain/comm/process_group.h"
#include "torch/device/tensor_comm.h"

namespace dtrain::device {

struct Call {
  enum Kind { allreduce, broadcast, allgather, reduce_scatter } kind;
  comm::ReduceOp rop = comm::ReduceOp::sum;
  int root = 0;
  // Elementwise on equal positions of in and out (allreduce, broadcast): may be cut into chunks.
  bool chunkable() const { return kind == allreduce || kind == broadcast; }
};

// The collective on host memory: in (count elements per rank's block) and out, as ProcessGroup takes them.
comm::WorkPtr hostCall(comm::ProcessGroup& pg, const Call& c, const void* in, void* out, size_t in_count, comm::DType t);

// A collective on host buffers: in, out and the elements of in it covers (a chunk's, or all of in).
using HostOp = std::function<comm::WorkPtr(const void* in, void* out, size_t in_count)>;

namespace cuda {
// in and out (CUDA tensors) staged through pinned host buffers around op: chunked when the op is
// elementwise (in and out then the same host buffer), whole otherwise; copy_in false when this rank's
// input is not read (a broadcast's non-root).
comm::WorkPtr staged(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out, bool chunkable, bool copy_in,
                     const HostOp& op);
// Where the CUDA tensor t is (path.h), this rank being `rank`.
Place placeOf(const at::Tensor& t, int rank);
// The NCCL communicator of t's device in pg, made now (tensor_comm.h: prepare).
void prepareNccl(comm::ProcessGroup& pg, const at::Tensor& t);
// The call on CUDA tensors by `path` (nccl or staged).
comm::WorkPtr run(comm::ProcessGroup& pg, Path path, const Call& c, const at::Tensor& in, const at::Tensor& out);
}  // namespace cuda

}  // namespace dtrain::device
