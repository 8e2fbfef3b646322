// dtrain-bench ddp --mode dp: DataParallel (one process, N replica threads) on the reference MLP, for
// the DP-vs-DDP comparison. Each step trains on N x batch rows, like N DDP ranks of `batch` rows.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "dtrain/data_parallel.h"

namespace dtrain::bench {

int runDataParallel(int threads, int batch, int steps, int warmup) {
  torch::set_num_threads(1);  // one intra-op thread per replica
  torch::manual_seed(0);
  auto net = torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                                   torch::nn::ReLU(), torch::nn::Linear(2048, 1024), torch::nn::ReLU(),
                                   torch::nn::Linear(1024, 10));
  DataParallel dp(net, threads);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto g = at::make_generator<at::CPUGeneratorImpl>(0);
  auto x = at::randn({threads * batch, 784}, g);
  auto y = at::randint(0, 10, {threads * batch}, g, torch::kLong);
  auto loss_fn = [](torch::nn::Module& replica, const at::Tensor& xs, const at::Tensor& ys) {
    return torch::nn::functional::cross_entropy(replica.as<torch::nn::Sequential>()->forward(xs), ys);
  };
  auto step = [&] {
    opt.zero_grad();
    dp.step(x, y, loss_fn);
    opt.step();
  };
  for (int i = 0; i < warmup; ++i) step();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
  int64_t params = 0;
  for (auto& p : net->parameters()) params += p.numel();
  std::printf("dtrain-dp threads=%d params=%lld batch_per_replica=%d ms_per_step=%.1f samples_per_s=%.1f\n", threads,
              static_cast<long long>(params), batch, dt * 1e3, threads * batch / dt);
  return 0;
}

}  // namespace dtrain::bench
