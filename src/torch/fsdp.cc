// FullyShardedDataParallel (dtrain/fsdp.h): units of a Sequential whose parameters view one flat buffer
// per unit; the buffer's memory is released when the unit's parameters are not needed and allocated again
// (and filled by an allgather of the shards) before the unit's forward and its backward. Backward's
// gradient accumulators tell when a unit's gradients are complete; its reduce-scatters are issued in
// reverse unit order, so every rank issues the same sequence.
#include "dtrain/fsdp.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <unordered_map>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/recompute.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"
#include "torch/fsdp_impl.h"
#include "torch/grad_hook.h"
#include "torch/sharding.h"

namespace dtrain {
using fsdp_detail::Unit;

namespace {

// Children per unit: the caller's, or consecutive children until min_unit_params elements.
std::vector<int> childrenPerUnit(const torch::nn::Sequential& seq, const FsdpOptions& o) {
  const int n = static_cast<int>(seq->size());
  if (!o.units.empty()) {
    int sum = 0;
    for (int c : o.units) {
      DTRAIN_CHECK(c >= 1, InvalidArgument, "FSDP: a unit of {} children (each needs at least one)", c);
      sum += c;
    }
    DTRAIN_CHECK(sum == n, InvalidArgument, "FSDP: units cover {} children, the Sequential has {}", sum, n);
    return o.units;
  }
  DTRAIN_CHECK(o.min_unit_params >= 1, InvalidArgument, "FSDP: min_unit_params {} (must be positive)", o.min_unit_params);
  std::vector<int> out;
  int children = 0;
  int64_t numel = 0;
  for (int i = 0; i < n; ++i) {
    ++children;
    for (const auto& p : seq->ptr(static_cast<size_t>(i))->parameters()) numel += p.numel();
    if (numel >= o.min_unit_params || i + 1 == n) {
      out.push_back(children);
      children = 0;
      numel = 0;
    }
  }
  return out;
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(torch::nn::Sequential model, std::shared_ptr<comm::ProcessGroup> pg,
                                                   FsdpOptions o)
    : impl_(std::make_unique<Impl>()) {
  DTRAIN_CHECK(model.ptr() != nullptr, InvalidArgument, "FSDP: the model is null");
  DTRAIN_CHECK(pg != nullptr, InvalidArgument, "FSDP: process group is null");
  DTRAIN_CHECK(o.stage == 2 || o.stage == 3, InvalidArgument, "FSDP: stage {} (2 or 3; stage 1 is ZeroRedundancyOptimizer)",
               o.stage);
  Impl& m = *impl_;
  m.model = model;
  m.pg = std::move(pg);
  m.opts = o;
  const int world = m.pg->size(), rank = m.pg->rank();
  std::unordered_map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::unordered_map<const c10::TensorImpl*, bool> taken;
  at::Tensor first_param;  // every parameter on its device (m.device)
  int first = 0;
  for (int children : childrenPerUnit(model, o)) {
    Unit u;
    u.first = first;
    u.children = children;
    for (int c = first; c < first + children; ++c)
      for (const auto& p : model->ptr(static_cast<size_t>(c))->parameters())
        if (p.requires_grad() && !taken[p.unsafeGetTensorImpl()]) {
          taken[p.unsafeGetTensorImpl()] = true;
          device::checkTensor(p, fmt::format("FSDP parameter {}", name_of[p.unsafeGetTensorImpl()]).c_str());
          if (!first_param.defined()) first_param = p;
          device::checkSameDevice(first_param, name_of[first_param.unsafeGetTensorImpl()], p,
                                  name_of[p.unsafeGetTensorImpl()], "FullyShardedDataParallel");
          DTRAIN_CHECK(u.params.empty() || p.scalar_type() == u.params[0].scalar_type(), InvalidArgument,
                       "FSDP: unit {} mixes dtypes ({} is {}, {} is {}); keep one dtype per unit", m.units.size(),
                       u.names[0], c10::toString(u.params[0].scalar_type()), name_of[p.unsafeGetTensorImpl()],
                       c10::toString(p.scalar_type()));
          u.offsets.push_back(u.numel);
          u.numel += p.numel();
          u.params.push_back(p);
          u.names.push_back(name_of[p.unsafeGetTensorImpl()]);
        }
    first += children;
    m.units.push_back(std::move(u));
  }
  if (first_param.defined()) m.device = first_param.device();
  torch::NoGradGuard no_grad;
  for (auto& u : m.units) {
    const auto dtype = u.params.empty() ? at::kFloat : u.params[0].scalar_type();
    u.chunk = std::max<int64_t>(1, (u.numel + world - 1) / world);
    u.flat = at::zeros({u.chunk * world}, at::TensorOptions().dtype(dtype).device(m.device));
    u.bytes = u.flat.nbytes();
    for (size_t i = 0; i < u.params.size(); ++i) {
      auto view = u.flat.narrow(0, u.offsets[i], u.params[i].numel()).view(u.params[i].sizes());
      view.copy_(u.params[i]);
      u.params[i].set_data(view);
    }
    device::broadcast(*m.pg, u.flat, 0)->wait();
    u.shard = u.flat.narrow(0, rank * u.chunk, u.chunk).clone().requires_grad_(true);
    u.gathered = true;
    m.gathered_now += static_cast<int64_t>(u.bytes);
    m.release(u);
  }
  m.gathered_peak = m.transient_peak = 0;
  m.owner = std::make_shared<std::atomic<Impl*>>(impl_.get());
  for (size_t k = 0; k < m.units.size(); ++k) {
    auto& u = m.units[k];
    for (size_t i = 0; i < u.params.size(); ++i) {
      detail::addAccumulatorHook<Impl>(
          u.params[i], m.owner, [k, i](Impl& impl, const at::Tensor&, bool arrived) { impl.onGradReady(k, i, arrived); },
          u.accumulators);
    }
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  if (impl_ && impl_->owner) impl_->owner->store(nullptr);
}

at::Tensor FullyShardedDataParallel::forward(const at::Tensor& x) {
  Impl& m = *impl_;
  // Gathered values older than their shard (an optimizer step since) are gathered afresh.
  for (auto& u : m.units)
    if (u.gathered && u.version != u.shard._version()) m.release(u);
  const bool grad = at::GradMode::is_enabled();
  at::Tensor h = x;
  for (size_t k = 0; k < m.units.size(); ++k) {
    Unit& u = m.units[k];
    m.ensure(u);
    if (m.opts.prefetch && k + 1 < m.units.size()) m.startGather(m.units[k + 1]);
    const SegmentFn fn = childrenOf(m.model, u.first, u.first + u.children);
    h = m.opts.recompute ? recompute(fn, {h}, u.params)[0] : fn({h})[0];
    if (grad && h.requires_grad()) {
      auto owner = m.owner;
      h.register_hook([owner, k](const at::Tensor& g) {
        if (auto* mm = owner->load()) mm->onPreBackward(k);
        return g;
      });
    }
    if (m.opts.stage == 3 || !grad) m.release(u);  // (no backward will need them)
  }
  return h;
}

void FullyShardedDataParallel::Impl::startPass() {
  in_backward = true;
  next_launch = static_cast<int>(units.size()) - 1;
  for (auto& u : units) {
    u.ready.assign(u.params.size(), 0);
    u.pending = u.params.size();
    u.reducing.reset();
  }
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finishPass(); });
}

void FullyShardedDataParallel::Impl::onPreBackward(size_t k) {
  if (!in_backward) startPass();
  Unit& u = units[k];
  ensure(u);
  if (opts.prefetch && k > 0) startGather(units[k - 1]);
  // A synced pass whose gradients start from nothing: autograd accumulates them straight into a pooled
  // buffer, which is then reduce-scattered as it is (no allocation, no copy). Without prefetch (at most
  // two units' buffers) autograd's own gradient tensors are kept instead and copied into the buffer the
  // parameters leave: a pooled gradient buffer would be a third unit beside autograd's temporaries.
  bool fresh = opts.prefetch && sync && !u.grad_flat.defined();
  for (const auto& p : u.params) fresh = fresh && !p.grad().defined();
  if (!fresh || u.params.empty()) return;
  u.grad_flat = borrow(u.bytes).view(u.shard.scalar_type()).zero_();
  for (size_t i = 0; i < u.params.size(); ++i)
    u.params[i].mutable_grad() = u.grad_flat.narrow(0, u.offsets[i], u.params[i].numel()).view(u.params[i].sizes());
  u.grads_in_buf = true;
}

void FullyShardedDataParallel::Impl::onGradReady(size_t k, size_t i, bool arrived) {
  if (!in_backward) startPass();
  Unit& u = units[k];
  if (arrived) u.used = true;
  if (u.ready[i]) return;
  u.ready[i] = 1;
  if (--u.pending == 0) launchReady();
}

void FullyShardedDataParallel::Impl::launchReady() {
  while (next_launch >= 0 && units[static_cast<size_t>(next_launch)].pending == 0) {
    Unit& u = units[static_cast<size_t>(next_launch--)];
    release(u);  // its backward is done
    if (!sync) continue;
    // One reduce-scatter in flight at a time: the previous unit's gradient buffer goes first. Without
    // prefetch none overlaps the next unit's backward, whose gradients would be a unit more.
    if (next_launch + 2 < static_cast<int>(units.size())) completeReduce(units[static_cast<size_t>(next_launch + 2)]);
    reduceScatter(u);
    if (!opts.prefetch) completeReduce(u);
  }
}

void FullyShardedDataParallel::Impl::completeReduce(Unit& u) {
  if (!u.reducing) return;
  u.reducing->wait();
  u.reducing.reset();
  u.reduced = u.grad_part;  // (reduced into a tensor of its own, see reduceScatter)
  at::Tensor bytes = u.grad_flat.view(at::kByte);
  u.grad_flat = at::Tensor();
  giveBack(bytes);
  u.grad_part = at::Tensor();
}

void FullyShardedDataParallel::Impl::applyUsedUnits() {
  std::vector<int32_t> used(units.size());
  for (size_t k = 0; k < units.size(); ++k) used[k] = units[k].used ? 1 : 0;
  // Every rank, after the same reduce-scatters; one rank: used here is used anywhere.
  if (pg->size() > 1) pg->allreduce(used.data(), used.size(), comm::DType::i32, comm::ReduceOp::max)->wait();
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < units.size(); ++k) {
    Unit& u = units[k];
    u.used = false;  // the next pass opens a new window
    at::Tensor part = std::move(u.reduced);
    u.reduced = at::Tensor();
    if (!used[k] || !part.defined()) continue;
    auto& g = u.shard.mutable_grad();
    if (!g.defined()) g = part;
    else g.add_(part);
  }
}

void FullyShardedDataParallel::Impl::reduceScatter(Unit& u) {
  if (!u.grads_in_buf) {  // gradients accumulated by autograd itself (noSync passes before): copied in
    int64_t param_grads = 0;
    for (const auto& p : u.params)
      if (p.grad().defined()) param_grads += static_cast<int64_t>(p.grad().nbytes());
    transient_peak = std::max(transient_peak, pool_bytes + param_grads);
    u.grad_flat = borrow(u.bytes).view(u.shard.scalar_type()).zero_();
    for (size_t i = 0; i < u.params.size(); ++i) {
      const auto& g = u.params[i].grad();
      if (g.defined()) u.grad_flat.narrow(0, u.offsets[i], u.params[i].numel()).copy_(g.reshape(-1));
    }
  }
  for (auto& p : u.params) p.mutable_grad().reset();
  u.grads_in_buf = false;
  u.grad_part = at::empty({u.chunk}, u.grad_flat.options());  // becomes the shard's gradient if it has none
  // (grad_flat may be longer than the unit's padded size: the first chunk x world elements are scattered.)
  u.reducing = device::reduceScatter(*pg, u.grad_flat.narrow(0, 0, u.chunk * pg->size()), u.grad_part,
                                     comm::ReduceOp::avg);
}

void FullyShardedDataParallel::Impl::finishPass() {
  struct Reset {
    Impl* m;
    ~Reset() { m->in_backward = false; }
  } reset{this};
  for (auto& u : units) u.pending = 0;  // parameters without a gradient in this pass: zeros
  launchReady();
  for (auto& u : units) completeReduce(u);
  if (sync) applyUsedUnits();
}

std::vector<at::Tensor> FullyShardedDataParallel::shards() const {
  std::vector<at::Tensor> out;
  for (const auto& u : impl_->units) out.push_back(u.shard);
  return out;
}

double FullyShardedDataParallel::clipGradNorm(double max_norm) {
  const auto mine = shards();
  return clipGradNormAcross(*impl_->pg, mine, mine, max_norm, "FSDP::clipGradNorm");
}

FullyShardedDataParallel::NoSync::NoSync(FullyShardedDataParallel* f) : f_(f) { f_->impl_->sync = false; }
FullyShardedDataParallel::NoSync::~NoSync() { f_->impl_->sync = true; }

std::map<std::string, at::Tensor> FullyShardedDataParallel::fullState() {
  Impl& m = *impl_;
  std::map<std::string, at::Tensor> out;
  torch::NoGradGuard no_grad;
  for (auto& u : m.units) {
    const bool was = u.gathered;
    m.ensure(u);
    for (size_t i = 0; i < u.params.size(); ++i) out[u.names[i]] = u.params[i].detach().clone();
    if (!was) m.release(u);
  }
  return out;
}

std::vector<int> FullyShardedDataParallel::unitSizes() const {
  std::vector<int> out;
  for (const auto& u : impl_->units) out.push_back(u.children);
  return out;
}

FullyShardedDataParallel::Memory FullyShardedDataParallel::memory() const {
  Memory out;
  for (const auto& u : impl_->units) {
    out.shard_parameters += static_cast<int64_t>(u.shard.nbytes());
    if (u.shard.grad().defined()) out.shard_gradients += static_cast<int64_t>(u.shard.grad().nbytes());
  }
  out.gathered_now = impl_->gathered_now;
  out.gathered_peak = impl_->gathered_peak;
  out.transient_peak = impl_->transient_peak;
  return out;
}

}  // namespace dtrain
