/// @file
/// Communicating less often: local SGD and model averaging, with PyTorch 1.13's semantics
/// (torch.distributed.algorithms.model_averaging and ddp_comm_hooks.post_localSGD_hook).
///
/// Local SGD: every rank takes optimizer steps on its own gradients and the ranks average their
/// parameters every `period` steps, so the links carry the model once per period instead of the
/// gradients every step. Post-local SGD (Lin et al., 2020) starts with ordinary DDP (gradients averaged
/// over all ranks) and switches to local SGD at a chosen step, averaging gradients within each host
/// only (cheap, over shared memory) from then on.
///
/// \code
///   auto dist = dtrain::init();
///   dtrain::DistributedDataParallel ddp(model, dist.world());
///   ddp.registerCommHook(dtrain::postLocalSGDHook(dist.local(), /*start_localSGD_iter=*/100));
///   dtrain::PeriodicModelAverager averager(dist.world(), /*period=*/8, /*warmup_steps=*/100);
///   for (...) {
///     opt.zero_grad(); loss(model(x), y).backward(); opt.step();
///     averager.averageParameters(model->parameters());   // every 8th step from step 100
///   }
/// \endcode
///
/// PeriodicModelAverager::averageParameters(params), called once per optimizer step: when
/// step >= warmup_steps and (step - warmup_steps) % period == 0, the parameters that have a gradient
/// (defined grad) on some rank of the group (the ranks agree on the list first: one small allreduce; with
/// libtorch 2.x's zero_grad(), a branch that one rank skipped has no gradient there) are flattened,
/// divided by the group's size, allreduced (sum) and written back; then
/// step += 1. Optimizer state (momentum, Adam moments) is not averaged. HierarchicalModelAverager
/// averages over one of several groups: at each step >= warmup_steps, the group with the largest period
/// that divides step (step % period == 0, no warm-up offset), if any; e.g. {{4, dist.local()},
/// {16, dist.world()}}: within the host every 4 steps, across all ranks every 16. The last level's group
/// is the whole group (PyTorch's rule); periods strictly increase.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "dtrain/ddp.h"

namespace dtrain {

/// Averages `params` (all of them, defined or not as given) over `group`: divide by its size, allreduce
/// (sum), write back in place. PyTorch's utils.average_parameters.
void averageParameters(const std::vector<at::Tensor>& params, comm::ProcessGroup& group);

/// Averages the parameters over a group every `period` optimizer steps after a warm-up (local SGD).
class PeriodicModelAverager {
 public:
  /// InvalidArgument for period < 1 or warmup_steps < 0 (period 1 works: it averages every step).
  PeriodicModelAverager(std::shared_ptr<comm::ProcessGroup> group, int64_t period, int64_t warmup_steps = 0);
  /// Call once per optimizer step; averages the parameters that have a gradient on some rank when it is time.
  /// Returns whether it averaged.
  bool averageParameters(const std::vector<at::Tensor>& params);
  /// Optimizer steps counted so far (calls of averageParameters()).
  int64_t step() const { return step_; }
  void setStep(int64_t step) { step_ = step; }  ///< Sets the step count, e.g. after restoring a checkpoint.
  /// Steps between two averagings.
  int64_t period() const { return period_; }

 private:
  std::shared_ptr<comm::ProcessGroup> group_;
  int64_t period_, warmup_, step_ = 0;
};

/// Averages the parameters over one of several groups, each with its own period (see the file's description).
class HierarchicalModelAverager {
 public:
  /// levels: (period, group) with strictly increasing periods >= 1; the last group has the largest size,
  /// that of the whole job's group. InvalidArgument naming the level otherwise.
  explicit HierarchicalModelAverager(std::vector<std::pair<int64_t, std::shared_ptr<comm::ProcessGroup>>> levels,
                                     int64_t warmup_steps = 0);
  /// Call once per optimizer step; averages over the level whose turn it is, if any. Returns the period
  /// of the level it averaged over, or 0.
  int64_t averageParameters(const std::vector<at::Tensor>& params);
  /// Optimizer steps counted so far (calls of averageParameters()).
  int64_t step() const { return step_; }
  void setStep(int64_t step) { step_ = step; }  ///< Sets the step count, e.g. after restoring a checkpoint.

 private:
  std::vector<std::pair<int64_t, std::shared_ptr<comm::ProcessGroup>>> levels_;
  int64_t warmup_, step_ = 0;
};

/// post_localSGD_hook: until start_localSGD_iter synced passes, the bucket is averaged over DDP's group;
/// from then on over `subgroup` (PyTorch's default subgroup is the ranks of this machine: pass
/// dist.local()), or not at all when post_local_gradient_allreduce is false. InvalidArgument for a null
/// subgroup or a negative start.
std::shared_ptr<CommHook> postLocalSGDHook(std::shared_ptr<comm::ProcessGroup> subgroup, int64_t start_localSGD_iter,
                                           bool post_local_gradient_allreduce = true);

}  // namespace dtrain
