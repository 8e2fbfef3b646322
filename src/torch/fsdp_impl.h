// FullyShardedDataParallel's state (internal to fsdp.cc and fsdp_state.cc).
#pragma once
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/compat.h"
#include "dtrain/fsdp.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"

namespace dtrain {

namespace fsdp_detail {

struct Unit {
  int first = 0, children = 0;          // the Sequential's children [first, first + children)
  std::vector<at::Tensor> params;       // the module's own parameter tensors, viewing `flat`
  std::vector<std::string> names;
  std::vector<int64_t> offsets;
  int64_t numel = 0, chunk = 0;         // chunk: this rank's share (the buffer is W * chunk, zero-padded)
  at::Tensor flat;                      // the gathered parameters (its memory lent by the pool while gathered)
  at::Tensor param_buf;                 // the pool's buffer lent to `flat`
  bool grads_in_buf = false;            // this pass's gradients are views into grad_flat (from the pool)
  at::Tensor shard;                     // this rank's part, what the optimizer steps
  size_t bytes = 0;                     // of the gathered buffer
  bool gathered = false;
  int64_t version = 0;                  // the shard's version counter when it was gathered
  comm::WorkPtr gathering;              // an allgather in flight (prefetch)
  // This backward pass:
  std::vector<char> ready;
  size_t pending = 0;
  comm::WorkPtr reducing;
  at::Tensor grad_flat, grad_part;
  // A gradient reached one of the unit's parameters on this rank in this accumulation window (the synced
  // pass and the noSync passes before it). A unit that no rank used leaves its shard's gradient as it was
  // (an undefined one stays undefined, so the optimizer skips the shard, as one process skips the
  // parameters): the reduced part waits in `reduced` until the ranks have told each other (finishPass).
  bool used = false;
  at::Tensor reduced;
  std::vector<compat::GradAccumulatorPtr> accumulators;
};

}  // namespace fsdp_detail

struct FullyShardedDataParallel::Impl {
  using Unit = fsdp_detail::Unit;
  torch::nn::Sequential model{nullptr};
  std::shared_ptr<comm::ProcessGroup> pg;
  FsdpOptions opts;
  std::vector<Unit> units;
  bool sync = true, in_backward = false;
  int next_launch = -1;  // the next unit whose reduce-scatter may go (reverse order)
  int64_t gathered_now = 0, gathered_peak = 0;
  int64_t transient_peak = 0;  // the pool's bytes at most (and autograd's own gradients of a unit, when used)
  std::shared_ptr<std::atomic<Impl*>> owner;

  // Whole-unit buffers (gathered parameters, gradients) are lent from a pool and given back, so that a
  // step does not allocate, fault in and free tens of MB: the pool keeps what was needed at most at once.
  at::Device device{at::kCPU};   // the parameters' (all on one device): where the pool's buffers live
  std::vector<at::Tensor> pool;  // free buffers
  int64_t pool_bytes = 0;        // every buffer the pool made (free or lent)
  at::Tensor borrow(size_t bytes) {
    auto best = pool.end();
    for (auto it = pool.begin(); it != pool.end(); ++it)
      if (it->nbytes() >= bytes && (best == pool.end() || it->nbytes() < best->nbytes())) best = it;
    if (best != pool.end()) {
      at::Tensor t = *best;
      pool.erase(best);
      return t;
    }
    pool_bytes += static_cast<int64_t>(bytes);
    transient_peak = std::max(transient_peak, pool_bytes);
    return at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device));
  }
  void giveBack(at::Tensor& t) {
    if (t.defined()) pool.push_back(t);
    t = at::Tensor();
  }
  void allocate(Unit& u) {
    u.param_buf = borrow(u.bytes);
    auto* s = u.flat.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(at::DataPtr(u.param_buf.data_ptr(), device));
    s->set_nbytes(u.bytes);
    gathered_now += static_cast<int64_t>(u.bytes);
    gathered_peak = std::max(gathered_peak, gathered_now);
  }
  void release(Unit& u) {
    if (u.gathering) u.gathering->wait();
    u.gathering.reset();
    if (!u.gathered) return;
    u.flat.storage().unsafeGetStorageImpl()->reset();
    giveBack(u.param_buf);
    gathered_now -= static_cast<int64_t>(u.bytes);
    u.gathered = false;
  }
  // Starts gathering the unit's parameters (async: wait with ensure()).
  void startGather(Unit& u) {
    if (u.gathered) return;
    allocate(u);
    u.gathered = true;
    u.version = u.shard._version();
    u.gathering = device::allgather(*pg, u.shard, u.flat.narrow(0, 0, u.chunk * pg->size()));
  }
  void ensure(Unit& u) {
    startGather(u);
    if (u.gathering) u.gathering->wait();
    u.gathering.reset();
  }

  void startPass();
  void onPreBackward(size_t k);
  void onGradReady(size_t k, size_t i, bool arrived);
  void launchReady();
  void reduceScatter(Unit& u);
  void completeReduce(Unit& u);  // waits for u's reduce-scatter; its part waits in u.reduced
  // After the pass's reduce-scatters: which units some rank used (an allreduce, max, of a flag per unit);
  // their reduced parts go into the shards' gradients, the others' are dropped.
  void applyUsedUnits();
  void finishPass();
};

}  // namespace dtrain
