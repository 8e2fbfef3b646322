// The CUDA paths of tensor collectives (tensor_comm.h): which one a group takes, NCCL on the device, and
// staging through pinned host buffers. Compiled to a refusal in a build without CUDA.
#include <ATen/ATen.h>

#include <chrono>
#include <string>
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/tensor.h"
#include "torch/device/call.h"

#ifdef DTRAIN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <functional>
#endif

namespace dtrain::device::cuda {

#ifdef DTRAIN_WITH_CUDA

namespace {

using Clock = std::chrono::steady_clock;

// Staged copies go in chunks of about this size, at most kMaxChunks per call: the collective on one chunk
// runs while the next is still being copied to the host, and each result is copied back at once.
constexpr size_t kChunkBytes = size_t{4} << 20;
constexpr int64_t kMaxChunks = 16;

// A CUDA event without timing on `device`, destroyed with its owner. Every call on it sets its device
// first (restoring the thread's afterwards): the group's thread and the thread that drops the last
// reference must not open a context on GPU 0 when the rank works on another one.
struct Event {
  cudaEvent_t e = nullptr;
  c10::Device device;
  Event(int rank, c10::Device dev) : device(dev) {
    c10::cuda::CUDAGuard g(device);
    cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    DTRAIN_CHECK(r == cudaSuccess, Error, "[rank {}] staging: cudaEventCreate: {}", rank, cudaGetErrorString(r));
  }
  ~Event() {
    if (!e) return;
    c10::cuda::CUDAGuard g(device);
    cudaEventDestroy(e);
  }
  // Records it on the stream (of its device).
  void record(const c10::cuda::CUDAStream& stream, int rank) const {
    cudaError_t r = cudaEventRecord(e, stream.stream());
    DTRAIN_CHECK(r == cudaSuccess, Error, "[rank {}] staging: cudaEventRecord: {}", rank, cudaGetErrorString(r));
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// Polls the event until it fires; a deadline, never an unbounded cudaEventSynchronize.
void waitFor(const Event& ev, Clock::time_point deadline, const std::string& what, int rank) {
  c10::cuda::CUDAGuard g(ev.device);
  for (;;) {
    const cudaError_t q = cudaEventQuery(ev.e);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady)
      throw Error(fmt::format("[rank {}] {}: CUDA error {} ({})", rank, what, static_cast<int>(q), cudaGetErrorString(q)));
    if (Clock::now() > deadline)
      throw TimeoutError(fmt::format("[rank {}] {}: the GPU did not finish the copy before the group's deadline", rank, what));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

std::shared_ptr<comm::NcclComm> ncclFor(comm::ProcessGroup& pg, int device) {
  auto a = pg.attachment(fmt::format("dtrain.nccl.cuda:{}", device),
                         [&] { return std::static_pointer_cast<void>(comm::NcclComm::create(pg, device)); });
  return std::static_pointer_cast<comm::NcclComm>(a);
}

comm::WorkPtr viaNccl(comm::ProcessGroup& pg, const Call& c, const at::Tensor& in, const at::Tensor& out) {
  const int dev = in.device().index();
  auto nccl = ncclFor(pg, dev);
  void* s = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream();
  const auto dt = toCommDType(in.scalar_type());
  const auto n = static_cast<size_t>(in.numel());
  comm::WorkPtr w;
  switch (c.kind) {
    case Call::allreduce: w = nccl->allreduce(in.data_ptr(), out.data_ptr(), n, dt, c.rop, s); break;
    case Call::broadcast: w = nccl->broadcast(out.data_ptr(), n, dt, c.root, s); break;
    case Call::allgather: w = nccl->allgather(in.data_ptr(), out.data_ptr(), n, dt, s); break;
    case Call::reduce_scatter:
      w = nccl->reduceScatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), dt, c.rop, s);
      break;
  }
  w->onComplete([in, out] {});  // the tensors live until the GPU is done with them
  return w;
}

}  // namespace

comm::WorkPtr staged(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor& out, bool chunkable, bool copy_in,
                     const HostOp& op) {
  const c10::Device dev = in.device();
  c10::cuda::CUDAGuard guard(dev);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(dev.index());
  const int rank = pg.rank();
  const auto pinned = at::TensorOptions().dtype(in.scalar_type()).pinned_memory(true);
  const at::Tensor src = in.reshape({-1}), dst = out.reshape({-1});
  const at::Tensor hin = at::empty({in.numel()}, pinned);
  const at::Tensor hout = chunkable ? hin : at::empty({out.numel()}, pinned);
  const auto deadline = Clock::now() + pg.options().timeout;
  const int64_t n = in.numel();
  const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / in.element_size()));
  const int64_t chunks = chunkable ? std::max<int64_t>(1, std::min(kMaxChunks, (n + per - 1) / per)) : 1;
  const int64_t step = chunks == 1 ? n : (n + chunks - 1) / chunks;
  std::vector<comm::WorkPtr> parts;
  for (int64_t i = 0, off = 0; i < chunks; ++i, off += step) {
    const int64_t len = std::max<int64_t>(0, std::min(step, n - off));
    const at::Tensor d_in = chunks == 1 ? src : src.narrow(0, off, len), h_in = chunks == 1 ? hin : hin.narrow(0, off, len);
    const at::Tensor d_out = chunks == 1 ? dst : dst.narrow(0, off, len), h_out = chunks == 1 ? hout : hout.narrow(0, off, len);
    auto ready = std::make_shared<Event>(rank, dev);
    {
      c10::cuda::CUDAStreamGuard sg(stream);
      if (copy_in) h_in.copy_(d_in, /*non_blocking=*/true);
    }
    ready->record(stream, rank);
    const std::string what = fmt::format("staged copy to the host of {} elements (chunk {} of {})", len, i + 1, chunks);
    pg.localStep(what, [ready, deadline, what, rank] { waitFor(*ready, deadline, what, rank); });
    comm::WorkPtr w = op(h_in.data_ptr(), h_out.data_ptr(), static_cast<size_t>(chunks == 1 ? n : len));
    // The result goes back on the caller's stream as soon as this chunk is done, and the chunk counts as
    // done once that copy has finished (an event after it, waited for in the group's order): a consumer
    // on another stream or thread then reads the result, not the old contents. The host buffers live
    // until then.
    comm::ProcessGroup* group = &pg;
    const std::string back = fmt::format("staged copy back of {} elements (chunk {} of {})", len, i + 1, chunks);
    parts.push_back(w->then([group, stream, dev, d_out, h_out, hin, hout, deadline, back, rank]() -> comm::WorkPtr {
      c10::cuda::CUDAGuard g(dev);
      c10::cuda::CUDAStreamGuard sg(stream);
      d_out.copy_(h_out, /*non_blocking=*/true);
      auto done = std::make_shared<Event>(rank, dev);
      done->record(stream, rank);
      return group->localStep(back, [done, deadline, back, rank, d_out, hin, hout] { waitFor(*done, deadline, back, rank); });
    }));
  }
  // Done when every chunk's copy back has finished.
  comm::WorkPtr all = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) all = all->then([w = parts[i]] { return w; });
  return all;
}

Place placeOf(const at::Tensor& t, int rank) {
  const int dev = t.device().index();
  char bus[64] = {0};
  cudaError_t r = cudaDeviceGetPCIBusId(bus, sizeof(bus), dev);
  DTRAIN_CHECK(r == cudaSuccess, Error, "[rank {}] cuda:{}: cudaDeviceGetPCIBusId: {}", rank, dev, cudaGetErrorString(r));
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  // Host name and PCI bus id: the same GPU in every process that sees it (CUDA_VISIBLE_DEVICES may give
  // one GPU different indices in different processes).
  return Place{dev, std::hash<std::string>{}(std::string(host) + "/" + bus), ncclSharesGpus()};
}

void prepareNccl(comm::ProcessGroup& pg, const at::Tensor& t) { ncclFor(pg, t.device().index()); }

comm::WorkPtr run(comm::ProcessGroup& pg, Path path, const Call& c, const at::Tensor& in, const at::Tensor& out) {
  if (path == Path::nccl) return viaNccl(pg, c, in, out);
  const auto dt = toCommDType(in.scalar_type());
  return staged(pg, in, out, c.chunkable(), !(c.kind == Call::broadcast && pg.rank() != c.root),
                [&pg, c, dt](const void* i, void* o, size_t count) { return hostCall(pg, c, i, o, count, dt); });
}

#else  // a build without CUDA: no CUDA tensor gets here (checkTensor refuses it first)

namespace {
[[noreturn]] void refuse(int rank, const at::Tensor& t) {
  throw InvalidArgument(fmt::format("[rank {}] a tensor on {}: this dtrain was built without CUDA", rank, t.device().str()));
}
}  // namespace

Place placeOf(const at::Tensor& t, int rank) { refuse(rank, t); }

void prepareNccl(comm::ProcessGroup& pg, const at::Tensor& t) { refuse(pg.rank(), t); }

comm::WorkPtr run(comm::ProcessGroup& pg, Path, const Call&, const at::Tensor& in, const at::Tensor&) { refuse(pg.rank(), in); }

comm::WorkPtr staged(comm::ProcessGroup& pg, const at::Tensor& in, const at::Tensor&, bool, bool, const HostOp&) {
  refuse(pg.rank(), in);
}

#endif

}  // namespace dtrain::device::cuda
