/// @file
/// Sharded optimizer state (ZeRO stage 1): dtrain::ZeroRedundancyOptimizer, PyTorch 1.13's
/// ZeroRedundancyOptimizer for libtorch. Each rank of the group owns a part of the parameters, keeps the
/// optimizer state (momentum, Adam's moments) of those only and steps only those; then every owner's new
/// values reach every rank. With Adam that is 8 bytes per parameter per rank divided by the world size
/// instead of 8 on every rank. Gradients stay whole on every rank (use it with DDP as it is).
///
/// \code
///   dtrain::DistributedDataParallel ddp(model, pg);
///   dtrain::ZeroRedundancyOptimizer opt(model->parameters(), [](auto groups) {
///     return std::make_unique<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(1e-3));
///   }, pg);
///   for (...) {
///     opt.zeroGrad();
///     loss(ddp.forward(model, x), y).backward();      // DDP averages the gradients
///     opt.clipGradNorm(1.0);                          // optional: the global norm, as in one process
///     opt.step();                                     // collective: owners step, then broadcast
///   }
///   opt.saveConsolidated("adam.pt");                  // collective; rank 0 writes what torch.load reads
/// \endcode
///
/// Partition (zeroPartition()): as PyTorch 1.13 — per parameter group in order, the group's parameters
/// sorted by size, largest first (a stable sort), each to the rank with the least elements so far (the
/// lowest rank wins ties), the loads carried from one group to the next; no parameter is split.
///
/// Tied weights: a tensor that appears more than once in the list (a module's parameters() lists a weight
/// shared by two submodules under both names) is one parameter, at its first place; uniqueParameters()
/// does the same for a module's named parameters, and DDP uses the same rule.
///
/// Consolidated state (saveConsolidated): one file, torch::pickle_save of PyTorch's optimizer state_dict
/// layout with global parameter indices: {"state": {i: {...}}, "param_groups": [{options..., "params":
/// [i...]}]}, so Python's torch.load(path) returns a dict that torch.optim.Adam(...).load_state_dict()
/// (AdamW, SGD alike) takes. Per parameter: Adam and AdamW "step" (a float tensor), "exp_avg",
/// "exp_avg_sq" (and "max_exp_avg_sq" with amsgrad); SGD "momentum_buffer"; dtrain's Lamb "step",
/// "exp_avg", "exp_avg_sq"; Lars "momentum_buffer". loadConsolidated() reads such a file at any world
/// size: each rank keeps the entries of the parameters it owns (resharding).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace dtrain {
namespace comm {
class ProcessGroup;
}
struct CheckpointState;

/// PyTorch 1.13's partition: the owner rank of every parameter, the groups' parameters concatenated in
/// order, from each parameter's number of elements.
std::vector<int> zeroPartition(const std::vector<std::vector<int64_t>>& numels_per_group, int world_size);

/// module's named parameters (recursively) with each tensor once: a tied weight keeps its first name.
std::vector<std::pair<std::string, at::Tensor>> uniqueParameters(const torch::nn::Module& module);

/// Options of a ZeroRedundancyOptimizer.
struct ZeroOptions {
  /// Owners send their new values in broadcasts of at most this many bytes (smaller parameters of one
  /// owner and dtype are packed together; a larger one goes as it is, without a copy).
  size_t broadcast_bucket_bytes = 16u << 20;
};

/// ZeRO stage 1: each rank keeps the optimizer state of the parameters it owns only, steps those, and
/// sends their new values to the others (see the file's description).
class ZeroRedundancyOptimizer {
 public:
  /// Builds the rank's local optimizer over the groups it is given: the caller's groups with only the
  /// parameters this rank owns (possibly none), each with its options.
  using MakeOptimizer =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;

  /// Every rank passes the same parameters (same order, shapes and dtypes) and the same options; the
  /// constructor checks that across the group (InvalidArgument naming the first difference and rank).
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups, MakeOptimizer make,
                          std::shared_ptr<comm::ProcessGroup> pg, ZeroOptions options = {});
  /// The same with params as one group.
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, MakeOptimizer make, std::shared_ptr<comm::ProcessGroup> pg,
                          ZeroOptions options = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  /// Collective. Copies the groups' options (set the learning rate on paramGroups(), e.g. from a
  /// schedule) into the local optimizer, steps the parameters this rank owns, then every parameter
  /// gets its owner's new value.
  void step();
  /// Clears every parameter's gradient as the libtorch it was built with clears them in
  /// Optimizer::zero_grad(): undefined on 2.x (set_to_none; the optimizer then skips a parameter that
  /// gets no gradient before the next step, and DDP keeps it undefined where no rank used it), zeroed in
  /// place on 1.13. zeroGrad(false) zeroes in place (DDP's gradients stay views into its buckets),
  /// zeroGrad(true) makes them undefined, on both.
  void zeroGrad();
  /// zeroGrad(false) zeroes in place, zeroGrad(true) makes the gradients undefined (see zeroGrad()).
  void zeroGrad(bool set_to_none);
  /// Collective: scales every gradient by max_norm / (total 2-norm + 1e-6) when the norm is above
  /// max_norm (torch.nn.utils.clip_grad_norm_), the norm taken over every parameter's gradient as in
  /// one process; returns the total norm.
  double clipGradNorm(double max_norm);

  /// The caller's groups, with every parameter. Their options are what step() applies.
  std::vector<torch::optim::OptimizerParamGroup>& paramGroups();
  /// The parameters in order (groups concatenated, each tensor once) and their owners.
  const std::vector<at::Tensor>& parameters() const;
  /// The rank that owns parameter `index` (into parameters()).
  int ownerOf(size_t index) const;
  /// This rank's optimizer (its state is the owned parameters' only).
  torch::optim::Optimizer& local();

  /// Collective: every rank's state reaches rank `to`, which writes the consolidated file (see above)
  /// atomically (a temporary file renamed into place).
  void saveConsolidated(const std::string& path, int to = 0);
  /// Reads a consolidated file (saved at any world size) and keeps the owned parameters' entries; the
  /// groups' options come from the file too. Not collective. Error naming the file and what does not
  /// match (the number of parameters, a shape, the optimizer's kind).
  void loadConsolidated(const std::string& path);

  /// Per-rank checkpoints (dtrain/checkpoint.h, a Checkpointer over the group, each rank writing its
  /// part in parallel; complete on every rank or not at all): this rank's part into s.sharded, tensors
  /// named "zero.state.<index>.<entry>" (its owned parameters' entries) and "zero.param_groups" (the
  /// groups' options, pickled). The model itself: s.captureModel as usual.
  void captureSharded(CheckpointState& s) const;
  /// From a per-rank checkpoint's directory (Checkpointer::list().back().path), saved at any world size:
  /// reads every rank's file and keeps the owned parameters' entries. Not collective. Error naming the
  /// directory when a rank's file is missing or does not hold ZeRO's state.
  void restoreSharded(const std::string& checkpoint_dir);
  /// The same from states already in memory: `parts` holds every old rank's CheckpointState (as
  /// captureSharded filled it), in old-rank order, saved at any world size; `what` names their source in
  /// errors (a directory, "peer snapshots"). Not collective.
  /// \code
  ///   std::vector<dtrain::CheckpointState> parts;        // e.g. every old rank's snapshot, in rank order
  ///   zero.restoreSharded(parts, "in-memory snapshots");
  /// \endcode
  void restoreSharded(const std::vector<CheckpointState>& parts, const std::string& what);

  /// What this rank holds, in bytes: parameters (all of them, at stage 1), gradients (defined ones),
  /// optimizer state (its tensors).
  struct Memory {
    ///@{
    /// Bytes of parameters (all of them, at stage 1), of gradients (defined ones) and of optimizer state
    /// (its tensors).
    int64_t parameters = 0, gradients = 0, optimizer_state = 0;
    ///@}
  };
  /// What this rank holds now.
  Memory memory() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain
