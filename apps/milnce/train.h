// Training and evaluation of the MIL-NCE model, distributed with dtrain.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/device.h"
#include "dtrain/distributed.h"
#include "dtrain/fsdp.h"
#include "dtrain/local_sgd.h"
#include "dtrain/zero.h"
#include "dtrain/progress.h"
#include "milnce/data.h"
#include "milnce/model.h"
#include "milnce/pretrained.h"

namespace milnce {

struct TrainOptions {
  std::string data;          // generated data directory
  std::string out = "runs/milnce";  // checkpoints/, metrics.jsonl (rank 0; docs/OBSERVABILITY.md), eval.json
  int epochs = 30;
  int batch = 32;            // clips per rank per step
  int accum = 1;             // micro-batches per optimizer step (DDP no_sync in between)
  double lr = 1e-3;
  double warmup = 0.1;       // fraction of the optimizer steps spent warming up linearly
  // Over slow links (docs/SLOW-LINKS.md): the DDP communication hook (dtrain/hook_spec.h: none, fp16,
  // bf16, topk:RATIO, powersgd:R[:START]); the optimizer (adam; lamb or lars with weight_decay, biases
  // and norm weights excluded); local SGD: after the warm-up, gradients averaged within each machine
  // only and parameters averaged over all ranks every local_sgd steps (0: off).
  std::string comm_hook = "none";
  // DDP's gradient bucket caps in MiB (DDPOptions; DTRAIN_TUNE=on tunes them instead).
  double bucket_mb = 25, first_bucket_mb = 1, last_bucket_mb = 0;
  std::string device = "cpu";  // cpu, cuda (cuda:LOCAL_RANK), cuda:N or auto (dtrain/device.h)
  std::string optimizer = "adam";
  double weight_decay = 0;
  int local_sgd = 0;
  // ZeRO (docs/ZERO.md): 0 replicates everything (DDP); 1 shards the optimizer state
  // (ZeroRedundancyOptimizer over DDP); 2 and 3 shard the gradients and Adam's state too (and at 3 the
  // parameters outside each encoder's forward) with FullyShardedDataParallel, one instance per encoder.
  // 1-3 checkpoint per rank and need no --local-sgd; 2/3 need --comm-hook none and --optimizer adam.
  int zero = 0;
  uint64_t seed = 0;
  // Resuming (resume) continues from the newest checkpoint, mid-epoch too, at any world size: the
  // sampler goes on from the samples the checkpoint's epoch had read, and the global batch (batch x
  // accum x world size) is kept by changing accum (an error if it cannot be).
  bool resume = false;
  int stop_after = 0;        // stop once this many epochs are done (0: run all), as if interrupted
  int checkpoint_every = 0;  // also checkpoint every this many optimizer steps within an epoch (0: epoch ends)
  bool disk_checkpoints = true;  // false: no checkpoints on disk (out/checkpoints is neither read nor written)
  // Peer-memory snapshots (dtrain/snapshot.h) every this many optimizer steps and at every epoch's end
  // (0: none), into the dtrain-run agents' stores: snapshot_stores, or DTRAIN_SNAPSHOT_STORES when empty.
  // Resuming takes the newer of the newest snapshot and the newest disk checkpoint (memory wins a tie).
  int snapshot_every = 0;
  std::string snapshot_stores;
  int stop_after_steps = 0;  // stop once this many optimizer steps are done (0: never), as if interrupted
  // Each rank appends "epoch E step S: indices" per micro-batch to out/samples-rank<r>.txt: what was read,
  // to audit coverage across restarts (steps after the newest checkpoint are read again on resuming).
  bool log_samples = false;
  // Start from the HowTo100M reference's trained model (pretrained.h): its state_dict file, and its word
  // dictionary (a .npy of words) that replaces the data set's vocabulary and word vectors. The widths come
  // from the file. A resumed run's checkpoint replaces these weights; pass the same options to resume.
  std::string init, dict;
  int keep = 10;             // checkpoints kept
  int eval_windows = 4;
  bool eval = true;          // evaluate before training and after every eval_every epochs (and the last)
  int eval_every = 1;
  // Rank 0's progress on stderr: a bar on a terminal, else a line every progress_every steps (0: one
  // line per epoch).
  dtrain::ProgressOptions::Mode progress = dtrain::ProgressOptions::Mode::automatic;
  int progress_every = 0;
  LoaderOptions loader;
  ModelOptions model;  // model.raw_video: train S3D-G from the videos of a gen-video data set (--raw-video)
  // Raw video: threads decoding clips per rank and micro-batches decoded ahead (video_loader.h).
  int loader_threads = 2;
  int prefetch = 4;
};

struct Retrieval {
  int clips = 0;
  double r1 = 0, r5 = 0, r10 = 0, median_rank = 0;
  int64_t failed_windows = 0;  // raw video: eval windows whose video did not decode (embedded as zeros)
};
// Text-to-video retrieval on the held-out clips: each clip's video embedding is the mean over
// `windows` windows of the clip. Ranks are 1-based; chance is R@k = k / clips, median (clips + 1) / 2.
// `progress`, when given (total: the clips), is updated once per clip embedded.
Retrieval evaluate(MilNceNet& model, const Dataset& data, const LoaderOptions& lo, int windows,
                   dtrain::Progress* progress = nullptr);
std::string formatRetrieval(const std::string& label, const Retrieval& r);
std::string retrievalHeader(int clips);
std::string chanceRow(int clips);

// Linear warmup to the base rate, then cosine decay to 0, by optimizer step.
double learningRate(double base, int64_t step, int64_t total, int64_t warmup_steps);

// One optimizer step's worth of work, shared by the CLI and the tests: embeddings of the local
// batch, all-gathered across ranks (the gradient flows back to each rank's slice), the MIL-NCE loss
// on the global batch, backward through DDP (o.zero 0; 1: the optimizer a ZeroRedundancyOptimizer) or
// through two FullyShardedDataParallel
// instances, one per encoder (o.zero 2 or 3: the optimizer steps their shards; the frozen word vectors
// stay replicated). InvalidArgument for options FSDP cannot take (a comm hook, local SGD, lamb/lars).
class Trainer {
 public:
  // `init`, when given, fills the model before DDP or FSDP takes it (o.model and data adopted it first:
  // adoptPretrained).
  Trainer(const dtrain::Distributed& dist, const Dataset& data, const TrainOptions& o, const Pretrained* init = nullptr);
  ~Trainer();
  // Forward + backward of one micro-batch; `sync` false accumulates without communicating.
  double lossAndBackward(const Batch& local, bool sync = true);
  void optimizerStep(int64_t step, int64_t total, int64_t warmup_steps);
  // --local-sgd: from optimizer step `start` on (call before the first backward).
  void enableLocalSgd(int64_t start);
  // After a resume at optimizer step `step`: the averager's count follows.
  void resumeAt(int64_t step);
  // FSDP (--zero 2, 3): the parameters are sharded.
  bool sharded() const { return video_fsdp_ != nullptr; }
  // --zero 1-3: ranks hold different state, checkpointed per rank.
  bool perRankState() const { return o_.zero > 0; }
  // The model. Sharded: its trainable parameters hold no values outside forward (see evalModel()).
  MilNceNet& model() { return model_; }
  // The optimizer (--zero 1: this rank's part, which steps the parameters it owns).
  torch::optim::Optimizer& optimizer();
  // The last backward's communication (DDP's; zeros when sharded: FSDP keeps no timings).
  dtrain::DistributedDataParallel::Stats commStats() const;

  // Collective when sharded: every trainable parameter's current value by its name in MilNceNet.
  std::map<std::string, at::Tensor> fullState();
  // Collective when sharded: a model holding the current values, for evaluate() (the model itself for
  // DDP; a copy, filled from fullState(), when sharded).
  MilNceNet& evalModel();
  // The training state a checkpoint holds: the model and optimizer (DDP); the model and this rank's
  // optimizer state (--zero 1: s.sharded "zero.*"); this rank's shards and their optimizer state
  // (FSDP: s.sharded "video.*" and "text.*").
  void captureTraining(dtrain::CheckpointState& s) const;
  // From every saved rank's state in old-rank order (DDP: parts[0], the one file), saved at any world
  // size; `what` names the source in errors. Not collective.
  void restoreTraining(const std::vector<dtrain::CheckpointState>& parts, const std::string& what);

 private:
  const dtrain::Distributed& dist_;
  TrainOptions o_;
  c10::Device device_;  // where the model trains (TrainOptions::device)
  MilNceNet model_{nullptr};
  MilNceNet eval_model_{nullptr};  // sharded: evalModel()'s copy
  std::unique_ptr<dtrain::DistributedDataParallel> ddp_;
  std::unique_ptr<dtrain::FullyShardedDataParallel> video_fsdp_, text_fsdp_;
  std::unique_ptr<torch::optim::Optimizer> opt_;        // --zero 0, 2, 3
  std::unique_ptr<dtrain::ZeroRedundancyOptimizer> zero_;  // --zero 1
  std::unique_ptr<dtrain::PeriodicModelAverager> averager_;
};

// The whole job: evaluate, train for o.epochs (resuming if asked), checkpoint and evaluate every epoch.
// Rank 0 logs the run, every step and every evaluation to o.out/metrics.jsonl (appended to on --resume).
void train(const dtrain::Distributed& dist, const TrainOptions& o);

// For `milnce eval`: the parts of `path` (a checkpoint file, or a per-rank checkpoint directory: every
// rank's file in rank order) or, when path is empty, of the newest checkpoint in `checkpoints` (a run's
// checkpoints/ directory, whatever --zero saved it); empty when there is none.
std::vector<dtrain::CheckpointState> loadCheckpoint(const std::string& checkpoints, const std::string& path);
// The parameters those parts hold into `model` (built with o.model): FSDP's shards (--zero 2, 3) put
// together in this process, at any saved world size, with rank 0's buffers (S3D-G's BatchNorm
// statistics). `what` names the source in errors.
void restoreCheckpointModel(MilNceNet& model, const Dataset& data, const TrainOptions& o,
                            const std::vector<dtrain::CheckpointState>& parts, const std::string& what);

}  // namespace milnce
