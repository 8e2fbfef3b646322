// DataParallel (see data_parallel.h): replicas on a persistent thread pool; each step runs three
// phases on it (refresh replicas, forward + backward per slice, sum gradients into the main module).
#include "dtrain/data_parallel.h"

#include <ATen/ThreadLocalState.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>

#include "dtrain/comm/error.h"

namespace dtrain {
namespace {

// Runs fn(0..n-1) with index 0 on the calling thread and the others on n-1 threads that live as long
// as the pool, so a step creates no threads. The caller's torch thread-local state (grad mode, ...)
// is applied on the workers for the duration of each task.
class WorkerPool {
 public:
  explicit WorkerPool(int n) : errors_(static_cast<size_t>(n)) {
    threads_.reserve(static_cast<size_t>(n - 1));
    try {
      for (int i = 1; i < n; ++i) threads_.emplace_back([this, i] { loop(i); });
    } catch (...) {
      stopAndJoin();  // the destructor will not run: do not leave joinable threads behind
      throw;
    }
  }

  ~WorkerPool() { stopAndJoin(); }

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return static_cast<int>(errors_.size()); }

  // Returns once every index finished; then rethrows the exception of the lowest index that threw.
  void run(const std::function<void(int)>& fn) {
    at::ThreadLocalState state;
    {
      std::lock_guard<std::mutex> lk(mu_);
      task_ = &fn;
      state_ = &state;
      std::fill(errors_.begin(), errors_.end(), nullptr);
      pending_ = size() - 1;
      ++generation_;
    }
    work_cv_.notify_all();
    std::exception_ptr mine;
    try {
      fn(0);
    } catch (...) {
      mine = std::current_exception();
    }
    // Wait even when index 0 threw: the workers still use fn and state, which live in this frame.
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    task_ = nullptr;
    state_ = nullptr;
    errors_[0] = mine;
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void stopAndJoin() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void loop(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const auto* task = task_;
      const auto* state = state_;
      lk.unlock();
      std::exception_ptr error;
      try {
        at::ThreadLocalStateGuard guard(*state);
        (*task)(index);
      } catch (...) {
        error = std::current_exception();
      }
      lk.lock();
      errors_[static_cast<size_t>(index)] = error;
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_;  // a new generation of tasks, or stop
  std::condition_variable done_cv_;  // pending_ reached 0
  const std::function<void(int)>* task_ = nullptr;
  const at::ThreadLocalState* state_ = nullptr;
  std::vector<std::exception_ptr> errors_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;  // last: joined before the state above is destroyed
};

// dst <- src without autograd, onto `device` (the replica's; unset: wherever src is). Keeps dst's storage
// when the layout matches; otherwise (the main module was moved with to() after the replicas were made)
// dst takes a copy of src's type.
void copyInto(at::Tensor& dst, const at::Tensor& src, const c10::optional<c10::Device>& device) {
  if (!src.defined() || !dst.defined()) return;
  const c10::Device where = device ? *device : src.device();
  if (dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type() && dst.device() == where)
    dst.copy_(src);
  else
    dst.set_data(src.detach().to(where, src.scalar_type(), /*non_blocking=*/false, /*copy=*/true));
  if (dst.is_leaf() && dst.requires_grad() != src.requires_grad()) dst.set_requires_grad(src.requires_grad());
}

}  // namespace

struct DataParallel::Impl {
  Impl(std::shared_ptr<torch::nn::Module> main, int n, std::vector<c10::Device> on = {}) : devices(std::move(on)) {
    replicas.push_back(std::move(main));
    if (!devices.empty()) replicas[0]->to(devices[0]);
    for (int k = 1; k < n; ++k) {
      replicas.push_back(replicas[0]->clone());
      if (!devices.empty()) replicas.back()->to(devices[static_cast<size_t>(k)]);
    }
    for (auto& r : replicas) {
      params.push_back(r->parameters());
      buffers.push_back(r->buffers());
    }
    for (int k = 1; k < n; ++k) {
      // clone() of a well-formed Cloneable module always matches; a hand-written clone() may not.
      DTRAIN_CHECK(params[k].size() == params[0].size() && buffers[k].size() == buffers[0].size(), InvalidArgument,
                   "DataParallel: clone() of the module has {} parameters and {} buffers, the module {} and {}",
                   params[k].size(), buffers[k].size(), params[0].size(), buffers[0].size());
    }
    assignReductions(n);
    pool = std::make_unique<WorkerPool>(n);
  }

  // Spreads the gradient sums over the threads, largest parameters first to the least loaded.
  void assignReductions(int n) {
    owned.assign(static_cast<size_t>(n), {});
    std::vector<size_t> order(params[0].size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return params[0][a].numel() > params[0][b].numel(); });
    std::vector<int64_t> load(static_cast<size_t>(n), 0);
    for (size_t j : order) {
      size_t t = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      owned[t].push_back(j);
      load[t] += params[0][j].numel();
    }
  }

  // Replica k <- main module. Replica k's stale gradients go too, so a step that failed midway
  // cannot leak them into the next one.
  void syncReplica(int k) {
    if (k == 0) return;
    torch::NoGradGuard no_grad;
    replicas[k]->train(replicas[0]->is_training());
    for (size_t j = 0; j < params[0].size(); ++j) {
      copyInto(params[k][j], params[0][j], deviceOf(k));
      params[k][j].mutable_grad().reset();
    }
    for (size_t j = 0; j < buffers[0].size(); ++j) copyInto(buffers[k][j], buffers[0][j], deviceOf(k));
  }

  // main.grad += sum of the replicas' gradients, for the parameters thread t owns.
  void reduceGradients(int t) {
    torch::NoGradGuard no_grad;
    for (size_t j : owned[static_cast<size_t>(t)]) {
      at::Tensor& acc = params[0][j].mutable_grad();
      for (size_t k = 1; k < replicas.size(); ++k) {
        at::Tensor& g = params[k][j].mutable_grad();
        if (!g.defined()) continue;  // unused by that replica's slice
        if (acc.defined())
          acc.add_(g.to(acc.device()));
        else
          acc = g.to(params[0][j].device(), g.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
        g.reset();  // frees the memory now rather than at the next sync
      }
    }
  }

  // Replica k's device when DataParallel was given devices, else unset (each replica where the main is).
  c10::optional<c10::Device> deviceOf(int k) const {
    if (devices.empty()) return c10::nullopt;
    return devices[static_cast<size_t>(k)];
  }

  std::vector<c10::Device> devices;                          // empty: every replica on the main's device
  std::vector<std::shared_ptr<torch::nn::Module>> replicas;  // [0] is the main module
  std::vector<std::vector<at::Tensor>> params;               // params[k][j]: parameter j of replica k
  std::vector<std::vector<at::Tensor>> buffers;
  std::vector<std::vector<size_t>> owned;                    // parameters whose sum thread t computes
  std::unique_ptr<WorkerPool> pool;                          // last: its threads stop before the rest goes
};

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, int num_replicas) {
  DTRAIN_CHECK(module != nullptr, InvalidArgument, "DataParallel: null module");
  DTRAIN_CHECK_GE(num_replicas, 1, "DataParallel: num_replicas");
  impl_ = std::make_unique<Impl>(std::move(module), num_replicas);
}

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, std::vector<c10::Device> devices) {
  DTRAIN_CHECK(module != nullptr, InvalidArgument, "DataParallel: null module");
  DTRAIN_CHECK(!devices.empty(), InvalidArgument, "DataParallel: no devices");
  const int n = static_cast<int>(devices.size());
  impl_ = std::make_unique<Impl>(std::move(module), n, std::move(devices));
}

DataParallel::~DataParallel() = default;

int DataParallel::numReplicas() const { return static_cast<int>(impl_->replicas.size()); }

torch::nn::Module& DataParallel::replica(int k) {
  DTRAIN_CHECK(k >= 0 && k < numReplicas(), InvalidArgument, "DataParallel: replica {} of {}", k, numReplicas());
  return *impl_->replicas[static_cast<size_t>(k)];
}

std::vector<int64_t> DataParallel::splitSizes(int64_t batch, int num_replicas) {
  DTRAIN_CHECK_GE(num_replicas, 1, "DataParallel::splitSizes: num_replicas");
  DTRAIN_CHECK_GE(batch, 0, "DataParallel::splitSizes: batch");
  std::vector<int64_t> sizes(static_cast<size_t>(num_replicas), batch / num_replicas);
  for (int64_t k = 0; k < batch % num_replicas; ++k) ++sizes[static_cast<size_t>(k)];
  return sizes;
}

void DataParallel::syncReplicas() {
  impl_->pool->run([this](int k) { impl_->syncReplica(k); });
}

at::Tensor DataParallel::step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn) {
  DTRAIN_CHECK(input.defined() && input.dim() >= 1, InvalidArgument,
               "DataParallel::step: input needs a batch dimension (dim 0)");
  const int64_t batch = input.size(0);
  DTRAIN_CHECK(batch > 0, InvalidArgument, "DataParallel::step: empty batch");
  if (target.defined()) {
    DTRAIN_CHECK(target.dim() >= 1 && target.size(0) == batch, InvalidArgument,
                 "DataParallel::step: target has shape [{}], input has {} rows", fmt::join(target.sizes(), ", "),
                 batch);
  }
  DTRAIN_CHECK(static_cast<bool>(loss_fn), InvalidArgument, "DataParallel::step: empty loss function");

  const int n = numReplicas();
  const std::vector<int64_t> sizes = splitSizes(batch, n);
  std::vector<int64_t> offsets(sizes.size(), 0);
  std::partial_sum(sizes.begin(), sizes.end() - 1, offsets.begin() + 1);

  // A phase of its own: replica 0 (the main module) may update its buffers in forward while the
  // others are still copying them.
  syncReplicas();

  std::vector<at::Tensor> losses(static_cast<size_t>(n));
  impl_->pool->run([&](int k) {
    const size_t ks = static_cast<size_t>(k);
    if (sizes[ks] == 0) return;
    at::Tensor x = input.narrow(0, offsets[ks], sizes[ks]);
    at::Tensor y = target.defined() ? target.narrow(0, offsets[ks], sizes[ks]) : at::Tensor();
    if (auto device = impl_->deviceOf(k)) {  // the slice goes to its replica's device
      x = x.to(*device);
      if (y.defined()) y = y.to(*device);
    }
    at::Tensor loss = loss_fn(*impl_->replicas[ks], x, y);
    DTRAIN_CHECK(loss.defined() && loss.numel() == 1, InvalidArgument,
                 "DataParallel::step: the loss function must return a scalar (the mean loss of its slice), "
                 "got {} on replica {}",
                 loss.defined() ? fmt::format("shape [{}]", fmt::join(loss.sizes(), ", ")) : "an undefined tensor",
                 k);
    // Weighting each slice's mean by its share of the batch makes the summed gradients those of
    // the mean over the batch.
    at::Tensor weighted = loss.reshape({}) * (static_cast<double>(sizes[ks]) / static_cast<double>(batch));
    weighted.backward();
    losses[ks] = weighted.detach();
  });

  impl_->pool->run([this](int t) { impl_->reduceGradients(t); });

  at::Tensor total;
  for (auto& l : losses)
    if (l.defined()) total = total.defined() ? total + l.to(total.device()) : l;
  return total;
}

}  // namespace dtrain
