// ps::DistributedModule: see include/dtrain/ps_module.h.
#include "dtrain/ps_module.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <atomic>

#include "../buckets.h"
#include "../grad_hook.h"
#include "dtrain/comm/error.h"

namespace dtrain::ps {

struct DistributedModule::Impl {
  struct Bucket {
    std::string name;
    std::vector<size_t> params;
    std::vector<int64_t> offsets;  // element offset of each parameter in the bucket
    int64_t numel = 0;
    at::Tensor grads, values;      // flat float32
    at::Tensor used;               // u8 per element: 1 where this pass gave its parameter a gradient
    size_t ready = 0;
    comm::WorkPtr push, pull;
  };
  std::shared_ptr<torch::nn::Module> module;
  Worker* worker = nullptr;
  ModuleOptions opts;
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  std::vector<size_t> bucket_of, slot_of;  // per parameter
  std::vector<bool> seen;                  // per parameter, this pass
  std::vector<Bucket> buckets;
  // A post-hook on each parameter's gradient accumulator (as DDP's): it runs once per backward pass with
  // the gradient that flowed in, also when backward reaches the parameter through dtrain::recompute,
  // whose recomputation would run a tensor hook a second time.
  std::shared_ptr<std::atomic<Impl*>> owner;
  std::vector<compat::GradAccumulatorPtr> accumulators;
  std::vector<uintptr_t> hook_keys;
  bool pulls_pending = false;
  bool sum_only = false;
  // sum_only: how many workers gave each parameter a gradient in the step, summed by the servers as the
  // gradients are (PS tensor "<prefix>used"); a parameter no worker used keeps its .grad() as it was.
  std::string used_name;
  at::Tensor used_flags, used_counts;  // float32 per parameter: this worker's 0/1, then the sums

  // Parameter j of bucket b's slice of flat (its grads or values), shaped like the parameter.
  at::Tensor slice(const at::Tensor& flat, const Bucket& b, size_t j) const {
    const auto& p = params[b.params[j]];
    return flat.narrow(0, b.offsets[j], p.numel()).view(p.sizes());
  }

  void onGrad(size_t i, const at::Tensor& grad) {
    // No gradient (autograd can call a hook with none, e.g. through dtrain::recompute for a parameter the
    // segment did not use): the parameter is unused in this pass.
    if (!grad.defined()) return;
    DTRAIN_CHECK(!pulls_pending, InvalidArgument,
                 "ps::DistributedModule: backward before beforeForward(): the forward used parameters older than "
                 "the last step's update (parameter '{}')",
                 names[i]);
    Bucket& b = buckets[bucket_of[i]];
    DTRAIN_CHECK(!b.push, InvalidArgument,
                 "ps::DistributedModule: parameter '{}' got a gradient after its bucket {} was pushed (used twice "
                 "in one pass, or two backward passes in one step: call step() between them)",
                 names[i], bucket_of[i]);
    auto slot = slice(b.grads, b, slot_of[i]);
    auto g = grad.detach().to(at::kFloat);
    if (seen[i]) {
      slot.add_(g);
      return;
    }
    slot.copy_(g);
    seen[i] = true;
    slice(b.used, b, slot_of[i]).fill_(1);
    if (++b.ready == b.params.size()) b.push = worker->pushAsync(b.name, b.grads, b.used);
  }
};

DistributedModule::DistributedModule(std::shared_ptr<torch::nn::Module> module, Worker& worker,
                                     ModuleOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  DTRAIN_CHECK(module != nullptr, InvalidArgument, "ps::DistributedModule: no module");
  m.module = std::move(module);
  m.worker = &worker;
  m.opts = options;
  m.sum_only = worker.options().update == PSOptions::Update::sum_only;
  for (const auto& it : m.module->named_parameters()) {
    if (!it.value().requires_grad()) continue;
    DTRAIN_CHECK(it.value().device().is_cpu() && it.value().scalar_type() == at::kFloat, InvalidArgument,
                 "ps::DistributedModule: parameter '{}' must be float32 on the CPU", it.key());
    m.params.push_back(it.value());
    m.names.push_back(it.key());
  }
  DTRAIN_CHECK(!m.params.empty(), InvalidArgument, "ps::DistributedModule: the module has no trainable parameters");
  const size_t n = m.params.size();
  m.bucket_of.resize(n);
  m.slot_of.resize(n);
  m.seen.assign(n, false);
  // DDP's buckets: reverse registration order, a first bucket of first_bucket_bytes, then bucket_bytes.
  const size_t first = options.first_bucket_bytes ? options.first_bucket_bytes : options.bucket_bytes;
  for (auto& group : detail::assignBuckets(m.params, detail::reverseOrder(n), {options.bucket_bytes, first})) {
    auto& b = m.buckets.emplace_back();
    b.name = fmt::format("{}bucket{}", options.prefix, m.buckets.size() - 1);
    for (size_t k : group) {
      m.bucket_of[k] = m.buckets.size() - 1;
      m.slot_of[k] = b.params.size();
      b.params.push_back(k);
      b.offsets.push_back(b.numel);
      b.numel += m.params[k].numel();
    }
  }
  for (auto& b : m.buckets) {
    b.grads = at::zeros({b.numel}, at::kFloat);
    b.used = at::zeros({b.numel}, at::kByte);
    b.values = at::empty({b.numel}, at::kFloat);
    for (size_t j = 0; j < b.params.size(); ++j)
      m.slice(b.values, b, j).copy_(m.params[b.params[j]].detach());
    worker.declare(b.name, b.values);  // worker 0's values are stored
  }
  if (m.sum_only) {
    m.used_name = options.prefix + "used";
    m.used_flags = at::zeros({static_cast<int64_t>(n)}, at::kFloat);
    m.used_counts = at::zeros({static_cast<int64_t>(n)}, at::kFloat);
    worker.declare(m.used_name, m.used_counts);
  }
  // Every worker starts from worker 0's values.
  refresh();
  beforeForward();
  m.owner = std::make_shared<std::atomic<Impl*>>(impl_.get());
  for (size_t i = 0; i < n; ++i) {
    m.hook_keys.push_back(detail::addAccumulatorHook<Impl>(
        m.params[i], m.owner, [i](Impl& impl, const at::Tensor& grad, bool) { impl.onGrad(i, grad); },
        m.accumulators));
  }
}

DistributedModule::~DistributedModule() {
  auto& m = *impl_;
  if (m.owner) m.owner->store(nullptr);  // hooks that outlive us (the accumulators may) become no-ops
  for (size_t i = 0; i < m.accumulators.size(); ++i) m.accumulators[i]->del_post_hook(m.hook_keys[i]);
  // Operations still in flight read our buffers: let them finish (errors were or will be reported).
  for (auto& b : m.buckets) {
    for (auto* w : {&b.push, &b.pull}) {
      if (!*w) continue;
      try {
        (*w)->wait();
      } catch (...) {
      }
    }
  }
}

void DistributedModule::beforeForward() {
  auto& m = *impl_;
  if (!m.pulls_pending) return;
  torch::NoGradGuard no_grad;
  for (auto& b : m.buckets) {
    b.pull->wait();
    b.pull.reset();
    for (size_t j = 0; j < b.params.size(); ++j) {
      auto& p = m.params[b.params[j]];
      p.detach().copy_(m.slice(b.values, b, j));
    }
  }
  m.pulls_pending = false;
}

void DistributedModule::step() {
  auto& m = *impl_;
  DTRAIN_CHECK(!m.pulls_pending, InvalidArgument,
               "ps::DistributedModule: step() twice without beforeForward() in between");
  // Buckets with parameters that got no gradient in this pass: zeros for those, then push, with which
  // elements carry a gradient: an element that no worker's push carries is not updated (servers that
  // update) or keeps its .grad() (sum_only), as one process's optimizer skips a parameter without one.
  // A parameter without a gradient in this pass whose .grad() is defined (zeroed in place by zero_grad(),
  // 1.13's default and 2.x's zero_grad(false)) counts as used with a zero gradient, as in one process,
  // where the optimizer steps it (momentum, weight decay); an undefined one (2.x's zero_grad()) does not.
  std::vector<char> used(m.params.size());
  for (size_t i = 0; i < m.params.size(); ++i) used[i] = m.seen[i] || m.params[i].grad().defined();
  for (auto& b : m.buckets) {
    if (b.push) continue;
    for (size_t j = 0; j < b.params.size(); ++j) {
      size_t i = b.params[j];
      if (m.seen[i]) continue;
      m.slice(b.grads, b, j).zero_();
      if (used[i]) m.slice(b.used, b, j).fill_(1);
    }
    b.push = m.worker->pushAsync(b.name, b.grads, b.used);
  }
  comm::WorkPtr used_push;
  if (m.sum_only) {
    for (size_t i = 0; i < m.params.size(); ++i) m.used_flags[static_cast<int64_t>(i)] = used[i] ? 1.0f : 0.0f;
    used_push = m.worker->pushAsync(m.used_name, m.used_flags);
  }
  for (auto& b : m.buckets) {
    b.push->wait();
    b.push.reset();
    b.ready = 0;
    b.used.zero_();
  }
  if (used_push) used_push->wait();
  std::fill(m.seen.begin(), m.seen.end(), false);
  m.worker->clockAsync();
  for (auto& b : m.buckets) b.pull = m.worker->pullAsync(b.name, b.values);
  if (!m.sum_only) {
    m.pulls_pending = true;
    return;
  }
  // sum_only: the pulled sums become the mean gradients of the parameters some worker used.
  m.worker->pullAsync(m.used_name, m.used_counts)->wait();
  const int over = m.opts.average_over > 0 ? m.opts.average_over : m.worker->numProcesses();
  for (auto& b : m.buckets) {
    b.pull->wait();
    b.pull.reset();
    for (size_t j = 0; j < b.params.size(); ++j) {
      if (m.used_counts[static_cast<int64_t>(b.params[j])].item<float>() == 0) continue;
      auto& p = m.params[b.params[j]];
      auto g = m.slice(b.values, b, j) / static_cast<double>(over);
      if (p.grad().defined()) {
        p.mutable_grad().copy_(g);
      } else {
        p.mutable_grad() = g;
      }
    }
  }
}

void DistributedModule::refresh() {
  auto& m = *impl_;
  DTRAIN_CHECK(!m.pulls_pending, InvalidArgument, "ps::DistributedModule: refresh() with pulls pending");
  for (auto& b : m.buckets) b.pull = m.worker->pullAsync(b.name, b.values);
  m.pulls_pending = true;
}

size_t DistributedModule::numBuckets() const { return impl_->buckets.size(); }
const std::vector<size_t>& DistributedModule::bucketParams(size_t b) const { return impl_->buckets.at(b).params; }

std::vector<std::vector<size_t>> DistributedModule::bucketLayout() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : impl_->buckets) out.push_back(b.params);
  return out;
}

}  // namespace dtrain::ps
