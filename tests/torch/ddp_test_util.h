// What the DDP tests share: a small net (optionally with BatchNorm and an unused branch), the global
// batch of a step, a process group and a comparison of two models.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "dtrain/comm/process_group.h"
#include "harness.h"

namespace dtrain::test {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool batchnorm = false, bool unused_branch = false) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 3));
    if (batchnorm) bn = register_module("bn", torch::nn::BatchNorm1d(16));
    if (unused_branch) spare = register_module("spare", torch::nn::Linear(16, 16));
  }
  // skip_fc2: a data-dependent branch (used to make one rank skip a layer).
  torch::Tensor forward(torch::Tensor x, bool skip_fc2 = false) {
    x = torch::relu(fc1->forward(x));
    if (bn) x = bn->forward(x);
    if (!skip_fc2) x = torch::tanh(fc2->forward(x));
    return fc3->forward(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, spare{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

constexpr int kPerRank = 4;

// The global batch of step s: world * kPerRank rows; rank r's slice is rows [r*kPerRank, (r+1)*kPerRank).
inline std::pair<torch::Tensor, torch::Tensor> batch(int step, int world) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = at::randn({world * kPerRank, 6}, g, torch::kDouble);
  auto y = at::randint(0, 3, {world * kPerRank}, g, torch::kLong);
  return {x, y};
}

inline Net makeNet(bool bn = false, bool unused = false) {
  torch::manual_seed(7);
  Net n(bn, unused);
  n->to(torch::kDouble);
  return n;
}

inline std::unique_ptr<torch::optim::Optimizer> makeOpt(const std::string& kind, torch::nn::Module& n) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(n.parameters(), torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(n.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// Parameters within rel (relative to max(1, |b|)), buffers within rel absolute.
inline void expectClose(torch::nn::Module& a, torch::nn::Module& b, double rel, const std::string& what) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (const auto& item : pa) {
    auto other = pb[item.key()];
    double diff = (item.value() - other).abs().max().item<double>();
    double scale = std::max(1.0, other.abs().max().item<double>());
    EXPECT_LE(diff / scale, rel) << what << ": parameter " << item.key() << " differs by " << diff;
  }
  auto ba = a.named_buffers(), bb = b.named_buffers();
  for (const auto& item : ba) {
    double diff = (item.value().to(torch::kDouble) - bb[item.key()].to(torch::kDouble)).abs().max().item<double>();
    EXPECT_LE(diff, rel) << what << ": buffer " << item.key() << " differs by " << diff;
  }
}

inline std::shared_ptr<comm::ProcessGroup> group(const StoreServer& s, int rank, int world, int timeout_s = 30,
                                                  const std::string& transport = "auto") {
  comm::GroupOptions o;
  o.timeout = std::chrono::seconds(timeout_s);
  o.transport = transport;
  return comm::ProcessGroup::create(s.client(), rank, world, o);
}

}  // namespace dtrain::test
