/// @file
/// Large-batch training: the LARS and LAMB optimizers and the linear scaling rule with gradual warm-up.
/// Both optimizers are torch::optim optimizers (parameter groups, zero_grad, save/load with
/// `torch::save`/`torch::load` or dtrain::CheckpointState::captureOptimizer), so they drop into any loop.
///
/// \code
///   // BERT convention: biases and 1-D parameters (LayerNorm/BatchNorm weights) get no weight decay
///   // and no trust-ratio scaling.
///   auto groups = dtrain::optim::decayGroups(*model, dtrain::optim::LambOptions(1e-3).weight_decay(0.01));
///   dtrain::optim::Lamb opt(groups, dtrain::optim::LambOptions(1e-3).weight_decay(0.01));
///
///   // 8x the batch of a recipe tuned at 256 samples with lr 1e-3: warm up to 8e-3, then cosine decay.
///   dtrain::optim::LinearScalingOptions so;
///   so.base_lr = 1e-3; so.base_batch = 256; so.global_batch = 2048;   // ranks x per-rank x accumulation
///   so.warmup_steps = 500; so.decay = dtrain::optim::Decay::kCosine; so.total_steps = 10000;
///   dtrain::optim::LinearScaling sched(so);
///   for (int64_t step = 0; step < 10000; ++step) {
///     sched.apply(opt, step);            // sets the lr of every parameter group for this step
///     opt.zero_grad(); loss(...).backward(); opt.step();
///   }
/// \endcode
///
/// Which published variant each follows:
/// - LARS: You, Gitman, Ginsburg 2017 ("Large Batch Training of Convolutional Networks", arXiv
///   1708.03888, Algorithm 1), as in the MLPerf ResNet-50 LARS: the learning rate sits inside the
///   momentum buffer.  local = η·‖w‖/(‖g‖ + β‖w‖ + eps)  (1 when ‖w‖ or ‖g‖ is 0)
///                     v ← m·v + lr·local·(g + β·w);  w ← w − v
///   With adapt(false) the group is plain momentum SGD with decay β (use β = 0 for excluded groups).
/// - LAMB: You et al. 2019 ("Large Batch Optimization for Deep Learning", arXiv 1904.00962 v5,
///   Algorithm 2, with bias correction), computed as NVIDIA apex FusedLAMB (adam_w_mode,
///   grad_averaging, eps outside the square root, global-norm clipping first):
///     g ← g / max(‖G‖/max_grad_norm, 1)   where ‖G‖ is the norm of all gradients of all groups
///     m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;  m̂ = m/(1−β1ᵗ);  v̂ = v/(1−β2ᵗ)
///     u = m̂/(√v̂ + eps) + λ·w;  ratio = φ(‖w‖)/‖u‖ (1 when φ(‖w‖) or ‖u‖ is 0);  w ← w − lr·ratio·u
///   φ is the identity, or ‖w‖ clamped to [trust_min, trust_max] when those are set (the paper's φ;
///   torch-optimizer's Lamb clamps to [0, 10]). bias_correction(false) gives the paper's v1-v3 form.
///   Difference from FusedLAMB: there the trust ratio is skipped for every group with weight decay 0
///   (use_nvlamb off); here it is the group's adapt() flag, so decayGroups() gives FusedLAMB's
///   behaviour for the BERT split and a group with λ = 0 can still be adapted (NVLAMB).
#pragma once
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

/// Large-batch optimizers (LARS, LAMB), their parameter groups and the linear scaling rule.
namespace dtrain::optim {

// ---- LARS ----
/// The options of Lars, per parameter group (torch::optim style: chained setters).
struct LarsOptions : public torch::optim::OptimizerCloneableOptions<LarsOptions> {
  /// The defaults with learning rate lr (implicit, as torch::optim's options are).
  LarsOptions(double lr = 0.1);  // NOLINT(google-explicit-constructor): torch::optim's convention
  TORCH_ARG(double, lr) = 0.1;  ///< the learning rate, >= 0
  TORCH_ARG(double, momentum) = 0.9;           ///< m, in [0, 1)
  TORCH_ARG(double, weight_decay) = 0;         ///< β, >= 0
  TORCH_ARG(double, trust_coefficient) = 0.001;  ///< η (the paper's 0.001), > 0
  TORCH_ARG(double, eps) = 1e-8;               ///< > 0
  TORCH_ARG(bool, adapt) = true;               ///< false: no trust-ratio scaling (local lr = 1)

 public:
  /// Reads the options from archive (torch::optim's serialization).
  void serialize(torch::serialize::InputArchive& archive) override;
  /// Writes the options into archive.
  void serialize(torch::serialize::OutputArchive& archive) const override;
  /// lr(), for torch's LR schedulers.
  double get_lr() const override { return lr(); }
  /// Sets lr(), for torch's LR schedulers.
  void set_lr(const double lr) override { this->lr(lr); }
};

/// The state Lars keeps per parameter.
struct LarsParamState : public torch::optim::OptimizerCloneableParamState<LarsParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);  ///< v: the momentum buffer, learning rate included
 public:
  /// Reads the state from archive.
  void serialize(torch::serialize::InputArchive& archive) override;
  /// Writes the state into archive.
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// LARS (You, Gitman, Ginsburg 2017) as a torch::optim optimizer (see the file's description).
class Lars : public torch::optim::Optimizer {
 public:
  /// dtrain::InvalidArgument for a bad option (in the defaults or in any group), naming it.
  explicit Lars(std::vector<torch::optim::OptimizerParamGroup> param_groups, LarsOptions defaults = {});
  /// One group of params with the given options.
  explicit Lars(std::vector<torch::Tensor> params, LarsOptions defaults = {});
  /// One LARS step of every group; returns closure's loss when a closure is given (else an undefined tensor).
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Writes the groups' options and the per-parameter state (torch::optim's format, tagged "Lars").
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads what save() wrote; InvalidArgument when the archive holds another optimizer's state.
  void load(torch::serialize::InputArchive& archive) override;
};

// ---- LAMB ----
/// The options of Lamb, per parameter group (torch::optim style: chained setters).
struct LambOptions : public torch::optim::OptimizerCloneableOptions<LambOptions> {
  /// The defaults with learning rate lr (implicit, as torch::optim's options are).
  LambOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): torch::optim's convention
  /// (β1, β2).
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(double, lr) = 1e-3;  ///< the learning rate, >= 0
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);  ///< each in [0, 1)
  TORCH_ARG(double, eps) = 1e-6;                            ///< > 0 (FusedLAMB's default)
  TORCH_ARG(double, weight_decay) = 0.01;                   ///< λ, >= 0 (FusedLAMB's default)
  TORCH_ARG(bool, bias_correction) = true;  ///< divide m and v by (1 − βᵗ) (false: the paper's v1-v3 form)
  TORCH_ARG(bool, adapt) = true;  ///< false: no trust ratio (ratio 1), an AdamW step
  /// φ(‖w‖) = clamp(‖w‖, trust_min, trust_max); the defaults make φ the identity.
  TORCH_ARG(double, trust_min) = 0;
  TORCH_ARG(double, trust_max) = std::numeric_limits<double>::infinity();  ///< see trust_min
  /// Global-norm clipping of all gradients before the step; 0 turns it off. Read from the optimizer's
  /// defaults (one norm over every group, as FusedLAMB), not per group.
  TORCH_ARG(double, max_grad_norm) = 1.0;

 public:
  /// Reads the options from archive (torch::optim's serialization).
  void serialize(torch::serialize::InputArchive& archive) override;
  /// Writes the options into archive.
  void serialize(torch::serialize::OutputArchive& archive) const override;
  /// lr(), for torch's LR schedulers.
  double get_lr() const override { return lr(); }
  /// Sets lr(), for torch's LR schedulers.
  void set_lr(const double lr) override { this->lr(lr); }
};

/// The state Lamb keeps per parameter.
struct LambParamState : public torch::optim::OptimizerCloneableParamState<LambParamState> {
  TORCH_ARG(int64_t, step) = 0;  ///< t: steps taken
  TORCH_ARG(torch::Tensor, exp_avg);  ///< m: the first moment
  TORCH_ARG(torch::Tensor, exp_avg_sq);  ///< v: the second moment
 public:
  /// Reads the state from archive.
  void serialize(torch::serialize::InputArchive& archive) override;
  /// Writes the state into archive.
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// LAMB (You et al. 2019), computed as NVIDIA apex's FusedLAMB, as a torch::optim optimizer (see the file's
/// description).
class Lamb : public torch::optim::Optimizer {
 public:
  /// dtrain::InvalidArgument for a bad option (in the defaults or in any group), naming it.
  explicit Lamb(std::vector<torch::optim::OptimizerParamGroup> param_groups, LambOptions defaults = {});
  /// One group of params with the given options.
  explicit Lamb(std::vector<torch::Tensor> params, LambOptions defaults = {});
  /// One LAMB step of every group; returns closure's loss when a closure is given (else an undefined tensor).
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Writes the groups' options and the per-parameter state (torch::optim's format, tagged "Lamb").
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads what save() wrote; InvalidArgument when the archive holds another optimizer's state.
  void load(torch::serialize::InputArchive& archive) override;
  /// The global gradient norm of the last step, before clipping (0 before the first step).
  double lastGradNorm() const { return last_grad_norm_; }

 private:
  double last_grad_norm_ = 0;
};

// ---- parameter groups ----
/// True for the parameters the BERT convention exempts from weight decay and trust-ratio scaling:
/// every parameter with fewer than 2 dimensions (biases, LayerNorm/BatchNorm weights and biases)
/// and every parameter whose name ends in "bias".
bool excludedFromDecay(const std::string& name, const torch::Tensor& param);

/// Splits module.named_parameters() (only those with requires_grad) into two groups, in the module's
/// order: group 0 with `options` as given, group 1 (the excluded ones above) with a copy of `options`
/// where weight_decay = 0 and adapt = false. An empty group is left out. Options: LarsOptions or
/// LambOptions.
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> decayGroups(const torch::nn::Module& module,
                                                           const Options& options);

// ---- the linear scaling rule with gradual warm-up (Goyal et al. 2017, arXiv 1706.02677) ----
/// How LinearScaling's learning rate decays after the warm-up.
enum class Decay {
  kConstant,   ///< stays at the peak
  kCosine,     ///< cosine from the peak to final_lr at total_steps
  kStep,       ///< multiplied by gamma at each milestone
  kPolynomial  ///< (1 - t/T)^power from the peak to final_lr at total_steps
};

/// Options of LinearScaling.
struct LinearScalingOptions {
  double base_lr = 0.1;         ///< the lr tuned at base_batch, > 0
  int64_t base_batch = 256;     ///< > 0
  int64_t global_batch = 256;   ///< samples per optimizer step over all ranks (x accumulation), > 0
  int64_t warmup_steps = 0;     ///< >= 0
  std::optional<double> warmup_start_lr;  ///< lr of step 0 when warming up; unset: base_lr (Goyal et al.)
  Decay decay = Decay::kConstant;  ///< after the warm-up
  int64_t total_steps = 0;      ///< kCosine, kPolynomial: the step where the decay reaches final_lr
  double final_lr = 0;          ///< kCosine, kPolynomial: the lr at total_steps and after, >= 0
  std::vector<int64_t> milestones;  ///< kStep: increasing steps at which the lr is multiplied by gamma
  double gamma = 0.1;               ///< kStep, in (0, 1]
  double power = 2;                 ///< kPolynomial (the LARS paper's 2), > 0
};

/// The linear scaling rule with gradual warm-up as a learning-rate schedule.
///
/// lr(step), for the 0-based index of the optimizer step about to be taken:
/// \verbatim
///   peak = base_lr · global_batch / base_batch
///   step < W (warm-up):  start + (peak − start) · step / W     (step 0 uses start; step W is peak)
///   after, with t = step − W and T = total_steps − W (t capped at T):
///     kConstant: peak;  kCosine: final + (peak − final)·(1 + cos(π·t/T))/2
///     kStep: peak · gamma^(number of milestones <= step);  kPolynomial: final + (peak − final)·(1 − t/T)^power
/// \endverbatim
/// It is a pure function of the step, so resuming from a checkpoint needs only the step.
class LinearScaling {
 public:
  /// dtrain::InvalidArgument for bad options, naming the field.
  explicit LinearScaling(LinearScalingOptions options);
  /// peak = base_lr · global_batch / base_batch.
  double peakLr() const;
  /// The learning rate of the 0-based optimizer step `step` (see the class description).
  double lr(int64_t step) const;
  /// Sets the lr of every parameter group of any torch::optim optimizer to lr(step); returns it.
  double apply(torch::optim::Optimizer& optimizer, int64_t step) const;

 private:
  LinearScalingOptions o_;
};

}  // namespace dtrain::optim
