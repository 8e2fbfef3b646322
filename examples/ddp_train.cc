// Training with DistributedDataParallel: the same binary runs alone or under dtrain-run.
//
//   build/bin/example-ddp                                          # one process
//   build/bin/dtrain-run --standalone --nproc-per-node 2 build/bin/example-ddp
//   build/bin/example-ddp --metrics run/metrics.jsonl              # rank 0 logs every step (JSON lines)
//
// A small classifier on generated data (the label is which of 4 directions x points to); every rank
// reads its share of each epoch through the DistributedSampler, DDP averages the gradients.
//
// Over slow links (docs/SLOW-LINKS.md):
//   --comm-hook none|fp16|bf16|topk:RATIO|powersgd:R[:START]   compress the gradients (dtrain/hook_spec.h;
//                fp16/bf16 do not compress over shared memory, where it cannot pay: fp16:always does)
//   --optimizer sgd|lamb|lars    SGD with momentum (default), or a large-batch optimizer (dtrain/optim.h)
//   --local-sgd N                gradients averaged within each machine, parameters across all every N steps
//   --batch B                    samples per rank and step (64)
//   --epochs E                   passes over the data (5)
//   --lr LR                      learning rate at 64 samples per step (0.05 with sgd and lars, 0.005 with lamb)
//   --scale-lr                   the linear scaling rule: LR x global batch / 64, warmed up over the first epoch
//
// On GPUs (a CUDA build of dtrain; dtrain/device.h):
//   --device cpu|cuda|cuda:N|auto   where to train (cpu); cuda is cuda:LOCAL_RANK. Gradients travel by NCCL
//                where every rank has a GPU of its own, else staged through the host (DTRAIN_CUDA_COMM).
#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <string>

#include "dtrain/ddp.h"
#include "dtrain/device.h"
#include "dtrain/distributed.h"
#include "dtrain/hook_spec.h"
#include "dtrain/local_sgd.h"
#include "dtrain/metrics.h"
#include "dtrain/optim.h"
#include "dtrain/sampler.h"
#include "dtrain/trace.h"

struct NetImpl : torch::nn::Module {
  NetImpl() : fc1(register_module("fc1", torch::nn::Linear(16, 64))), fc2(register_module("fc2", torch::nn::Linear(64, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

struct Args {
  std::string metrics, hook = "none", optimizer = "sgd", device = "cpu";
  int64_t batch = 64, local_sgd = 0;
  int epochs = 5;
  double lr = -1;  // -1: the optimizer's default
  bool scale_lr = false;
};

Args parse(int argc, char** argv) {
  Args a;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--metrics") a.metrics = value(i);
    else if (arg == "--comm-hook") a.hook = value(i);
    else if (arg == "--optimizer") a.optimizer = value(i);
    else if (arg == "--batch") a.batch = std::stoll(value(i));
    else if (arg == "--epochs") a.epochs = std::stoi(value(i));
    else if (arg == "--local-sgd") a.local_sgd = std::stoll(value(i));
    else if (arg == "--lr") a.lr = std::stod(value(i));
    else if (arg == "--scale-lr") a.scale_lr = true;
    else if (arg == "--device") a.device = value(i);
    else throw std::invalid_argument("unknown argument " + arg + " (see the comment at the top of examples/ddp_train.cc)");
  }
  if (a.optimizer != "sgd" && a.optimizer != "lamb" && a.optimizer != "lars")
    throw std::invalid_argument("--optimizer '" + a.optimizer + "': expected sgd, lamb or lars");
  if (a.batch < 1 || a.epochs < 1 || a.local_sgd < 0)
    throw std::invalid_argument("--batch and --epochs must be >= 1, --local-sgd >= 0");
  if (a.lr < 0) a.lr = a.optimizer == "lamb" ? 0.005 : 0.05;
  return a;
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(torch::nn::Module& model, const Args& a) {
  if (a.optimizer == "lamb") {
    auto o = dtrain::optim::LambOptions(a.lr).weight_decay(0.01);
    return std::make_unique<dtrain::optim::Lamb>(dtrain::optim::decayGroups(model, o), o);
  }
  if (a.optimizer == "lars") {
    auto o = dtrain::optim::LarsOptions(a.lr).weight_decay(1e-4);
    return std::make_unique<dtrain::optim::Lars>(dtrain::optim::decayGroups(model, o), o);
  }
  return std::make_unique<torch::optim::SGD>(model.parameters(), torch::optim::SGDOptions(a.lr).momentum(0.9));
}

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  const std::string& metrics = args.metrics;
  torch::set_num_threads(1);
  auto dist = dtrain::init();  // a world of one when not launched by dtrain-run / torchrun / mpirun
  const torch::Device device = dtrain::selectDevice(args.device, dist.localRank());
  std::unique_ptr<dtrain::MetricsLog> log;  // docs/OBSERVABILITY.md: a run record, then one per step
  if (!metrics.empty() && dist.isMain()) {
    log = std::make_unique<dtrain::MetricsLog>(metrics);
    log->writeRun("example-ddp", dist.size(), dtrain::Record().set("batch", args.batch).set("lr", args.lr).set("epochs", args.epochs)
                                                    .set("comm_hook", args.hook).set("optimizer", args.optimizer)
                                                    .set("local_sgd", args.local_sgd).set("scale_lr", args.scale_lr)
                                                    .set("device", device.str()));
  }

  torch::manual_seed(0);  // the same data on every rank; DDP broadcasts rank 0's weights anyway
  auto centers = torch::randn({4, 16});
  auto labels = torch::randint(0, 4, {4096});
  auto data = (centers.index_select(0, labels) + 0.8 * torch::randn({4096, 16})).to(device);
  labels = labels.to(device);

  Net model;
  model->to(device);
  dtrain::DistributedDataParallel ddp(model.ptr(), dist.world());
  if (auto hook = dtrain::makeCommHook(dtrain::parseCommHookSpec(args.hook))) ddp.registerCommHook(hook);
  std::unique_ptr<dtrain::PeriodicModelAverager> averager;  // local SGD from the start
  if (args.local_sgd > 0) {
    if (args.hook != "none") throw std::invalid_argument("--local-sgd and --comm-hook: choose one");
    ddp.registerCommHook(dtrain::postLocalSGDHook(dist.local(), /*start_localSGD_iter=*/0));
    averager = std::make_unique<dtrain::PeriodicModelAverager>(dist.world(), args.local_sgd);
  }
  auto opt = makeOptimizer(*model, args);
  dtrain::DistributedSampler sampler(data.size(0), dist.size(), dist.rank(), /*shuffle=*/true, /*seed=*/0);

  const int64_t batch = args.batch;  // per rank
  // The linear scaling rule (Goyal et al.): the lr tuned at 64 samples per step, times the global batch
  // over 64, reached by a linear warm-up over the first epoch.
  dtrain::optim::LinearScalingOptions so;
  so.base_lr = args.lr;
  so.base_batch = 64;
  so.global_batch = args.scale_lr ? batch * dist.size() : 64;
  so.warmup_steps = args.scale_lr ? static_cast<int64_t>(sampler.indices().size()) / batch : 0;
  const dtrain::optim::LinearScaling schedule(so);
  int64_t step = 0;
  dtrain::Stopwatch step_time;
  dtrain::BytesSentMeter sent;
  for (int epoch = 0; epoch < args.epochs; ++epoch) {
    sampler.setEpoch(epoch);
    step_time.lap();  // step times leave out the accuracy check below
    auto idx = torch::tensor(sampler.indices(), torch::kLong).to(device);
    double sum = 0;
    int steps = 0;
    for (int64_t b = 0; b + batch <= idx.size(0); b += batch) {
      auto rows = idx.narrow(0, b, batch);
      const double lr = schedule.apply(*opt, step);
      opt->zero_grad();
      torch::Tensor loss;
      {
        DTRAIN_SPAN("forward", "compute");  // your own spans, on the timeline (DTRAIN_TIMELINE=DIR)
        loss = torch::nn::functional::cross_entropy(model->forward(data.index_select(0, rows)),
                                                    labels.index_select(0, rows));
      }
      loss.backward();  // gradients averaged across ranks, overlapped with backward
      {
        DTRAIN_SPAN("optimizer.step", "optim");
        opt->step();
        if (averager) averager->averageParameters(model->parameters());
      }
      sum += loss.item<double>();
      ++steps;
      ++step;
      if (log) {
        auto st = ddp.lastStats();
        double step_s = step_time.lap();
        log->write(dtrain::Record("step").set("step", step).set("epoch", epoch).set("time_s", log->seconds())
                       .set("loss", loss.item<double>()).set("lr", lr).set("samples_per_s", batch * dist.size() / step_s)
                       .stepTimes(step_s, st.comm_ms / 1e3, st.exposed_ms / 1e3)
                       .set("bytes_sent", sent.sinceLast()).set("rss_bytes", dtrain::residentBytes()));
      }
    }
    torch::NoGradGuard no_grad;
    double acc = (model->forward(data).argmax(1) == labels).to(torch::kDouble).mean().item<double>();
    if (dist.isMain())
      std::printf("epoch %d  loss %.4f  accuracy %.3f  (%d ranks%s)\n", epoch, sum / steps, acc, dist.size(),
                  device.is_cpu() ? "" : (", " + device.str()).c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
