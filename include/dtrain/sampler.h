/// @file
/// DistributedSampler: which dataset indices each rank reads in an epoch, with PyTorch's semantics
/// (torch.utils.data.DistributedSampler), so a job moved between Python and C++ sees the same order.
/// DistributedLoaderSampler is the same order as a torch::data sampler, for torch::data::make_data_loader.
///
/// \code
///   auto dist = dtrain::init();
///   dtrain::DistributedSampler sampler(dataset.size(), dist, /*shuffle=*/true, /*seed=*/42);
///   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
///     sampler.setEpoch(epoch);                 // a new permutation each epoch, the same on every rank
///     for (int64_t i : sampler.indices()) ...  // sampler.size() indices, disjoint across ranks
///   }
///
///   // With a torch::data Dataset and DataLoader (examples/ddp_dataloader.cc):
///   dtrain::DistributedLoaderSampler sampler(dataset.size().value(), dist, /*shuffle=*/true, /*seed=*/42);
///   auto loader = torch::data::make_data_loader(dataset.map(torch::data::transforms::Stack<>()), sampler,
///                                               torch::data::DataLoaderOptions().batch_size(64));
///   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
///     sampler.setEpoch(epoch);                 // the loader's copy sees it: copies share their state
///     for (auto& batch : *loader) ...          // this rank's share, in batches
///   }
/// \endcode
///
/// The order: torch.randperm(n) seeded with seed + epoch (or 0..n-1 without shuffle); then either padded
/// to a multiple of the number of replicas by repeating indices from the start (so every rank gets the
/// same count and no collective is left waiting), or, with drop_last, truncated to a multiple; rank r
/// takes every R-th index starting at r. Resumed at global position s (setEpoch(epoch, s)), the same
/// applies to the order's samples from s on: rank r's i-th index is order[(s + r + i R) mod n] (the
/// padding repeats the epoch's first samples, as without resuming; at the same world size the resumed
/// sampler reads exactly what the uninterrupted one would have).
/// A rank's first k indices are order[k R) of what was left, so after k of them on every rank the global
/// position is s + k R (DistributedLoaderSampler::globalPosition()).
///
/// Forgetting setEpoch (PyTorch's set_epoch) makes every epoch read the same order. With shuffle on,
/// a warning goes to stderr once ("[rank r] ..."): from DistributedLoaderSampler when an epoch starts
/// (the loader's begin()) with the same epoch number as the one before; from DistributedSampler when
/// indices() is called again and setEpoch() was never called.
#pragma once
#include <torch/data/samplers/base.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace dtrain {

class Distributed;

/// Which dataset indices this rank reads in each epoch, with PyTorch's DistributedSampler semantics (see
/// the file's description).
class DistributedSampler {
 public:
  /// InvalidArgument when dataset_size < 0, num_replicas < 1 or rank is outside [0, num_replicas).
  DistributedSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);
  /// One replica per process of the world: num_replicas = dist.size(), rank = dist.rank().
  DistributedSampler(int64_t dataset_size, const Distributed& dist, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);

  /// Call at the start of every epoch: the permutation is seeded with seed + epoch. To resume an epoch,
  /// pass how many samples of its order were read before, by all ranks together (`start`, in global
  /// samples: steps done * batch per rank * the world size then): the ranks share the rest of the order,
  /// at this sampler's world size, whatever it was before, and no sample is read twice or skipped.
  /// InvalidArgument unless 0 <= start <= the dataset's size.
  void setEpoch(int64_t epoch, int64_t start = 0);
  /// The epoch set by setEpoch() (0 before).
  int64_t epoch() const { return epoch_; }
  /// The samples of this epoch read before it (setEpoch's start).
  int64_t start() const { return start_; }

  /// This rank's indices for the current epoch (from start()); size() of them.
  std::vector<int64_t> indices() const;
  /// How many indices each rank gets: ceil(m / R), or floor(m / R) with drop_last, where m is the
  /// number of samples left (the dataset's size minus start()).
  int64_t size() const {
    const int64_t left = dataset_size_ - start_, r = num_replicas_;
    // drop_last: floor(m / R) per rank (PyTorch writes it ceil((m - R) / R) when m % R != 0: the same).
    return drop_last_ ? left / r : (left + r - 1) / r;
  }
  /// size() * num_replicas: the length of the padded or truncated order all ranks share.
  int64_t totalSize() const { return size() * num_replicas_; }

  /// The number of samples in the dataset.
  int64_t datasetSize() const { return dataset_size_; }
  /// R: the number of ranks sharing the dataset.
  int numReplicas() const { return num_replicas_; }
  /// This rank among them.
  int rank() const { return rank_; }
  /// Whether each epoch's order is a seeded permutation (else 0..n-1).
  bool shuffle() const { return shuffle_; }
  /// The permutation's base seed (seed + epoch).
  uint64_t seed() const { return seed_; }
  /// Whether the order is truncated (true) or padded (false) to a multiple of R.
  bool dropLast() const { return drop_last_; }

 private:
  friend class DistributedLoaderSampler;
  std::vector<int64_t> order() const;  // indices() without the forgotten-setEpoch check

  int64_t dataset_size_;
  int num_replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t epoch_ = 0;
  int64_t start_ = 0;
  bool epoch_set_ = false;
  mutable int64_t indices_calls_ = 0;
  mutable bool warned_ = false;
};

/// The DistributedSampler as a torch::data sampler: make_data_loader(dataset, sampler, options) reads
/// this rank's indices of each epoch, in batches. Copies share one state (the epoch and the position),
/// so the copy the loader holds follows setEpoch() on the one you keep. Each epoch (each reset(), i.e.
/// each loader->begin()) starts the current epoch's order from the beginning; reset(new_size) changes
/// the dataset size. save()/load() keep the epoch and the position in it (torch::serialize archives),
/// as libtorch's samplers do, the position in global samples, so that load() at another world size goes
/// on where the saved run stopped; note that a DataLoader's begin() calls reset(), which starts the
/// epoch's order over from the setEpoch start (after load(): the loaded position).
class DistributedLoaderSampler : public torch::data::samplers::Sampler<> {
 public:
  /// As DistributedSampler's constructors (InvalidArgument for the same bad arguments).
  DistributedLoaderSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle = true,
                           uint64_t seed = 0, bool drop_last = false);
  /// One replica per process of the world, as DistributedSampler's.
  DistributedLoaderSampler(int64_t dataset_size, const Distributed& dist, bool shuffle = true, uint64_t seed = 0,
                           bool drop_last = false);

  /// As DistributedSampler::setEpoch (start: global samples of the epoch read before).
  void setEpoch(int64_t epoch, int64_t start = 0);
  /// The current epoch.
  int64_t epoch() const;
  /// Samples of the current epoch read by all ranks together: start plus R times this rank's indices
  /// handed out since the epoch began (the loader's batches), at most the dataset's size. Save it with the
  /// checkpoint (CheckpointState::samples) and resume with setEpoch(epoch, it) at any world size.
  int64_t globalPosition() const;
  /// This rank's indices per epoch.
  int64_t size() const;

  /// Starts the current epoch's order over (from the setEpoch start); new_size: a new dataset size.
  void reset(torch::optional<size_t> new_size = torch::nullopt) override;
  /// The next batch_size indices of this rank (fewer at the end), or nullopt when the epoch is done.
  torch::optional<std::vector<size_t>> next(size_t batch_size) override;
  /// Writes the epoch and the position (this rank's and the global one) into archive.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads what save() wrote; goes on from the saved global position at this world size.
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace dtrain
