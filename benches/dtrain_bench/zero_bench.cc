// dtrain-bench zero: the sharded training state (ZeRO) against DDP, with Adam. Every rank prints a line:
//   dtrain-zero mode=zero3 world=4 rank=1 model=wide params=100687872 ms_per_step=... samples_per_s=...
//   param_bytes=... grad_bytes=... optim_bytes=... transient_bytes=... model_state_bytes=... vmhwm_bytes=...
//   check=ranks-agree wrong=0
// mode: ddp (DDP, Adam), zero1 (DDP, ZeroRedundancyOptimizer over Adam), zero2 and zero3
// (FullyShardedDataParallel, one unit per Linear, Adam over the shards), empty (no model: the baseline of
// the program's own memory, for vmhwm differences).
// model: reference (benches/peers/torch_ddp.py's 784-2048-2048-1024-10 MLP on its fixed batches) or wide
// (--layers Linear(W, W) with ReLUs between, on random inputs, loss mean(y²); 6 x 4096 is 100.7M
// parameters).
// The byte counts are this rank's, at their peak: parameters held (all, or the shards), gradients, Adam's
// state, and for zero2/zero3 the most gathered parameters and whole-unit gradients held at once
// (FullyShardedDataParallel::Memory::transient_peak); model_state_bytes is their sum. vmhwm_bytes is the
// peak resident memory (VmHWM) while training (the peak is reset once the model is built and wrapped;
// build_vmhwm_bytes is the peak up to then, which includes the whole model every rank builds before it is
// sharded); compare it with an `empty` run's to see what the model cost. Every mode, `empty` included,
// first runs one 64 MiB allreduce, so that the transport's buffers (fixed, not the model's) are resident
// in the baseline too.
// check: after the timed steps every rank's parameters are summed and compared across ranks (they must
// agree: data parallelism's invariant); wrong>0 makes the exit status 1. zero2/zero3 print check=none
// (their shards differ by design; tests/torch/fsdp_test.cc checks them against one process).
#include "zero_bench.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/distributed.h"
#include "dtrain/fsdp.h"
#include "dtrain/zero.h"
#include "observe.h"
#include "reference_mlp.h"

namespace dtrain::bench {
namespace {

struct Options {
  std::string mode = "zero1";
  std::string model = "reference";
  int width = 4096;
  int layers = 6;
  int batch = 64;
  int steps = 20;
  int warmup = 3;
  bool prefetch = true;
  Observe observe;
};

torch::nn::Sequential makeModel(const Options& o) {
  if (o.model == "reference") return referenceMlp();
  torch::manual_seed(0);
  torch::nn::Sequential s;
  for (int i = 0; i < o.layers; ++i) {
    s->push_back(torch::nn::Linear(o.width, o.width));
    if (i + 1 < o.layers) s->push_back(torch::nn::ReLU());
  }
  return s;
}

std::pair<at::Tensor, at::Tensor> makeBatch(const Options& o, int rank) {
  if (o.model == "reference") return rankBatch(rank, o.batch);
  auto g = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  return {at::randn({o.batch, o.width}, g), at::Tensor()};
}

at::Tensor lossOf(const Options& o, const at::Tensor& out, const at::Tensor& y) {
  return o.model == "reference" ? torch::nn::functional::cross_entropy(out, y) : out.pow(2).mean();
}

int64_t adamStateBytes(const torch::optim::Optimizer& opt) {
  int64_t n = 0;
  for (const auto& [key, s] : opt.state()) {
    const auto& a = static_cast<const torch::optim::AdamParamState&>(*s);
    n += static_cast<int64_t>(a.exp_avg().nbytes() + a.exp_avg_sq().nbytes());
  }
  return n;
}

int64_t bytesOf(const std::vector<at::Tensor>& ts, bool grads) {
  int64_t n = 0;
  for (const auto& t : ts) {
    const auto& x = grads ? t.grad() : t;
    if (x.defined()) n += static_cast<int64_t>(x.nbytes());
  }
  return n;
}

struct Bytes {
  int64_t params = 0, grads = 0, optim = 0, transient = 0;
};

// One mode's training objects and step.
struct Trainer {
  const Options& o;
  Distributed& dist;
  torch::nn::Sequential net{nullptr};
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::Adam> adam;

  Trainer(const Options& opts, Distributed& d) : o(opts), dist(d) {
    net = makeModel(o);
    auto make = [](std::vector<torch::optim::OptimizerParamGroup> g) {
      return std::make_unique<torch::optim::Adam>(std::move(g), torch::optim::AdamOptions(1e-3));
    };
    if (o.mode == "ddp" || o.mode == "zero1") {
      ddp = std::make_unique<DistributedDataParallel>(net.ptr(), dist.world());
      if (o.mode == "zero1") zero = std::make_unique<ZeroRedundancyOptimizer>(net->parameters(), make, dist.world());
      else adam = std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-3));
    } else {
      FsdpOptions f;
      f.stage = o.mode == "zero2" ? 2 : 3;
      f.min_unit_params = 1;  // one unit per Linear (ReLUs join the unit before them)
      f.prefetch = o.prefetch;
      fsdp = std::make_unique<FullyShardedDataParallel>(net, dist.world(), f);
      adam = std::make_unique<torch::optim::Adam>(fsdp->shards(), torch::optim::AdamOptions(1e-3));
    }
  }

  void step(const at::Tensor& x, const at::Tensor& y) {
    if (zero) zero->zeroGrad();
    else adam->zero_grad();
    auto out = fsdp ? fsdp->forward(x) : ddp->forward(net, x);
    lossOf(o, out, y).backward();
    if (zero) zero->step();
    else adam->step();
  }

  Bytes bytes() const {
    Bytes b;
    if (zero) {
      const auto m = zero->memory();
      return {m.parameters, m.gradients, m.optimizer_state, 0};
    }
    if (fsdp) {
      const auto m = fsdp->memory();
      return {m.shard_parameters, m.shard_gradients, adamStateBytes(*adam), m.transient_peak};
    }
    b.params = bytesOf(net->parameters(), false);
    b.grads = bytesOf(net->parameters(), true);
    b.optim = adamStateBytes(*adam);
    return b;
  }

  // The parameters to compare across ranks: DDP and stage 1 keep whole replicas; the shards of stages 2
  // and 3 have no such invariant (their equality with one process is what tests/torch/fsdp_test.cc checks).
  std::vector<at::Tensor> replicated() const { return fsdp ? std::vector<at::Tensor>{} : net->parameters(); }
};

int runZero(const Options& o) {
  torch::set_num_threads(1);
  auto dist = dtrain::init();
  const int world = dist.size(), rank = dist.rank();
  {  // the transport's buffers resident in every mode (the baseline's too); this tensor is not
    at::Tensor warm = at::ones({16 << 20});
    dist.world()->allreduce(warm.data_ptr(), warm.data_ptr(), static_cast<size_t>(warm.numel()), comm::DType::f32,
                            comm::ReduceOp::sum)->wait();
  }
  resetPeakResidentBytes();
  if (o.mode == "empty") {
    dist.world()->barrier()->wait();
    std::printf("dtrain-zero mode=empty world=%d rank=%d vmhwm_bytes=%llu\n", world, rank,
                static_cast<unsigned long long>(peakResidentBytes()));
    return 0;
  }
  Trainer t(o, dist);
  const uint64_t build_hwm = peakResidentBytes();
  resetPeakResidentBytes();
  auto [x, y] = makeBatch(o, rank);
  for (int i = 0; i < o.warmup; ++i) t.step(x, y);
  dist.world()->barrier()->wait();
  Progress progress("zero", o.steps, o.observe.progress(dist.isMain(), "step"));
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.steps; ++i) {
    t.step(x, y);
    progress.update(i + 1);
  }
  dist.world()->barrier()->wait();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o.steps;
  progress.finish();
  const uint64_t hwm = peakResidentBytes();  // (before the check below allocates anything)
  // The check: every rank holds the same parameters.
  const int64_t wrong = ranksAgree(*dist.world(), t.replicated()).wrong;
  const Bytes b = t.bytes();
  const int64_t state = b.params + b.grads + b.optim + b.transient;
  std::printf("dtrain-zero mode=%s world=%d rank=%d model=%s params=%lld ms_per_step=%.1f samples_per_s=%.1f "
              "param_bytes=%lld grad_bytes=%lld optim_bytes=%lld transient_bytes=%lld model_state_bytes=%lld "
              "vmhwm_bytes=%llu build_vmhwm_bytes=%llu check=%s wrong=%lld\n",
              o.mode.c_str(), world, rank, o.model.c_str(), static_cast<long long>(countParams(t.net)), dt * 1e3,
              world * o.batch / dt, static_cast<long long>(b.params), static_cast<long long>(b.grads),
              static_cast<long long>(b.optim), static_cast<long long>(b.transient), static_cast<long long>(state),
              static_cast<unsigned long long>(hwm), static_cast<unsigned long long>(build_hwm), t.fsdp ? "none" : "ranks-agree", static_cast<long long>(wrong));
  std::fflush(stdout);
  auto log = o.observe.open(dist.isMain(), "zero", world, Record().set("mode", o.mode).set("model", o.model));
  if (log) {
    log->write(Record("bench").set("name", "zero").set("mode", o.mode).set("model", o.model)
                   .set("params", countParams(t.net)).set("ms_per_step", dt * 1e3).set("samples_per_s", world * o.batch / dt)
                   .set("param_bytes", b.params).set("grad_bytes", b.grads).set("optim_bytes", b.optim)
                   .set("transient_bytes", b.transient).set("model_state_bytes", state).set("vmhwm_bytes", hwm).set("build_vmhwm_bytes", build_hwm)
                   .set("wrong", wrong));
  }
  return wrong == 0 ? 0 : 1;
}

}  // namespace

void addZeroCommand(CLI::App& app) {
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand("zero", "sharded training state (ZeRO 1-3) against DDP, with Adam: speed and memory per rank");
  sub->add_option("--mode", o->mode, "ddp, zero1, zero2, zero3 or empty")
      ->check(CLI::IsMember({"ddp", "zero1", "zero2", "zero3", "empty"}));
  sub->add_option("--model", o->model, "reference (the 7.9M MLP) or wide (--layers x --width)")
      ->check(CLI::IsMember({"reference", "wide"}));
  sub->add_option("--width", o->width, "wide: features per layer")->check(CLI::PositiveNumber);
  sub->add_option("--layers", o->layers, "wide: Linear layers")->check(CLI::PositiveNumber);
  sub->add_flag("--prefetch,!--no-prefetch", o->prefetch, "zero2/zero3: gather the next unit while one computes (default on)");
  sub->add_option("--batch", o->batch, "batch per rank")->check(CLI::PositiveNumber);
  sub->add_option("--steps", o->steps, "timed steps")->check(CLI::PositiveNumber);
  sub->add_option("--warmup", o->warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  o->observe.addOptions(sub);
  sub->callback([o] { runAndExit("zero", [&] { return runZero(*o); }); });
}

}  // namespace dtrain::bench
