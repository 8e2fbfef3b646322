// The reference MLP and its one-process reference training (see reference_mlp.h).
#include "reference_mlp.h"

#include <algorithm>
#include <cmath>

#include "dtrain/comm/error.h"
#include "dtrain/trace.h"

namespace dtrain::bench {

torch::nn::Sequential referenceMlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                               torch::nn::ReLU(), torch::nn::Linear(2048, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

BenchModel parseBenchModel(const std::string& name) {
  if (name == "mlp" || name == "reference") return BenchModel::mlp;
  if (name == "conv") return BenchModel::conv;
  throw InvalidArgument("--model '" + name + "' (expected mlp or conv)");
}

torch::nn::Sequential benchModel(BenchModel m) {
  if (m == BenchModel::mlp) return referenceMlp();
  torch::manual_seed(0);
  auto conv = [](int64_t in, int64_t out, int64_t stride) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1));
  };
  return torch::nn::Sequential(conv(3, 64, 1), torch::nn::ReLU(), conv(64, 128, 2), torch::nn::ReLU(),
                               conv(128, 256, 2), torch::nn::ReLU(), conv(256, 256, 1), torch::nn::ReLU(),
                               conv(256, 512, 2), torch::nn::ReLU(),
                               torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions(1)),
                               torch::nn::Flatten(), torch::nn::Linear(512, 1000));
}

std::pair<at::Tensor, at::Tensor> rankBatch(int rank, int rows, BenchModel m) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(rank);
  auto x = m == BenchModel::mlp ? at::randn({rows, 784}, g) : at::randn({rows, 3, 32, 32}, g);
  auto y = at::randint(0, m == BenchModel::mlp ? 10 : 1000, {rows}, g, torch::kLong);
  return {x, y};
}

std::pair<at::Tensor, at::Tensor> globalBatch(int world, int rows_per_rank, BenchModel m) {
  std::vector<at::Tensor> xs, ys;
  for (int r = 0; r < world; ++r) {
    auto [x, y] = rankBatch(r, rows_per_rank, m);
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

torch::nn::Sequential trainReference(const at::Tensor& x, const at::Tensor& y, int steps, BenchModel m) {
  auto net = benchModel(m);
  auto opt = makeSgd(net);
  for (int i = 0; i < steps; ++i) sgdStep(net, opt, x, y);
  return net;
}

ParamCheck compareParams(torch::nn::Sequential& net, torch::nn::Sequential& ref, double tol, BenchModel m) {
  torch::NoGradGuard no_grad;
  auto init = benchModel(m);
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
