/// @file
/// Checkpoints for resuming training: model, optimizer, LR scheduler numbers, epoch and step, RNG
/// state and metrics. Two layouts:
///  - one file that the main rank writes, when every rank holds the same state (DDP, DataParallel);
///  - one file per rank plus a manifest, when ranks hold different state (pipeline stages, PS workers,
///    later sharded optimizers): every rank saves and loads its own part, collectively.
///
/// \code
///   dtrain::Checkpointer ckpt("/ckpt/run1", dist, /*keep_last=*/3);   // only dist.isMain() writes
///   int64_t start_epoch = 0;
///   if (auto s = ckpt.loadLatest()) {                    // every rank resumes from the newest file
///     s->restoreModel(*model);                           // by name; a shape mismatch names the parameter
///     s->restoreOptimizer(optimizer);
///     s->restoreRng();
///     lr = s->scheduler.at("lr");
///     start_epoch = s->epoch + 1;
///   }
///   for (int64_t epoch = start_epoch; epoch < epochs; ++epoch) {
///     ...train...
///     if (ckpt.writes()) {                               // skip building the state on other ranks
///       dtrain::CheckpointState s;
///       s.captureModel(*model);
///       s.captureOptimizer(optimizer);
///       s.captureRng();
///       s.scheduler["lr"] = lr;
///       s.epoch = epoch;
///       s.step = step;
///       s.metrics["loss"] = loss;
///       ckpt.save(s);
///     }
///     dist.world()->barrier()->wait();                   // if others must see the file before going on
///   }
/// \endcode
///
/// Per rank (pass the group whose ranks hold different state; save and loadLatest are collective):
/// \code
///   dtrain::Checkpointer ckpt("/ckpt/pipe", dist.world());         // every rank writes its own stage
///   if (auto s = ckpt.loadLatest()) {                    // this rank's part of the newest complete one
///     s->restoreModel(*stage);
///     s->restoreOptimizer(opt);
///   }
///   ...
///   dtrain::CheckpointState s;                           // this rank's state
///   s.captureModel(*stage);
///   s.captureOptimizer(opt);
///   s.step = step;                                       // the same (epoch, step) on every rank
///   ckpt.save(s);                                        // returns once the checkpoint is complete everywhere
/// \endcode
///
/// A file is torch::pickle_save of a dict, so Python reads it with torch.load(path):
///   {"format": "dtrain-checkpoint-v1", "model": {name: tensor}, "optimizer": uint8 tensor (the bytes of a
///    torch::serialize::OutputArchive), "scheduler": {str: float}, "epoch": int, "step": int, "samples": int,
///    "rng": uint8 tensor (the default CPU generator's state, empty if not captured), "user_rng": str,
///    "metrics": {str: float}, "parameter_server": {name: tensor}} and "sharded": {name: tensor} when set
/// and in the per-rank layout also "rank": int, "world_size": int.
///
/// Single file: files are named `ckpt-<epoch, 6 digits>-<step, 9 digits>.pt`; the newest is the greatest
/// (epoch, step). A save writes `.tmp-<name>`, fsyncs it, renames it into place and fsyncs the directory, so
/// a crash leaves either the old set of checkpoints or the new one, never a half-written ckpt-*.pt.
///
/// Per rank: a checkpoint is a directory `ckpt-<epoch>-<step>/` holding `rank-<r>-of-<n>.pt` for every rank r
/// (each written like a single file: temporary, fsync, rename) and manifest.pt, which rank 0 writes the
/// same way only after every rank reported its file written: {"format": "dtrain-checkpoint-manifest-v1",
/// "epoch", "step", "world_size", "files": [name per rank], "bytes": [size per rank]}. A checkpoint
/// exists once its manifest does: a crash or a failed write anywhere mid-save leaves no manifest, and the
/// previous checkpoint stays the newest. Loading takes the newest directory whose manifest exists and
/// whose files are all present with the manifest's sizes (an incomplete one is skipped with a warning on
/// stderr). The manifest lists every rank's file so that a later loader can reshard (elastic restarts,
/// sharded optimizers); today loading at another world size is an error naming both sizes.
/// The parameter servers' state is the job's, not a rank's: rank 0 (worker 0, from saveState()) sets
/// CheckpointState::parameter_server, the other ranks leave it empty, and loadLatest returns rank 0's on
/// every rank (each worker's ps::Worker::loadState needs it).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace dtrain {
namespace comm {
class ProcessGroup;
}

class Distributed;

/// A snapshot of everything a resumed run needs. The fields are plain data: fill them directly or
/// through the capture/restore helpers.
struct CheckpointState {
  std::map<std::string, at::Tensor> model;       ///< parameters and buffers by qualified name (CPU copies)
  std::string optimizer;                         ///< bytes of the optimizer's OutputArchive; empty: none
  std::map<std::string, double> scheduler;       ///< the caller's LR-scheduler numbers
  int64_t epoch = 0;  ///< the caller's epoch; with step, it names the checkpoint
  int64_t step = 0;  ///< the caller's step count; with epoch, it names the checkpoint
  /// Samples of `epoch` read by all ranks together (DistributedLoaderSampler::globalPosition()): resume
  /// with sampler.setEpoch(epoch, samples), at any world size.
  int64_t samples = 0;
  at::Tensor rng;                                ///< default CPU generator state; undefined: not captured
  std::string user_rng;                          ///< e.g. a std::mt19937 written with operator<<
  std::map<std::string, double> metrics;  ///< the caller's numbers (best loss, ...)
  /// The parameter servers' state (values and optimizer state of every PS tensor and sparse table), as
  /// ps::Worker::saveState() returns it; empty when training does not use a parameter server.
  std::map<std::string, at::Tensor> parameter_server;
  /// This rank's part of a sharded training state (ZeroRedundancyOptimizer / FullyShardedDataParallel
  /// captureSharded), per-rank layout only; empty otherwise.
  std::map<std::string, at::Tensor> sharded;

  /// Copies (CPU, detached) every named parameter and buffer of module, recursively.
  void captureModel(const torch::nn::Module& module);
  /// Copies the saved tensors into module's parameters and buffers by name. InvalidArgument naming the
  /// tensor when a shape differs or, when strict, a name is on one side only.
  void restoreModel(torch::nn::Module& module, bool strict = true) const;
  /// Any torch::optim::Optimizer (its own save/load format: momentum buffers, Adam moments, options).
  void captureOptimizer(const torch::optim::Optimizer& optimizer);
  /// InvalidArgument when nothing was captured; dtrain::Error when the optimizer rejects the state
  /// (another optimizer type, another number of parameters).
  void restoreOptimizer(torch::optim::Optimizer& optimizer) const;
  /// The default CPU generator (torch::rand, randn, randperm, dropout without an explicit generator).
  void captureRng();
  /// InvalidArgument when nothing was captured.
  void restoreRng() const;
};

/// A PyTorch state_dict by name: what Python's torch.save(model.state_dict(), path) wrote (an OrderedDict,
/// its _metadata dropped), or torch.save of a plain dict of tensors. CPU tensors, as saved. dtrain::Error
/// naming the file: missing, not a torch.save file, corrupt or truncated, or a key that is not a string or
/// a value that is not a tensor.
std::map<std::string, at::Tensor> readStateDict(const std::string& path);
/// readStateDict(path) copied into the module's parameters and buffers by name, as
/// CheckpointState::restoreModel does (shapes checked before anything is copied; strict: the file and the
/// module must hold the same names). For a module built with the names of the PyTorch model that saved it.
void loadStateDict(torch::nn::Module& module, const std::string& path, bool strict = true);

/// Where a checkpoint is (the file; per rank: its directory) and which (epoch, step) its name says it holds.
struct CheckpointFile {
  std::string path;  ///< the file, or per rank its directory
  int64_t epoch = 0;  ///< the epoch its name says
  int64_t step = 0;  ///< the step its name says
};

/// Saves CheckpointStates into a directory and finds the newest, in one file or one file per rank, atomically
/// (see the file's description).
class Checkpointer {
 public:
  /// Single file. writer: whether save() writes on this process (true on exactly one rank per directory).
  /// keep_last: how many checkpoints to keep, newest first; 0 keeps all.
  /// InvalidArgument naming the path when dir is a file (or under one), or, for a writer, not writable.
  explicit Checkpointer(std::string dir, int keep_last = 3, bool writer = true);
  /// Single file: the main rank (global rank 0) writes; every rank reads.
  Checkpointer(std::string dir, const Distributed& dist, int keep_last = 3);
  /// Per rank: every rank of group writes its own file; save() and loadLatest() are collective over
  /// group (every rank calls them, in the same order). The group must outlive the Checkpointer.
  Checkpointer(std::string dir, std::shared_ptr<comm::ProcessGroup> group, int keep_last = 3);

  /// Writes state (creating dir if needed), then deletes all but the newest keep_last checkpoints and
  /// any leftover .tmp- files (per rank: and the directories of saves that never completed). Returns the
  /// path written; "" on ranks that do not write. A state with the (epoch, step) of an existing
  /// checkpoint replaces it atomically. dtrain::Error naming the file when writing fails (the previous
  /// checkpoints are left untouched). Per rank: every rank passes the same (epoch, step); when any rank
  /// fails (a write error, other numbers), every rank throws an Error naming it and nothing is committed.
  std::string save(const CheckpointState& state) const;

  /// The newest checkpoint, or nullopt when dir has none (or does not exist). Names that do not parse
  /// and .tmp- files are ignored. A corrupt or truncated newest file is an Error naming it: no silent
  /// fallback to an older one (use list() and load() to choose one explicitly). Per rank: this rank's
  /// state from the newest complete checkpoint, which rank 0 chooses for all; an Error on every rank
  /// when any rank cannot read its file, or when the checkpoint was written by another number of ranks.
  std::optional<CheckpointState> loadLatest() const;
  /// dtrain::Error naming path when it cannot be read or is not a dtrain checkpoint (saying what it is).
  /// Reads per-rank files too: load(ckpt.list().back().path + "/" + rankFileName(r, n)).
  static CheckpointState load(const std::string& path);
  /// Every rank's state of a per-rank checkpoint directory (list().back().path), in rank order, at the
  /// world size its file names give (any size: for resharding). InvalidArgument naming the directory when
  /// it holds no `rank-<r>-of-<n>.pt` file or one rank's is missing. Not collective.
  static std::vector<CheckpointState> loadRanks(const std::string& dir);

  /// The checkpoints in dir, oldest first (per rank: the complete ones, path = their directory).
  std::vector<CheckpointFile> list() const;
  /// The file name save() uses for (epoch, step): "ckpt-000003-000001200.pt".
  static std::string fileName(int64_t epoch, int64_t step);
  /// Per rank: the directory of (epoch, step), "ckpt-000003-000001200", and the files in it.
  static std::string dirName(int64_t epoch, int64_t step);
  static std::string rankFileName(int rank, int world_size);  ///< "rank-00001-of-00004.pt"
  /// Per rank: the manifest's file name in a checkpoint's directory.
  static constexpr const char* kManifestName = "manifest.pt";

  /// The directory, as given.
  const std::string& dir() const { return dir_; }
  /// Whether save() writes on this process.
  bool writes() const { return writer_; }
  /// True for the per-rank layout (made with a group).
  bool perRank() const { return group_ != nullptr; }
  /// How many checkpoints save() keeps (0: all).
  int keepLast() const { return keep_last_; }

 private:
  std::string savePerRank(const CheckpointState& state) const;
  std::optional<CheckpointState> loadLatestPerRank() const;
  std::vector<CheckpointFile> listPerRank() const;

  std::string dir_;
  int keep_last_;
  bool writer_;
  std::shared_ptr<comm::ProcessGroup> group_;  // per rank
};

}  // namespace dtrain
