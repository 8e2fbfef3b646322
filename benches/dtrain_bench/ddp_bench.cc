// dtrain-bench ddp: trains the reference MLP of benches/peers/torch_ddp.py (784-2048-2048-1024-10,
// batch 64 per rank, SGD momentum 0.9, one compute thread per rank) and prints a line of the same
// form as that script:
//   dtrain-ddp world=2 params=7912458 batch_per_rank=64 ms_per_step=... samples_per_s=... hidden=0.83
//   transport=shm hook=none bytes_per_step=31649832 wrong=0/16 max_err=1.6e-03 check=reference
// --hook takes dtrain/hook_spec.h's values (none, fp16, bf16, topk:RATIO, powersgd:R); bytes_per_step
// is what this rank sent per timed step (every collective, comm::bytesSent()).
// hidden is the fraction of the allreduce time that backward hid (DDP's lastStats, averaged over the
// timed steps). Run it under dtrain-run for several ranks; alone it is the one-rank baseline.
// `--mode dp --threads N` runs DataParallel (one process, N replica threads) on N x batch instead.
// `--device cuda` trains on cuda:LOCAL_RANK (dtrain/device.h; NCCL where each rank has a GPU of its own,
// else staged through the host) and adds device=cuda:N to the line; the check runs on the CPU.
//
// Verification, after the timed steps: every rank trains the same MLP in one process with plain
// libtorch on the global batch (all ranks' batches concatenated) for as many steps, and compares
// its DDP parameters with that reference (reference_mlp.h). wrong=K/N: K of the N parameter tensors
// (8 per rank) differ from the reference by more than the tolerance, relative to how far training
// moved them; max_err is the largest such relative error. K > 0 makes the exit status 1. Top-k and
// PowerSGD follow another trajectory by design: check=ranks-agree then counts the tensors whose sum
// differs between ranks (DDP's invariant) instead.
// Progress on stderr counts the timed steps; --metrics FILE adds a step record per timed step and a
// bench record (observe.h).
#include "ddp_bench.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "observe.h"
#include "reference_mlp.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/device.h"
#include "dtrain/distributed.h"
#include "dtrain/hook_spec.h"
#include "dtrain/local_sgd.h"

namespace dtrain::bench {
namespace {

// ||ddp - reference|| / ||reference - init|| per parameter tensor (see compareParams). fp32 DDP
// differs from the one-process run by summation order only, which drifts to about 2e-3 by 33 steps;
// a 16-bit hook also rounds every averaged gradient. Not averaging, or averaging only some
// buckets, is off by order 1.
constexpr double kTolerance = 0.02;
constexpr double kToleranceCompressed = 0.05;

struct Options {
  int steps = 30;
  int batch = 64;
  int warmup = 3;
  std::string mode = "ddp";
  int threads = 2;
  std::string hook = "none";
  int local_sgd = 0;
  std::string device = "cpu";
  double bucket_mb = 25, first_bucket_mb = 1;  // DDPOptions' defaults (PyTorch's)
  double last_bucket_mb = 0;                    // DDPOptions' default (PyTorch's buckets; > 0: the last-bucket rule)
  std::string model = "mlp";                    // ddp: mlp (the reference MLP) or conv (reference_mlp.h)
  Observe observe;
};

// The run record's config.
Record runConfig(const Options& o) {
  return Record().set("mode", o.mode).set("steps", o.steps).set("batch", o.batch).set("warmup", o.warmup)
      .set("threads", o.threads).set("hook", o.hook)
      .set("local_sgd", o.local_sgd).set("device", o.device).set("bucket_mb", o.bucket_mb)
      .set("first_bucket_mb", o.first_bucket_mb).set("last_bucket_mb", o.last_bucket_mb).set("model", o.model);
}

// Hooks that drop information on purpose (top-k, PowerSGD) train a different trajectory than the
// one-process reference: for them the check is DDP's invariant instead, every rank holding the same
// parameters (each tensor's sum, min and max over ranks equal).
// Local SGD too (the ranks' parameters are averaged once more before the check).
bool lossy(const CommHookSpec& spec, const Options& o) {
  return spec.kind == "topk" || spec.kind == "powersgd" || o.local_sgd > 0;
}

// `trained`: the steps net took (warm-up, bucket tuning's and timed ones).
ParamCheck checkParams(Distributed& dist, torch::nn::Sequential& net, const Options& o, const CommHookSpec& spec,
                       int trained) {
  if (!lossy(spec, o)) {
    const BenchModel m = parseBenchModel(o.model);
    auto [gx, gy] = globalBatch(dist.size(), o.batch, m);
    auto ref = trainReference(gx, gy, trained, m);
    return compareParams(net, ref, spec.kind == "none" ? kTolerance : kToleranceCompressed, m);
  }
  return ranksAgree(*dist.world(), net->parameters());
}

const char* tuneName(DDPTuning::State s) {
  switch (s) {
    case DDPTuning::State::probing: return "probing";
    case DDPTuning::State::cached: return "cached";
    case DDPTuning::State::tuned: return "tuned";
    default: return "off";
  }
}

int runDdp(const Options& o) {
  torch::set_num_threads(1);
  auto dist = dtrain::init();
  const torch::Device device = selectDevice(o.device, dist.localRank());
  const BenchModel model = parseBenchModel(o.model);
  auto net = benchModel(model);
  net->to(device);
  DDPOptions ddp_options;
  ddp_options.bucket_bytes = static_cast<size_t>(o.bucket_mb * (1 << 20));
  ddp_options.first_bucket_bytes = static_cast<size_t>(o.first_bucket_mb * (1 << 20));
  ddp_options.last_bucket_bytes = static_cast<size_t>(o.last_bucket_mb * (1 << 20));
  DistributedDataParallel ddp(net.ptr(), dist.world(), ddp_options);
  const CommHookSpec spec = parseCommHookSpec(o.hook, "--hook");
  if (auto hook = makeCommHook(spec)) ddp.registerCommHook(hook);
  std::unique_ptr<PeriodicModelAverager> averager;  // local SGD: gradients within the host, parameters every N steps
  if (o.local_sgd > 0) {
    if (spec.kind != "none") throw InvalidArgument("dtrain-bench ddp: --local-sgd and --hook: choose one");
    ddp.registerCommHook(postLocalSGDHook(dist.local(), 0));
    averager = std::make_unique<PeriodicModelAverager>(dist.world(), o.local_sgd);
  }
  auto opt = makeSgd(net);
  auto [x_cpu, y_cpu] = rankBatch(dist.rank(), o.batch, model);
  const at::Tensor x = x_cpu.to(device), y = y_cpu.to(device);
  // The clock reads the GPU's time too: every step's work done before the barrier that ends the loop.
  auto settle = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  auto log = o.observe.open(dist.isMain(), "ddp", dist.size(), runConfig(o).set("transport", dist.world()->transportName()));
  double hidden = 0;
  // Warm-up, then (DTRAIN_TUNE) as many steps as bucket-size tuning takes: timed steps use its choice.
  int trained = 0;
  while (trained < o.warmup || ddp.tuning().state == DDPTuning::State::probing) {
    sgdStep(net, opt, x, y);
    if (averager) averager->averageParameters(net->parameters());
    ++trained;
  }
  trained += o.steps;
  settle();
  dist.world()->barrier()->wait();
  Progress progress("ddp", o.steps, o.observe.progress(dist.isMain(), "step"));
  BytesSentMeter sent;
  uint64_t sent_total = 0;
  Stopwatch step_time;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.steps; ++i) {
    sgdStep(net, opt, x, y);
    if (averager) averager->averageParameters(net->parameters());
    const auto st = ddp.lastStats();
    hidden += st.hiddenFraction();
    const double step_s = step_time.lap();
    const uint64_t step_bytes = sent.sinceLast();
    sent_total += step_bytes;
    if (log) {
      log->write(Record("step").set("step", i + 1).set("time_s", log->seconds())
                     .set("samples_per_s", dist.size() * o.batch / step_s).stepTimes(step_s, st.comm_ms / 1e3, st.exposed_ms / 1e3)
                     .set("bytes_sent", step_bytes).set("rss_bytes", residentBytes()));
    }
    progress.update(i + 1);
  }
  settle();
  dist.world()->barrier()->wait();
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o.steps;
  progress.finish();

  if (averager) averageParameters(net->parameters(), *dist.world());  // local SGD: agree before the check
  net->to(torch::kCPU);  // the reference runs on the CPU
  const ParamCheck mine = checkParams(dist, net, o, spec, trained);
  if (mine.wrong != 0 && lossy(spec, o)) {
    std::fprintf(stderr, "dtrain-bench ddp: rank %d: %lld of %lld parameter tensors differ between ranks (largest %.3g)\n",
                 dist.rank(), static_cast<long long>(mine.wrong), static_cast<long long>(mine.tensors), mine.max_rel);
  } else if (mine.wrong != 0) {
    // Said by the rank itself: the sum below goes through the collectives being measured.
    std::fprintf(stderr,
                 "dtrain-bench ddp: rank %d: %lld of %lld parameter tensors differ from the one-process reference "
                 "by more than %g of the training update (largest %.3g)\n",
                 dist.rank(), static_cast<long long>(mine.wrong), static_cast<long long>(mine.tensors),
                 spec.kind == "none" ? kTolerance : kToleranceCompressed, mine.max_rel);
  }
  ParamCheck all = mine;
  dist.world()->allreduce(&all.wrong, 1, comm::DType::i64, comm::ReduceOp::sum)->wait();
  dist.world()->allreduce(&all.tensors, 1, comm::DType::i64, comm::ReduceOp::sum)->wait();
  dist.world()->allreduce(&all.max_rel, 1, comm::DType::f64, comm::ReduceOp::max)->wait();
  const DDPTuning tuned = ddp.tuning();
  const std::string shown = o.local_sgd > 0 ? "local-sgd:" + std::to_string(o.local_sgd) : o.hook;
  if (dist.isMain()) {
    std::printf("dtrain-ddp world=%d params=%lld batch_per_rank=%d ms_per_step=%.1f samples_per_s=%.1f hidden=%.2f "
                "transport=%s hook=%s bytes_per_step=%llu wrong=%lld/%lld max_err=%.1e check=%s model=%s bucket_mb=%g "
                "first_bucket_mb=%g last_bucket_mb=%g tune=%s%s\n",
                dist.size(), static_cast<long long>(countParams(net)), o.batch, dt * 1e3, dist.size() * o.batch / dt,
                dist.size() > 1 ? hidden / o.steps : 0.0, dist.world()->transportName().c_str(), shown.c_str(),
                static_cast<unsigned long long>(sent_total / static_cast<uint64_t>(o.steps)),
                static_cast<long long>(all.wrong), static_cast<long long>(all.tensors), all.max_rel,
                lossy(spec, o) ? "ranks-agree" : "reference", o.model.c_str(), tuned.bucket_bytes / double(1 << 20),
                tuned.first_bucket_bytes / double(1 << 20), o.last_bucket_mb, tuneName(tuned.state),
                device.is_cpu() ? "" : (" device=" + device.str()).c_str());
  }
  if (log) {
    Record r("bench");
    r.set("name", "ddp").set("mode", "ddp").set("transport", dist.world()->transportName()).set("hook", o.hook)
        .set("params", countParams(net)).set("batch_per_rank", o.batch).set("steps", o.steps).set("ms_per_step", dt * 1e3)
        .set("samples_per_s", dist.size() * o.batch / dt)
        .set("bytes_per_step", sent_total / static_cast<uint64_t>(o.steps));
    if (dist.size() > 1) r.set("hidden_fraction", hidden / o.steps);
    r.set("model", o.model).set("bucket_bytes", static_cast<int64_t>(tuned.bucket_bytes))
        .set("first_bucket_bytes", static_cast<int64_t>(tuned.first_bucket_bytes)).set("tune", tuneName(tuned.state));
    log->write(r.set("wrong", all.wrong).set("tensors", all.tensors).set("max_err", all.max_rel));
  }
  return mine.wrong == 0 && all.wrong == 0 ? 0 : 1;
}

}  // namespace

int runDataParallel(int threads, int batch, int steps, int warmup, double tol, MetricsLog* log);  // data_parallel_bench.cc

void addDdpCommand(CLI::App& app) {
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand("ddp", "DDP (or --mode dp: DataParallel) training throughput on the reference MLP");
  sub->add_option("--steps", o->steps, "timed steps");
  sub->add_option("--batch", o->batch, "batch per rank (per replica for dp)");
  sub->add_option("--warmup", o->warmup, "untimed steps first");
  sub->add_option("--mode", o->mode, "ddp or dp")->check(CLI::IsMember({"ddp", "dp"}));
  sub->add_option("--bucket-mb", o->bucket_mb, "ddp: bucket cap in MiB (DDPOptions::bucket_bytes)")->check(CLI::PositiveNumber);
  sub->add_option("--first-bucket-mb", o->first_bucket_mb, "ddp: first bucket's cap in MiB")->check(CLI::PositiveNumber);
  sub->add_option("--last-bucket-mb", o->last_bucket_mb, "ddp: last bucket's cap in MiB (0, the default: PyTorch's buckets)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--threads", o->threads, "dp: replica threads");
  sub->add_option("--model", o->model, "ddp: mlp (the reference MLP, 7.9M parameters) or conv (a small conv net on "
                  "3x32x32 images, 2.8M)")->check(CLI::IsMember({"mlp", "conv"}));
  o->observe.addOptions(sub);
  sub->add_option("--device", o->device, "ddp: cpu, cuda (cuda:LOCAL_RANK), cuda:N or auto");
  sub->add_option("--hook", o->hook, "ddp: none, fp16, bf16, topk:RATIO or powersgd:R[:START] (dtrain/hook_spec.h)");
  sub->add_option("--local-sgd", o->local_sgd, "ddp: local SGD, parameters averaged every N steps (gradients within each host)")
      ->check(CLI::NonNegativeNumber);
  sub->callback([o] {
    runAndExit("ddp", [&] {
      if (o->mode == "ddp") return runDdp(*o);
      auto log = o->observe.open(true, "dp", 1, runConfig(*o));
      return runDataParallel(o->threads, o->batch, o->steps, o->warmup, kTolerance, log.get());
    });
  });
}

}  // namespace dtrain::bench
