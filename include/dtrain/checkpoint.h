// Checkpoints for resuming training: model, optimizer, LR scheduler numbers, epoch and step, RNG
// state and metrics in one file that the main rank writes atomically and every rank can read.
//
// \code
//   dtrain::Checkpointer ckpt("/ckpt/run1", dist, /*keep_last=*/3);   // only dist.isMain() writes
//   int64_t start_epoch = 0;
//   if (auto s = ckpt.loadLatest()) {                    // every rank resumes from the newest file
//     s->restoreModel(*model);                           // by name; a shape mismatch names the parameter
//     s->restoreOptimizer(optimizer);
//     s->restoreRng();
//     lr = s->scheduler.at("lr");
//     start_epoch = s->epoch + 1;
//   }
//   for (int64_t epoch = start_epoch; epoch < epochs; ++epoch) {
//     ...train...
//     if (ckpt.writes()) {                               // skip building the state on other ranks
//       dtrain::CheckpointState s;
//       s.captureModel(*model);
//       s.captureOptimizer(optimizer);
//       s.captureRng();
//       s.scheduler["lr"] = lr;
//       s.epoch = epoch;
//       s.step = step;
//       s.metrics["loss"] = loss;
//       ckpt.save(s);
//     }
//     dist.world()->barrier()->wait();                   // if others must see the file before going on
//   }
// \endcode
//
// The file is torch::pickle_save of a dict, so Python reads it with torch.load(path):
//   {"format": "dtrain-checkpoint-v1", "model": {name: tensor}, "optimizer": uint8 tensor (the bytes of a
//    torch::serialize::OutputArchive), "scheduler": {str: float}, "epoch": int, "step": int,
//    "rng": uint8 tensor (the default CPU generator's state, empty if not captured), "user_rng": str,
//    "metrics": {str: float}, "parameter_server": {name: tensor}}
// Files are named ckpt-<epoch, 6 digits>-<step, 9 digits>.pt; the newest is the greatest (epoch, step).
// A save writes .tmp-<name>, fsyncs it, renames it into place and fsyncs the directory, so a crash
// leaves either the old set of checkpoints or the new one, never a half-written ckpt-*.pt.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
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

class Distributed;

// A snapshot of everything a resumed run needs. The fields are plain data: fill them directly or
// through the capture/restore helpers.
struct CheckpointState {
  std::map<std::string, at::Tensor> model;       // parameters and buffers by qualified name (CPU copies)
  std::string optimizer;                         // bytes of the optimizer's OutputArchive; empty: none
  std::map<std::string, double> scheduler;       // the caller's LR-scheduler numbers
  int64_t epoch = 0;
  int64_t step = 0;
  at::Tensor rng;                                // default CPU generator state; undefined: not captured
  std::string user_rng;                          // e.g. a std::mt19937 written with operator<<
  std::map<std::string, double> metrics;
  // The parameter servers' state (values and optimizer state of every PS tensor and sparse table), as
  // ps::Worker::saveState() returns it; empty when training does not use a parameter server.
  std::map<std::string, at::Tensor> parameter_server;

  // Copies (CPU, detached) every named parameter and buffer of module, recursively.
  void captureModel(const torch::nn::Module& module);
  // Copies the saved tensors into module's parameters and buffers by name. InvalidArgument naming the
  // tensor when a shape differs or, when strict, a name is on one side only.
  void restoreModel(torch::nn::Module& module, bool strict = true) const;
  // Any torch::optim::Optimizer (its own save/load format: momentum buffers, Adam moments, options).
  void captureOptimizer(const torch::optim::Optimizer& optimizer);
  // InvalidArgument when nothing was captured; dtrain::Error when the optimizer rejects the state
  // (another optimizer type, another number of parameters).
  void restoreOptimizer(torch::optim::Optimizer& optimizer) const;
  // The default CPU generator (torch::rand, randn, randperm, dropout without an explicit generator).
  void captureRng();
  // InvalidArgument when nothing was captured.
  void restoreRng() const;
};

// Where a checkpoint file is and which (epoch, step) its name says it holds.
struct CheckpointFile {
  std::string path;
  int64_t epoch = 0;
  int64_t step = 0;
};

class Checkpointer {
 public:
  // writer: whether save() writes on this process (true on exactly one rank per directory).
  // keep_last: how many checkpoint files to keep, newest first; 0 keeps all.
  explicit Checkpointer(std::string dir, int keep_last = 3, bool writer = true);
  // The main rank (global rank 0) writes; every rank reads.
  Checkpointer(std::string dir, const Distributed& dist, int keep_last = 3);

  // Writes state (creating dir if needed), then deletes all but the newest keep_last checkpoints and
  // any leftover .tmp- files. Returns the path written; "" on ranks that do not write. A state with
  // the (epoch, step) of an existing file replaces it atomically. dtrain::Error naming the file when
  // writing fails (the previous checkpoints are left untouched).
  std::string save(const CheckpointState& state) const;

  // The newest checkpoint, or nullopt when dir has none (or does not exist). Names that do not parse
  // and .tmp- files are ignored. A corrupt or truncated newest file is an Error naming it: no silent
  // fallback to an older one (use list() and load() to choose one explicitly).
  std::optional<CheckpointState> loadLatest() const;
  // dtrain::Error naming path when it cannot be read or is not a dtrain checkpoint.
  static CheckpointState load(const std::string& path);

  // The checkpoint files in dir, oldest first.
  std::vector<CheckpointFile> list() const;
  // The file name save() uses for (epoch, step): "ckpt-000003-000001200.pt".
  static std::string fileName(int64_t epoch, int64_t step);

  const std::string& dir() const { return dir_; }
  bool writes() const { return writer_; }
  int keepLast() const { return keep_last_; }

 private:
  std::string dir_;
  int keep_last_;
  bool writer_;
};

}  // namespace dtrain
