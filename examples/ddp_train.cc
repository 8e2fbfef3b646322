// Training with DistributedDataParallel: the same binary runs alone or under dtrain-run.
//
//   build/bin/example-ddp                                          # one process
//   build/bin/dtrain-run --standalone --nproc-per-node 2 build/bin/example-ddp
//   build/bin/example-ddp --metrics run/metrics.jsonl              # rank 0 logs every step (JSON lines)
//
// A small classifier on generated data (the label is which of 4 directions x points to); every rank
// reads its share of each epoch through the DistributedSampler, DDP averages the gradients.
#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <string>

#include "dtrain/ddp.h"
#include "dtrain/distributed.h"
#include "dtrain/metrics.h"
#include "dtrain/sampler.h"
#include "dtrain/trace.h"

struct NetImpl : torch::nn::Module {
  NetImpl() : fc1(register_module("fc1", torch::nn::Linear(16, 64))), fc2(register_module("fc2", torch::nn::Linear(64, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

int main(int argc, char** argv) try {
  std::string metrics;  // --metrics FILE
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--metrics" && i + 1 < argc) metrics = argv[++i];
    else throw std::invalid_argument(std::string("unknown argument ") + argv[i] + " (usage: example-ddp [--metrics FILE])");
  }
  torch::set_num_threads(1);
  auto dist = dtrain::init();  // a world of one when not launched by dtrain-run / torchrun / mpirun
  std::unique_ptr<dtrain::MetricsLog> log;  // docs/OBSERVABILITY.md: a run record, then one per step
  if (!metrics.empty() && dist.isMain()) {
    log = std::make_unique<dtrain::MetricsLog>(metrics);
    log->writeRun("example-ddp", dist.size(), dtrain::Record().set("batch", 64).set("lr", 0.05).set("epochs", 5));
  }

  torch::manual_seed(0);  // the same data on every rank; DDP broadcasts rank 0's weights anyway
  auto centers = torch::randn({4, 16});
  auto labels = torch::randint(0, 4, {4096});
  auto data = centers.index_select(0, labels) + 0.8 * torch::randn({4096, 16});

  Net model;
  dtrain::DistributedDataParallel ddp(model.ptr(), dist.world());
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  dtrain::DistributedSampler sampler(data.size(0), dist.size(), dist.rank(), /*shuffle=*/true, /*seed=*/0);

  const int64_t batch = 64;  // per rank
  int64_t step = 0;
  dtrain::Stopwatch step_time;
  dtrain::BytesSentMeter sent;
  for (int epoch = 0; epoch < 5; ++epoch) {
    sampler.setEpoch(epoch);
    step_time.lap();  // step times leave out the accuracy check below
    auto idx = torch::tensor(sampler.indices(), torch::kLong);
    double sum = 0;
    int steps = 0;
    for (int64_t b = 0; b + batch <= idx.size(0); b += batch) {
      auto rows = idx.narrow(0, b, batch);
      opt.zero_grad();
      torch::Tensor loss;
      {
        DTRAIN_SPAN("forward", "compute");  // your own spans, on the timeline (DTRAIN_TIMELINE=DIR)
        loss = torch::nn::functional::cross_entropy(model->forward(data.index_select(0, rows)),
                                                    labels.index_select(0, rows));
      }
      loss.backward();  // gradients averaged across ranks, overlapped with backward
      {
        DTRAIN_SPAN("optimizer.step", "optim");
        opt.step();
      }
      sum += loss.item<double>();
      ++steps;
      if (log) {
        auto st = ddp.lastStats();
        double step_s = step_time.lap();
        log->write(dtrain::Record("step").set("step", ++step).set("epoch", epoch).set("time_s", log->seconds())
                       .set("loss", loss.item<double>()).set("lr", 0.05).set("samples_per_s", batch * dist.size() / step_s)
                       .stepTimes(step_s, st.comm_ms / 1e3, st.exposed_ms / 1e3)
                       .set("bytes_sent", sent.sinceLast()).set("rss_bytes", dtrain::residentBytes()));
      }
    }
    torch::NoGradGuard no_grad;
    double acc = (model->forward(data).argmax(1) == labels).to(torch::kDouble).mean().item<double>();
    if (dist.isMain()) std::printf("epoch %d  loss %.4f  accuracy %.3f  (%d ranks)\n", epoch, sum / steps, acc, dist.size());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
