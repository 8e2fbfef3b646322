// LARS (You, Gitman, Ginsburg 2017, Algorithm 1; see dtrain/optim.h): per layer, a local learning
// rate η‖w‖/(‖g‖ + β‖w‖ + eps) scales the decayed gradient, and momentum accumulates the scaled
// update with the learning rate inside the buffer (as the paper and the MLPerf reference):
//   v ← m·v + lr·local·(g + βw);  w ← w − v.
#include <fmt/format.h>

#include "common.h"
#include "dtrain/compat.h"
#include "dtrain/comm/error.h"
#include "dtrain/optim.h"

namespace dtrain::optim {

namespace {

void checkLars(const LarsOptions& o, const std::string& where) {
  using detail::checkOption;
  checkOption(o.lr() >= 0, "Lars", "lr must be >= 0", o.lr(), where);
  checkOption(o.momentum() >= 0 && o.momentum() < 1, "Lars", "momentum must be in [0, 1)", o.momentum(), where);
  checkOption(o.weight_decay() >= 0, "Lars", "weight_decay must be >= 0", o.weight_decay(), where);
  checkOption(o.trust_coefficient() > 0, "Lars", "trust_coefficient must be > 0", o.trust_coefficient(), where);
  checkOption(o.eps() > 0, "Lars", "eps must be > 0", o.eps(), where);
}

void checkLarsGroups(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t i = 0; i < groups.size(); ++i)
    checkLars(static_cast<const LarsOptions&>(groups[i].options()), detail::groupName(i));
}

}  // namespace

LarsOptions::LarsOptions(double lr) : lr_(lr) {}

void LarsOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(trust_coefficient);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adapt);
}

void LarsOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, trust_coefficient);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adapt);
}

void LarsParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
}

void LarsParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, momentum_buffer);
}

Lars::Lars(std::vector<torch::optim::OptimizerParamGroup> param_groups, LarsOptions defaults)
    : Optimizer(param_groups, std::make_unique<LarsOptions>(defaults)) {
  compat::keepGroupOptions(param_groups_, param_groups);  // libtorch 2.15 replaced them with the defaults
  checkLars(defaults, "the defaults");
  checkLarsGroups(param_groups_);
}

Lars::Lars(std::vector<torch::Tensor> params, LarsOptions defaults)
    : Lars({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor Lars::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = detail::evaluate(closure);
  checkLarsGroups(param_groups_);  // options may have been changed since construction
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const LarsOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const auto& g = p.grad();
      detail::checkDense(g, "Lars");
      double local = 1.0;
      if (o.adapt()) {
        double w_norm = p.norm().item<double>(), g_norm = g.norm().item<double>();
        if (w_norm > 0 && g_norm > 0)
          local = o.trust_coefficient() * w_norm / (g_norm + o.weight_decay() * w_norm + o.eps());
      }
      auto update = g.add(p, o.weight_decay()).mul_(o.lr() * local);
      if (o.momentum() == 0) {
        p.sub_(update);
        continue;
      }
      auto key = compat::optimizerStateKey(p);
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto s = std::make_unique<LarsParamState>();
        s->momentum_buffer(update.clone(at::MemoryFormat::Preserve));
        it = state_.emplace(key, std::move(s)).first;
      } else {
        static_cast<LarsParamState&>(*it->second).momentum_buffer().mul_(o.momentum()).add_(update);
      }
      p.sub_(static_cast<LarsParamState&>(*it->second).momentum_buffer());
    }
  }
  return loss;
}

void Lars::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<LarsParamState, LarsOptions>(archive, *this);
  detail::writeTag(archive, "Lars");
}

void Lars::load(torch::serialize::InputArchive& archive) {
  detail::checkTag(archive, "Lars");
  torch::optim::serialize<LarsParamState, LarsOptions>(archive, *this);
}

}  // namespace dtrain::optim
