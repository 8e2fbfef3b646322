// dtrain-bench ddp --mode dp: DataParallel (one process, N replica threads) on the reference MLP, for
// the DP-vs-DDP comparison. Each step trains on N x batch rows, like N DDP ranks of `batch` rows.
// Verified like ddp (ddp_bench.cc): after the timed steps the model is compared with the same
// training without DataParallel (reference_mlp.h); wrong > 0 makes the exit status 1. With --metrics, a
// bench record named "dp".
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <tuple>

#include "reference_mlp.h"
#include "dtrain/data_parallel.h"
#include "dtrain/metrics.h"

namespace dtrain::bench {

int runDataParallel(int threads, int batch, int steps, int warmup, double tol, MetricsLog* log) {
  torch::set_num_threads(1);  // one intra-op thread per replica
  auto net = referenceMlp();
  DataParallel dp(net, threads);
  auto opt = makeSgd(net);
  at::Tensor x, y;  // named, not structured bindings: the step lambda captures them
  std::tie(x, y) = rankBatch(0, threads * batch);
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

  auto ref = trainReference(x, y, warmup + steps);
  ParamCheck c = compareParams(net, ref, tol);
  std::printf("dtrain-dp threads=%d params=%lld batch_per_replica=%d ms_per_step=%.1f samples_per_s=%.1f "
              "wrong=%lld/%lld max_err=%.1e\n",
              threads, static_cast<long long>(countParams(net)), batch, dt * 1e3, threads * batch / dt,
              static_cast<long long>(c.wrong), static_cast<long long>(c.tensors), c.max_rel);
  if (log) {
    log->write(Record("bench").set("name", "dp").set("threads", threads).set("params", countParams(net))
                   .set("batch_per_replica", batch).set("steps", steps).set("ms_per_step", dt * 1e3)
                   .set("samples_per_s", threads * batch / dt).set("wrong", c.wrong).set("tensors", c.tensors)
                   .set("max_err", c.max_rel));
  }
  return c.wrong == 0 ? 0 : 1;
}

}  // namespace dtrain::bench
