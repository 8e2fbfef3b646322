// The reference MLP and its one-process reference training (see reference_mlp.h).
#include "reference_mlp.h"

#include <algorithm>
#include <cmath>

#include "dtrain/trace.h"

namespace dtrain::bench {

torch::nn::Sequential referenceMlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                               torch::nn::ReLU(), torch::nn::Linear(2048, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

std::pair<at::Tensor, at::Tensor> rankBatch(int rank, int rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(rank);
  auto x = at::randn({rows, 784}, g);
  auto y = at::randint(0, 10, {rows}, g, torch::kLong);
  return {x, y};
}

std::pair<at::Tensor, at::Tensor> globalBatch(int world, int rows_per_rank) {
  std::vector<at::Tensor> xs, ys;
  for (int r = 0; r < world; ++r) {
    auto [x, y] = rankBatch(r, rows_per_rank);
    xs.push_back(x);
    ys.push_back(y);
  }
  return {torch::cat(xs), torch::cat(ys)};
}

torch::optim::SGD makeSgd(torch::nn::Sequential& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
}

void sgdStep(torch::nn::Sequential& net, torch::optim::SGD& opt, const at::Tensor& x, const at::Tensor& y) {
  opt.zero_grad();
  at::Tensor loss;
  {
    DTRAIN_SPAN("forward", "compute");
    loss = torch::nn::functional::cross_entropy(net->forward(x), y);
  }
  loss.backward();
  DTRAIN_SPAN("optimizer.step", "optim");
  opt.step();
}

torch::nn::Sequential trainReference(const at::Tensor& x, const at::Tensor& y, int steps) {
  auto net = referenceMlp();
  auto opt = makeSgd(net);
  for (int i = 0; i < steps; ++i) sgdStep(net, opt, x, y);
  return net;
}

ParamCheck compareParams(torch::nn::Sequential& net, torch::nn::Sequential& ref, double tol) {
  torch::NoGradGuard no_grad;
  auto init = referenceMlp();
  auto p = net->parameters(), q = ref->parameters(), p0 = init->parameters();
  ParamCheck c;
  c.tensors = static_cast<int64_t>(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    double err = (p[i] - q[i]).norm().item<double>() / std::max((q[i] - p0[i]).norm().item<double>(), 1e-30);
    if (!(err <= tol)) ++c.wrong;  // NaN too
    c.max_rel = std::max(c.max_rel, std::isnan(err) ? HUGE_VAL : err);
  }
  return c;
}

ParamCheck ranksAgree(comm::ProcessGroup& pg, const std::vector<at::Tensor>& params) {
  ParamCheck c;
  std::vector<double> lo, hi;
  for (const auto& p : params) lo.push_back(p.detach().to(torch::kDouble).sum().item<double>());
  hi = lo;
  pg.allreduce(lo.data(), lo.data(), lo.size(), comm::DType::f64, comm::ReduceOp::min)->wait();
  pg.allreduce(hi.data(), hi.data(), hi.size(), comm::DType::f64, comm::ReduceOp::max)->wait();
  c.tensors = static_cast<int64_t>(lo.size());
  for (size_t i = 0; i < lo.size(); ++i) {
    if (lo[i] != hi[i]) ++c.wrong;
    c.max_rel = std::max(c.max_rel, std::abs(hi[i] - lo[i]) / std::max(1e-30, std::abs(hi[i])));
  }
  return c;
}

int64_t countParams(torch::nn::Sequential& net) {
  int64_t n = 0;
  for (auto& p : net->parameters()) n += p.numel();
  return n;
}

}  // namespace dtrain::bench
