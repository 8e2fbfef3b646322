// DistributedSampler (see sampler.h): PyTorch's index order, computed for one rank.
#include "dtrain/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "dtrain/comm/error.h"
#include "dtrain/distributed.h"

namespace dtrain {

DistributedSampler::DistributedSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  DTRAIN_CHECK_GE(dataset_size, 0, "DistributedSampler: dataset_size");
  DTRAIN_CHECK_GE(num_replicas, 1, "DistributedSampler: num_replicas");
  DTRAIN_CHECK(rank >= 0 && rank < num_replicas, InvalidArgument,
               "DistributedSampler: rank {} is outside [0, num_replicas={})", rank, num_replicas);
  const int64_t r = num_replicas;
  // drop_last: floor(n / R) per rank (PyTorch writes it ceil((n - R) / R) when n % R != 0: the same).
  num_samples_ = drop_last ? dataset_size / r : (dataset_size + r - 1) / r;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, const Distributed& dist, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : DistributedSampler(dataset_size, dist.size(), dist.rank(), shuffle, seed, drop_last) {}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> out;
  if (num_samples_ == 0) return out;
  const int64_t n = dataset_size_;
  // Every rank draws the whole permutation (not only its share): that is what keeps ranks consistent
  // without communicating, and what makes the order equal to Python's.
  at::Tensor perm;
  if (shuffle_) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ + static_cast<uint64_t>(epoch_));
    perm = torch::randperm(n, gen, torch::kLong);
  }
  const int64_t* p = shuffle_ ? perm.data_ptr<int64_t>() : nullptr;
  // The padded order is order[j % n] for j < totalSize() (PyTorch appends order[:pad], repeating the
  // whole order as often as needed when n < pad); truncation is the same formula with totalSize() <= n.
  out.reserve(static_cast<size_t>(num_samples_));
  for (int64_t i = 0; i < num_samples_; ++i) {
    const int64_t j = (rank_ + i * num_replicas_) % n;
    out.push_back(p ? p[j] : j);
  }
  return out;
}

}  // namespace dtrain
