// Collectives on tensors of any device (tensor_comm.h): the checks, the host path and the dispatch. The
// CUDA paths are in cuda_paths.cc.
#include "torch/device/tensor_comm.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include "dtrain/comm/error.h"
#include "dtrain/tensor.h"
#include "torch/device/call.h"

namespace dtrain::device {

void checkTensor(const at::Tensor& t, const char* what) {
  DTRAIN_CHECK(t.defined(), InvalidArgument, "{}: undefined tensor", what);
#ifdef DTRAIN_WITH_CUDA
  DTRAIN_CHECK(t.device().is_cpu() || t.device().is_cuda(), InvalidArgument,
               "{}: tensor is on {}, dtrain communicates CPU and CUDA tensors", what, t.device().str());
#else
  DTRAIN_CHECK(t.device().is_cpu(), InvalidArgument,
               "{}: tensor is on {}, and this dtrain was built without CUDA (DTRAIN_CUDA=OFF): it communicates CPU "
               "tensors", what, t.device().str());
#endif
  DTRAIN_CHECK(t.is_contiguous(), InvalidArgument, "{}: tensor of shape {} is not contiguous", what,
               fmt::format("{}", fmt::join(t.sizes(), "x")));
  toCommDType(t.scalar_type(), what);
}

void checkSameDevice(const at::Tensor& first, const std::string& first_name, const at::Tensor& t,
                     const std::string& name, const char* who) {
  DTRAIN_CHECK(t.device() == first.device(), InvalidArgument, "{} parameter {} is on {}, {} on {}: {} takes a model on "
               "one device", who, name, t.device().str(), first_name, first.device().str(), who);
}

Path pathFor(comm::ProcessGroup& pg, const at::Tensor& t) {
  const bool gpu = t.device().is_cuda();
  // Agreed once per group and device of this rank; a failed agreement is tried again by the next call.
  auto a = pg.attachment(gpu ? fmt::format("dtrain.path.cuda:{}", t.device().index()) : "dtrain.path.cpu", [&] {
    const Place mine = gpu ? cuda::placeOf(t, pg.rank()) : Place::cpu();
    return std::static_pointer_cast<void>(std::make_shared<Path>(agreePath(pg, mine)));
  });
  return *std::static_pointer_cast<Path>(a);
}

void prepare(comm::ProcessGroup& pg, const at::Tensor& t) {
  if (pathFor(pg, t) == Path::nccl) cuda::prepareNccl(pg, t);
}

comm::WorkPtr hostCall(comm::ProcessGroup& pg, const Call& c, const void* in, void* out, size_t in_count, comm::DType t) {
  switch (c.kind) {
    case Call::allreduce: return pg.allreduce(in, out, in_count, t, c.rop);
    case Call::broadcast: return pg.broadcast(out, in_count, t, c.root);
    case Call::allgather: return pg.allgather(in, out, in_count, t);
    case Call::reduce_scatter:
      return pg.reduceScatter(in, out, in_count / static_cast<size_t>(pg.size()), t, c.rop);
  }
  return nullptr;
}

namespace {

// What every collective on tensors checks first: both communicable, on one device, of one dtype (the
// output is written with the input's element size).
void checkPair(const at::Tensor& in, const at::Tensor& out) {
  checkTensor(in, "collective input");
  checkTensor(out, "collective output");
  DTRAIN_CHECK(in.device() == out.device(), InvalidArgument, "collective: input on {}, output on {}",
               in.device().str(), out.device().str());
  DTRAIN_CHECK(in.scalar_type() == out.scalar_type(), InvalidArgument,
               "collective: input of dtype {}, output of dtype {} (they must be the same)",
               c10::toString(in.scalar_type()), c10::toString(out.scalar_type()));
}

comm::WorkPtr run(comm::ProcessGroup& pg, const Call& c, const at::Tensor& in, const at::Tensor& out) {
  checkPair(in, out);
  const Path path = pathFor(pg, in);
  if (path != Path::host) return cuda::run(pg, path, c, in, out);
  auto w = hostCall(pg, c, in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()),
                    toCommDType(in.scalar_type()));
  w->onComplete([in, out] {});  // the tensors live until the op is done
  return w;
}

}  // namespace

comm::WorkPtr allreduce(comm::ProcessGroup& pg, const at::Tensor& t, comm::ReduceOp op) {
  return run(pg, Call{Call::allreduce, op, 0}, t, t);
}

comm::WorkPtr allreduce(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out, comm::ReduceOp op) {
  DTRAIN_CHECK_EQ(out.numel(), in.numel(), "allreduce: output elements (as many as the input)");
  return run(pg, Call{Call::allreduce, op, 0}, in, out);
}

comm::WorkPtr broadcast(comm::ProcessGroup& pg, const at::Tensor& t, int root) {
  return run(pg, Call{Call::broadcast, comm::ReduceOp::sum, root}, t, t);
}

comm::WorkPtr allgather(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out) {
  DTRAIN_CHECK_EQ(out.numel(), in.numel() * pg.size(), "allgather: output elements (input x group size)");
  return run(pg, Call{Call::allgather, comm::ReduceOp::sum, 0}, in, out);
}

comm::WorkPtr reduceScatter(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out, comm::ReduceOp op) {
  DTRAIN_CHECK_EQ(in.numel(), out.numel() * pg.size(), "reduceScatter: input elements (output x group size)");
  return run(pg, Call{Call::reduce_scatter, op, 0}, in, out);
}

comm::WorkPtr onHost(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out,
                     const std::function<comm::WorkPtr(const void* in, void* out)>& op) {
  checkPair(in, out);
  if (pathFor(pg, in) != Path::host)  // staged even where NCCL is the path: it has no uneven collectives
    return cuda::staged(pg, in, out, /*chunkable=*/false, /*copy_in=*/true,
                        [op](const void* i, void* o, size_t) { return op(i, o); });
  auto w = op(in.data_ptr(), out.data_ptr());
  w->onComplete([in, out] {});
  return w;
}

}  // namespace dtrain::device
