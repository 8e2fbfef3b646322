// dtrain-bench pipeline: a deep MLP (--layers x Linear(width, width) + ReLU) cut into P stages (one per
// rank, run it under dtrain-run --nproc-per-node P), trained with the GPipe and the 1F1B schedule for
// each micro-batch count M, and with the interleaved 1F1B schedule (--chunks V model chunks a rank; M
// a multiple of P, other counts are listed as not run). Per configuration it prints, over the timed steps:
//   step_ms        wall time of a step (forwards and backwards of every micro-batch): the median over the
//                  timed steps, of the slowest rank
//   bubble         measured idle share of a step, averaged over stages: 1 - (F + B compute) / step
//   theory         (P-1)/(M+P-1), the bubble when every F and B takes the same time and messages are free;
//                  (P-1)/(VM+P-1) interleaved
//   ideal_ms       issue 29's yardstick: one process running the whole model over the M micro-batches in
//                  turn (rank 0, timed alone: the compute at the micro-batch size), / P, x (1 + theory)
//   vs_ideal       step_ms / ideal_ms (1.10 = 10% slower than the formula)
//   ceil_ms        the same yardstick on this machine's ceiling: every rank computing its own chunks over
//                  the M micro-batches at the same time, no messages (the slowest rank), x (1 + theory)
//   vs_ceil        step_ms / ceil_ms: what the schedule and its messages add to the compute they cannot hide
//   peak_act       micro-batches of activations held at the peak, per stage (GPipe: M; 1F1B: P - s)
//   peak_MB        bytes of the tensors the stage's modules produced for them, at that peak
//   speedup        one process running the whole model on the whole batch (rank 0, timed alone) / step_ms
//   #wrong         gradient elements of every stage (summed over the ranks) that differ from the one-process
//                  run's by more than 1e-4 of its largest, plus 1 when the batch loss does; the program
//                  exits 1 when any configuration had one
// Progress on stderr counts the configurations; --metrics FILE adds a step record per timed step
// (bubble_fraction of rank 0's stage) and a bench record per configuration (observe.h).
#include "pipeline_bench.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>

#include "dtrain/comm/error.h"
#include "dtrain/distributed.h"
#include "dtrain/pipeline.h"
#include "observe.h"

namespace dtrain::bench {
namespace {

struct Options {
  int layers = 8;
  int width = 1024;
  int batch = 256;
  int steps = 4;
  int warmup = 1;
  std::vector<int> micro{1, 2, 4, 8, 16};
  std::string schedule = "all";
  int chunks = 2;
  Observe observe;
};

torch::nn::Sequential deepMlp(const Options& o) {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  for (int i = 0; i < o.layers; ++i) {
    m->push_back(torch::nn::Linear(o.width, o.width));
    m->push_back(torch::nn::ReLU());
  }
  return m;
}

at::Tensor lossFn(const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); }

std::string schedName(PipelineSchedule s, int chunks) {
  return s == PipelineSchedule::interleaved ? fmt::format("interl.V={}", chunks) : scheduleName(s);
}

std::string joinInts(const std::vector<double>& v, const char* fmt) {
  std::string s;
  char buf[32];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof buf, fmt, v[i]);
    s += (i ? "/" : "") + std::string(buf);
  }
  return s;
}

// What every configuration shares: the stage, the batch and the one-process reference to check against.
struct Bench {
  Bench(const Options& opts, std::shared_ptr<comm::ProcessGroup> group, int stages, int r)
      : o(opts), pg(std::move(group)), P(stages), rank(r) {}
  const Options& o;
  std::shared_ptr<comm::ProcessGroup> pg;
  int P, rank;
  torch::nn::Sequential stage;
  std::vector<torch::nn::Sequential> chunks;  // the interleaved schedule's
  at::Tensor x, y;
  double ref_ms = 0, ref_loss = 0;
  std::map<int, double> micro_ms;  // M -> one process over the M micro-batches in turn
  std::map<std::string, at::Tensor> ref_grads;
  MetricsLog* log = nullptr;
  int64_t steps_logged = 0;
};

// One configuration: warm-up and timed steps (each a step record), the check against the reference,
// the row. Returns the wrong results over every rank.
// The pipeline's ceiling on this machine: every rank computes its own chunks' forwards and backwards
// over the M micro-batches at the same time, with no messages and no waiting (inputs and output
// gradients drawn at random); this rank's time in ms. Two ranks computing at once on a shared memory
// system are slower than one alone, which the one-process yardstick does not see. Run before every
// pipeline step, so that both see the machine in the same state (this VM's speed drifts by 20-30%).
double concurrentOnce(Bench& b, std::vector<torch::nn::Sequential>& chunks, int M) {
  auto rows = at::tensor_split(at::arange(b.o.batch), M, 0);
  b.pg->barrier()->wait();
  auto t0 = std::chrono::steady_clock::now();
  for (auto& chunk : chunks) {
    for (int m = 0; m < M; ++m) {
      auto x = at::randn({rows[m].size(0), b.o.width}).requires_grad_(true);
      auto out = chunk->forward(x);
      out.backward(at::randn_like(out));
    }
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2;
}

int64_t measure(Bench& b, PipelineSchedule sched, int M) {
  const Options& o = b.o;
  const int P = b.P, rank = b.rank;
  const bool interleaved = sched == PipelineSchedule::interleaved;
  auto chunks = interleaved ? b.chunks : std::vector<torch::nn::Sequential>{b.stage};
  Pipeline pipe(chunks, b.pg, PipelineOptions{M, sched});
  std::vector<double> compute_each, step_each;  // per timed step: the ceiling's compute, the step
  auto stage = pipe.module();
  double step_ms = 0, busy_ms = 0, loss = 0;
  int64_t wrong = 0;
  const PipelineStats* st = nullptr;
  BytesSentMeter sent;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    const double compute = concurrentOnce(b, chunks, M);
    stage->zero_grad();
    loss = pipe.step(rank == 0 ? b.x : at::Tensor(), rank == P - 1 ? b.y : at::Tensor(), lossFn);
    st = &pipe.stats();
    if (i < o.warmup) {
      sent.sinceLast();  // the timed steps' bytes only
      continue;
    }
    step_ms += st->step_ms;
    busy_ms += st->forward_ms + st->backward_ms;
    compute_each.push_back(compute);
    step_each.push_back(st->step_ms);
    if (b.log) {  // rank 0's stage: its own idle share; the loss is known on the last stage only
      Record r("step");
      r.set("step", ++b.steps_logged).set("time_s", b.log->seconds()).set("schedule", scheduleName(sched))
          .set("micro_batches", M).set("step_s", st->step_ms / 1e3).set("samples_per_s", o.batch / (st->step_ms / 1e3))
          .set("bubble_fraction", 1.0 - (st->forward_ms + st->backward_ms) / st->step_ms);
      if (P == 1) r.set("loss", loss);
      b.log->write(r.set("bytes_sent", sent.sinceLast()).set("rss_bytes", residentBytes()));
    }
  }
  // Verify against the one-process run: the loss (counted once, on the last stage) and every
  // gradient element of this rank's stage; the counts are summed over the ranks.
  if (rank == P - 1 && !(std::abs(loss - b.ref_loss) <= 1e-4 * std::abs(b.ref_loss))) wrong += 1;
  for (auto& p : stage->named_parameters()) {
    const at::Tensor& want = b.ref_grads.at(p.key());
    const double tol = 1e-4 * std::max(1.0, want.abs().max().item<double>());
    wrong += (p.value().grad() - want).abs().gt(tol).sum().item<int64_t>();
  }
  b.pg->allreduce(&wrong, 1, comm::DType::i64)->wait();
  // Medians over the timed steps (this VM stalls now and then), the slowest rank's.
  std::array<double, 5> mine{median(step_each), 1.0 - busy_ms / step_ms, static_cast<double>(st->peak_stored_activations),
                             static_cast<double>(st->peak_activation_bytes) / (1 << 20), median(compute_each)};
  std::vector<double> all(5 * static_cast<size_t>(P));
  b.pg->allgather(mine.data(), all.data(), 5, comm::DType::f64)->wait();
  if (rank != 0) return wrong;
  double step = 0, bubble = 0, compute_ms = 0;
  std::vector<double> peaks, mbs;
  for (int s = 0; s < P; ++s) {
    step = std::max(step, all[5 * s]);
    bubble += all[5 * s + 1] / P;
    peaks.push_back(all[5 * s + 2]);
    mbs.push_back(all[5 * s + 3]);
    compute_ms = std::max(compute_ms, all[5 * s + 4]);
  }
  const int V = interleaved ? o.chunks : 1;
  const double theory = static_cast<double>(P - 1) / (V * M + P - 1);
  const double ideal = b.micro_ms.at(M) / P * (1 + theory);
  const double ceiling = compute_ms * (1 + theory);
  std::printf("%-11s %4d %9.1f %8.3f %8.3f %9.1f %8.3f %9.1f %8.3f %14s %16s %8.2f %7lld\n", schedName(sched, V).c_str(), M,
              step, bubble, theory, ideal, step / ideal, ceiling, step / ceiling, joinInts(peaks, "%.0f").c_str(),
              joinInts(mbs, "%.1f").c_str(), b.ref_ms / step, static_cast<long long>(wrong));
  std::fflush(stdout);
  if (b.log) {
    b.log->write(Record("bench").set("name", "pipeline").set("schedule", scheduleName(sched)).set("micro_batches", M)
                     .set("stages", P).set("chunks", V).set("step_ms", step).set("bubble_fraction", bubble)
                     .set("theory_bubble", theory).set("ideal_ms", ideal).set("ceiling_ms", ceiling)
                     .set("speedup", b.ref_ms / step).set("wrong", wrong));
  }
  return wrong;
}

// The one-process reference: rank 0 times it alone (the others wait), then every rank computes its
// loss and gradients, by parameter name, to check its own stage against.
void reference(Bench& b, torch::nn::Sequential& model) {
  if (b.rank == 0) {
    for (int i = 0; i <= b.o.steps; ++i) {
      model->zero_grad();
      auto t0 = std::chrono::steady_clock::now();
      lossFn(model->forward(b.x), b.y).backward();
      if (i > 0) b.ref_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    b.ref_ms /= b.o.steps;
    // The same work cut into M micro-batches (smaller GEMMs), gradients accumulated.
    for (int M : b.o.micro) {
      std::vector<double> each;
      auto xs = at::tensor_split(b.x, M, 0), ys = at::tensor_split(b.y, M, 0);
      for (int i = 0; i <= b.o.steps; ++i) {
        model->zero_grad();
        auto t0 = std::chrono::steady_clock::now();
        for (int m = 0; m < M; ++m) lossFn(model->forward(xs[m]), ys[m]).backward();
        if (i > 0) each.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      b.micro_ms[M] = median(each);
    }
  }
  b.pg->barrier()->wait();
  model->zero_grad();
  auto l = lossFn(model->forward(b.x), b.y);
  l.backward();
  b.ref_loss = l.item<double>();
  for (auto& p : model->named_parameters()) b.ref_grads[p.key()] = p.value().grad().clone();
}

int run(const Options& o) {
  torch::set_num_threads(1);
  auto dist = dtrain::init();
  const int P = dist.size(), rank = dist.rank();
  auto model = deepMlp(o);
  auto g = at::make_generator<at::CPUGeneratorImpl>(1);
  Bench b{o, dist.world(), P, rank};
  b.x = at::randn({o.batch, o.width}, g);
  b.y = at::randn({o.batch, o.width}, g);
  reference(b, model);
  b.stage = pipelineStage(model, rank, P);
  b.chunks = pipelineChunks(model, rank, P, o.chunks);
  int64_t stage_params = 0;
  for (auto& p : b.stage->parameters()) stage_params += p.numel();
  auto log = o.observe.open(rank == 0, "pipeline", P, Record().set("layers", o.layers).set("width", o.width)
                                                         .set("batch", o.batch).set("steps", o.steps).set("warmup", o.warmup)
                                                         .set("schedule", o.schedule).set("transport", b.pg->transportName()));
  b.log = log.get();
  if (rank == 0) {
    std::printf("# dtrain-bench pipeline: P=%d layers=%d width=%d batch=%d params/stage0=%lld threads=1 "
                "transport=%s one-process step %.1f ms\n",
                P, o.layers, o.width, o.batch, static_cast<long long>(stage_params), b.pg->transportName().c_str(),
                b.ref_ms);
    std::printf("%-11s %4s %9s %8s %8s %9s %8s %9s %8s %14s %16s %8s %7s\n", "sched", "M", "step_ms", "bubble", "theory",
                "ideal_ms", "vs_ideal", "ceil_ms", "vs_ceil", "peak_act", "peak_MB", "speedup", "#wrong");
    std::fflush(stdout);
  }
  std::vector<PipelineSchedule> schedules;
  if (o.schedule == "all" || o.schedule == "both" || o.schedule == "gpipe") schedules.push_back(PipelineSchedule::gpipe);
  if (o.schedule == "all" || o.schedule == "both" || o.schedule == "1f1b") schedules.push_back(PipelineSchedule::one_f_one_b);
  if (o.schedule == "all" || o.schedule == "interleaved") schedules.push_back(PipelineSchedule::interleaved);
  Progress progress("pipeline", static_cast<int64_t>(schedules.size() * o.micro.size()),
                    o.observe.progress(rank == 0, "configuration"));
  int64_t total_wrong = 0, done = 0;
  for (auto sched : schedules) {
    for (int M : o.micro) {
      progress.clear();  // rank 0's row goes where the bar was
      if (sched == PipelineSchedule::interleaved && M % P != 0) {  // the schedule needs a multiple of P
        if (rank == 0) std::printf("%-11s %4d   not run: M is not a multiple of P = %d\n", schedName(sched, o.chunks).c_str(), M, P);
      } else {
        total_wrong += measure(b, sched, M);
      }
      progress.update(++done, fmt::format("{} M={}", scheduleName(sched), M));
    }
  }
  progress.finish();
  if (total_wrong > 0 && rank == 0)
    std::fprintf(stderr, "dtrain-bench pipeline: %lld wrong results\n", static_cast<long long>(total_wrong));
  return total_wrong > 0 ? 1 : 0;
}

}  // namespace

void addPipelineCommand(CLI::App& app) {
  auto o = std::make_shared<Options>();
  auto* sub = app.add_subcommand("pipeline", "pipeline parallelism: bubble and activation memory of GPipe and 1F1B");
  sub->add_option("--layers", o->layers, "Linear + ReLU blocks");
  sub->add_option("--width", o->width, "features of every layer");
  sub->add_option("--batch", o->batch, "rows per step (split into M micro-batches)");
  sub->add_option("--steps", o->steps, "timed steps per configuration");
  sub->add_option("--warmup", o->warmup, "untimed steps first");
  sub->add_option("--micro", o->micro, "micro-batch counts")->delimiter(',');
  o->observe.addOptions(sub);
  sub->add_option("--schedule", o->schedule, "gpipe, 1f1b, interleaved, both (gpipe and 1f1b) or all")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "both", "all"}));
  sub->add_option("--chunks", o->chunks, "model chunks a rank under the interleaved schedule")->check(CLI::Range(1, 64));
  sub->callback([o] { runAndExit("pipeline", [&] { return run(*o); }); });
}

}  // namespace dtrain::bench
