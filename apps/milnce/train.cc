// MIL-NCE training loop and retrieval evaluation (see train.h). The loop reads like the paper's:
// fetch a batch, embed, gather, loss, backward-and-reduce, step.
#include "milnce/train.h"

#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dtrain/autograd.h"
#include "dtrain/comm/error.h"
#include "dtrain/checkpoint.h"
#include "dtrain/sampler.h"

namespace milnce {

using Clock = std::chrono::steady_clock;

double learningRate(double base, int64_t step, int64_t total, int64_t warmup_steps) {
  if (step < warmup_steps) return base * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  double t = static_cast<double>(step - warmup_steps) / static_cast<double>(std::max<int64_t>(1, total - warmup_steps));
  return base * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, t)));
}

Trainer::Trainer(const dtrain::Distributed& dist, const Dataset& data, const TrainOptions& o) : dist_(dist), o_(o) {
  ModelOptions mo = o.model;
  mo.feature_dim = data.feature_dim;
  torch::manual_seed(static_cast<uint64_t>(o.seed));
  model_ = MilNceNet(data.word_vectors, mo);
  ddp_ = std::make_unique<dtrain::DistributedDataParallel>(model_.ptr(), dist.world());
  std::vector<at::Tensor> trainable;
  for (auto& p : model_->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  opt_ = std::make_unique<torch::optim::Adam>(trainable, torch::optim::AdamOptions(o.lr));
}

double Trainer::lossAndBackward(const Batch& local, bool sync) {
  const int64_t b = local.video.size(0), k = local.text.size(1), w = local.text.size(2);
  auto v = model_->encodeVideo(local.video);                 // [b, D]
  auto t = model_->encodeText(local.text.reshape({b * k, w}));  // [b*K, D]
  auto& pg = *dist_.world();
  // Every rank scores its clips against every rank's captions; the gradient of the gathered
  // embeddings is summed across ranks and each rank keeps its own slice (AllGatherGrad::sum), so
  // with DDP's averaging the update equals one process on the global batch.
  auto all_v = dtrain::allGather(v, pg);
  auto all_t = dtrain::allGather(t, pg);
  auto loss = milNceLoss(all_v, all_t) / o_.accum;
  if (sync) {
    loss.backward();
  } else {
    auto guard = ddp_->noSync();
    loss.backward();
  }
  return loss.item<double>() * o_.accum;
}

void Trainer::optimizerStep(int64_t step, int64_t total, int64_t warmup_steps) {
  double lr = learningRate(o_.lr, step, total, warmup_steps);
  for (auto& g : opt_->param_groups()) static_cast<torch::optim::AdamOptions&>(g.options()).lr(lr);
  opt_->step();
  opt_->zero_grad();
}

Retrieval evaluate(MilNceNet& model, const Dataset& data, const LoaderOptions& lo, int windows) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto& clips = data.eval_clips;
  const int64_t n = static_cast<int64_t>(clips.size());
  std::vector<at::Tensor> vids, texts;
  for (const auto& c : clips) {
    vids.push_back(model->encodeVideo(evalClipWindows(data, c, windows, lo)).mean(0));
    texts.push_back(evalText(data, c, lo.max_words));
  }
  model->train();
  Retrieval r;
  r.clips = static_cast<int>(n);
  if (n == 0) return r;
  auto v = torch::stack(vids);                              // [n, D]
  auto t = model->encodeText(torch::stack(texts));          // [n, D]
  auto sim = torch::matmul(t, v.t());                       // query i (text) x clip j (video)
  auto own = sim.diagonal().unsqueeze(1);
  auto ranks = (sim > own).sum(1).to(torch::kDouble) + 1;  // 1-based rank of the right clip
  r.r1 = (ranks <= 1).to(torch::kDouble).mean().item<double>();
  r.r5 = (ranks <= 5).to(torch::kDouble).mean().item<double>();
  r.r10 = (ranks <= 10).to(torch::kDouble).mean().item<double>();
  r.median_rank = ranks.median().item<double>();
  return r;
}

std::string retrievalHeader(int clips) {
  return fmt::format("text -> video retrieval on {} held-out clips       R@1     R@5    R@10   median rank", clips);
}
std::string formatRetrieval(const std::string& label, const Retrieval& r) {
  return fmt::format("  {:<44} {:6.1f}% {:6.1f}% {:6.1f}%   {:8.1f}", label, 100 * r.r1, 100 * r.r5, 100 * r.r10,
                     r.median_rank);
}
std::string chanceRow(int clips) {
  Retrieval c;
  c.clips = clips;
  c.r1 = std::min(1.0, 1.0 / clips);
  c.r5 = std::min(1.0, 5.0 / clips);
  c.r10 = std::min(1.0, 10.0 / clips);
  c.median_rank = (clips + 1) / 2.0;
  return formatRetrieval("chance", c);
}

namespace {

nlohmann::json toJson(const Retrieval& r) {
  return {{"clips", r.clips}, {"R@1", r.r1}, {"R@5", r.r5}, {"R@10", r.r10}, {"median_rank", r.median_rank}};
}

// Rank 0's progress: a live bar when stdout is a terminal, one line per epoch otherwise.
class Progress {
 public:
  Progress(bool on, int epoch, int epochs, int64_t steps) : on_(on), epoch_(epoch), epochs_(epochs), steps_(steps) {
    tty_ = isatty(1);
    t0_ = Clock::now();
  }
  void update(int64_t done, double loss, double lr, double samples_per_s, double eta_s) {
    if (!on_) return;
    // Not a terminal (a log, or dtrain-run's pipes): one line per epoch.
    if (!tty_ && done != steps_) return;
    int width = 24, fill = static_cast<int>(width * done / std::max<int64_t>(1, steps_));
    std::string bar = std::string(fill, '#') + std::string(width - fill, '.');
    std::printf("%sepoch %d/%d [%s] %lld/%lld loss %.4f lr %.2e %.0f samples/s ETA %s%s", tty_ ? "\r" : "", epoch_ + 1,
                epochs_, bar.c_str(), static_cast<long long>(done), static_cast<long long>(steps_), loss, lr,
                samples_per_s, formatEta(eta_s).c_str(), tty_ ? "" : "\n");
    std::fflush(stdout);
  }
  void end() {
    if (on_ && tty_) std::printf("\n");
  }

 private:
  static std::string formatEta(double s) {
    int t = static_cast<int>(s + 0.5);
    return fmt::format("{}:{:02d}", t / 60, t % 60);
  }
  bool on_, tty_ = false;
  int epoch_, epochs_;
  int64_t steps_;
  Clock::time_point t0_;
};

}  // namespace

void train(const dtrain::Distributed& dist, const TrainOptions& o) {
  Dataset data = Dataset::load(o.data);
  const bool main = dist.isMain();
  std::filesystem::create_directories(o.out);
  Trainer trainer(dist, data, o);
  dtrain::Checkpointer ckpt(o.out + "/checkpoints", dist, o.keep);
  dtrain::DistributedSampler sampler(static_cast<int64_t>(data.videos.size()), dist, /*shuffle=*/true, o.seed,
                                     /*drop_last=*/true);
  const int64_t micro_per_epoch = sampler.size() / o.batch;
  if (micro_per_epoch < o.accum) {
    throw dtrain::InvalidArgument(fmt::format(
        "{} training videos over {} ranks leave {} per rank: fewer than one step of batch {} x accum {}",
        data.videos.size(), dist.size(), sampler.size(), o.batch, o.accum));
  }
  const int64_t steps_per_epoch = micro_per_epoch / o.accum;
  const int64_t total = steps_per_epoch * o.epochs;
  const int64_t warmup_steps = std::max<int64_t>(1, static_cast<int64_t>(o.warmup * total));

  int start_epoch = 0;
  int64_t step = 0;
  if (o.resume) {
    if (auto st = ckpt.loadLatest()) {
      st->restoreModel(*trainer.model());
      st->restoreOptimizer(trainer.optimizer());
      st->restoreRng();
      start_epoch = static_cast<int>(st->epoch);
      step = st->step;
      if (main) std::printf("resumed from epoch %d, step %lld\n", start_epoch, static_cast<long long>(step));
    } else if (main) {
      std::printf("no checkpoint in %s/checkpoints: starting afresh\n", o.out.c_str());
    }
  }
  std::ofstream metrics;
  if (main) metrics.open(o.out + "/metrics.jsonl", std::ios::app);
  nlohmann::json eval_json;
  if (o.eval && main) {
    auto before = evaluate(trainer.model(), data, o.loader, o.eval_windows);
    eval_json["before"] = toJson(before);
    std::printf("%s\n%s\n%s\n", retrievalHeader(before.clips).c_str(), formatRetrieval("before training", before).c_str(),
                chanceRow(before.clips).c_str());
    std::fflush(stdout);
  }
  const int last_epoch = o.stop_after > 0 ? std::min(o.epochs, o.stop_after) : o.epochs;
  for (int epoch = start_epoch; epoch < last_epoch; ++epoch) {
    sampler.setEpoch(epoch);
    const auto idx = sampler.indices();
    // The loader's randomness depends only on (seed, epoch, rank): a resumed run draws the same clips.
    std::mt19937_64 rng(o.seed * 1000003ull + static_cast<uint64_t>(epoch) * 7919ull + static_cast<uint64_t>(dist.rank()));
    Progress bar(main && o.progress, epoch, o.epochs, steps_per_epoch);
    auto t0 = Clock::now();
    double loss_sum = 0;
    for (int64_t s = 0; s < steps_per_epoch; ++s) {
      double loss = 0;
      for (int a = 0; a < o.accum; ++a) {
        int64_t m = s * o.accum + a;
        std::vector<int64_t> rows(idx.begin() + m * o.batch, idx.begin() + (m + 1) * o.batch);
        Batch batch = makeBatch(data, rows, o.loader, rng);
        loss += trainer.lossAndBackward(batch, /*sync=*/a + 1 == o.accum) / o.accum;
      }
      trainer.optimizerStep(step, total, warmup_steps);
      ++step;
      loss_sum += loss;
      double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      double sps = (s + 1) * o.batch * o.accum * dist.size() / std::max(secs, 1e-9);
      double eta = secs / (s + 1) * (steps_per_epoch - s - 1 + (o.epochs - epoch - 1) * steps_per_epoch);
      bar.update(s + 1, loss_sum / (s + 1), learningRate(o.lr, step - 1, total, warmup_steps), sps, eta);
    }
    bar.end();
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (main) {
      nlohmann::json line = {{"epoch", epoch + 1},
                             {"step", step},
                             {"loss", loss_sum / steps_per_epoch},
                             {"lr", learningRate(o.lr, step - 1, total, warmup_steps)},
                             {"samples_per_s", steps_per_epoch * o.batch * o.accum * dist.size() / secs},
                             {"seconds", secs},
                             {"world", dist.size()}};
      metrics << line.dump() << "\n";
      metrics.flush();
    }
    dtrain::CheckpointState st;
    st.captureModel(*trainer.model());
    st.captureOptimizer(trainer.optimizer());
    st.captureRng();
    st.epoch = epoch + 1;
    st.step = step;
    st.scheduler["step"] = static_cast<double>(step);
    st.scheduler["total"] = static_cast<double>(total);
    st.metrics["loss"] = loss_sum / steps_per_epoch;
    ckpt.save(st);
  }
  if (o.eval && main) {
    auto after = evaluate(trainer.model(), data, o.loader, o.eval_windows);
    eval_json["after"] = toJson(after);
    std::printf("%s\n", retrievalHeader(after.clips).c_str());
    if (eval_json.contains("before")) {
      Retrieval b{eval_json["before"]["clips"], eval_json["before"]["R@1"], eval_json["before"]["R@5"],
                  eval_json["before"]["R@10"], eval_json["before"]["median_rank"]};
      std::printf("%s\n", formatRetrieval("before training", b).c_str());
    }
    std::printf("%s\n%s\n", formatRetrieval(fmt::format("after training ({} epochs)", o.epochs), after).c_str(),
                chanceRow(after.clips).c_str());
    std::ofstream(o.out + "/eval.json") << eval_json.dump(2) << "\n";
  }
}

}  // namespace milnce
