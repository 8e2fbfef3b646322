// The BERT convention's parameter groups: biases and normalisation weights (every 1-D parameter)
// get no weight decay and no trust-ratio scaling (see dtrain/optim.h).
#include <string>

#include "dtrain/optim.h"

namespace dtrain::optim {

bool excludedFromDecay(const std::string& name, const torch::Tensor& param) {
  static const std::string kBias = "bias";
  bool ends_in_bias = name.size() >= kBias.size() && name.compare(name.size() - kBias.size(), kBias.size(), kBias) == 0;
  return param.dim() < 2 || ends_in_bias;
}

template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> decayGroups(const torch::nn::Module& module,
                                                           const Options& options) {
  std::vector<torch::Tensor> decayed, excluded;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    (excludedFromDecay(item.key(), item.value()) ? excluded : decayed).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decayed.empty()) groups.emplace_back(std::move(decayed), std::make_unique<Options>(options));
  if (!excluded.empty()) {
    auto o = std::make_unique<Options>(options);
    o->weight_decay(0);
    o->adapt(false);
    groups.emplace_back(std::move(excluded), std::move(o));
  }
  return groups;
}

template std::vector<torch::optim::OptimizerParamGroup> decayGroups<LarsOptions>(const torch::nn::Module&,
                                                                                 const LarsOptions&);
template std::vector<torch::optim::OptimizerParamGroup> decayGroups<LambOptions>(const torch::nn::Module&,
                                                                                 const LambOptions&);

}  // namespace dtrain::optim
