/// @file
/// SyncBatchNorm: BatchNorm whose training statistics are those of the global batch (every rank of a
/// process group), so that small per-rank batches normalise as one large batch would. PyTorch's
/// torch.nn.SyncBatchNorm semantics, forward and backward.
///
/// \code
///   auto dist = dtrain::init();
///   // Either build the model with SyncBatchNorm layers ...
///   auto bn = dtrain::SyncBatchNorm(torch::nn::BatchNormOptions(64).momentum(0.1), dist.world());
///   // ... or convert the BatchNorm1d/2d/3d layers of an existing model (see convertSyncBatchNorm):
///   torch::nn::Sequential net(torch::nn::Conv2d(3, 64, 3), torch::nn::BatchNorm2d(64), torch::nn::ReLU());
///   net = torch::nn::Sequential(
///       std::dynamic_pointer_cast<torch::nn::SequentialImpl>(dtrain::convertSyncBatchNorm(net.ptr(), dist.world())));
///   dtrain::DistributedDataParallel ddp(net.ptr(), dist.world());
/// \endcode
///
/// Training mode (with a group of more than one rank): per channel, mean and biased variance of the
/// global batch normalise the input; running_mean/running_var move towards the global mean and the
/// *unbiased* global variance (global count N, var * N / (N - 1)), the same on every rank. Backward
/// allreduces sum(dy) and sum(dy * (x - mean)) per channel, so rank r's input gradient is
/// d(sum_j L_j)/dx_r (L_j: rank j's loss); weight and bias gradients are this rank's part only (DDP
/// averages them, as in PyTorch). Per-rank batches may differ in size and be empty (N counts rows *
/// spatial positions of all ranks); an empty rank still takes part in both collectives. All ranks of the
/// group must run forward and backward through each SyncBatchNorm in the same order, or the others fail
/// at the group's deadline (GroupOptions::timeout) naming the op.
///   Eval mode uses the running statistics (no communication); a group of one rank, or
///   track_running_stats(false) in eval mode, is torch::batch_norm exactly as torch::nn::BatchNorm.
///
/// Differences from PyTorch: the group is given explicitly (dtrain has no process-wide world: pass
/// dist.world() for PyTorch's default); CPU tensors (PyTorch's needs CUDA); the per-rank statistics are
/// (count, mean, sum of squared deviations) merged with Chan et al.'s pairwise formula (PyTorch gathers
/// (mean, invstd, count)): the same numbers, without the 1/sqrt round trip. A global count of at most
/// one value per channel throws InvalidArgument on every rank (PyTorch: only with a world of one).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain {

/// BatchNorm over the global batch of a process group (see the file's description); use it through its
/// holder, dtrain::SyncBatchNorm.
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// A new layer (weight 1, bias 0, running_mean 0, running_var 1) for inputs (N, C, *) with
  /// C = options.num_features(). pg must not be null; it is kept alive by the layer.
  SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, std::shared_ptr<comm::ProcessGroup> pg);
  /// Takes over a BatchNorm1d/2d/3d layer: its options and its parameter and buffer tensors themselves
  /// (shared, not copied: an optimizer built on the old layer keeps updating the same tensors).
  /// InvalidArgument when batch_norm is not one of those three.
  SyncBatchNormImpl(const torch::nn::Module& batch_norm, std::shared_ptr<comm::ProcessGroup> pg);

  /// (Re)creates weight, bias and the running statistics as options say (a taken-over layer's tensors at construction).
  void reset() override;
  /// running_mean 0, running_var 1, num_batches_tracked 0 (when tracked).
  void reset_running_stats();
  /// reset_running_stats(), and weight 1, bias 0 (when affine).
  void reset_parameters();
  /// "dtrain::SyncBatchNorm(C, eps=..., momentum=..., affine=..., track_running_stats=..., group=... of W)".
  void pretty_print(std::ostream& stream) const override;

  /// input: (N, C, *) with C = num_features, N may be 0 on some ranks in training mode.
  at::Tensor forward(const at::Tensor& input);

  /// The group whose batch statistics are used.
  const std::shared_ptr<comm::ProcessGroup>& group() const { return pg_; }

  torch::nn::BatchNormOptions options;  ///< as given, or the taken-over layer's
  ///@{
  /// The learnable scale and shift, per channel; undefined unless affine.
  at::Tensor weight, bias;
  ///@}
  ///@{
  /// The running statistics, per channel, and the number of training batches seen; undefined unless
  /// track_running_stats.
  at::Tensor running_mean, running_var, num_batches_tracked;
  ///@}

 private:
  std::shared_ptr<comm::ProcessGroup> pg_;
  std::vector<at::Tensor> adopt_;  // a taken-over BatchNorm's tensors, for reset() during construction
};
/// dtrain::SyncBatchNorm, the module holder of SyncBatchNormImpl (as torch::nn::BatchNorm2d of BatchNorm2dImpl).
TORCH_MODULE(SyncBatchNorm);

/// The training-mode function on its own (always synchronising, also for a group of one): normalises
/// input (N, C, *) with the group's batch statistics, updates running_mean/running_var in place when
/// they are defined (exponential factor `momentum`), differentiable in input, weight and bias.
at::Tensor syncBatchNorm(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
                         double eps, comm::ProcessGroup& pg);

/// Replaces every BatchNorm1d/2d/3d layer in `module`'s tree with a SyncBatchNorm over pg that shares
/// its parameters and buffers (torch.nn.SyncBatchNorm.convert_sync_batchnorm). Returns the converted
/// root: a new SyncBatchNorm when `module` is itself a BatchNorm, a new Sequential when it is a
/// Sequential holding a BatchNorm, else `module` itself, changed in place.
///
/// How it reaches the layers, and what it cannot reach: libtorch keeps a parent's children in its
/// registry (register_module), which Module::replace_module rewrites, and which parameters(), buffers(),
/// state dicts and DDP read. Containers call their children through their own lists: ModuleDict is
/// updated in place (insert), Sequential and ModuleList are rebuilt with the same names and the new
/// container replaces the old in the registry. What it cannot rewrite are a module's C++ members: a
/// `torch::nn::BatchNorm2d bn` member that forward() calls keeps calling the old, local BatchNorm
/// (sharing the parameters, so nothing looks wrong). For such models declare the member as
/// dtrain::SyncBatchNorm, or keep BatchNorm layers inside containers called through the registry.
std::shared_ptr<torch::nn::Module> convertSyncBatchNorm(std::shared_ptr<torch::nn::Module> module,
                                                        std::shared_ptr<comm::ProcessGroup> pg);

}  // namespace dtrain
