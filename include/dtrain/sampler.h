// DistributedSampler: which dataset indices each rank reads in an epoch, with PyTorch's semantics
// (torch.utils.data.DistributedSampler), so a job moved between Python and C++ sees the same order.
// DistributedLoaderSampler is the same order as a torch::data sampler, for torch::data::make_data_loader.
//
// \code
//   auto dist = dtrain::init();
//   dtrain::DistributedSampler sampler(dataset.size(), dist, /*shuffle=*/true, /*seed=*/42);
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.setEpoch(epoch);                 // a new permutation each epoch, the same on every rank
//     for (int64_t i : sampler.indices()) ...  // sampler.size() indices, disjoint across ranks
//   }
//
//   // With a torch::data Dataset and DataLoader (examples/ddp_dataloader.cc):
//   dtrain::DistributedLoaderSampler sampler(dataset.size().value(), dist, /*shuffle=*/true, /*seed=*/42);
//   auto loader = torch::data::make_data_loader(dataset.map(torch::data::transforms::Stack<>()), sampler,
//                                               torch::data::DataLoaderOptions().batch_size(64));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.setEpoch(epoch);                 // the loader's copy sees it: copies share their state
//     for (auto& batch : *loader) ...          // this rank's share, in batches
//   }
// \endcode
//
// The order: torch.randperm(n) seeded with seed + epoch (or 0..n-1 without shuffle); then either padded
// to a multiple of the number of replicas by repeating indices from the start (so every rank gets the
// same count and no collective is left waiting), or, with drop_last, truncated to a multiple; rank r
// takes every R-th index starting at r.
//
// Forgetting setEpoch (PyTorch's set_epoch) makes every epoch read the same order. With shuffle on,
// a warning goes to stderr once ("[rank r] ..."): from DistributedLoaderSampler when an epoch starts
// (the loader's begin()) with the same epoch number as the one before; from DistributedSampler when
// indices() is called again and setEpoch() was never called.
#pragma once
#include <torch/data/samplers/base.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace dtrain {

class Distributed;

class DistributedSampler {
 public:
  // InvalidArgument when dataset_size < 0, num_replicas < 1 or rank is outside [0, num_replicas).
  DistributedSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);
  // One replica per process of the world: num_replicas = dist.size(), rank = dist.rank().
  DistributedSampler(int64_t dataset_size, const Distributed& dist, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);

  // Call at the start of every epoch: the permutation is seeded with seed + epoch.
  void setEpoch(int64_t epoch) {
    epoch_ = epoch;
    epoch_set_ = true;
  }
  int64_t epoch() const { return epoch_; }

  // This rank's indices for the current epoch; size() of them.
  std::vector<int64_t> indices() const;
  // How many indices each rank gets: ceil(n / R), or floor(n / R) with drop_last.
  int64_t size() const { return num_samples_; }
  // size() * num_replicas: the length of the padded or truncated order all ranks share.
  int64_t totalSize() const { return num_samples_ * num_replicas_; }

  int64_t datasetSize() const { return dataset_size_; }
  int numReplicas() const { return num_replicas_; }
  int rank() const { return rank_; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }
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
  int64_t num_samples_;
  int64_t epoch_ = 0;
  bool epoch_set_ = false;
  mutable int64_t indices_calls_ = 0;
  mutable bool warned_ = false;
};

// The DistributedSampler as a torch::data sampler: make_data_loader(dataset, sampler, options) reads
// this rank's indices of each epoch, in batches. Copies share one state (the epoch and the position),
// so the copy the loader holds follows setEpoch() on the one you keep. Each epoch (each reset(), i.e.
// each loader->begin()) starts the current epoch's order from the beginning; reset(new_size) changes
// the dataset size. save()/load() keep the epoch and the position in it (torch::serialize archives),
// as libtorch's samplers do; note that a DataLoader's begin() calls reset(), which starts over.
class DistributedLoaderSampler : public torch::data::samplers::Sampler<> {
 public:
  // As DistributedSampler's constructors (InvalidArgument for the same bad arguments).
  DistributedLoaderSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle = true,
                           uint64_t seed = 0, bool drop_last = false);
  DistributedLoaderSampler(int64_t dataset_size, const Distributed& dist, bool shuffle = true, uint64_t seed = 0,
                           bool drop_last = false);

  void setEpoch(int64_t epoch);
  int64_t epoch() const;
  // This rank's indices per epoch.
  int64_t size() const;

  void reset(torch::optional<size_t> new_size = torch::nullopt) override;
  torch::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace dtrain
