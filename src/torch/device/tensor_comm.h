// Collectives on tensors of any device: the one place that decides which path a tensor takes, so that
// DDP's bucketing, FSDP, the hooks and the optimizers never ask CUDA themselves (docs/ARCHITECTURE.md,
// "Devices").
//   host    a CPU tensor: its storage goes to the ProcessGroup as it is (no copy)
//   nccl    a CUDA tensor, in a CUDA build, where every rank of the group has a GPU of its own (or the
//           group is a world of one): NCCL on the device (dtrain/comm/nccl.h), the communicator made on
//           first use and kept as one of the group's attachments
//   staged  every other CUDA tensor (ranks sharing a GPU, no NCCL, DTRAIN_CUDA_COMM=staged): through
//           pinned host buffers over the group's own transport. Device-to-host copies are queued on the
//           caller's current stream in chunks, each followed by an event; the group waits for each chunk's
//           event in its issue order (ProcessGroup::localStep) and runs the collective on that chunk while
//           later chunks are still copying; each chunk's result is copied back on the same stream as soon
//           as its collective ends. So work queued on that stream after wait() sees the result.
// Every function returns at once with the Work of the whole operation and keeps the tensors alive until
// it completes; the caller waits as for any Work. Errors name `what` (e.g. "DDP bucket 3").
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <string>

#include "dtrain/comm/process_group.h"
#include "torch/device/path.h"

namespace dtrain::device {

// The path `t` takes through `pg` (path.h: choosePath). Collective on a group's first tensor of each
// device of this rank: the ranks agree, once, on where each one's tensors are; a group whose ranks pass
// CPU tensors on some and CUDA tensors on others fails there on every rank, saying so.
Path pathFor(comm::ProcessGroup& pg, const at::Tensor& t);

// InvalidArgument naming `what` unless t is defined, contiguous, of a dtype dtrain communicates and on
// the CPU or (in a CUDA build) on a CUDA device.
void checkTensor(const at::Tensor& t, const char* what);

// InvalidArgument unless t is on first's device: `who` (DDP, FSDP, ZeRO) takes a model on one device. The
// names are the two tensors'.
void checkSameDevice(const at::Tensor& first, const std::string& first_name, const at::Tensor& t,
                     const std::string& name, const char* who);

// Collective over pg: decides the path of tensors like t in pg (pathFor) and, for NCCL, makes pg's
// communicator now. NCCL warns that making a communicator while another's kernels are in flight can
// deadlock, so code that will use a second group on the GPU (DDP's comm hooks) prepares it before its
// first step; and the exchange pathFor waits for must not first happen inside a continuation on the
// group's own thread.
void prepare(comm::ProcessGroup& pg, const at::Tensor& t);

// In place: every rank's t becomes the reduction.
comm::WorkPtr allreduce(comm::ProcessGroup& pg, const at::Tensor& t, comm::ReduceOp op);
// Out of place: out (as many elements as in, on its device) becomes the reduction of every rank's in.
comm::WorkPtr allreduce(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out, comm::ReduceOp op);
comm::WorkPtr broadcast(comm::ProcessGroup& pg, const at::Tensor& t, int root);
// out holds pg.size() * in.numel() elements, on in's device.
comm::WorkPtr allgather(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out);
// in holds pg.size() * out.numel() elements; out gets this rank's reduced block.
comm::WorkPtr reduceScatter(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out, comm::ReduceOp op);

// Any collective that ProcessGroup runs on host buffers (allgatherv, reduceScatterv, ...), on tensors of
// any device: CPU tensors as they are, CUDA tensors staged through pinned host buffers, whole (NCCL has
// no uneven collectives).
comm::WorkPtr onHost(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out,
                     const std::function<comm::WorkPtr(const void* in, void* out)>& op);

}  // namespace dtrain::device
