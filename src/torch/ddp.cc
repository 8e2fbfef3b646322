// DistributedDataParallel (see ddp.h for the design): bucket layout, the synced backward pass and the
// buffer broadcast at its end. The comm hooks' continuation thread and the fp16/bf16 hooks are in
// ddp_hooks.cc, the join scope's shadow passes in join.cc.
#include "dtrain/ddp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <map>

#include "buckets.h"
#include "comm/trace/trace_internal.h"
#include "ddp_impl.h"
#include "dtrain/comm/error.h"
#include "dtrain/tensor.h"
#include "dtrain/zero.h"
#include "torch/device/tensor_comm.h"
#include "errors.h"
#include "grad_hook.h"

namespace dtrain {

using detail::Bucket;
using detail::Clock;

namespace timeline = comm::trace::timeline;

namespace {
double msBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The sequence number in a Work's description ("allreduce seq=41 f32 x 1024 avg"), or -1.
int64_t seqOf(const comm::Work& w) {
  const std::string& d = w.describe();
  auto at = d.find(" seq=");
  return at == std::string::npos ? -1 : std::atoll(d.c_str() + at + 5);
}
}  // namespace

void DistributedDataParallel::Impl::buildBuckets(const std::vector<size_t>& order) {
  buckets.clear();
  layout_order = order;
  bucket_of.assign(params.size(), 0);
  offset_of.assign(params.size(), 0);
  auto groups = detail::assignBuckets(params, order, {opts.bucket_bytes, opts.first_bucket_bytes, opts.last_bucket_bytes});
  for (size_t k = 0; k < groups.size(); ++k) {
    Bucket bk;
    int64_t numel = 0;
    for (size_t i : groups[k]) {
      bucket_of[i] = k;
      offset_of[i] = static_cast<size_t>(numel);
      numel += params[i].numel();
    }
    bk.gb.index = static_cast<int>(k);
    bk.gb.params = groups[k];
    bk.gb.flat = at::zeros({numel}, params[groups[k][0]].options().requires_grad(false));
    bk.gb.last = k + 1 == groups.size();
    toCommDType(bk.gb.flat.scalar_type(), "DDP gradient bucket");  // refuses a dtype that cannot travel
    buckets.push_back(std::move(bk));
    for (size_t i : groups[k]) {
      // An undefined gradient stays undefined (the optimizer skips it) until a gradient arrives.
      if (params[i].grad().defined()) adoptGrad(i);
      buckets.back().gb.grads.push_back(gradView(i));
    }
  }
}

// It aliases the bucket's storage without being an autograd view: libtorch's Optimizer::zero_grad()
// calls detach_() on gradients, which views do not allow.
at::Tensor DistributedDataParallel::Impl::gradView(size_t i) {
  const auto& p = params[i];
  const auto& flat = buckets[bucket_of[i]].gb.flat;
  at::Tensor alias = at::empty({0}, flat.options());
  alias.set_(flat.storage(), flat.storage_offset() + static_cast<int64_t>(offset_of[i]), p.sizes(),
             at::detail::defaultStrides(p.sizes()));
  return alias;
}

// An optimizer that set grads to none (or a user who replaced one) made autograd allocate a fresh
// tensor: move it in and point .grad() back at the bucket.
void DistributedDataParallel::Impl::adoptGrad(size_t i) {
  at::Tensor view = gradView(i);
  auto& g = params[i].mutable_grad();
  if (g.defined() && g.data_ptr() == view.data_ptr()) return;
  if (g.defined()) view.copy_(g);
  else view.zero_();
  g = view;
}

void DistributedDataParallel::Impl::startPass() {
  in_backward = true;
  if (tune.report.state == DDPTuning::State::probing) tune.pass_began = Clock::now();
  pass_start_us = timeline::on() ? comm::trace::nowUs() : 0;
  pass_start_bytes = comm::bytesSent();
  ready.assign(params.size(), 0);
  for (auto& b : buckets) {
    b.pending = b.gb.params.size();
    b.work.reset();
    b.ready_us = b.launched_us = 0;
  }
  next_launch = 0;
  any_launched = false;
  if (join) startHandshake(/*running=*/true);  // the first collective of the pass, before any bucket
  // Runs once the whole backward graph has executed: wait for the buckets there.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finishPass(); });
}

void DistributedDataParallel::Impl::onGradReady(size_t i, bool arrived) {
  if (opts.find_unused_parameters && arrived) unused.used[i] = 1;  // noSync passes too: the window decides
  if (!sync) return;
  if (!in_backward) startPass();
  // No gradient: unused in this pass, as a parameter whose node did not run (finishPass fills it in).
  if (opts.find_unused_parameters && !arrived) return;
  if (ready[i]) return;  // already counted in this pass
  adoptGrad(i);
  ready[i] = 1;
  if (synced_passes == 0) arrival.push_back(i);
  if (--buckets[bucket_of[i]].pending == 0) bucketReady(buckets[bucket_of[i]]);
  launchReady();
}

void DistributedDataParallel::Impl::bucketReady(Bucket& b) {
  if (timeline::on()) b.ready_us = comm::trace::nowUs();
}

// Launches complete buckets strictly in index order, so every rank issues the same sequence.
void DistributedDataParallel::Impl::launchReady() {
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launchBucket(buckets[next_launch++]);
}

void DistributedDataParallel::Impl::launchBucket(Bucket& b) {
  comm::IssueAndMoveOn move_on;  // backward goes on: the group's thread starts the bucket at once
  if (b.ready_us) b.launched_us = comm::trace::nowUs();
  if (!any_launched) {
    first_launch = Clock::now();
    any_launched = true;
  }
  if (!hook) {
    b.work = device::allreduce(*pg, b.gb.flat, comm::ReduceOp::avg);
    return;
  }
  b.gb.lane_ = hook_runner->open(b.gb.index, pg->rank(), hook->name(), chain_pg.get());
  struct Seal {  // also when run() throws: the hook thread must not wait for this bucket forever
    detail::HookLane& lane;
    ~Seal() { lane.seal(); }
  } seal{*b.gb.lane_};
  b.work = hook->run(*pg, b.gb);
  DTRAIN_CHECK(b.work != nullptr, InvalidArgument, "[rank {}] DDP comm hook '{}' returned no Work for bucket {}",
               pg->rank(), hook->name(), b.gb.index);
}

void DistributedDataParallel::Impl::finishPass() {
  auto end_backward = Clock::now();
  struct Reset {
    Impl* m;
    ~Reset() { m->in_backward = false; }
  } reset{this};
  std::vector<size_t> missing;
  for (size_t i = 0; i < params.size(); ++i)
    if (!ready[i]) missing.push_back(i);
  if (!missing.empty() && !opts.find_unused_parameters) {
    std::string list;
    for (size_t k = 0; k < missing.size() && k < 20; ++k) list += (k ? ", " : "") + names[missing[k]];
    if (missing.size() > 20) list += fmt::format(", ... ({} in all)", missing.size());
    std::string msg = fmt::format(
        "DistributedDataParallel: {} parameter(s) received no gradient in this backward pass: {}. If they "
        "are unused on purpose, set DDPOptions::find_unused_parameters = true.",
        missing.size(), list);
    // Peers may be waiting for this rank's next bucket: fail them now rather than at the timeout.
    // The abort runs after the buckets already launched; waiting for it (it "fails" by design)
    // makes sure the peers have been told before this rank unwinds, and perhaps exits.
    try {
      pg->abort(msg)->wait();
    } catch (const Error&) {
    }
    throw Error(fmt::format("[rank {}] {}", pg->rank(), msg));
  }
  if (opts.find_unused_parameters) keepIdleGradients();
  for (size_t i : missing) {
    adoptGrad(i);
    ready[i] = 1;
    if (--buckets[bucket_of[i]].pending == 0) bucketReady(buckets[bucket_of[i]]);
  }
  // Buckets not launched yet (those of unused parameters) go now. During backward only hooks launch.
  launchReady();
  if (opts.find_unused_parameters) startUsedExchange(/*joined=*/false);
  detail::Handshake h;
  h.running = h.max_running = 0;
  double scale = 1.0;
  if (join) {
    h = readHandshake();
    ++join->passes;
    if (!join->opts.divide_by_initial_world_size && h.running < pg->size()) scale = double(pg->size()) / h.running;
  }
  // Buffers are final once forward ran: rank 0's (under Join: the highest training rank's) go out now,
  // behind the buckets, so that every rank starts the next forward with them (what PyTorch's DDP
  // broadcasts at the start of that forward).
  Clock::time_point last = first_launch;
  try {
    auto buffer_works = startBufferBroadcast(h.max_running);
    completeBuckets(scale, &last);
    endBufferBroadcast(buffer_works, h.max_running);
    if (opts.find_unused_parameters) restoreUnusedEverywhere();
  } catch (const std::exception&) {
    if (join) throw;
    // The commonest cause in a training loop: ranks with different numbers of batches.
    detail::rethrowWithContext(fmt::format(
        "[rank {}] DistributedDataParallel: the gradient allreduce of this backward failed. If the ranks run different "
        "numbers of batches, train inside a dtrain::Join scope (dtrain/join.h). ",
        pg->rank()));
  }
  auto done = Clock::now();
  stats.comm_ms = msBetween(first_launch, last);
  stats.exposed_ms = std::max(0.0, msBetween(end_backward, done));
  stats.bytes_sent = comm::bytesSent() - pass_start_bytes;
  afterSyncedPass();
  if (pass_start_us && timeline::on()) timeline::span("backward", "compute", pass_start_us, comm::trace::nowUs());
  if (join && join->opts.throw_on_early_termination && h.running < pg->size())
    throw Error(earlyTerminationMessage(h));
}

void DistributedDataParallel::Impl::keepIdleGradients() {
  unused.idle.clear();
  unused.before.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    if (unused.used[i]) continue;
    const at::Tensor& g = params[i].grad();
    unused.idle.push_back(i);
    // A copy, not the tensor: the gradient may be the bucket's own slice, which the allreduce overwrites.
    unused.before.push_back(g.defined() ? g.detach().clone() : at::Tensor());
  }
}

void DistributedDataParallel::Impl::startUsedExchange(bool joined) {
  unused.flags.assign(params.size(), 0);
  if (!joined)
    for (size_t i = 0; i < params.size(); ++i) unused.flags[i] = unused.used[i] ? 1 : 0;
  if (pg->size() > 1)  // (one rank: unused here is unused everywhere)
    unused.exchange = pg->allreduce(unused.flags.data(), unused.flags.size(), comm::DType::i32, comm::ReduceOp::max);
}

void DistributedDataParallel::Impl::restoreUnusedEverywhere() {
  struct NewWindow {  // the next pass opens a new accumulation window, also when this one failed
    detail::UnusedState& u;
    ~NewWindow() {
      u.used.assign(u.used.size(), 0);
      u.idle.clear();
      u.before.clear();
      u.exchange.reset();
    }
  } next{unused};
  if (unused.exchange) unused.exchange->wait();
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < unused.idle.size(); ++k) {
    const size_t i = unused.idle[k];
    if (unused.flags[i]) continue;  // some rank used it: averaged with this rank's zeros, as it should
    if (!unused.before[k].defined()) {
      params[i].mutable_grad() = at::Tensor();  // no gradient, as in one process: the optimizer skips it
    } else {
      at::Tensor view = gradView(i);
      view.copy_(unused.before[k]);
      params[i].mutable_grad() = view;
    }
  }
}

void DistributedDataParallel::Impl::completeBuckets(double scale, Clock::time_point* last_done) {
  for (auto& b : buckets) {
    b.work->wait();
    if (last_done) *last_done = std::max(*last_done, b.work->finishedAt());
    if (scale != 1.0) b.gb.flat.mul_(scale);
    // From its last gradient to its allreduce's (or hook chain's) end, on its own track.
    if (b.ready_us && timeline::on()) {
      timeline::asyncSpan("bucket ", b.gb.index, "ddp", b.ready_us, comm::trace::usOf(b.work->finishedAt()),
                          {"bytes", b.gb.flat.numel() * b.gb.flat.element_size()},
                          {"params", static_cast<int64_t>(b.gb.params.size())},
                          {"launch_wait_us", b.launched_us - b.ready_us}, {"seq", seqOf(*b.work)});
    }
  }
}

void DistributedDataParallel::Impl::afterSyncedPass() {
  if (synced_passes++ == 0) {
    if (opts.rebuild_buckets && pg->size() > 1) rebuildFromArrival();
    startTuning();
  } else if (tune.report.state == DDPTuning::State::probing) {
    tuneAfterPass();
  }
}

// Rank 0's arrival order becomes everyone's bucket order (unused parameters last).
void DistributedDataParallel::Impl::rebuildFromArrival() {
  std::vector<int64_t> order(params.size());
  std::vector<char> seen(params.size(), 0);
  size_t k = 0;
  for (size_t i : arrival) {
    order[k++] = static_cast<int64_t>(i);
    seen[i] = 1;
  }
  for (size_t i = params.size(); i-- > 0;)
    if (!seen[i]) order[k++] = static_cast<int64_t>(i);
  pg->broadcast(order.data(), order.size(), comm::DType::i64, 0)->wait();
  std::vector<size_t> o(order.begin(), order.end());
  buildBuckets(o);
}

std::vector<comm::WorkPtr> DistributedDataParallel::Impl::startBufferBroadcast(int root) {
  std::vector<comm::WorkPtr> works;
  if (!opts.broadcast_buffers || buffers.empty() || pg->size() == 1) return works;
  torch::NoGradGuard no_grad;
  auto& pack = buffer_pack;
  for (size_t k = 0; k < pack.flats.size(); ++k) {
    auto& flat = pack.flats[k];
    if (pg->rank() == root) {
      int64_t off = 0;
      for (size_t i : pack.members[k]) {
        flat.narrow(0, off, buffers[i].numel()).copy_(buffers[i].reshape({-1}));
        off += buffers[i].numel();
      }
    }
    works.push_back(device::broadcast(*pg, flat, root));
  }
  return works;
}

void DistributedDataParallel::Impl::endBufferBroadcast(const std::vector<comm::WorkPtr>& works, int root) {
  for (auto& w : works) w->wait();
  if (works.empty() || pg->rank() == root) return;
  torch::NoGradGuard no_grad;
  auto& pack = buffer_pack;
  for (size_t k = 0; k < pack.flats.size(); ++k) {
    int64_t off = 0;
    for (size_t i : pack.members[k]) {
      buffers[i].copy_(pack.flats[k].narrow(0, off, buffers[i].numel()).view(buffers[i].sizes()));
      off += buffers[i].numel();
    }
  }
}

void DistributedDataParallel::Impl::broadcastFrom(int root, const std::vector<at::Tensor>& ts, const char* what) {
  if (pg->size() == 1) return;
  std::vector<comm::WorkPtr> works;
  for (const auto& t : ts) {
    device::checkTensor(t, what);
    works.push_back(device::broadcast(*pg, t, root));
  }
  for (auto& w : works) w->wait();
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 std::shared_ptr<comm::ProcessGroup> pg, DDPOptions options)
    : impl_(std::make_unique<Impl>()) {
  DTRAIN_CHECK(module != nullptr, InvalidArgument, "DistributedDataParallel: module is null");
  DTRAIN_CHECK(pg != nullptr, InvalidArgument, "DistributedDataParallel: process group is null");
  DTRAIN_CHECK(options.bucket_bytes > 0 && options.first_bucket_bytes > 0, InvalidArgument,
               "DistributedDataParallel: bucket sizes must be positive");
  DTRAIN_CHECK(options.tune_rounds >= 1, InvalidArgument, "DistributedDataParallel: tune_rounds must be >= 1, got {}",
               options.tune_rounds);
  Impl& m = *impl_;
  m.module = std::move(module);
  m.pg = std::move(pg);
  m.opts = options;
  m.tune.mode = detail::resolveTune(options.tune);
  // A weight shared by two submodules (tied) is listed under both names: it is one parameter, with its
  // first name.
  for (const auto& [name, p] : uniqueParameters(*m.module)) {
    if (!p.requires_grad()) continue;
    device::checkTensor(p, fmt::format("DDP parameter {}", name).c_str());
    if (!m.params.empty()) device::checkSameDevice(m.params[0], m.names[0], p, name, "DistributedDataParallel");
    m.params.push_back(p);
    m.names.push_back(name);
  }
  for (const auto& item : m.module->named_buffers(/*recurse=*/true)) {
    if (m.pg->size() > 1) device::checkTensor(item.value(), fmt::format("DDP buffer {}", item.key()).c_str());
    m.buffers.push_back(item.value());
  }
  std::map<c10::ScalarType, size_t> flat_of;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < m.buffers.size(); ++i) {
    auto t = m.buffers[i].scalar_type();
    if (!flat_of.count(t)) {
      flat_of[t] = m.buffer_pack.members.size();
      m.buffer_pack.members.emplace_back();
      numels.push_back(0);
    }
    m.buffer_pack.members[flat_of[t]].push_back(i);
    numels[flat_of[t]] += m.buffers[i].numel();
  }
  for (size_t k = 0; k < numels.size(); ++k)
    m.buffer_pack.flats.push_back(at::empty({numels[k]}, m.buffers[m.buffer_pack.members[k][0]].options()));
  // Every replica starts from rank 0's weights and buffers.
  {
    torch::NoGradGuard no_grad;
    m.broadcastFrom(0, m.params, "DDP parameter");
    m.broadcastFrom(0, m.buffers, "DDP buffer");
  }
  m.unused.used.assign(m.params.size(), 0);
  m.buildBuckets(detail::reverseOrder(m.params.size()));
  owner_ = std::make_shared<std::atomic<Impl*>>(impl_.get());
  for (size_t i = 0; i < m.params.size(); ++i) {
    // After the gradient accumulator: the gradient is in place.
    m.hook_keys.push_back(detail::addAccumulatorHook<Impl>(
        m.params[i], owner_, [i](Impl& impl, const at::Tensor&, bool arrived) { impl.onGradReady(i, arrived); },
        m.accumulators));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  owner_->store(nullptr);  // hooks that outlive us (the accumulators may) become no-ops
  for (size_t i = 0; i < impl_->accumulators.size(); ++i) impl_->accumulators[i]->del_post_hook(impl_->hook_keys[i]);
}

void DistributedDataParallel::beforeForward() {
  DTRAIN_CHECK(!impl_->join, InvalidArgument,
               "[rank {}] DistributedDataParallel::beforeForward() (or ddp.forward) inside a dtrain::Join scope: its "
               "broadcast is a collective a joined rank does not shadow. Under Join call model->forward() directly: "
               "buffers are broadcast at the end of every synced backward anyway",
               impl_->pg->rank());
  if (impl_->opts.broadcast_buffers) impl_->endBufferBroadcast(impl_->startBufferBroadcast(0), 0);
}

void DistributedDataParallel::setSync(bool on) { impl_->sync = on; }
void DistributedDataParallel::registerCommHook(std::shared_ptr<CommHook> hook) {
  auto& m = *impl_;
  DTRAIN_CHECK(!m.in_backward, InvalidArgument, "[rank {}] DistributedDataParallel::registerCommHook during backward",
               m.pg->rank());
  if (hook && hook->chainsCollectives() && !m.chain_pg) {
    std::vector<int> all(static_cast<size_t>(m.pg->size()));
    for (size_t r = 0; r < all.size(); ++r) all[r] = static_cast<int>(r);
    m.chain_pg = m.pg->newGroup(all);
    // Its path agreed and, for CUDA parameters, its NCCL communicator made now, not at the first step:
    // there the chained collectives start in continuations on the group's thread, and the first group's
    // kernels may be in flight (NCCL warns that making a communicator then can deadlock).
    if (!m.params.empty()) device::prepare(*m.chain_pg, m.params[0]);
  }
  if (hook && !m.hook_runner) m.hook_runner = std::make_unique<detail::HookRunner>();
  // A hook may keep state per bucket: the layout must not change under it.
  if (hook && m.tune.report.state == DDPTuning::State::probing) m.stopTuning("a comm hook was registered");
  m.hook = std::move(hook);
}
const std::vector<at::Tensor>& DistributedDataParallel::parameters() const { return impl_->params; }
const std::vector<std::string>& DistributedDataParallel::parameterNames() const { return impl_->names; }
comm::ProcessGroup& DistributedDataParallel::processGroup() const { return *impl_->pg; }
DistributedDataParallel::Stats DistributedDataParallel::lastStats() const { return impl_->stats; }
DDPTuning DistributedDataParallel::tuning() const {
  DDPTuning t = impl_->tune.report;
  t.bucket_bytes = impl_->opts.bucket_bytes;
  t.first_bucket_bytes = impl_->opts.first_bucket_bytes;
  return t;
}

std::vector<std::vector<size_t>> DistributedDataParallel::bucketLayout() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : impl_->buckets) out.push_back(b.gb.params);
  return out;
}

}  // namespace dtrain
