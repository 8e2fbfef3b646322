// LAMB (You et al. 2019, arXiv 1904.00962 v5, Algorithm 2, computed as NVIDIA apex FusedLAMB; see
// dtrain/optim.h): global-norm clipping of all gradients, Adam moments with bias correction, the
// AdamW-style update u = m̂/(√v̂ + eps) + λw, then a per-tensor trust ratio φ(‖w‖)/‖u‖.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "common.h"
#include "dtrain/compat.h"
#include "dtrain/comm/error.h"
#include "dtrain/optim.h"

namespace dtrain::optim {

namespace {

void checkLamb(const LambOptions& o, const std::string& where) {
  using detail::checkOption;
  auto [b1, b2] = o.betas();
  checkOption(o.lr() >= 0, "Lamb", "lr must be >= 0", o.lr(), where);
  checkOption(b1 >= 0 && b1 < 1, "Lamb", "betas[0] must be in [0, 1)", b1, where);
  checkOption(b2 >= 0 && b2 < 1, "Lamb", "betas[1] must be in [0, 1)", b2, where);
  checkOption(o.eps() > 0, "Lamb", "eps must be > 0", o.eps(), where);
  checkOption(o.weight_decay() >= 0, "Lamb", "weight_decay must be >= 0", o.weight_decay(), where);
  checkOption(o.trust_min() >= 0, "Lamb", "trust_min must be >= 0", o.trust_min(), where);
  checkOption(o.trust_max() > 0 && o.trust_max() >= o.trust_min(), "Lamb",
              "trust_max must be > 0 and >= trust_min", o.trust_max(), where);
  checkOption(o.max_grad_norm() >= 0, "Lamb", "max_grad_norm must be >= 0 (0: no clipping)", o.max_grad_norm(),
              where);
}

void checkLambGroups(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t i = 0; i < groups.size(); ++i)
    checkLamb(static_cast<const LambOptions&>(groups[i].options()), detail::groupName(i));
}

// The L2 norm of every gradient of every group together, accumulated in double.
double globalGradNorm(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  double sum = 0;
  for (const auto& group : groups)
    for (const auto& p : group.params())
      if (p.grad().defined()) {
        detail::checkDense(p.grad(), "Lamb");
        double n = p.grad().norm().item<double>();
        sum += n * n;
      }
  return std::sqrt(sum);
}

}  // namespace

LambOptions::LambOptions(double lr) : lr_(lr) {}

void LambOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adapt);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(trust_min);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(trust_max);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_grad_norm);
}

void LambOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adapt);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, trust_min);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, trust_max);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, max_grad_norm);
}

void LambParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
}

void LambParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
}

Lamb::Lamb(std::vector<torch::optim::OptimizerParamGroup> param_groups, LambOptions defaults)
    : Optimizer(param_groups, std::make_unique<LambOptions>(defaults)) {
  compat::keepGroupOptions(param_groups_, param_groups);  // libtorch 2.15 replaced them with the defaults
  checkLamb(defaults, "the defaults");
  checkLambGroups(param_groups_);
}

Lamb::Lamb(std::vector<torch::Tensor> params, LambOptions defaults)
    : Lamb({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor Lamb::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = detail::evaluate(closure);
  checkLamb(static_cast<const LambOptions&>(defaults()), "the defaults");
  checkLambGroups(param_groups_);  // options may have been changed since construction
  // FusedLAMB: g / max(‖G‖ / max_grad_norm, 1), one norm over all groups.
  last_grad_norm_ = globalGradNorm(param_groups_);
  double max_norm = static_cast<const LambOptions&>(defaults()).max_grad_norm();
  double clip = max_norm > 0 && last_grad_norm_ > max_norm ? last_grad_norm_ / max_norm : 1.0;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const LambOptions&>(group.options());
    auto [beta1, beta2] = o.betas();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto g = clip == 1.0 ? p.grad() : p.grad() / clip;
      auto key = compat::optimizerStateKey(p);
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto s = std::make_unique<LambParamState>();
        s->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        it = state_.emplace(key, std::move(s)).first;
      }
      auto& s = static_cast<LambParamState&>(*it->second);
      s.step(s.step() + 1);
      s.exp_avg().mul_(beta1).add_(g, 1 - beta1);
      s.exp_avg_sq().mul_(beta2).addcmul_(g, g, 1 - beta2);
      double bc1 = o.bias_correction() ? 1 - std::pow(beta1, s.step()) : 1.0;
      double bc2 = o.bias_correction() ? 1 - std::pow(beta2, s.step()) : 1.0;
      auto update = (s.exp_avg() / bc1).div_((s.exp_avg_sq() / bc2).sqrt_().add_(o.eps()));
      if (o.weight_decay() != 0) update.add_(p, o.weight_decay());
      double ratio = 1.0;
      if (o.adapt()) {
        double phi = std::clamp(p.norm().item<double>(), o.trust_min(), o.trust_max());
        ratio = detail::trustRatio(phi, update.norm().item<double>());
      }
      p.sub_(update, o.lr() * ratio);
    }
  }
  return loss;
}

void Lamb::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<LambParamState, LambOptions>(archive, *this);
  detail::writeTag(archive, "Lamb");
}

void Lamb::load(torch::serialize::InputArchive& archive) {
  detail::checkTag(archive, "Lamb");
  torch::optim::serialize<LambParamState, LambOptions>(archive, *this);
}

}  // namespace dtrain::optim
