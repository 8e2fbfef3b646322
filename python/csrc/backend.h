// dtrain as a torch.distributed backend (docs/PYTHON.md): a c10d::Backend over a dtrain ProcessGroup, made
// from the c10d::Store that torch.distributed passes in (torchrun's TCPStore), so no second rendezvous.
//
// Every collective torch.distributed offers on CPU tensors maps onto the group's ops; CUDA tensors go
// through dtrain's device layer (NCCL or staged through the host; not yet run on a GPU). A reduction
// that the comm layer has no kernel for (int8, int16, bool, the bitwise ops) is an all-gather followed by
// the reduction in torch, exact and slower. Each op returns a Work whose future completes with its
// outputs; errors reach Python as torch.distributed.DistBackendError (ValueError for bad arguments),
// naming the op, its sequence number and, for a lost peer, its rank.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain::python {

// Runs the futures' completions (and so their callbacks: Python code, DDP's comm hooks) off the group's
// thread, in order, on one thread while callbacks return; a callback that blocks (PyTorch's PowerSGD hook
// waits for a future inside its callback) gets the next completions run on another thread, so the
// future it waits for can complete. At most kMaxThreads threads; they end with the Completer.
class Completer {
 public:
  static constexpr int kMaxThreads = 32;
  Completer() = default;
  ~Completer();  // runs what is queued, then joins
  void post(std::function<void()> task);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  int idle_ = 0;
  std::vector<std::thread> threads_;
};

class DtrainBackend : public c10d::Backend {
 public:
  DtrainBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
                std::string name);
  ~DtrainBackend() override;

  const std::string getBackendName() const override { return "dtrain"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }

  comm::ProcessGroup& group() { return *pg_; }

  struct Op;  // one op being issued (backend.cc)

 private:
  // Each issues its part of `op` (called inside Op::run) and adds what must run once it is done.
  comm::WorkPtr issueAllreduce(Op& op, at::Tensor c, const c10d::ReduceOp& rop);
  comm::WorkPtr issueAllgatherBase(Op& op, const at::Tensor& output, const at::Tensor& input);
  comm::WorkPtr issueReduceScatter(Op& op, const at::Tensor& out, const std::vector<at::Tensor>& ins,
                                   const c10d::ReduceOp& rop);

  std::shared_ptr<comm::ProcessGroup> pg_;
  std::shared_ptr<Completer> completer_;
  std::atomic<uint64_t> seq_{0};  // ops are issued from Python's threads and the futures' callbacks
};

// The creator torch.distributed calls (python/dtrain/__init__.py).
c10::intrusive_ptr<c10d::Backend> createBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout, const std::string& name);

}  // namespace dtrain::python
