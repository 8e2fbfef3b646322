/// @file
/// DataParallel: one process, one model replica per thread (PyTorch's nn.DataParallel, the "DP" of
/// "DP vs DDP"). Each step splits the batch across the replicas, runs their forward and backward
/// concurrently and sums their gradients into the model the optimizer updates. It exists to compare
/// with DistributedDataParallel (ddp.h), which scales further: one process per replica, across hosts,
/// with the gradient exchange overlapped with backward.
///
/// \code
///   at::set_num_threads(1);                       // one intra-op thread per replica (see below)
///   auto net = torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
///   dtrain::DataParallel dp(net, /*num_replicas=*/4);
///   torch::optim::SGD opt(net->parameters(), 0.1);
///   for (auto& [x, y] : batches) {
///     opt.zero_grad();
///     at::Tensor loss = dp.step(x, y, [](torch::nn::Module& replica, const at::Tensor& x, const at::Tensor& y) {
///       return torch::mse_loss(replica.as<torch::nn::Sequential>()->forward(x), y);   // mean over the slice
///     });
///     opt.step();                                 // the next step() copies the new weights to the replicas
///   }
/// \endcode
///
/// Semantics of step(input, target, loss_fn):
///  - Replicas are refreshed from the main module first (parameters, buffers, train/eval mode).
///  - input and target (may be undefined) are split along dim 0 into num_replicas slices whose sizes
///    differ by at most one (10 rows on 4 replicas: 3, 3, 2, 2), so no replica idles while
///    batch >= num_replicas; with fewer rows the surplus replicas sit the step out.
///  - Replica k computes loss_fn(replica_k, input_k, target_k), which must return a scalar: the mean
///    loss of its slice. Its backward runs on loss_k * n_k / batch, so the summed gradient is that of
///    the mean over the whole batch: the same as one model on the whole batch (up to rounding).
///  - Gradients are added into the main module's .grad, accumulating like a normal backward (call
///    the optimizer's zero_grad() yourself). Returns the batch's mean loss, detached.
///  - An exception in any replica's loss_fn or backward is rethrown by step() (the lowest replica's,
///    when several throw) after every thread finished; the main module's gradients are then
///    unspecified (zero them before the next step).
///
/// Across GPUs: DataParallel(module, {cuda:0, cuda:1, ...}) puts replica k on device k (the main module is
/// moved to the first), moves each slice of input and target to its replica's device, and sums the
/// gradients on the first device; the returned loss is on the first device too. Devices may repeat (two
/// replicas on one GPU) and may be the CPU.
///
/// Replica 0 is the main module itself, run by the calling thread; replicas 1..n-1 are clone()s run
/// by a pool of n-1 threads that lives as long as the DataParallel. As in PyTorch, buffer updates
/// (e.g. BatchNorm running statistics) persist from replica 0 only, computed on its slice only.
/// The module must support clone(): modules deriving torch::nn::Cloneable (every built-in module and
/// the TORCH_MODULE holder pattern with registered submodules) do. clone() re-initializes the copies
/// before overwriting them, so building a DataParallel draws from torch's global RNG.
///
/// Threads: at::set_num_threads() is process-wide, so DataParallel does not touch it. Each replica's
/// operators run with that many intra-op threads, so n replicas use n x at::get_num_threads() cores:
/// set it to max(1, cores / num_replicas) (1 for small models) before building the DataParallel.
/// Thread-local torch state of the caller (grad mode, inference mode, ...) applies in every replica.
/// loss_fn runs concurrently on the replica threads: it must not touch shared state without a lock.
/// A DataParallel is not itself thread-safe: one step() at a time.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <vector>

namespace dtrain {

/// One process, one model replica per thread: each step splits the batch across the replicas and sums
/// their gradients into the main module (see the file's description).
class DataParallel {
 public:
  /// The mean loss of one slice. `replica` is the main module or one of its clones: reach its typed
  /// forward with replica.as<Net>() (Net being the holder or the module class).
  using LossFn = std::function<at::Tensor(torch::nn::Module& replica, const at::Tensor& input, const at::Tensor& target)>;

  /// num_replicas >= 1 (InvalidArgument otherwise); 1 runs everything on the calling thread. Every replica on
  /// the main module's device.
  DataParallel(std::shared_ptr<torch::nn::Module> module, int num_replicas);
  /// One replica per entry of devices (at least one), replica k on devices[k] (see above).
  DataParallel(std::shared_ptr<torch::nn::Module> module, std::vector<c10::Device> devices);
  /// As DataParallel(module.ptr(), devices), for a module holder (TORCH_MODULE).
  template <typename M>
  DataParallel(const torch::nn::ModuleHolder<M>& module, std::vector<c10::Device> devices)
      : DataParallel(module.ptr(), std::move(devices)) {}
  /// As DataParallel(module.ptr(), num_replicas), for a module holder (TORCH_MODULE).
  template <typename M>
  DataParallel(const torch::nn::ModuleHolder<M>& module, int num_replicas) : DataParallel(module.ptr(), num_replicas) {}
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// One forward + backward of the whole batch, split across the replicas (see above).
  at::Tensor step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn);

  /// Copies parameters, buffers and the train/eval mode main -> replicas. step() calls it first; call
  /// it yourself only to use replica(k) directly after changing the main module.
  void syncReplicas();

  /// The number of replicas, the main module included.
  int numReplicas() const;
  /// Replica k (0 is the main module).
  torch::nn::Module& replica(int k);
  /// Rows of each replica's slice for a batch of `batch` rows: sizes differ by at most one, larger first.
  static std::vector<int64_t> splitSizes(int64_t batch, int num_replicas);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain
