/// @file
/// Join: training with DDP when ranks have different numbers of batches (PyTorch's
/// torch.distributed.algorithms.Join with DistributedDataParallel).
///
/// \code
///   dtrain::DistributedDataParallel ddp(model.ptr(), dist.world());
///   {
///     dtrain::Join join(ddp);               // every rank, at the same point, before its loop
///     for (auto& batch : my_batches) {      // 5 batches here, 9 on another rank
///       opt.zero_grad();
///       loss_fn(model->forward(batch.data), batch.target).backward();
///       opt.step();
///     }
///     join.finish();                        // out of data: shadow the others until all are done
///   }                                       // (the destructor calls finish() if the scope ends normally)
/// \endcode
///
/// Semantics (PyTorch's): a rank that calls finish() has joined. Until every rank has joined it
/// shadows the others' synced backward passes: it contributes zeros to each gradient bucket's
/// allreduce and takes part in the buffer broadcast, so the ranks still training never wait for it.
/// The average divides by the initial world size (divide_by_initial_world_size, the default): with 3
/// ranks of which one has joined, a step's gradient is (g0 + g1 + 0) / 3. When all have joined,
/// finish() broadcasts the parameters and buffers of the last rank to join (the highest such rank)
/// so every rank leaves with the same model; optimizer state is not synchronized (a joined rank's is
/// that of its last step, as in PyTorch).
///
/// How: inside the join scope every synced backward starts with a small allreduce (one int per rank,
/// 1 if the rank still trains); a joined rank runs the same allreduce with 0 and, unless the sum is
/// 0 (everyone has joined), one shadow pass. Buffers come from the highest rank still training (rank
/// 0 may have joined with stale statistics), as PyTorch does under Join. noSync() backward passes
/// issue no collective and are not shadowed.
///
/// Rules: only DDP's gradient allreduces and buffer broadcasts are shadowed. Any other collective a
/// training rank issues while some rank has joined (an allGather in the loss, a barrier, a metric
/// allreduce, ddp.beforeForward()) cannot be matched: every rank fails with an error, the joined
/// rank's saying that it had joined. Do such collectives after the join scope. A joined rank waits at
/// most the group's timeout (DTRAIN_TIMEOUT) for the others' next synced backward.
#pragma once
#include <exception>

namespace dtrain {

class DistributedDataParallel;

/// Options of a Join.
struct JoinOptions {
  /// Divide the summed gradients by the world size (true, PyTorch's default) or by the number of
  /// ranks still training in that step (false).
  bool divide_by_initial_world_size = true;
  /// Stop as soon as any rank runs out of inputs: in the first synced pass after some rank joined,
  /// every rank throws dtrain::Error naming the joined ranks (after finishing that pass's
  /// collectives, so the group stays usable).
  bool throw_on_early_termination = false;
};

/// The scope in which ranks with uneven numbers of batches train with DDP: a rank out of data shadows the
/// others' synced backward passes until every rank is done (see the file's description).
class Join {
 public:
  /// Collective in spirit: every rank constructs it before the same synced backward pass.
  explicit Join(DistributedDataParallel& ddp, JoinOptions options = {});
  /// Calls finish() unless it was called or the scope is left by an exception (then it only leaves
  /// the join scope; the other ranks fail on their own). Throws what finish() throws.
  ~Join() noexcept(false);
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  /// This rank has no more inputs: shadow the others until every rank has called finish(), then
  /// make the model the same everywhere. Blocks; returns once all ranks are done.
  void finish();

 private:
  DistributedDataParallel& ddp_;
  int uncaught_ = 0;
  bool finished_ = false;
};

}  // namespace dtrain
