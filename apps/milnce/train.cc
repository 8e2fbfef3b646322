// MIL-NCE training loop and retrieval evaluation (see train.h). The loop reads like the paper's:
// fetch a batch, embed, gather, loss, backward-and-reduce, step.
#include "milnce/train.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <nlohmann/json.hpp>

#include "dtrain/autograd.h"
#include "dtrain/comm/error.h"
#include "dtrain/checkpoint.h"
#include "dtrain/hook_spec.h"
#include "dtrain/optim.h"
#include "dtrain/metrics.h"
#include "dtrain/sampler.h"
#include "dtrain/snapshot.h"
#include "dtrain/trace.h"
#include "milnce/video_loader.h"

namespace milnce {

double learningRate(double base, int64_t step, int64_t total, int64_t warmup_steps) {
  if (step < warmup_steps) return base * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  double t = static_cast<double>(step - warmup_steps) / static_cast<double>(std::max<int64_t>(1, total - warmup_steps));
  return base * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, t)));
}

Retrieval evaluate(MilNceNet& model, const Dataset& data, const LoaderOptions& lo, int windows,
                   dtrain::Progress* progress) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto& clips = data.eval_clips;
  const int64_t n = static_cast<int64_t>(clips.size());
  std::vector<at::Tensor> vids, texts;
  int64_t failed = 0;
  for (const auto& c : clips) {
    vids.push_back(model->encodeVideo(evalClipWindows(data, c, windows, lo, &failed)).mean(0));
    texts.push_back(evalText(data, c, lo.max_words));
    if (progress) progress->update(static_cast<int64_t>(vids.size()));
  }
  if (progress) progress->finish();
  model->train();
  Retrieval r;
  r.clips = static_cast<int>(n);
  r.failed_windows = failed;
  if (n == 0) return r;
  auto v = torch::stack(vids);                              // [n, D]
  auto t = model->encodeText(torch::stack(texts));          // [n, D]
  auto sim = torch::matmul(t, v.t());                       // query i (text) x clip j (video)
  auto own = sim.diagonal().unsqueeze(1);
  // The 1-based rank of the right clip, ties counted against it: an untrained S3D-G embeds every clip
  // alike (its activations fade through the layers), which must not rank them all first.
  auto ranks = (sim >= own).sum(1).to(torch::kDouble);
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

// Rank 0's metrics.jsonl (docs/OBSERVABILITY.md, "Metrics"): the run, every optimizer step, every
// evaluation. The other ranks log nothing.
class RunLog {
 public:
  RunLog(const dtrain::Distributed& dist, const TrainOptions& o) {
    if (!dist.isMain()) return;
    log_.emplace(o.out + "/metrics.jsonl", o.resume ? dtrain::MetricsLog::Open::append : dtrain::MetricsLog::Open::truncate);
    auto config = dtrain::Record()
                      .set("data", o.data).set("epochs", o.epochs).set("batch", o.batch).set("accum", o.accum)
                      .set("lr", o.lr).set("warmup", o.warmup).set("seed", o.seed).set("resume", o.resume)
                      .set("candidates", o.loader.num_candidates).set("max_words", o.loader.max_words)
                      .set("clip_steps", o.loader.clip_steps).set("hidden", o.model.hidden).set("embed", o.model.embed)
                      .set("transport", dist.world()->transportName()).set("comm_hook", o.comm_hook)
                      .set("optimizer", o.optimizer).set("weight_decay", o.weight_decay).set("local_sgd", o.local_sgd)
                      .set("zero", o.zero).set("raw_video", o.model.raw_video).set("init", o.init);
    if (o.model.raw_video)
      config.set("frames", o.loader.frames).set("fps", o.loader.fps).set("size", o.loader.size)
          .set("s3d_width", o.model.s3d_width).set("loader_threads", o.loader_threads);
    log_->writeRun("milnce", dist.size(), config);
  }
  void step(int epoch, int64_t step, double loss, double lr, double samples_per_s, double step_s,
            const dtrain::DistributedDataParallel::Stats& st, std::optional<double> data_wait_s) {
    const uint64_t sent = sent_.sinceLast();
    if (!log_) return;
    auto r = dtrain::Record("step").set("step", step).set("epoch", epoch).set("time_s", log_->seconds())
                 .set("loss", loss).set("lr", lr).set("samples_per_s", samples_per_s)
                 .stepTimes(step_s, st.comm_ms / 1e3, st.exposed_ms / 1e3)
                 .set("bytes_sent", sent).set("rss_bytes", dtrain::residentBytes());
    if (data_wait_s) r.set("data_wait_s", *data_wait_s);
    log_->write(r);
  }
  void write(const dtrain::Record& r) {
    if (log_) log_->write(r);
  }
  // After `epoch` epochs and `step` optimizer steps; recall in percent, as the tables print it.
  void eval(int epoch, int64_t step, const Retrieval& r) {
    if (!log_) return;
    log_->write(dtrain::Record("eval").set("epoch", epoch).set("step", step).set("clips", r.clips)
                    .set("R@1", 100 * r.r1).set("R@5", 100 * r.r5).set("R@10", 100 * r.r10)
                    .set("median_rank", r.median_rank).set("failed_windows", static_cast<double>(r.failed_windows)));
  }

 private:
  std::optional<dtrain::MetricsLog> log_;
  dtrain::BytesSentMeter sent_;
};

// The job of train(), in the order it runs: resume, evaluate, epochs (steps, checkpoint, evaluate).
class Job {
 public:
  Job(const dtrain::Distributed& dist, const TrainOptions& o, Dataset data, const Pretrained* init)
      : dist_(dist), o_(o), data_(std::move(data)), main_(dist.isMain()), trainer_(dist, data_, o, init),
        ckpt_(trainer_.perRankState() ? dtrain::Checkpointer(o.out + "/checkpoints", dist.world(), o.keep)
                                 : dtrain::Checkpointer(o.out + "/checkpoints", dist, o.keep)),
        sampler_(static_cast<int64_t>(data_.videos.size()), dist, /*shuffle=*/true, o.seed, /*drop_last=*/true),
        snaps_(dist, snapshotOptions(o, trainer_.perRankState())), snapshots_(o.snapshot_every > 0 && snaps_.enabled()) {
    if (o.snapshot_every > 0 && !snaps_.enabled() && main_)
      std::fprintf(stderr, "milnce: --snapshot-every %d: no snapshot stores (dtrain-run gives its workers "
                   "DTRAIN_SNAPSHOT_STORES): no peer-memory snapshots\n", o.snapshot_every);
    const int64_t micro_per_epoch = sampler_.size() / o.batch;
    if (micro_per_epoch < o.accum) {
      throw dtrain::InvalidArgument(fmt::format(
          "{} training videos over {} ranks leave {} per rank: fewer than one step of batch {} x accum {}",
          data_.videos.size(), dist.size(), sampler_.size(), o.batch, o.accum));
    }
    schedule();
    if (data_.raw_video) {
      VideoLoaderOptions vo;
      vo.threads = o.loader_threads;
      vo.prefetch = o.prefetch;
      video_loader_ = std::make_unique<VideoLoader>(data_, o.loader, vo);
    }
    if (o.log_samples) samples_log_.open(fmt::format("{}/samples-rank{}.txt", o.out, dist.rank()), std::ios::app);
    trainer_.enableLocalSgd(warmup_steps_);  // post-local SGD once the learning rate has warmed up
  }

  void run() {
    resume();
    // Each process that appends starts with a marker saying where it began: a restarted job's lines
    // follow those of the run it replaced, whose steps past this one were lost.
    if (samples_log_.is_open())
      samples_log_ << fmt::format("# start: world {} rank {} from step {}\n", dist_.size(), dist_.rank(), step_)
                   << std::flush;
    RunLog log(dist_, o_);
    log_ = &log;
    if (o_.eval && (before_ = evaluateAndLog())) {
      std::printf("%s\n%s\n%s\n", retrievalHeader(before_->clips).c_str(),
                  formatRetrieval("before training", *before_).c_str(), chanceRow(before_->clips).c_str());
      std::fflush(stdout);
    }
    const int last_epoch = o_.stop_after > 0 ? std::min(o_.epochs, o_.stop_after) : o_.epochs;
    const int64_t first_step = step_;
    for (int epoch = epoch_; epoch < last_epoch; ++epoch) {
      const auto loss = trainEpoch(epoch, std::exchange(start_samples_, 0));
      if (!loss) return finishSnapshots(first_step);  // stopped mid-epoch (stop_after_steps)
      epoch_ = epoch + 1;
      checkpoint(*loss, 0, /*disk=*/true, /*memory=*/true);
      if (stopNow()) return finishSnapshots(first_step);
      const bool last = epoch_ == last_epoch;
      if (o_.eval && !last && o_.eval_every > 0 && epoch_ % o_.eval_every == 0)
        if (auto r = evaluateAndLog()) {
          std::printf("%s\n", formatRetrieval(fmt::format("after epoch {}", epoch_), *r).c_str());
          std::fflush(stdout);
        }
    }
    finishSnapshots(first_step);
    if (o_.eval) finalTable();
  }

  // What a checkpoint holds: the training state (Trainer::captureTraining: DDP's model and optimizer,
  // or this rank's part of the sharded state), the RNG, and where the job is (epoch_ epochs done and `samples` samples
  // of the next one read by all ranks together; the schedule's numbers; the loss).
  dtrain::CheckpointState captureState(double loss, int64_t samples) {
    dtrain::CheckpointState st;
    trainer_.captureTraining(st);
    st.captureRng();
    st.epoch = epoch_;
    st.step = step_;
    st.samples = samples;
    st.scheduler["global_batch"] = static_cast<double>(int64_t{o_.batch} * accum_ * dist_.size());
    st.scheduler["step"] = static_cast<double>(step_);
    st.scheduler["total"] = static_cast<double>(total_);
    st.metrics["loss"] = loss;
    return st;
  }

  // Continues from saved state: every saved rank's captureState() in old-rank order, from a run of any
  // world size (DDP: parts[0] is the whole state). The position and schedule come from parts[0], the
  // RNG from this rank's old part when there is one. `what` names the source in errors.
  void restoreFrom(const std::vector<dtrain::CheckpointState>& parts, const std::string& what = "the checkpoint") {
    trainer_.restoreTraining(parts, what);
    const auto& st = parts[0];
    const auto mine = static_cast<size_t>(dist_.rank());
    parts[mine < parts.size() ? mine : 0].restoreRng();
    epoch_ = static_cast<int>(st.epoch);
    step_ = st.step;
    start_samples_ = st.samples;
    trainer_.resumeAt(step_);
    keepGlobalBatch(st);
    if (main_)
      std::printf("resumed from epoch %d, step %lld, sample %lld of the epoch (world %d, accum %d)\n", epoch_,
                  static_cast<long long>(step_), static_cast<long long>(start_samples_), dist_.size(), accum_);
  }

 private:
  static dtrain::SnapshotOptions snapshotOptions(const TrainOptions& o, bool per_rank) {
    dtrain::SnapshotOptions so;
    so.replicated = !per_rank;
    so.stores = o.snapshot_stores;
    return so;
  }

  // The step of the newest disk checkpoint; -1: none.
  int64_t newestDiskStep() const {
    if (!o_.disk_checkpoints) return -1;
    const auto saved = ckpt_.list();
    return saved.empty() ? -1 : saved.back().step;
  }

  // Resuming from peer memory (--snapshot-every): the newest complete snapshot when it is at least as new
  // as the newest disk checkpoint. Collective. False: resume from disk.
  bool resumeFromMemory() {
    if (!snapshots_) return false;
    const auto snap = snaps_.loadLatest();
    const int64_t disk = newestDiskStep();
    if (!snap || snap->step < disk) {
      if (main_)
        std::printf("peer memory: %s\n", snap ? fmt::format("step {}, older than the disk checkpoint of step {}", snap->step, disk).c_str()
                                              : "no complete snapshot");
      return false;
    }
    std::set<std::string> from(snap->sources.begin(), snap->sources.end());
    if (main_)
      std::printf("resumed from peer memory: the snapshot of step %lld taken by %d rank(s) in round %lld, from %s\n",
                  static_cast<long long>(snap->step), snap->world_size, static_cast<long long>(snap->round),
                  fmt::format("{}", fmt::join(from, ", ")).c_str());
    restoreFrom(snap->parts, fmt::format("the peer-memory snapshot of step {} (round {})", snap->step, snap->round));
    return true;
  }

  // Resuming, from the newer of peer memory and disk; on disk, from the newest checkpoint: its one file
  // (DDP), or every rank's file of its directory, saved at any world size (--zero 1-3).
  void resume() {
    if (!o_.resume || resumeFromMemory()) return;
    if (!o_.disk_checkpoints) {
      if (main_) std::printf("no checkpoint (--no-checkpoints, and none in peer memory): starting afresh\n");
      return;
    }
    if (!trainer_.perRankState()) {
      if (auto st = ckpt_.loadLatest()) {
        restoreFrom({*st}, ckpt_.dir());
        return;
      }
    } else if (const auto saved = ckpt_.list(); refuseDamagedNewer(saved), !saved.empty()) {
      restoreFrom(dtrain::Checkpointer::loadRanks(saved.back().path), saved.back().path);
      return;
    }
    refuseOtherLayout();
    if (main_) std::printf("no checkpoint in %s/checkpoints: starting afresh\n", o_.out.c_str());
  }

  // A per-rank checkpoint whose save completed (it has its manifest) but that no longer loads (a rank file
  // truncated or changed: Checkpointer::list leaves it out) is refused when it is newer than every good
  // one, as a damaged single file is: resuming from an older one, or afresh, would lose its progress
  // without a word (the fault soak found a damaged newest checkpoint restarting training from step 0).
  void refuseDamagedNewer(const std::vector<dtrain::CheckpointFile>& good) const {
    if (!std::filesystem::is_directory(ckpt_.dir())) return;
    const std::string newest_good =
        good.empty() ? "" : std::filesystem::path(good.back().path).filename().string();
    for (const auto& e : std::filesystem::directory_iterator(ckpt_.dir())) {
      const std::string name = e.path().filename().string();
      if (name.rfind("ckpt-", 0) != 0 || !e.is_directory() || name <= newest_good ||
          !std::filesystem::exists(e.path() / "manifest.pt"))
        continue;
      try {
        dtrain::Checkpointer::loadRanks(e.path().string());
      } catch (const std::exception& err) {
        throw dtrain::Error(fmt::format(
            "--resume: the newest checkpoint {} does not load: {}; remove it to resume from {}", e.path().string(),
            err.what(), newest_good.empty() ? "the start" : newest_good));
      }
    }
  }

  // Checkpoints of the other layout (saved with another --zero) are refused, not started afresh over.
  void refuseOtherLayout() const {
    if (!std::filesystem::is_directory(ckpt_.dir())) return;
    for (const auto& e : std::filesystem::directory_iterator(ckpt_.dir())) {
      const std::string name = e.path().filename().string();
      if (name.rfind("ckpt-", 0) == 0 && e.is_directory() != trainer_.perRankState())
        throw dtrain::InvalidArgument(fmt::format(
            "--resume: {} holds {} checkpoints ({}), saved with --zero {}; this run has --zero {}: resume with the "
            "--zero it was saved with", ckpt_.dir(), e.is_directory() ? "per-rank" : "single-file", name,
            e.is_directory() ? "1, 2 or 3" : "0", o_.zero));
    }
  }


  // A checkpoint from another world size: the same global batch (accum changed), so the same number of
  // steps per epoch and learning-rate schedule (drop_last's rounding aside).
  void keepGlobalBatch(const dtrain::CheckpointState& st) {
    const auto it = st.scheduler.find("global_batch");
    const int64_t global = it == st.scheduler.end() ? 0 : static_cast<int64_t>(it->second);
    const int64_t mine = int64_t{o_.batch} * accum_ * dist_.size();
    if (global > 0 && global != mine) {
      const int64_t per = int64_t{o_.batch} * dist_.size();
      if (global % per != 0)
        throw dtrain::InvalidArgument(fmt::format(
            "the checkpoint's global batch is {} clips; batch {} x {} ranks does not divide it: pick --batch so that "
            "it does",
            global, o_.batch, dist_.size()));
      accum_ = static_cast<int>(global / per);
      schedule();
    }
  }

  // Steps per epoch at this world size and accum_, and the learning-rate schedule over them.
  void schedule() {
    steps_per_epoch_ = sampler_.size() / o_.batch / accum_;
    total_ = steps_per_epoch_ * o_.epochs;
    warmup_steps_ = std::max<int64_t>(1, static_cast<int64_t>(o_.warmup * total_));
  }

  // Collective when sharded (every rank gathers the parameters); the main rank evaluates and logs, the
  // others return nothing.
  std::optional<Retrieval> evaluateAndLog() {
    MilNceNet& model = trainer_.evalModel();
    if (!main_) return std::nullopt;
    Retrieval r = evaluate(model, data_, o_.loader, o_.eval_windows);
    if (r.failed_windows > 0)
      std::printf("evaluation: %lld clip windows did not decode and were embedded as zeros\n",
                  static_cast<long long>(r.failed_windows));
    log_->eval(epoch_, step_, r);
    return r;
  }

  // Whether --stop-after-steps stops the run here.
  bool stopNow() const { return o_.stop_after_steps > 0 && step_ >= o_.stop_after_steps; }

  // One epoch of optimizer steps from global sample `start` on, each logged; returns the mean loss, or
  // nothing when stop_after_steps stopped it.
  std::optional<double> trainEpoch(int epoch, int64_t start) {
    sampler_.setEpoch(epoch, start);
    const auto idx = sampler_.indices();
    const int64_t steps = static_cast<int64_t>(idx.size()) / o_.batch / accum_;
    // A clip's randomness depends only on (seed, epoch, video) (clipRng): a run resumed anywhere, at any
    // world size, draws the clips the uninterrupted run would have.
    const uint64_t epoch_seed = o_.seed * 1000003ull + static_cast<uint64_t>(epoch) * 7919ull;
    dtrain::ProgressOptions po;
    po.mode = main_ ? o_.progress : dtrain::ProgressOptions::Mode::off;
    po.unit = "step";
    po.line_every = o_.progress_every > 0 ? o_.progress_every : steps_per_epoch_;
    dtrain::Progress bar(fmt::format("train epoch {}/{}", epoch + 1, o_.epochs), steps, po);
    const int64_t global_batch = int64_t{o_.batch} * accum_ * dist_.size();
    const double samples_per_step = static_cast<double>(global_batch);
    dtrain::Stopwatch epoch_time, step_time;
    double loss_sum = 0;
    auto rowsOf = [&](int64_t m) {
      return std::vector<int64_t>(idx.begin() + m * o_.batch, idx.begin() + (m + 1) * o_.batch);
    };
    if (video_loader_) {  // raw video: the loader threads decode the epoch's micro-batches ahead, in order
      std::vector<std::vector<int64_t>> micro;
      for (int64_t m = 0; m < steps * accum_; ++m) micro.push_back(rowsOf(m));
      video_loader_->start(std::move(micro), epoch_seed);
    }
    for (int64_t s = 0; s < steps; ++s) {
      double loss = 0;
      double wait_s = 0;  // this step's time waiting for data
      for (int a = 0; a < accum_; ++a) {
        int64_t m = s * accum_ + a;
        const std::vector<int64_t> rows = rowsOf(m);
        // Each line reaches the file before its rows are used: a rank killed after its gradients were
        // reduced (the step then commits on the others) has logged what it read. A line of a step that
        // did not commit is dropped by the audit (elastic_check.py), as the resume point says.
        if (samples_log_.is_open())
          samples_log_ << fmt::format("epoch {} step {}: {}\n", epoch, step_ + 1, fmt::join(rows, " "))
                       << std::flush;
        dtrain::Stopwatch waited;
        Batch batch = [&] {
          DTRAIN_SPAN("data.wait", "data");
          return video_loader_ ? video_loader_->next() : makeBatch(data_, rows, o_.loader, epoch_seed);
        }();
        wait_s += waited.seconds();
        loss += trainer_.lossAndBackward(batch, /*sync=*/a + 1 == accum_) / accum_;
      }
      const double lr = learningRate(o_.lr, step_, total_, warmup_steps_);
      trainer_.optimizerStep(step_, total_, warmup_steps_);
      ++step_;
      loss_sum += loss;
      const double step_s = step_time.lap();
      log_->step(epoch, step_, loss, lr, samples_per_step / std::max(step_s, 1e-9), step_s, trainer_.commStats(),
                 video_loader_ ? std::optional<double>(wait_s) : std::nullopt);
      std::string timing;
      if (video_loader_)  // the step's time waiting for decoded clips, and the rest
        timing = fmt::format(" data {:.0f} ms compute {:.0f} ms", 1e3 * wait_s, 1e3 * (step_s - wait_s));
      bar.update(s + 1, fmt::format("loss {:.4f} lr {:.2e} {:.0f} samples/s{}", loss_sum / (s + 1), lr,
                                    samples_per_step * (s + 1) / std::max(epoch_time.seconds(), 1e-9), timing));
      const bool more = s + 1 < steps;  // (the epoch's last step is checkpointed at the epoch's end)
      const bool disk = more && o_.checkpoint_every > 0 && step_ % o_.checkpoint_every == 0;
      const bool memory = more && o_.snapshot_every > 0 && step_ % o_.snapshot_every == 0;
      if (disk || memory) checkpoint(loss_sum / (s + 1), start + (s + 1) * global_batch, disk, memory);
      if (more && stopNow()) return std::nullopt;  // (at the epoch's last step: after its checkpoint, below)
    }
    if (video_loader_) reportLoader(epoch, epoch_time.seconds());
    return loss_sum / std::max<int64_t>(steps, 1);
  }

  // Raw video, at an epoch's end (collective): the clips every rank decoded, skipped and waited for, summed
  // over the ranks; rank 0 prints them with the videos that failed on it and logs them to metrics.jsonl.
  void reportLoader(int epoch, double epoch_s) {
    const VideoLoaderStats st = video_loader_->takeStats();
    std::vector<double> sums{static_cast<double>(st.clips), static_cast<double>(st.failures), st.decode_seconds,
                             st.wait_seconds, epoch_s};
    dist_.world()->allreduce(sums.data(), sums.size(), dtrain::comm::DType::f64)->wait();
    if (!main_) return;
    const double ranks = dist_.size();
    std::printf("epoch %d data: %.0f clips decoded, %.0f skipped (videos that failed to decode), data wait %.1f%% of "
                "the step, decode %.0f ms per clip on %d loader threads per rank\n",
                epoch + 1, sums[0], sums[1], 100 * sums[3] / std::max(sums[4], 1e-9),
                1e3 * sums[2] / std::max(sums[0] + sums[1], 1.0), o_.loader_threads);
    for (const auto& f : st.failed) std::printf("  skipped on rank 0: %s\n", f.c_str());
    std::fflush(stdout);
    log_->write(dtrain::Record("data").set("epoch", epoch).set("clips", sums[0]).set("skipped", sums[1])
                    .set("decode_s", sums[2]).set("wait_share", sums[3] / std::max(sums[4], 1e-9))
                    .set("ranks", ranks));
  }

  // epoch_ epochs done and `samples` samples of the next one read (by all ranks together): to disk
  // and/or to peer memory. The state is captured once; a snapshot's time on this thread is counted.
  void checkpoint(double loss, int64_t samples, bool disk, bool memory) {
    disk = disk && o_.disk_checkpoints;
    memory = memory && snapshots_ && snaps_.writes();
    if (!disk && !memory) return;
    dtrain::Stopwatch took;
    const dtrain::CheckpointState st = captureState(loss, samples);
    if (memory) {
      snaps_.save(st);  // (the tensors are captured copies: the disk save below reads the same ones)
      snapshot_s_ += took.seconds();
    }
    if (disk) ckpt_.save(st);
  }

  // The snapshots' last send completed (its error, if any, raised); rank 0 reports their cost.
  void finishSnapshots(int64_t first_step) {
    if (!snapshots_) return;
    snaps_.flush();
    const auto s = snaps_.stats();
    const int64_t steps = std::max<int64_t>(1, step_ - first_step);
    if (!main_ || s.snapshots == 0) return;
    const double each = s.snapshots > 0 ? 1.0 / static_cast<double>(s.snapshots) : 0;
    std::printf("peer snapshots: %lld taken (every %d steps and at epoch ends), %.1f ms each on the training thread "
                "(capture and hand-off), %.1f ms each sent in the background, %.2f MB per copy: %.2f ms per optimizer "
                "step over %lld steps\n",
                static_cast<long long>(s.snapshots), o_.snapshot_every, 1e3 * snapshot_s_ * each,
                1e3 * s.send_seconds * each, static_cast<double>(s.last_bytes) / 1e6,
                1e3 * snapshot_s_ / static_cast<double>(steps), static_cast<long long>(steps));
    log_->write(dtrain::Record("snapshots").set("count", s.snapshots).set("every", o_.snapshot_every)
                    .set("training_thread_s", snapshot_s_).set("background_s", s.send_seconds)
                    .set("bytes_per_copy", s.last_bytes).set("steps", steps));
  }

  // Before, after (the last epoch's evaluation) and chance, also written to eval.json.
  void finalTable() {
    const auto evaluated = evaluateAndLog();
    if (!evaluated) return;
    const Retrieval& after = *evaluated;
    nlohmann::json eval_json;
    std::printf("%s\n", retrievalHeader(after.clips).c_str());
    if (before_) {
      eval_json["before"] = toJson(*before_);
      std::printf("%s\n", formatRetrieval("before training", *before_).c_str());
    }
    eval_json["after"] = toJson(after);
    std::printf("%s\n%s\n", formatRetrieval(fmt::format("after training ({} epochs)", epoch_), after).c_str(),
                chanceRow(after.clips).c_str());
    std::ofstream(o_.out + "/eval.json") << eval_json.dump(2) << "\n";
  }

  const dtrain::Distributed& dist_;
  const TrainOptions& o_;
  Dataset data_;
  bool main_;
  Trainer trainer_;
  dtrain::Checkpointer ckpt_;
  dtrain::DistributedSampler sampler_;
  dtrain::PeerSnapshots snaps_;
  bool snapshots_;                // --snapshot-every, with stores to send to
  double snapshot_s_ = 0;         // on the training thread (capture and hand-off)
  int64_t steps_per_epoch_ = 0, total_ = 0, warmup_steps_ = 0;
  int accum_ = o_.accum;        // micro-batches per step (changed on resuming at another world size)
  int64_t start_samples_ = 0;   // of the epoch resumed mid-way, read before
  std::ofstream samples_log_;   // log_samples
  int epoch_ = 0;     // epochs done
  int64_t step_ = 0;  // optimizer steps done
  RunLog* log_ = nullptr;
  std::optional<Retrieval> before_;
  std::unique_ptr<VideoLoader> video_loader_;  // raw video: the loader threads
};

}  // namespace

void train(const dtrain::Distributed& dist, const TrainOptions& options) {
  // The data set (and --init's weights) are read before o.out is created: a wrong --data or --init leaves
  // no empty run directory behind.
  TrainOptions o = options;
  Dataset data = Dataset::load(o.data);
  std::optional<Pretrained> init;
  if (!o.init.empty()) {
    init = readPretrained(o.init, o.dict);
    adoptPretrained(*init, o.model, data);
  } else if (!o.dict.empty()) {
    throw dtrain::InvalidArgument(fmt::format("--dict {}: a dictionary goes with the weights it was trained with "
                                              "(--init FILE)", o.dict));
  }
  std::filesystem::create_directories(o.out);
  Job(dist, o, std::move(data), init ? &*init : nullptr).run();
}

std::vector<dtrain::CheckpointState> loadCheckpoint(const std::string& checkpoints, const std::string& path) {
  if (!path.empty()) {
    if (std::filesystem::is_directory(path)) return dtrain::Checkpointer::loadRanks(path);
    return {dtrain::Checkpointer::load(path)};
  }
  if (auto st = dtrain::Checkpointer(checkpoints, /*keep_last=*/0, /*writer=*/false).loadLatest()) return {*st};
  auto one = dtrain::comm::ProcessGroup::create(nullptr, 0, 1);
  const auto saved = dtrain::Checkpointer(checkpoints, one, /*keep_last=*/0).list();
  if (saved.empty()) return {};
  return dtrain::Checkpointer::loadRanks(saved.back().path);
}

void restoreCheckpointModel(MilNceNet& model, const Dataset& data, const TrainOptions& o,
                            const std::vector<dtrain::CheckpointState>& parts, const std::string& what) {
  if (!parts.at(0).sharded.count("video.param_groups")) {
    parts[0].restoreModel(*model);  // DDP's file, or --zero 1's rank files (each holds the whole model)
    return;
  }
  // FSDP's shards, put together by the same units in one process.
  auto pg = dtrain::comm::ProcessGroup::create(nullptr, 0, 1);
  const dtrain::Distributed one(pg, pg, dtrain::comm::WorldInfo{});
  TrainOptions so = o;
  so.zero = 2;
  so.comm_hook = "none";
  so.local_sgd = 0;
  so.optimizer = "adam";
  Trainer t(one, data, so);
  t.restoreTraining(parts, what);
  torch::NoGradGuard no_grad;
  auto params = model->named_parameters();
  for (const auto& [name, v] : t.fullState()) {
    auto* p = params.find(name);
    if (p == nullptr) throw dtrain::InvalidArgument(fmt::format("{}: '{}' is not a parameter of the model", what, name));
    p->copy_(v);
  }
  parts[0].restoreModel(*model, /*strict=*/false);  // BatchNorm's statistics (an FSDP file's model): rank 0's
}

}  // namespace milnce
