// dtrain-bench ddp: trains the reference MLP of ../shared/anchors/torch_ddp.py (784-2048-2048-1024-10,
// batch 64 per rank, SGD momentum 0.9, one compute thread per rank) and prints a line of the same
// form as that script:
//   dtrain-ddp world=2 params=7912458 batch_per_rank=64 ms_per_step=... samples_per_s=... hidden=0.83
// hidden is the fraction of the allreduce time that backward hid (DDP's lastStats, averaged over the
// timed steps). Run it under dtrain-run for several ranks; alone it is the one-rank baseline.
// `--mode dp --threads N` runs DataParallel (one process, N replica threads) on N x batch instead.
#include "bench/ddp_bench.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/distributed.h"

namespace dtrain::bench {
namespace {

struct Options {
  int steps = 30;
  int batch = 64;
  int warmup = 3;
  std::string mode = "ddp";
  int threads = 2;
  std::string hook = "none";
};

torch::nn::Sequential referenceMlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                               torch::nn::ReLU(), torch::nn::Linear(2048, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

int64_t countParams(torch::nn::Sequential& net) {
  int64_t n = 0;
  for (auto& p : net->parameters()) n += p.numel();
  return n;
}

int runDdp(const Options& o) {
  torch::set_num_threads(1);
  auto dist = dtrain::init();
  auto net = referenceMlp();
  DistributedDataParallel ddp(net.ptr(), dist.world());
  if (o.hook == "fp16") ddp.registerCommHook(fp16CompressHook());
  if (o.hook == "bf16") ddp.registerCommHook(bf16CompressHook());
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto g = at::make_generator<at::CPUGeneratorImpl>(dist.rank());
  auto x = at::randn({o.batch, 784}, g);
  auto y = at::randint(0, 10, {o.batch}, g, torch::kLong);
  double hidden = 0;
  auto step = [&] {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    opt.step();
    return loss;
  };
  for (int i = 0; i < o.warmup; ++i) step();
  dist.world()->barrier()->wait();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.steps; ++i) {
    step();
    hidden += ddp.lastStats().hidden_fraction();
  }
  dist.world()->barrier()->wait();
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o.steps;
  if (dist.isMain()) {
    std::printf("dtrain-ddp world=%d params=%lld batch_per_rank=%d ms_per_step=%.1f samples_per_s=%.1f hidden=%.2f "
                "transport=%s hook=%s\n",
                dist.size(), static_cast<long long>(countParams(net)), o.batch, dt * 1e3, dist.size() * o.batch / dt,
                dist.size() > 1 ? hidden / o.steps : 0.0, dist.world()->transportName().c_str(), o.hook.c_str());
  }
  return 0;
}

}  // namespace

int runDataParallel(int threads, int batch, int steps, int warmup);  // data_parallel_bench.cc

void addDdpCommand(CLI::App& app) {
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand("ddp", "DDP (or --mode dp: DataParallel) training throughput on the reference MLP");
  sub->add_option("--steps", o->steps, "timed steps");
  sub->add_option("--batch", o->batch, "batch per rank (per replica for dp)");
  sub->add_option("--warmup", o->warmup, "untimed steps first");
  sub->add_option("--mode", o->mode, "ddp or dp")->check(CLI::IsMember({"ddp", "dp"}));
  sub->add_option("--threads", o->threads, "dp: replica threads");
  sub->add_option("--hook", o->hook, "ddp: none, fp16 or bf16 gradient compression")
      ->check(CLI::IsMember({"none", "fp16", "bf16"}));
  sub->callback([o] {
    int rc = 1;
    try {
      rc = o->mode == "ddp" ? runDdp(*o) : runDataParallel(o->threads, o->batch, o->steps, o->warmup);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dtrain-bench ddp: %s\n", e.what());
    }
    std::fflush(stdout);
    std::exit(rc);
  });
}

}  // namespace dtrain::bench
