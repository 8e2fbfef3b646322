// DistributedSampler: which dataset indices each rank reads in an epoch, with PyTorch's semantics
// (torch.utils.data.DistributedSampler), so a job moved between Python and C++ sees the same order.
//
// \code
//   auto dist = dtrain::init();
//   dtrain::DistributedSampler sampler(dataset.size(), dist, /*shuffle=*/true, /*seed=*/42);
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.setEpoch(epoch);                 // a new permutation each epoch, the same on every rank
//     for (int64_t i : sampler.indices()) ...  // sampler.size() indices, disjoint across ranks
//   }
// \endcode
//
// The order: torch.randperm(n) seeded with seed + epoch (or 0..n-1 without shuffle); then either padded
// to a multiple of the number of replicas by repeating indices from the start (so every rank gets the
// same count and no collective is left waiting), or, with drop_last, truncated to a multiple; rank r
// takes every R-th index starting at r.
#pragma once
#include <cstdint>
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
  void setEpoch(int64_t epoch) { epoch_ = epoch; }
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

 private:
  int64_t dataset_size_;
  int num_replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t num_samples_;
  int64_t epoch_ = 0;
};

}  // namespace dtrain
