// The linear scaling rule with gradual warm-up (Goyal et al. 2017, arXiv 1706.02677) followed by a
// decay (see dtrain/optim.h for the formulas). A pure function of the step: nothing to checkpoint.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "dtrain/comm/error.h"
#include "dtrain/optim.h"

namespace dtrain::optim {

LinearScaling::LinearScaling(LinearScalingOptions options) : o_(std::move(options)) {
  DTRAIN_CHECK(o_.base_lr > 0 && std::isfinite(o_.base_lr), InvalidArgument,
               "LinearScaling: base_lr must be > 0 (got {})", o_.base_lr);
  DTRAIN_CHECK(o_.base_batch > 0, InvalidArgument, "LinearScaling: base_batch must be > 0 (got {})", o_.base_batch);
  DTRAIN_CHECK(o_.global_batch > 0, InvalidArgument, "LinearScaling: global_batch must be > 0 (got {})",
               o_.global_batch);
  DTRAIN_CHECK(o_.warmup_steps >= 0, InvalidArgument, "LinearScaling: warmup_steps must be >= 0 (got {})",
               o_.warmup_steps);
  DTRAIN_CHECK(!o_.warmup_start_lr || *o_.warmup_start_lr >= 0, InvalidArgument,
               "LinearScaling: warmup_start_lr must be >= 0 (got {})", o_.warmup_start_lr.value_or(0));
  if (o_.decay == Decay::kCosine || o_.decay == Decay::kPolynomial) {
    DTRAIN_CHECK(o_.total_steps > o_.warmup_steps, InvalidArgument,
                 "LinearScaling: a cosine or polynomial decay needs total_steps > warmup_steps (got {} and {})",
                 o_.total_steps, o_.warmup_steps);
    DTRAIN_CHECK(o_.final_lr >= 0, InvalidArgument, "LinearScaling: final_lr must be >= 0 (got {})", o_.final_lr);
  }
  if (o_.decay == Decay::kPolynomial)
    DTRAIN_CHECK(o_.power > 0, InvalidArgument, "LinearScaling: power must be > 0 (got {})", o_.power);
  if (o_.decay == Decay::kStep) {
    DTRAIN_CHECK(o_.gamma > 0 && o_.gamma <= 1, InvalidArgument, "LinearScaling: gamma must be in (0, 1] (got {})",
                 o_.gamma);
    for (size_t i = 1; i < o_.milestones.size(); ++i)
      DTRAIN_CHECK(o_.milestones[i] > o_.milestones[i - 1], InvalidArgument,
                   "LinearScaling: milestones must increase (milestone {} is {} after {})", i, o_.milestones[i],
                   o_.milestones[i - 1]);
  }
}

double LinearScaling::peakLr() const {
  return o_.base_lr * static_cast<double>(o_.global_batch) / static_cast<double>(o_.base_batch);
}

double LinearScaling::lr(int64_t step) const {
  DTRAIN_CHECK(step >= 0, InvalidArgument, "LinearScaling::lr: step must be >= 0 (got {})", step);
  const double peak = peakLr();
  if (step < o_.warmup_steps) {
    double start = o_.warmup_start_lr.value_or(o_.base_lr);
    return start + (peak - start) * static_cast<double>(step) / static_cast<double>(o_.warmup_steps);
  }
  const double t = static_cast<double>(std::min(step, o_.total_steps) - o_.warmup_steps);
  const double span = static_cast<double>(o_.total_steps - o_.warmup_steps);
  switch (o_.decay) {
    case Decay::kConstant:
      return peak;
    case Decay::kCosine:
      return o_.final_lr + (peak - o_.final_lr) * (1 + std::cos(M_PI * t / span)) / 2;
    case Decay::kPolynomial:
      return o_.final_lr + (peak - o_.final_lr) * std::pow(1 - t / span, o_.power);
    case Decay::kStep: {
      auto passed = std::upper_bound(o_.milestones.begin(), o_.milestones.end(), step) - o_.milestones.begin();
      return peak * std::pow(o_.gamma, static_cast<double>(passed));
    }
  }
  return peak;
}

double LinearScaling::apply(torch::optim::Optimizer& optimizer, int64_t step) const {
  double value = lr(step);
  for (auto& group : optimizer.param_groups()) group.options().set_lr(value);
  return value;
}

}  // namespace dtrain::optim
