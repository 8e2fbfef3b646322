/// @file
/// Sharded data parallel, ZeRO stages 2 and 3 (PyTorch FSDP's SHARD_GRAD_OP and FULL_SHARD): the model is
/// cut into units (consecutive children of a torch::nn::Sequential); each unit's parameters live as one
/// flat shard per rank (1/W of them, what the optimizer steps), are gathered just before the unit runs and
/// freed again; gradients are reduce-scattered into each rank's shard as backward finishes each unit.
///
/// \code
///   auto seq = torch::nn::Sequential(...);               // the layers, in order
///   dtrain::FsdpOptions o;
///   o.stage = 3;                                         // 2: keep a unit's parameters from its forward to its backward
///   o.units = {2, 2, 1};                                 // children per unit (empty: o.min_unit_params decides)
///   dtrain::FullyShardedDataParallel fsdp(seq, pg, o);
///   torch::optim::Adam opt(fsdp.shards(), torch::optim::AdamOptions(1e-3));  // steps the shards
///   for (...) {
///     opt.zero_grad();
///     loss(fsdp.forward(x), y).backward();               // gradients: averaged, in the shards' .grad()
///     fsdp.clipGradNorm(1.0);                            // optional, the global norm across shards
///     opt.step();
///   }
///   auto full = fsdp.fullState();                        // collective: every parameter, gathered, by name
/// \endcode
///
/// Memory per rank: the shards (parameters, gradients and optimizer state: 1/W of each) plus, at stage 3,
/// the gathered parameters of at most two units at a time (the running one and the prefetched next), and at
/// stage 2 those of every unit between its forward and its backward. A unit's gathered parameters are the
/// module's own parameter tensors, viewing one buffer whose memory is released and allocated again
/// (PyTorch FSDP's storage resize), so the model's code and autograd's saved tensors are unchanged.
///
/// Rules: every rank runs the same units in the same order (the gathers and reduce-scatters are issued as
/// forward and backward reach them); a unit's parameters share one dtype; a parameter belongs to the
/// unit of the child that registers it first (a weight tied across units is one parameter of the first;
/// the later unit uses it gathered only while the first unit's parameters are present — keep tied weights
/// in one unit). The optimizer must be elementwise (SGD, Adam, AdamW): the shards cut through parameters.
/// Unused parameters: a unit that no rank gave a gradient in an accumulation window (the noSync passes and
/// the synced one) leaves its shard's gradient as it was, so an undefined one (libtorch 2.x's zero_grad())
/// stays undefined and the optimizer skips the shard, as one process skips those parameters. A unit that
/// some rank used is averaged, zeros for the parameters that got no gradient: within a unit the optimizer
/// steps them with the others (momentum, weight decay, one Adam step count per shard), as PyTorch's FSDP
/// with flat parameters does. Give a branch that is not always taken (a conditional head, an expert) a
/// unit of its own to train it as one process would.
/// Recomputation: set recompute to run each unit through dtrain::recompute (its activations are dropped and
/// recomputed in backward, after the unit's parameters are gathered again).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dtrain {
namespace comm {
class ProcessGroup;
}
struct CheckpointState;

/// Options of a FullyShardedDataParallel.
struct FsdpOptions {
  int stage = 3;                      ///< 2 or 3
  std::vector<int> units;             ///< children per unit, in order, summing to the children's number
  int64_t min_unit_params = 1 << 20;  ///< without `units`: a unit closes once it holds this many elements
  /// true: gather the next unit (forward) / the previous one (backward) while one computes, and reduce-
  /// scatter a unit's gradients while the next unit's backward runs (up to four whole-unit buffers at
  /// once: two units' parameters, two units' gradients). false: at most two (the running unit's
  /// parameters, then its gradients, which reuse them), and no communication overlaps computation; for
  /// memory-tight runs (docs/ZERO.md "Memory").
  bool prefetch = true;
  bool recompute = false;             ///< run each unit through dtrain::recompute
  /// The names of captureSharded's entries start with this: give each instance its own when several
  /// FSDP instances (e.g. two encoders) save into one CheckpointState.
  std::string checkpoint_prefix = "fsdp";
};

/// Fully sharded data parallelism (ZeRO stage 2 or 3) of a Sequential model cut into units: each rank keeps
/// a shard of every unit's parameters, gradients and optimizer state (see the file's description).
class FullyShardedDataParallel {
 public:
  /// Collective: rank 0's parameter values become everyone's. InvalidArgument for bad options or a unit
  /// with mixed dtypes.
  FullyShardedDataParallel(torch::nn::Sequential model, std::shared_ptr<comm::ProcessGroup> pg, FsdpOptions o = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// Runs the units in order, gathering each unit's parameters first.
  at::Tensor forward(const at::Tensor& x);

  /// This rank's shards, one flat tensor per unit (requires_grad): give them to the optimizer.
  std::vector<at::Tensor> shards() const;
  /// Collective: scales the shards' gradients as torch.nn.utils.clip_grad_norm_ over the whole model; the
  /// total norm.
  double clipGradNorm(double max_norm);

  /// While alive, backward accumulates whole gradients on each rank without communication (gradient
  /// accumulation); the first backward after it reduce-scatters the sum.
  class NoSync {
   public:
    /// Turns gradient synchronisation of f off until the guard's end.
    explicit NoSync(FullyShardedDataParallel* f);
    /// Turns it back on.
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    FullyShardedDataParallel* f_;
  };
  /// A NoSync guard for this instance: `{ auto guard = fsdp.noSync(); ...backward... }`.
  [[nodiscard]] NoSync noSync() { return NoSync(this); }

  /// Per-rank checkpoints (dtrain/checkpoint.h, a Checkpointer over the group: every rank writes its part
  /// in parallel, complete on every rank or not at all): this rank's shards and the optimizer's state for
  /// them into s.sharded ("<p>.<unit>.shard", "<p>.<unit>.<entry>"; "<p>.param_groups": the options; <p>
  /// is FsdpOptions::checkpoint_prefix, "fsdp" by default). The optimizer may step other tensors too
  /// (e.g. a second instance's shards): only this instance's units are written.
  void captureSharded(CheckpointState& s, const torch::optim::Optimizer& optimizer) const;
  /// From a per-rank checkpoint's directory (Checkpointer::list().back().path), saved at any world size and
  /// either stage: reads every rank's file and takes this rank's part of each unit. Not collective.
  void restoreSharded(const std::string& checkpoint_dir, torch::optim::Optimizer& optimizer);
  /// The same from states already in memory: `parts` holds every old rank's CheckpointState (as
  /// captureSharded filled it), in old-rank order, saved at any world size (parts.size() is that size);
  /// `what` names their source in errors (a directory, "peer snapshots"). Not collective.
  /// \code
  ///   std::vector<dtrain::CheckpointState> parts;        // e.g. every old rank's snapshot, in rank order
  ///   fsdp.restoreSharded(parts, opt, "in-memory snapshots");
  /// \endcode
  void restoreSharded(const std::vector<CheckpointState>& parts, torch::optim::Optimizer& optimizer,
                      const std::string& what);

  /// Collective: every parameter's current value (gathered from the shards), by its name in the model.
  std::map<std::string, at::Tensor> fullState();

  /// Collective: the whole model and `optimizer`'s state over the shards (Adam, AdamW, SGD), one file that
  /// rank `to` writes atomically, in ZeroRedundancyOptimizer's consolidated layout (dtrain/zero.h: PyTorch's
  /// optimizer state_dict, one index per parameter in the model's order, torch.load reads it) plus
  /// "model": {name: tensor} (the gathered parameters, for inference or to start plain DDP from) and
  /// "parameter_names" (the names in index order).
  void saveConsolidated(const std::string& path, const torch::optim::Optimizer& optimizer, int to = 0);
  /// Reads such a file, saved at any world size and either stage: the parameters into this rank's shards
  /// and the optimizer's state for them; the groups' options too. Not collective. InvalidArgument naming
  /// the file and what does not match (a parameter missing or shaped otherwise, the optimizer's kind).
  void loadConsolidated(const std::string& path, torch::optim::Optimizer& optimizer);
  /// Children per unit, as built.
  std::vector<int> unitSizes() const;

  /// This rank's bytes: its shards and their gradients; gathered parameters now and at most at once since
  /// construction; and the most of whole-unit tensors held at once (gathered parameters, plus during
  /// backward a unit's gradients as autograd made them and the buffer being reduce-scattered).
  struct Memory {
    ///@{
    /// Bytes: this rank's shards and their gradients; gathered parameters now and at most at once since
    /// construction; the most of whole-unit tensors held at once.
    int64_t shard_parameters = 0, shard_gradients = 0, gathered_now = 0, gathered_peak = 0, transient_peak = 0;
    ///@}
  };
  /// This rank's memory now (see Memory).
  Memory memory() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain
