// dtrain-bench ps: the parameter server (run under `dtrain-run --servers S`; the same binary is a
// server or a worker by DTRAIN_ROLE).
//
//   --mode mlp: the reference MLP of benches/peers/torch_ddp.py (784-2048-2048-1024-10, batch 64 per
//     worker, SGD momentum 0.9 applied by the servers, BSP) trained through the PS; a pull and a push per
//     parameter per step. Prints
//       dtrain-ps workers=2 servers=1 params=7912458 batch_per_worker=64 ms_per_step=... samples_per_s=...
//     Compare with `dtrain-bench ddp` under the same launcher (without --servers).
//   --mode sparse: an embedding table of 1M x 64 floats; each step touches --rows random rows (1%):
//     pullRows + pushRows of the row gradients through the PS, against the dense alternative, an
//     allreduce of the whole 1M x 64 gradient (256 MB) over the workers' group. Prints the time of both,
//     the speedup and the PS's measured bytes per step (the allreduce's traffic depends on the algorithm
//     the transport picks, so none is claimed for it).
// Every result is verified and counted in "#wrong" (the program exits 1 when it is not 0): a small dense
// tensor pushed every step with rank-dependent gradients (BSP's mean, closed form), in mlp mode the
// trained parameters against one process training on every worker's batch (rank 0), in sparse mode a row
// table of known pushes and the dense allreduce of rank-dependent values against their average.
// Progress on stderr counts the timed steps; --metrics FILE adds a bench record "ps-mlp" or "ps-sparse".
#include "ps_bench.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "dtrain/comm/error.h"
#include "dtrain/distributed.h"
#include "dtrain/ps.h"
#include "dtrain/ps_module.h"
#include "observe.h"

namespace dtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string mode = "mlp";
  int steps = 20;
  int warmup = 3;
  int batch = 64;
  int64_t table_rows = 1000000;
  int64_t dim = 64;
  int64_t rows = 10000;
  int dense_steps = 5;
  double partition_kb = 4096;  // PSOptions::partition_bytes: the largest message (rows per pull/push message)
  Observe observe;
};

ps::PSOptions psOptions(const Options& o) {
  ps::PSOptions p;
  p.update = ps::PSOptions::Update::sgd;
  p.lr = 0.01;
  p.momentum = o.mode == "mlp" ? 0.9 : 0.0;  // sparse: plain SGD so the row check is order-independent
  p.partition_bytes = static_cast<size_t>(o.partition_kb * 1024);
  return p;
}

double seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A small dense tensor of zeros pushed in every step next to the real work: worker w's gradient is
// (w+1) everywhere, so BSP applies SGD (with the servers' momentum) to the mean (W+1)/2 once per step;
// the value after n steps is known in closed form.
struct DenseCheck {
  ps::Worker& w;
  ps::PSOptions p;
  int world;
  int steps = 0;
  DenseCheck(ps::Worker& worker, const ps::PSOptions& opts, int W) : w(worker), p(opts), world(W) {
    w.declare("check_dense", torch::zeros({1000}));
  }
  void push() {  // before clock()
    w.push("check_dense", torch::full({1000}, static_cast<float>(w.rank() + 1)));
    ++steps;
  }
  int64_t verify() {  // after the last clock(): the wrong elements
    auto out = torch::empty({1000});
    w.pull("check_dense", out);
    double g = (world + 1) / 2.0, buf = 0, val = 0;
    for (int i = 0; i < steps; ++i) {
      buf = p.momentum * buf + g;
      val -= p.lr * buf;
    }
    int64_t wrong = (out - val).abs().gt(1e-6 + 1e-4 * std::abs(val)).sum().item<int64_t>();
    if (wrong) std::fprintf(stderr, "[worker %d] check_dense after %d steps: got %f, want %f\n", w.rank(), steps,
                            out[0].item<double>(), val);
    return wrong;
  }
};

// Rows 0..99 of a fresh table; every worker pushes (w+1) on even rows; each push is its own SGD step.
int64_t checkRows(ps::Worker& w, int world, const ps::PSOptions& p, int64_t dim) {
  w.declareRows("check_rows", 1000, dim);
  auto even = torch::arange(0, 100, 2, torch::kLong);
  w.pushRows("check_rows", even, torch::full({even.size(0), dim}, static_cast<float>(w.rank() + 1)));
  w.clock();
  auto got = w.pullRows("check_rows", torch::arange(0, 100, torch::kLong));  // BSP gate: every worker pushed
  double sum = world * (world + 1) / 2.0;
  auto want = torch::zeros({100, dim});
  want.index_fill_(0, even, static_cast<float>(-p.lr * sum));
  int64_t wrong = (got - want).abs().gt(1e-7 + 1e-5 * want.abs()).sum().item<int64_t>();
  if (wrong) std::fprintf(stderr, "[worker %d] check_rows: max error %g\n", w.rank(), (got - want).abs().max().item<double>());
  return wrong;
}

torch::nn::Sequential referenceMlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                               torch::nn::ReLU(), torch::nn::Linear(2048, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

// The reference for --mode mlp: one process training the MLP on every worker's batch at once (the mean
// gradient BSP applies), with the servers' SGD; returns the wrong elements of the trained parameters.
int64_t checkMlp(torch::nn::Sequential& trained, int world, int batch, int steps, const ps::PSOptions& p) {
  auto ref = referenceMlp();
  std::vector<at::Tensor> xs, ys;
  for (int r = 0; r < world; ++r) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(r);  // worker r's batch
    xs.push_back(at::randn({batch, 784}, g));
    ys.push_back(at::randint(0, 10, {batch}, g, torch::kLong));
  }
  auto x = torch::cat(xs), y = torch::cat(ys);
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(p.lr).momentum(p.momentum));
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
    opt.step();
  }
  int64_t wrong = 0;
  auto got = trained->parameters(), want = ref->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    auto d = (got[i].detach() - want[i].detach()).abs();
    int64_t n = d.gt(1e-5 + 1e-3 * want[i].detach().abs()).sum().item<int64_t>();
    if (n) std::fprintf(stderr, "[worker 0] mlp parameter %zu: %lld wrong, max error %g\n", i, static_cast<long long>(n),
                        d.max().item<double>());
    wrong += n;
  }
  return wrong;
}

int64_t runMlp(const Options& o, ps::Worker& w, const Distributed& dist, DenseCheck& check, MetricsLog* log) {
  auto net = referenceMlp();
  int64_t nparams = 0;
  for (const auto& p : net->parameters()) nparams += p.numel();
  // The loop a DDP user writes, through ps::DistributedModule: 4 MB buckets pushed from the gradient
  // hooks while backward runs, the servers' SGD step, pulls installed before the next forward.
  ps::DistributedModule psm(net.ptr(), w);
  auto g = at::make_generator<at::CPUGeneratorImpl>(dist.rank());
  auto x = at::randn({o.batch, 784}, g);
  auto y = at::randint(0, 10, {o.batch}, g, torch::kLong);
  double first_loss = 0, last_loss = 0;
  auto step = [&] {
    psm.beforeForward();
    net->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    check.push();
    psm.step();
    return loss.item<double>();
  };
  for (int i = 0; i < o.warmup; ++i) first_loss = step();
  dist.world()->barrier()->wait();
  int64_t b0 = w.bytesSent() + w.bytesReceived();
  auto t0 = Clock::now();
  Progress progress("ps", o.steps, o.observe.progress(dist.isMain(), "step"));
  for (int i = 0; i < o.steps; ++i) {
    last_loss = step();
    progress.update(i + 1, fmt::format("loss {:.4f}", last_loss));
  }
  dist.world()->barrier()->wait();
  double dt = seconds(t0) / o.steps;
  double bytes = static_cast<double>(w.bytesSent() + w.bytesReceived() - b0) / o.steps;
  progress.finish();
  if (log) {
    log->write(Record("bench").set("name", "ps-mlp").set("workers", dist.size()).set("servers", w.numServers())
                   .set("params", nparams).set("batch_per_worker", o.batch).set("steps", o.steps)
                   .set("ms_per_step", dt * 1e3).set("samples_per_s", dist.size() * o.batch / dt)
                   .set("bytes_per_step_per_worker", bytes).set("first_loss", first_loss).set("last_loss", last_loss));
  }
  if (dist.isMain()) {
    std::printf("dtrain-ps workers=%d servers=%d params=%lld batch_per_worker=%d ms_per_step=%.1f samples_per_s=%.1f "
                "MB_per_step_per_worker=%.1f loss %.4f -> %.4f\n",
                dist.size(), w.numServers(), static_cast<long long>(nparams), o.batch, dt * 1e3,
                dist.size() * o.batch / dt, bytes / 1e6, first_loss, last_loss);
  }
  psm.beforeForward();  // the values after the last step
  return dist.isMain() ? checkMlp(net, dist.size(), o.batch, o.warmup + o.steps, w.options()) : 0;
}

struct SparseResult {
  double ms = 0, pull_ms = 0, push_ms = 0, bytes = 0;
  // pull_ms is a step's pull, which the server answers once it has applied this worker's previous push
  // (and clock): BSP orders them. pull_alone_ms is a pull with nothing before it, the steps done: what
  // moving the rows costs.
  double pull_alone_ms = 0;
};

void runSparse(const Options& o, ps::Worker& w, const Distributed& dist, DenseCheck& check, SparseResult& r) {
  w.declareRows("emb", o.table_rows, o.dim);
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + dist.rank());
  double pull_s = 0, push_s = 0;
  // Buffers reused across steps, as a training loop would (fresh 2.5 MB tensors fault in new pages).
  auto values = torch::empty({o.rows, o.dim}), grads = torch::empty({o.rows, o.dim});
  auto step = [&] {
    auto rows = at::randint(0, o.table_rows, {o.rows}, g, torch::kLong);
    auto t = Clock::now();
    w.pullRowsAsync("emb", rows, values)->wait();
    pull_s += seconds(t);
    at::mul_out(grads, values, 0.01).add_(1.0);  // stands in for the backward pass
    t = Clock::now();
    w.pushRows("emb", rows, grads);
    push_s += seconds(t);
    check.push();
    w.clock();
  };
  for (int i = 0; i < o.warmup; ++i) step();
  dist.world()->barrier()->wait();
  pull_s = push_s = 0;
  int64_t b0 = w.bytesSent() + w.bytesReceived();
  auto t0 = Clock::now();
  Progress progress("ps", o.steps, o.observe.progress(dist.isMain(), "step"));
  for (int i = 0; i < o.steps; ++i) {
    step();
    progress.update(i + 1);
  }
  dist.world()->barrier()->wait();
  double sparse_s = seconds(t0) / o.steps;
  double sparse_bytes = static_cast<double>(w.bytesSent() + w.bytesReceived() - b0) / o.steps;
  double alone_s = 0;
  for (int i = 0; i < o.steps; ++i) {
    auto rows = at::randint(0, o.table_rows, {o.rows}, g, torch::kLong);
    auto t = Clock::now();
    w.pullRowsAsync("emb", rows, values)->wait();
    alone_s += seconds(t);
  }
  dist.world()->barrier()->wait();
  r.pull_alone_ms = alone_s * 1e3 / o.steps;

  r.ms = sparse_s * 1e3;
  r.pull_ms = pull_s * 1e3 / o.steps;
  r.push_ms = push_s * 1e3 / o.steps;
  r.bytes = sparse_bytes;
}

// Rank r's dense gradient: (r + 1) * (1 + (row + col) % 7), so the average over W ranks is
// (W + 1) / 2 * (1 + (row + col) % 7), exactly (small integers and halves).
at::Tensor densePattern(const Options& o) {
  auto rows = torch::arange(o.table_rows, torch::kLong).remainder(7).to(torch::kFloat).unsqueeze(1);
  return (rows + torch::arange(o.dim, torch::kFloat)).remainder_(7).add_(1);
}

// The elements of grad that are not the average of every rank's pattern.
int64_t checkDense(const Options& o, const at::Tensor& grad, int W, const char* when, int rank) {
  auto want = densePattern(o).mul_((W + 1) / 2.0);
  auto d = (grad - want).abs_();
  int64_t wrong = d.gt(1e-5 * 7 * W).sum().item<int64_t>();
  if (wrong) std::fprintf(stderr, "[worker %d] dense allreduce %s: %lld wrong, max error %g\n", rank, when,
                          static_cast<long long>(wrong), d.max().item<double>());
  return wrong;
}

// The dense alternative, timed after the PS servers have finished (so they take no CPU from it).
int64_t runDense(const Options& o, const Distributed& dist, const SparseResult& r, int servers, MetricsLog* log) {
  double sparse_s = r.ms / 1e3, sparse_bytes = r.bytes;
  const int W = dist.size();
  auto grad = densePattern(o).mul_(dist.rank() + 1);
  auto allreduce = [&] {
    dist.world()->allreduce(grad.data_ptr<float>(), grad.numel(), comm::DType::f32, comm::ReduceOp::avg)->wait();
  };
  allreduce();
  int64_t wrong = checkDense(o, grad, W, "(first)", dist.rank());
  dist.world()->barrier()->wait();
  auto t0 = Clock::now();
  for (int i = 0; i < o.dense_steps; ++i) allreduce();
  dist.world()->barrier()->wait();
  double dense_s = seconds(t0) / o.dense_steps;
  double table_bytes = static_cast<double>(grad.numel()) * 4;
  // The timed allreduces average identical buffers: the values must stay the average.
  wrong += checkDense(o, grad, W, "(timed)", dist.rank());
  if (dist.isMain()) {
    std::printf("dtrain-ps-sparse workers=%d servers=%d table=%lldx%lld rows_per_step=%lld (%.2f%%)\n", W,
                servers, static_cast<long long>(o.table_rows), static_cast<long long>(o.dim),
                static_cast<long long>(o.rows), 100.0 * o.rows / o.table_rows);
    std::printf("  sparse PS (pullRows+pushRows): ms_per_step=%.2f (pull %.2f, push %.2f) pull_alone_ms=%.2f "
                "MB_per_step_per_worker=%.2f (sent+received)\n",
                sparse_s * 1e3, r.pull_ms, r.push_ms, r.pull_alone_ms, sparse_bytes / 1e6);
    std::printf("  dense allreduce (%.0f MB gradient, %s): ms_per_step=%.2f\n", table_bytes / 1e6,
                dist.world()->transportName().c_str(), dense_s * 1e3);
    std::printf("  speedup=%.1fx\n", dense_s / sparse_s);
  }
  if (log) {
    log->write(Record("bench").set("name", "ps-sparse").set("workers", W).set("servers", servers)
                   .set("table_rows", o.table_rows).set("dim", o.dim).set("rows_per_step", o.rows)
                   .set("sparse_ms_per_step", sparse_s * 1e3).set("pull_ms", r.pull_ms).set("push_ms", r.push_ms)
                   .set("pull_alone_ms", r.pull_alone_ms)
                   .set("sparse_bytes_per_step_per_worker", sparse_bytes).set("dense_ms_per_step", dense_s * 1e3)
                   .set("speedup", dense_s / sparse_s));
  }
  return wrong;
}

int run(const Options& o) {
  torch::set_num_threads(1);
  auto p = psOptions(o);
  if (ps::runServerIfRole(p)) return 0;
  const char* s = std::getenv("DTRAIN_NUM_SERVERS");
  if (!s || std::getenv("DTRAIN_ROLE") == nullptr) {
    std::fprintf(stderr, "dtrain-bench ps: run under dtrain-run --servers S (e.g. dtrain-run --standalone --servers 1 "
                         "--nproc-per-node 2 dtrain-bench ps)\n");
    return 1;
  }
  auto dist = dtrain::init();  // the workers' own group (barriers, the dense allreduce)
  ps::Worker w(ps::storeFromEnv(), dist.rank(), dist.size(), std::atoi(s), p);
  DenseCheck check(w, p, dist.size());
  auto log = o.observe.open(dist.isMain(), "ps", dist.size(),
                            Record().set("mode", o.mode).set("steps", o.steps).set("warmup", o.warmup).set("servers", w.numServers()));
  SparseResult r;
  int64_t wrong = 0;
  if (o.mode == "mlp") wrong += runMlp(o, w, dist, check, log.get());
  else runSparse(o, w, dist, check, r);
  wrong += check.verify();
  if (o.mode == "sparse") wrong += checkRows(w, dist.size(), p, o.dim);
  w.finish();
  if (o.mode == "sparse") wrong += runDense(o, dist, r, w.numServers(), log.get());
  dist.world()->allreduce(&wrong, 1, comm::DType::i64)->wait();  // over every worker
  if (dist.isMain()) std::printf("  #wrong %lld\n", static_cast<long long>(wrong));
  return wrong == 0 ? 0 : 1;
}

}  // namespace

void addPsCommand(CLI::App& app) {
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand(
      "ps",
      "parameter server (under dtrain-run --servers S): --mode mlp trains the reference MLP through the PS (compare "
      "with `dtrain-bench ddp` under the same dtrain-run without --servers); --mode sparse: 1M x 64 embedding rows "
      "through the PS vs a dense allreduce of the whole gradient");
  sub->add_option("--mode", o->mode, "mlp or sparse")->check(CLI::IsMember({"mlp", "sparse"}));
  sub->add_option("--steps", o->steps, "timed steps");
  sub->add_option("--warmup", o->warmup, "untimed steps first");
  sub->add_option("--batch", o->batch, "mlp: batch per worker");
  sub->add_option("--table-rows", o->table_rows, "sparse: rows of the table");
  sub->add_option("--dim", o->dim, "sparse: floats per row");
  sub->add_option("--rows", o->rows, "sparse: random rows touched per step");
  sub->add_option("--dense-steps", o->dense_steps, "sparse: timed dense allreduce steps");
  sub->add_option("--partition-kb", o->partition_kb, "PSOptions::partition_bytes in KiB (the largest message)")
      ->check(CLI::PositiveNumber);
  o->observe.addOptions(sub);
  sub->callback([o] { runAndExit("ps", [&] { return run(*o); }); });
}

}  // namespace dtrain::bench
