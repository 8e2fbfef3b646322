// The parameter-server Worker: Work, the communication thread, construction, declarations and the
// calling thread's side of each operation (the network side is in worker_net.cc, checkpoint state in
// state_io.cc).
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "dtrain/trace.h"
#include "worker_impl.h"

namespace dtrain::ps {

// ------------------------------------------------------------------------------------------------
// The Worker's communication thread
// ------------------------------------------------------------------------------------------------

// Runs the Worker's operations in issue order. After one failed, the later ones fail with its error.
struct Worker::Impl::Thread {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<comm::WorkPtr, std::function<void()>>> queue;
  bool stop = false;
  std::exception_ptr sticky;  // the thread's own
  std::thread thread;

  void loop() {
    for (;;) {
      std::pair<comm::WorkPtr, std::function<void()>> job;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
      }
      std::exception_ptr err;
      if (sticky) {
        try {
          std::rethrow_exception(sticky);
        } catch (const std::exception& e) {
          err = sameType(e, fmt::format("{} not run: an earlier operation failed: {}", job.first->describe(), e.what()));
        }
      } else {
        try {
          job.second();
        } catch (...) {
          err = std::current_exception();
          sticky = err;
        }
      }
      job.first->finish(err);
    }
  }
};

comm::WorkPtr Worker::Impl::submit(std::string what, std::function<void()> fn) {
  auto w = std::make_shared<comm::Work>(fmt::format("[worker {}] {}", rank_, what),
                                       std::chrono::steady_clock::now() + deadlines_.operation, rank_);
  {
    std::lock_guard<std::mutex> lk(thread_->mu);
    thread_->queue.emplace_back(w, std::move(fn));
  }
  thread_->cv.notify_one();
  return w;
}

// ------------------------------------------------------------------------------------------------
// Worker: construction, declarations, the calling thread's side of each operation
// ------------------------------------------------------------------------------------------------

namespace {
void checkWorkerOptions(int num_servers, const PSOptions& opts, const std::shared_ptr<comm::Store>& store) {
  DTRAIN_CHECK(num_servers >= 1, InvalidArgument, "ps::Worker: {} servers", num_servers);
  DTRAIN_CHECK(opts.staleness >= 0, InvalidArgument, "ps: staleness {} < 0", opts.staleness);
  DTRAIN_CHECK(store != nullptr, InvalidArgument, "ps::Worker: no store");
}
}  // namespace

Worker::Impl::Impl(std::shared_ptr<comm::Store> store, int rank, int num_workers, int num_servers, PSOptions opts)
    : rank_(rank), num_workers_(num_workers), num_servers_(num_servers), opts_(opts), deadlines_(deadlines(opts)) {
  DTRAIN_CHECK(num_workers >= 1 && rank >= 0 && rank < num_workers, InvalidArgument,
               "ps::Worker: rank {} of {} workers", rank, num_workers);
  checkWorkerOptions(num_servers, opts, store);
  load_.assign(static_cast<size_t>(num_servers), 0);
  connect(store);
  startThread();
}

Worker::Impl::Impl(std::shared_ptr<comm::Store> store, LocalAggregation agg, int num_servers, PSOptions opts)
    : rank_(agg.node),
      num_workers_(agg.num_nodes),
      num_servers_(num_servers),
      opts_(opts),
      deadlines_(deadlines(opts)) {
  DTRAIN_CHECK(agg.local != nullptr, InvalidArgument, "ps::Worker: local aggregation without a local group");
  DTRAIN_CHECK(agg.num_nodes >= 1 && agg.node >= 0 && agg.node < agg.num_nodes, InvalidArgument,
               "ps::Worker: node {} of {} nodes", agg.node, agg.num_nodes);
  checkWorkerOptions(num_servers, opts, store);
  load_.assign(static_cast<size_t>(num_servers), 0);
  std::vector<int> all(static_cast<size_t>(agg.local->size()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
  // A group of its own: the Worker's thread issues collectives on it while the user may use agg.local.
  local_ = agg.local->newGroup(all);
  if (local_->rank() == 0) connect(store);
  startThread();
}

void Worker::Impl::startThread() {
  thread_ = std::make_unique<Thread>();
  thread_->thread = std::thread([t = thread_.get()] {
    trace::setThreadName("ps worker");
    t->loop();
  });
}

void Worker::Impl::connect(const std::shared_ptr<comm::Store>& store) {
  auto gopts = groupOptions(deadlines_.worker_io);
  for (int s = 0; s < num_servers_; ++s) {
    auto c = std::make_unique<Conn>();
    c->server = s;
    try {
      c->pg = ProcessGroup::create(pairStore(store, rank_, s), 0, 2, gopts);
    } catch (...) {
      rethrowWithContext(fmt::format("[worker {}] connecting to server {}: ", rank_, s));
    }
    conns_.push_back(std::move(c));
  }
}

Worker::Impl::~Impl() {
  try {
    finish();
  } catch (...) {
  }
  if (thread_) {
    {
      std::lock_guard<std::mutex> lk(thread_->mu);
      thread_->stop = true;
    }
    thread_->cv.notify_all();
    thread_->thread.join();
  }
}

const Entry& Worker::Impl::entry(const std::string& name, bool sparse) const {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: '{}' used after finish()", name);
  auto it = entries_.find(name);
  DTRAIN_CHECK(it != entries_.end(), InvalidArgument, "ps: '{}' was not declared", name);
  DTRAIN_CHECK(it->second.sparse == sparse, InvalidArgument, "ps: '{}' is a {} tensor", name,
               it->second.sparse ? "sparse (declareRows)" : "dense (declare)");
  return it->second;
}

void Worker::Impl::declare(const std::string& name, const at::Tensor& init) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: declare after finish()");
  DTRAIN_CHECK(!entries_.count(name), InvalidArgument, "ps: '{}' declared twice", name);
  auto t = floatCpu(init, "initial value");
  DTRAIN_CHECK(t.numel() > 0, InvalidArgument, "ps: '{}' is empty", name);
  Entry e;
  e.numel = t.numel();
  const int64_t limit = partLimit(opts_);
  const int64_t nparts = (e.numel + limit - 1) / limit;
  int64_t off = 0;
  for (int64_t i = 0; i < nparts; ++i) {
    int64_t count = e.numel / nparts + (i < e.numel % nparts ? 1 : 0);
    int s = static_cast<int>(std::min_element(load_.begin(), load_.end()) - load_.begin());
    load_[static_cast<size_t>(s)] += count * 4;
    e.parts.push_back(Part{next_key_++, s, off, count});
    off += count;
  }
  entries_.emplace(name, e);
  submit(fmt::format("declare '{}'", name), [this, e, t] {
    if (connected()) netDeclare(e, t);
  })->wait();
}

void Worker::Impl::declareRows(const std::string& name, int64_t num_rows, int64_t dim) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: declareRows after finish()");
  DTRAIN_CHECK(!entries_.count(name), InvalidArgument, "ps: '{}' declared twice", name);
  DTRAIN_CHECK(num_rows > 0 && dim > 0, InvalidArgument, "ps: table '{}' of {} x {}", name, num_rows, dim);
  DTRAIN_CHECK(dim <= partLimit(opts_), InvalidArgument, "ps: table '{}' rows of {} floats exceed partition_bytes",
               name, dim);
  DTRAIN_CHECK(num_rows / num_servers_ < INT32_MAX, InvalidArgument,
               "ps: table '{}' of {} rows: more than 2^31 rows per server", name, num_rows);
  Entry e;
  e.sparse = true;
  e.num_rows = num_rows;
  e.dim = dim;
  e.key = next_key_++;
  entries_.emplace(name, e);
  submit(fmt::format("declareRows '{}'", name), [this, e] {
    if (connected()) netDeclareRows(e);
  })->wait();
}

// Where a pull lands: `out` itself on the CPU; for a CUDA `out`, a host tensor copied into it once the pull
// is done (the parameter server's messages travel through the host).
static at::Tensor hostFor(const at::Tensor& out) {
  return out.device().is_cpu() ? out : at::empty(out.sizes(), out.options().device(at::kCPU));
}

static bool cpuOrCuda(const at::Tensor& t) { return t.device().is_cpu() || t.device().is_cuda(); }

// The row ids on the host, checked against the table.
at::Tensor checkRows(const at::Tensor& rows, const Entry& e, const std::string& name) {
  DTRAIN_CHECK(rows.defined() && rows.dim() == 1 && rows.scalar_type() == at::kLong && cpuOrCuda(rows),
               InvalidArgument, "ps: rows of '{}' must be a 1-d int64 CPU or CUDA tensor", name);
  auto r = rows.to(at::kCPU).contiguous();
  const int64_t* ids = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i) {
    DTRAIN_CHECK(ids[i] >= 0 && ids[i] < e.num_rows, InvalidArgument, "ps: row {} of '{}' out of range [0, {})",
                 ids[i], name, e.num_rows);
  }
  return r;
}

comm::WorkPtr Worker::Impl::pushAsync(const std::string& name, const at::Tensor& grad, const at::Tensor& used) {
  const auto& e = entry(name, false);
  auto g = floatCpu(grad, "gradient");
  DTRAIN_CHECK_EQ(g.numel(), e.numel, fmt::format("ps: push '{}': numel", name));
  at::Tensor u;
  if (used.defined()) {
    DTRAIN_CHECK(used.device().is_cpu() && (used.scalar_type() == at::kByte || used.scalar_type() == at::kBool),
                 InvalidArgument, "ps: push '{}': `used` must be a uint8 or bool CPU tensor, got {} on {}", name,
                 c10::toString(used.scalar_type()), used.device().str());
    DTRAIN_CHECK_EQ(used.numel(), e.numel, fmt::format("ps: push '{}': numel of `used`", name));
    u = used.reshape({-1}).ne(0).to(at::kByte).contiguous();
  }
  const int c = clock_;
  return submit(fmt::format("push '{}'", name), [this, &e, g, u, c] {
    DTRAIN_SPAN("ps push", "ps");
    if (!local_) return netPush(e, g, c, u);
    auto sum = localSum(*local_, g, opts_);
    auto any = u.defined() ? localUsed(*local_, u) : at::Tensor();
    if (connected()) netPush(e, sum, c, any);
  });
}

comm::WorkPtr Worker::Impl::pullAsync(const std::string& name, at::Tensor out) {
  const auto& e = entry(name, false);
  DTRAIN_CHECK(out.defined() && cpuOrCuda(out) && out.scalar_type() == at::kFloat && out.is_contiguous(),
               InvalidArgument, "ps: pull '{}': out must be a contiguous float32 CPU or CUDA tensor", name);
  DTRAIN_CHECK_EQ(out.numel(), e.numel, fmt::format("ps: pull '{}': numel", name));
  const int c = clock_;
  return submit(fmt::format("pull '{}'", name), [this, &e, out, host = hostFor(out), c] {
    DTRAIN_SPAN("ps pull", "ps");
    if (connected()) netPull(e, nullptr, host, c);
    if (local_) local_->broadcast(host.data_ptr<float>(), static_cast<size_t>(e.numel), DType::f32, 0)->wait();
    if (!host.is_same(out)) out.copy_(host);
  });
}

comm::WorkPtr Worker::Impl::pushPullAsync(const std::string& name, const at::Tensor& grad, at::Tensor out) {
  const auto& e = entry(name, false);
  auto g = floatCpu(grad, "gradient");
  DTRAIN_CHECK_EQ(g.numel(), e.numel, fmt::format("ps: pushPull '{}': numel", name));
  DTRAIN_CHECK(out.defined() && cpuOrCuda(out) && out.scalar_type() == at::kFloat && out.is_contiguous(),
               InvalidArgument, "ps: pushPull '{}': out must be a contiguous float32 CPU or CUDA tensor", name);
  DTRAIN_CHECK_EQ(out.numel(), e.numel, fmt::format("ps: pushPull '{}': numel", name));
  const int c = clock_;
  return submit(fmt::format("pushPull '{}'", name), [this, &e, g, out, host = hostFor(out), c] {
    DTRAIN_SPAN("ps pushpull", "ps");
    if (!local_) {
      netPull(e, &g, host, c);
    } else {
      auto sum = localSum(*local_, g, opts_);
      if (connected()) netPull(e, &sum, host, c);
      local_->broadcast(host.data_ptr<float>(), static_cast<size_t>(e.numel), DType::f32, 0)->wait();
    }
    if (!host.is_same(out)) out.copy_(host);
  });
}

comm::WorkPtr Worker::Impl::clockAsync() {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: clock after finish()");
  const int c = ++clock_;
  return submit(fmt::format("clock {}", c), [this, c] {
    if (connected()) netClock(0, c);
  });
}

comm::WorkPtr Worker::Impl::pushRowsAsync(const std::string& name, const at::Tensor& rows, const at::Tensor& grads) {
  const auto& e = entry(name, true);
  auto ids = checkRows(rows, e, name);
  auto g = floatCpu(grads, "row gradients");
  DTRAIN_CHECK(g.dim() == 2 && g.size(0) == rows.numel() && g.size(1) == e.dim, InvalidArgument,
               "ps: pushRows '{}': grads must be [{}, {}]", name, rows.numel(), e.dim);
  const int c = clock_;
  return submit(fmt::format("pushRows '{}'", name), [this, &e, ids, g, c] {
    DTRAIN_SPAN("ps push", "ps");
    if (!local_) return netPushRows(e, ids, g, c);
    at::Tensor all_ids, all_g;
    localRows(*local_, ids, &g, e.dim, all_ids, &all_g);
    if (connected()) netPushRows(e, all_ids, all_g, c);
  });
}

at::Tensor Worker::Impl::pullRows(const std::string& name, const at::Tensor& rows) {
  const auto& e = entry(name, true);
  auto out = at::empty({rows.numel(), e.dim}, at::TensorOptions().dtype(at::kFloat).device(rows.device()));
  pullRowsAsync(name, rows, out)->wait();
  return out;
}

comm::WorkPtr Worker::Impl::pullRowsAsync(const std::string& name, const at::Tensor& rows, at::Tensor out) {
  const auto& e = entry(name, true);
  auto ids = checkRows(rows, e, name);
  DTRAIN_CHECK(out.defined() && cpuOrCuda(out) && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                   out.dim() == 2 && out.size(0) == rows.numel() && out.size(1) == e.dim,
               InvalidArgument, "ps: pullRows '{}': out must be a contiguous float32 CPU or CUDA tensor [{}, {}]", name,
               rows.numel(), e.dim);
  const int c = clock_;
  return submit(fmt::format("pullRows '{}'", name), [this, &e, ids, out, host = hostFor(out), c] {
    DTRAIN_SPAN("ps pull", "ps");
    if (!local_) {
      netPullRows(e, ids, host, c);
    } else {
      at::Tensor all_ids;
      int64_t offset = localRows(*local_, ids, nullptr, e.dim, all_ids, nullptr);
      auto values = at::empty({all_ids.numel(), e.dim}, at::kFloat);
      if (connected()) netPullRows(e, all_ids, values, c);
      local_->broadcast(values.data_ptr<float>(), static_cast<size_t>(values.numel()), DType::f32, 0)->wait();
      host.copy_(values.narrow(0, offset, ids.numel()));
    }
    if (!host.is_same(out)) out.copy_(host);
  });
}

void Worker::Impl::finish() {
  if (finished_) return;
  finished_ = true;
  if (!thread_) return;
  submit("finish", [this] {
    if (connected()) netFinish();
  })->wait();
}

// ------------------------------------------------------------------------------------------------
// Worker: the public API, forwarded to its Impl
// ------------------------------------------------------------------------------------------------

Worker::Worker(std::shared_ptr<comm::Store> store, int rank, int num_workers, int num_servers, PSOptions opts)
    : impl_(std::make_unique<Impl>(std::move(store), rank, num_workers, num_servers, opts)) {}
Worker::Worker(std::shared_ptr<comm::Store> store, LocalAggregation agg, int num_servers, PSOptions opts)
    : impl_(std::make_unique<Impl>(std::move(store), std::move(agg), num_servers, opts)) {}
Worker::~Worker() = default;

void Worker::declare(const std::string& name, const at::Tensor& init) { impl_->declare(name, init); }
void Worker::declareRows(const std::string& name, int64_t num_rows, int64_t dim) {
  impl_->declareRows(name, num_rows, dim);
}
void Worker::push(const std::string& name, const at::Tensor& grad) { impl_->pushAsync(name, grad)->wait(); }
void Worker::pull(const std::string& name, at::Tensor& out) { impl_->pullAsync(name, out)->wait(); }
void Worker::pushPull(const std::string& name, const at::Tensor& grad, at::Tensor& out) {
  impl_->pushPullAsync(name, grad, out)->wait();
}
void Worker::clock() { impl_->clockAsync()->wait(); }
int Worker::clockValue() const { return impl_->clock_; }
void Worker::pushRows(const std::string& name, const at::Tensor& rows, const at::Tensor& grads) {
  impl_->pushRowsAsync(name, rows, grads)->wait();
}
at::Tensor Worker::pullRows(const std::string& name, const at::Tensor& rows) { return impl_->pullRows(name, rows); }
comm::WorkPtr Worker::pushAsync(const std::string& name, const at::Tensor& grad) {
  return impl_->pushAsync(name, grad);
}

comm::WorkPtr Worker::pushAsync(const std::string& name, const at::Tensor& grad, const at::Tensor& used) {
  return impl_->pushAsync(name, grad, used);
}
comm::WorkPtr Worker::pullAsync(const std::string& name, at::Tensor out) { return impl_->pullAsync(name, out); }
comm::WorkPtr Worker::pushPullAsync(const std::string& name, const at::Tensor& grad, at::Tensor out) {
  return impl_->pushPullAsync(name, grad, out);
}
comm::WorkPtr Worker::clockAsync() { return impl_->clockAsync(); }
comm::WorkPtr Worker::pushRowsAsync(const std::string& name, const at::Tensor& rows, const at::Tensor& grads) {
  return impl_->pushRowsAsync(name, rows, grads);
}
comm::WorkPtr Worker::pullRowsAsync(const std::string& name, const at::Tensor& rows, at::Tensor out) {
  return impl_->pullRowsAsync(name, rows, out);
}
std::map<std::string, at::Tensor> Worker::saveState() { return impl_->saveState(); }
void Worker::loadState(const std::map<std::string, at::Tensor>& state) { impl_->loadState(state); }
int64_t Worker::bytesSent() const { return impl_->sent_.load(); }
int64_t Worker::bytesReceived() const { return impl_->received_.load(); }
void Worker::finish() { impl_->finish(); }
int Worker::rank() const { return impl_->rank_; }
int Worker::numWorkers() const { return impl_->num_workers_; }
int Worker::numProcesses() const {
  return impl_->local_ ? impl_->num_workers_ * impl_->local_->size() : impl_->num_workers_;
}
int Worker::numServers() const { return impl_->num_servers_; }
bool Worker::connected() const { return impl_->connected(); }
const PSOptions& Worker::options() const { return impl_->opts_; }

}  // namespace dtrain::ps
