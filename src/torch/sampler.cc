// DistributedSampler (see sampler.h): PyTorch's index order, computed for one rank; and
// DistributedLoaderSampler, the same order served to a torch::data DataLoader.
#include "dtrain/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>

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
}

void DistributedSampler::setEpoch(int64_t epoch, int64_t start) {
  DTRAIN_CHECK(start >= 0 && start <= dataset_size_, InvalidArgument,
               "DistributedSampler::setEpoch: start {} (samples already read) is outside [0, dataset size {}]", start,
               dataset_size_);
  epoch_ = epoch;
  start_ = start;
  epoch_set_ = true;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, const Distributed& dist, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : DistributedSampler(dataset_size, dist.size(), dist.rank(), shuffle, seed, drop_last) {}

namespace {
void warnSameOrder(int rank, const char* who, const char* why) {
  fmt::print(stderr,
             "[rank {}] warning: {} {}: every epoch reads the same order. Call sampler.setEpoch(epoch) at the start "
             "of each epoch (PyTorch's set_epoch). (Warned once.)\n",
             rank, who, why);
}
}  // namespace

std::vector<int64_t> DistributedSampler::indices() const {
  if (shuffle_ && !epoch_set_ && indices_calls_++ > 0 && !warned_) {
    warned_ = true;
    warnSameOrder(rank_, "DistributedSampler", "indices() was called again and setEpoch() never was");
  }
  return order();
}

std::vector<int64_t> DistributedSampler::order() const {
  std::vector<int64_t> out;
  const int64_t count = size();
  if (count == 0) return out;
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
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = (start_ + rank_ + i * num_replicas_) % n;
    out.push_back(p ? p[j] : j);
  }
  return out;
}

struct DistributedLoaderSampler::State {
  DistributedSampler sampler;
  std::vector<int64_t> order;  // this epoch's indices
  size_t pos = 0;
  std::optional<int64_t> last_started;  // the epoch number of the last reset()
  bool warned = false;
};

DistributedLoaderSampler::DistributedLoaderSampler(int64_t dataset_size, int num_replicas, int rank, bool shuffle,
                                                   uint64_t seed, bool drop_last)
    : state_(std::make_shared<State>(State{DistributedSampler(dataset_size, num_replicas, rank, shuffle, seed, drop_last), {}, 0, std::nullopt, false})) {
  state_->order = state_->sampler.order();  // usable before the first reset()
}

DistributedLoaderSampler::DistributedLoaderSampler(int64_t dataset_size, const Distributed& dist, bool shuffle,
                                                   uint64_t seed, bool drop_last)
    : DistributedLoaderSampler(dataset_size, dist.size(), dist.rank(), shuffle, seed, drop_last) {}

void DistributedLoaderSampler::setEpoch(int64_t epoch, int64_t start) { state_->sampler.setEpoch(epoch, start); }

int64_t DistributedLoaderSampler::globalPosition() const {
  const auto& s = state_->sampler;
  return std::min(s.datasetSize(), s.start() + static_cast<int64_t>(state_->pos) * s.numReplicas());
}
int64_t DistributedLoaderSampler::epoch() const { return state_->sampler.epoch(); }
int64_t DistributedLoaderSampler::size() const { return state_->sampler.size(); }

void DistributedLoaderSampler::reset(torch::optional<size_t> new_size) {
  State& st = *state_;
  if (new_size) {
    const auto& s = st.sampler;
    DistributedSampler resized(static_cast<int64_t>(*new_size), s.numReplicas(), s.rank(), s.shuffle(), s.seed(),
                               s.dropLast());
    resized.setEpoch(s.epoch(), std::min(s.start(), static_cast<int64_t>(*new_size)));
    st.sampler = resized;
  }
  const int64_t epoch = st.sampler.epoch();
  if (st.sampler.shuffle() && st.last_started == epoch && !st.warned) {
    st.warned = true;
    warnSameOrder(st.sampler.rank(), "DistributedLoaderSampler",
                  fmt::format("started epoch {} again (setEpoch() did not change it since the last epoch)", epoch).c_str());
  }
  st.last_started = epoch;
  st.order = st.sampler.order();
  st.pos = 0;
}

torch::optional<std::vector<size_t>> DistributedLoaderSampler::next(size_t batch_size) {
  State& st = *state_;
  if (st.pos >= st.order.size()) return torch::nullopt;
  const size_t n = std::min(batch_size, st.order.size() - st.pos);
  std::vector<size_t> out(st.order.begin() + static_cast<std::ptrdiff_t>(st.pos),
                          st.order.begin() + static_cast<std::ptrdiff_t>(st.pos + n));
  st.pos += n;
  return out;
}

void DistributedLoaderSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", torch::tensor(state_->sampler.epoch(), torch::kInt64), /*is_buffer=*/true);
  archive.write("position", torch::tensor(static_cast<int64_t>(state_->pos), torch::kInt64), /*is_buffer=*/true);
  archive.write("global_position", torch::tensor(globalPosition(), torch::kInt64), /*is_buffer=*/true);
}

void DistributedLoaderSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch = torch::empty({}, torch::kInt64), pos = torch::empty({}, torch::kInt64);
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", pos, /*is_buffer=*/true);
  State& st = *state_;
  at::Tensor global = torch::empty({}, torch::kInt64);
  if (archive.try_read("global_position", global, /*is_buffer=*/true)) {  // (absent in older archives)
    const int64_t g = global.item<int64_t>();
    DTRAIN_CHECK(g >= 0 && g <= st.sampler.datasetSize(), InvalidArgument,
                 "DistributedLoaderSampler::load: global position {} is outside the dataset's {} samples", g,
                 st.sampler.datasetSize());
    st.sampler.setEpoch(epoch.item<int64_t>(), g);  // the rest of the epoch, at this world size
    st.order = st.sampler.order();
    st.pos = 0;
    return;
  }
  st.sampler.setEpoch(epoch.item<int64_t>());
  st.order = st.sampler.order();
  const int64_t p = pos.item<int64_t>();
  DTRAIN_CHECK(p >= 0 && p <= static_cast<int64_t>(st.order.size()), InvalidArgument,
               "DistributedLoaderSampler::load: position {} is outside this rank's {} indices", p, st.order.size());
  st.pos = static_cast<size_t>(p);
}

}  // namespace dtrain
