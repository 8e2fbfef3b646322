// Parameter server: see include/dtrain/ps.h for the model, the protocol and the consistency rules.
//
// Layout of this file: the wire header and error helpers; the Worker (partitioning, requests, replies);
// the Server (one thread per worker connection, shared partition state under one mutex + condition
// variable, the optimizer updates); the environment helpers.
#include "dtrain/ps.h"

#include "dtrain/comm/rendezvous.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>

#include "dtrain/comm/error.h"
#include "errors.h"

namespace dtrain::ps {
namespace {

using comm::DType;
using comm::ProcessGroup;
using comm::WorkPtr;
using Clock = std::chrono::steady_clock;
using detail::rethrowWithContext;
using detail::sameType;

constexpr uint32_t kMagic = 0x50535631;  // "PSV1"
enum Op : uint16_t {
  kDeclare = 1,
  kDeclareRows = 2,
  kPush = 3,
  kPull = 4,
  kPushPull = 5,
  kPushRows = 6,
  kPullRows = 7,
  kClock = 8,
  kBye = 9,
  kGetState = 10,
  kSetState = 11,
  kAck = 20,
  kValues = 21,
  kError = 22,
};
constexpr uint16_t kFlagInit = 1;  // declare: this worker sends the initial values
constexpr uint16_t kFlagRows = 2;  // get/set state: of a sparse table
constexpr uint16_t kFlagSet = 4;   // clock: set to this value (restore), not advance
constexpr int64_t kMaxErrorBytes = 4096;

struct Header {
  uint32_t magic = kMagic;
  uint16_t op = 0;
  uint16_t flags = 0;
  uint32_t key = 0;
  int32_t clock = 0;
  int64_t count = 0;
  int64_t row_dim = 0;
  int64_t aux = 0;
};
static_assert(sizeof(Header) == kHeaderBytes, "wire header size");

const char* opName(uint16_t op) {
  switch (op) {
    case kDeclare: return "declare";
    case kDeclareRows: return "declareRows";
    case kPush: return "push";
    case kPull: return "pull";
    case kPushPull: return "pushPull";
    case kPushRows: return "pushRows";
    case kPullRows: return "pullRows";
    case kClock: return "clock";
    case kBye: return "goodbye";
    case kGetState: return "getState";
    case kSetState: return "setState";
    case kAck: return "ack";
    case kValues: return "values";
    case kError: return "error";
    default: return "unknown";
  }
}

int64_t partLimit(const PSOptions& o) { return std::max<int64_t>(1, static_cast<int64_t>(o.partition_bytes / 4)); }
int64_t maxRowsPerMessage(const PSOptions& o, int64_t dim) { return std::max<int64_t>(1, partLimit(o) / dim); }

at::Tensor floatCpu(const at::Tensor& t, const char* what) {
  DTRAIN_CHECK(t.defined(), InvalidArgument, "ps: {} is undefined", what);
  DTRAIN_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, InvalidArgument,
               "ps: {} must be a float32 CPU tensor (got {} on {})", what, c10::toString(t.scalar_type()),
               t.device().str());
  return t.contiguous();
}

comm::GroupOptions groupOptions(std::chrono::milliseconds timeout) {
  comm::GroupOptions g = comm::GroupOptions::fromEnv();
  g.timeout = timeout;
  return g;
}

std::shared_ptr<comm::Store> pairStore(const std::shared_ptr<comm::Store>& store, int w, int s) {
  return std::make_shared<comm::PrefixStore>(fmt::format("ps/w{}s{}", w, s), store);
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Worker
// ------------------------------------------------------------------------------------------------

struct Worker::Conn {
  int server = 0;
  std::shared_ptr<ProcessGroup> pg;
};

namespace {

// The sends and receives of one worker call, waited together; errors name the server.
class Batch {
 public:
  Batch(int rank, std::atomic<int64_t>& sent, std::atomic<int64_t>& received)
      : rank_(rank), sent_(sent), received_(received) {}

  void sendHeader(int s, ProcessGroup& pg, const Header& h) {
    headers_.push_back(std::make_unique<Header>(h));
    add(s, [&] { return pg.send(headers_.back().get(), sizeof(Header), DType::u8, 1); });
    sent_ += kHeaderBytes;
  }
  void send(int s, ProcessGroup& pg, const void* p, int64_t count, DType t) {
    if (count == 0) return;
    add(s, [&] { return pg.send(p, static_cast<size_t>(count), t, 1); });
    sent_ += count * static_cast<int64_t>(comm::dtypeSize(t));
  }
  void recv(int s, ProcessGroup& pg, void* p, int64_t count, DType t) {
    if (count == 0) return;
    auto w = named(s, [&] { return pg.recv(p, static_cast<size_t>(count), t, 1); });
    named(s, [&] { w->wait(); return 0; });
    received_ += count * static_cast<int64_t>(comm::dtypeSize(t));
  }
  // Receives a reply header; a kError reply is thrown (with the server's message), another op than
  // `expect` is a ProtocolError.
  Header recvReply(int s, ProcessGroup& pg, uint16_t expect) {
    Header h;
    recv(s, pg, &h, sizeof(Header), DType::u8);
    if (h.magic != kMagic) {
      throw ProtocolError(fmt::format("[worker {}] server {}: bad reply magic {:#x}", rank_, s, h.magic));
    }
    if (h.op == kError) {
      if (h.count < 0 || h.count > kMaxErrorBytes) {
        throw ProtocolError(fmt::format("[worker {}] server {}: error reply of {} bytes", rank_, s, h.count));
      }
      std::string msg(static_cast<size_t>(h.count), '\0');
      recv(s, pg, msg.data(), h.count, DType::u8);
      throw Error(fmt::format("[worker {}] server {} failed: {}", rank_, s, msg));
    }
    if (h.op != expect) {
      throw ProtocolError(fmt::format("[worker {}] server {}: expected a {} reply, got {}", rank_, s,
                                      opName(expect), opName(h.op)));
    }
    return h;
  }
  void waitAll() {
    for (auto& [s, w] : works_) named(s, [&] { w->wait(); return 0; });
    works_.clear();
  }

  template <class F>
  auto named(int s, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (...) {
      rethrowWithContext(fmt::format("[worker {}] server {}: ", rank_, s));
    }
  }

 private:
  template <class F>
  void add(int s, F&& f) {
    works_.emplace_back(s, named(s, f));
  }
  int rank_;
  std::atomic<int64_t>& sent_;
  std::atomic<int64_t>& received_;
  std::vector<std::unique_ptr<Header>> headers_;
  std::vector<std::pair<int, WorkPtr>> works_;
};

// Sends a header-only request (clock, goodbye) to every server.
template <class Conns>
void sendToAllServers(Batch& b, const Conns& conns, uint16_t op, int32_t clock, uint16_t flags = 0) {
  for (size_t s = 0; s < conns.size(); ++s) {
    Header h;
    h.op = op;
    h.flags = flags;
    h.clock = clock;
    b.sendHeader(static_cast<int>(s), *conns[s]->pg, h);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Work and the Worker's communication thread
// ------------------------------------------------------------------------------------------------

void Work::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return done_; })) {
    throw TimeoutError(fmt::format("ps: {} did not complete within {} ms", what_, timeout.count()));
  }
  if (error_) std::rethrow_exception(error_);
}

bool Work::completed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

void Work::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

// Runs the Worker's operations in issue order. After one failed, the later ones fail with its error.
struct Worker::Thread {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<WorkHandle, std::function<void()>>> queue;
  bool stop = false;
  std::exception_ptr sticky;  // the thread's own
  std::thread thread;

  void loop() {
    for (;;) {
      std::pair<WorkHandle, std::function<void()>> job;
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
          err = sameType(e, fmt::format("{} not run: an earlier operation failed: {}", job.first->what(), e.what()));
        }
      } else {
        try {
          job.second();
        } catch (...) {
          err = std::current_exception();
          sticky = err;
        }
      }
      job.first->complete(err);
    }
  }
};

WorkHandle Worker::submit(std::string what, std::function<void()> fn) {
  auto w = std::make_shared<Work>(fmt::format("[worker {}] {}", rank_, what), opts_.timeout * 4);
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

Worker::Worker(std::shared_ptr<comm::Store> store, int rank, int num_workers, int num_servers, PSOptions opts)
    : rank_(rank), num_workers_(num_workers), num_servers_(num_servers), opts_(opts) {
  DTRAIN_CHECK(num_workers >= 1 && rank >= 0 && rank < num_workers, InvalidArgument,
               "ps::Worker: rank {} of {} workers", rank, num_workers);
  checkWorkerOptions(num_servers, opts, store);
  load_.assign(static_cast<size_t>(num_servers), 0);
  connect(store);
  startThread();
}

Worker::Worker(std::shared_ptr<comm::Store> store, LocalAggregation agg, int num_servers, PSOptions opts)
    : rank_(agg.node), num_workers_(agg.num_nodes), num_servers_(num_servers), opts_(opts) {
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

void Worker::startThread() {
  thread_ = std::make_unique<Thread>();
  thread_->thread = std::thread([t = thread_.get()] { t->loop(); });
}

void Worker::connect(const std::shared_ptr<comm::Store>& store) {
  auto grace = std::max<std::chrono::milliseconds>(std::chrono::seconds(1), opts_.timeout / 4);
  auto gopts = groupOptions(opts_.timeout + grace);
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

Worker::~Worker() {
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

const Worker::Entry& Worker::entry(const std::string& name, bool sparse) const {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: '{}' used after finish()", name);
  auto it = entries_.find(name);
  DTRAIN_CHECK(it != entries_.end(), InvalidArgument, "ps: '{}' was not declared", name);
  DTRAIN_CHECK(it->second.sparse == sparse, InvalidArgument, "ps: '{}' is a {} tensor", name,
               it->second.sparse ? "sparse (declareRows)" : "dense (declare)");
  return it->second;
}

void Worker::declare(const std::string& name, const at::Tensor& init) {
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

void Worker::declareRows(const std::string& name, int64_t num_rows, int64_t dim) {
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

namespace {
// The sum (on local rank 0) of the local workers' g; the mean unless the update is sum_only.
at::Tensor localSum(comm::ProcessGroup& local, const at::Tensor& g, const PSOptions& o) {
  const bool root = local.rank() == 0;
  at::Tensor sum = root ? at::empty_like(g) : at::Tensor();
  local.reduce(g.data_ptr<float>(), root ? sum.data_ptr<float>() : nullptr, static_cast<size_t>(g.numel()),
               DType::f32, comm::ReduceOp::sum, 0)->wait();
  if (root && o.update != PSOptions::Update::sum_only) sum.div_(static_cast<double>(local.size()));
  return sum;
}
// Every local worker's rows (and, with grads, their rows' gradients), concatenated in local-rank order.
// Returns the offset of this worker's rows.
int64_t localRows(comm::ProcessGroup& local, const at::Tensor& ids, const at::Tensor* grads, int64_t dim,
                  at::Tensor& all_ids, at::Tensor* all_grads) {
  const size_t L = static_cast<size_t>(local.size());
  int64_t n = ids.numel();
  std::vector<int64_t> counts(L);
  local.allgather(&n, counts.data(), 1, DType::i64)->wait();
  std::vector<size_t> c(L), cd(L);
  int64_t total = 0, offset = 0;
  for (size_t r = 0; r < L; ++r) {
    if (static_cast<int>(r) == local.rank()) offset = total;
    c[r] = static_cast<size_t>(counts[r]);
    cd[r] = static_cast<size_t>(counts[r] * dim);
    total += counts[r];
  }
  all_ids = at::empty({total}, at::kLong);
  local.allgatherv(ids.data_ptr<int64_t>(), all_ids.data_ptr<int64_t>(), c, DType::i64)->wait();
  if (grads) {
    *all_grads = at::empty({total, dim}, at::kFloat);
    local.allgatherv(grads->data_ptr<float>(), all_grads->data_ptr<float>(), cd, DType::f32)->wait();
  }
  return offset;
}
void checkRows(const at::Tensor& rows, const Worker::Entry& e, const std::string& name) {
  DTRAIN_CHECK(rows.defined() && rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.device().is_cpu(),
               InvalidArgument, "ps: rows of '{}' must be a 1-d int64 CPU tensor", name);
  auto r = rows.contiguous();
  const int64_t* ids = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i) {
    DTRAIN_CHECK(ids[i] >= 0 && ids[i] < e.num_rows, InvalidArgument, "ps: row {} of '{}' out of range [0, {})",
                 ids[i], name, e.num_rows);
  }
}
}  // namespace

WorkHandle Worker::pushAsync(const std::string& name, const at::Tensor& grad) {
  const auto& e = entry(name, false);
  auto g = floatCpu(grad, "gradient");
  DTRAIN_CHECK_EQ(g.numel(), e.numel, fmt::format("ps: push '{}': numel", name));
  const int c = clock_;
  return submit(fmt::format("push '{}'", name), [this, &e, g, c] {
    if (!local_) return netPush(e, g, c);
    auto sum = localSum(*local_, g, opts_);
    if (connected()) netPush(e, sum, c);
  });
}

WorkHandle Worker::pullAsync(const std::string& name, at::Tensor out) {
  const auto& e = entry(name, false);
  DTRAIN_CHECK(out.defined() && out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
               InvalidArgument, "ps: pull '{}': out must be a contiguous float32 CPU tensor", name);
  DTRAIN_CHECK_EQ(out.numel(), e.numel, fmt::format("ps: pull '{}': numel", name));
  const int c = clock_;
  return submit(fmt::format("pull '{}'", name), [this, &e, out, c] {
    if (connected()) netPull(e, nullptr, out, c);
    if (local_) local_->broadcast(out.data_ptr<float>(), static_cast<size_t>(e.numel), DType::f32, 0)->wait();
  });
}

WorkHandle Worker::pushPullAsync(const std::string& name, const at::Tensor& grad, at::Tensor out) {
  const auto& e = entry(name, false);
  auto g = floatCpu(grad, "gradient");
  DTRAIN_CHECK_EQ(g.numel(), e.numel, fmt::format("ps: pushPull '{}': numel", name));
  DTRAIN_CHECK(out.defined() && out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
               InvalidArgument, "ps: pushPull '{}': out must be a contiguous float32 CPU tensor", name);
  DTRAIN_CHECK_EQ(out.numel(), e.numel, fmt::format("ps: pushPull '{}': numel", name));
  const int c = clock_;
  return submit(fmt::format("pushPull '{}'", name), [this, &e, g, out, c] {
    if (!local_) return netPull(e, &g, out, c);
    auto sum = localSum(*local_, g, opts_);
    if (connected()) netPull(e, &sum, out, c);
    local_->broadcast(out.data_ptr<float>(), static_cast<size_t>(e.numel), DType::f32, 0)->wait();
  });
}

WorkHandle Worker::clockAsync() {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: clock after finish()");
  const int c = ++clock_;
  return submit(fmt::format("clock {}", c), [this, c] {
    if (connected()) netClock(0, c);
  });
}

WorkHandle Worker::pushRowsAsync(const std::string& name, const at::Tensor& rows, const at::Tensor& grads) {
  const auto& e = entry(name, true);
  checkRows(rows, e, name);
  auto g = floatCpu(grads, "row gradients");
  DTRAIN_CHECK(g.dim() == 2 && g.size(0) == rows.numel() && g.size(1) == e.dim, InvalidArgument,
               "ps: pushRows '{}': grads must be [{}, {}]", name, rows.numel(), e.dim);
  auto ids = rows.contiguous();
  const int c = clock_;
  return submit(fmt::format("pushRows '{}'", name), [this, &e, ids, g, c] {
    if (!local_) return netPushRows(e, ids, g, c);
    at::Tensor all_ids, all_g;
    localRows(*local_, ids, &g, e.dim, all_ids, &all_g);
    if (connected()) netPushRows(e, all_ids, all_g, c);
  });
}

at::Tensor Worker::pullRows(const std::string& name, const at::Tensor& rows) {
  const auto& e = entry(name, true);
  auto out = at::empty({rows.numel(), e.dim}, at::kFloat);
  pullRowsAsync(name, rows, out)->wait();
  return out;
}

WorkHandle Worker::pullRowsAsync(const std::string& name, const at::Tensor& rows, at::Tensor out) {
  const auto& e = entry(name, true);
  checkRows(rows, e, name);
  DTRAIN_CHECK(out.defined() && out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                   out.dim() == 2 && out.size(0) == rows.numel() && out.size(1) == e.dim,
               InvalidArgument, "ps: pullRows '{}': out must be a contiguous float32 CPU tensor [{}, {}]", name,
               rows.numel(), e.dim);
  auto ids = rows.contiguous();
  const int c = clock_;
  return submit(fmt::format("pullRows '{}'", name), [this, &e, ids, out, c] {
    if (!local_) return netPullRows(e, ids, out, c);
    at::Tensor all_ids;
    int64_t offset = localRows(*local_, ids, nullptr, e.dim, all_ids, nullptr);
    auto values = at::empty({all_ids.numel(), e.dim}, at::kFloat);
    if (connected()) netPullRows(e, all_ids, values, c);
    local_->broadcast(values.data_ptr<float>(), static_cast<size_t>(values.numel()), DType::f32, 0)->wait();
    out.copy_(values.narrow(0, offset, ids.numel()));
  });
}

void Worker::finish() {
  if (finished_) return;
  finished_ = true;
  if (!thread_) return;
  submit("finish", [this] {
    if (connected()) netFinish();
  })->wait();
}

// ------------------------------------------------------------------------------------------------
// Worker: the network side (on the Worker's thread)
// ------------------------------------------------------------------------------------------------

void Worker::netDeclare(const Entry& e, const at::Tensor& t) {
  Batch b(rank_, sent_, received_);
  const float* data = t.data_ptr<float>();
  for (const auto& p : e.parts) {
    Header h;
    h.op = kDeclare;
    h.key = p.key;
    h.count = p.count;
    h.clock = clock_;  // a tensor declared at step c starts at version c (bsp)
    h.flags = rank_ == 0 ? kFlagInit : 0;
    auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
    b.sendHeader(p.server, pg, h);
    if (rank_ == 0) b.send(p.server, pg, data + p.offset, p.count, DType::f32);
  }
  b.waitAll();
  for (const auto& p : e.parts) b.recvReply(p.server, *conns_[static_cast<size_t>(p.server)]->pg, kAck);
}

void Worker::netDeclareRows(const Entry& e) {
  Batch b(rank_, sent_, received_);
  for (int s = 0; s < num_servers_; ++s) {
    Header h;
    h.op = kDeclareRows;
    h.key = e.key;
    h.count = e.num_rows;
    h.row_dim = e.dim;
    h.flags = rank_ == 0 ? kFlagInit : 0;
    b.sendHeader(s, *conns_[static_cast<size_t>(s)]->pg, h);
  }
  b.waitAll();
  for (int s = 0; s < num_servers_; ++s) b.recvReply(s, *conns_[static_cast<size_t>(s)]->pg, kAck);
}

void Worker::netPush(const Entry& e, const at::Tensor& g, int clock) {
  Batch b(rank_, sent_, received_);
  const float* data = g.data_ptr<float>();
  for (const auto& p : e.parts) {
    Header h;
    h.op = kPush;
    h.key = p.key;
    h.clock = clock;
    h.count = p.count;
    auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
    b.sendHeader(p.server, pg, h);
    b.send(p.server, pg, data + p.offset, p.count, DType::f32);
  }
  b.waitAll();
}

void Worker::netPull(const Entry& e, const at::Tensor* grad, const at::Tensor& out, int clock) {
  float* dst = out.data_ptr<float>();
  // Sends a partition's request (and, for pushPull, its gradient) to its server.
  auto request = [&](Batch& b, const Part& p) {
    Header h;
    h.op = grad ? kPushPull : kPull;
    h.key = p.key;
    h.clock = clock;
    h.count = p.count;
    auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
    b.sendHeader(p.server, pg, h);
    if (grad) b.send(p.server, pg, grad->data_ptr<float>() + p.offset, p.count, DType::f32);
  };
  auto reply = [&](Batch& b, const Part& p) {
    auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
    Header h = b.recvReply(p.server, pg, kValues);
    if (h.key != p.key || h.count != p.count) {
      throw ProtocolError(fmt::format("[worker {}] server {}: reply for partition {} x {}, expected {} x {}",
                                      rank_, p.server, h.key, h.count, p.key, p.count));
    }
    b.recv(p.server, pg, dst + p.offset, p.count, DType::f32);
  };
  if (grad) {
    // One partition at a time: while a server sends a large reply it reads nothing, so a second large
    // gradient queued behind the first on the same connection would deadlock both sides.
    for (const auto& p : e.parts) {
      Batch b(rank_, sent_, received_);
      request(b, p);
      b.waitAll();
      reply(b, p);
    }
    return;
  }
  // Pull requests are headers only: post them all, then collect the replies.
  Batch b(rank_, sent_, received_);
  for (const auto& p : e.parts) request(b, p);
  b.waitAll();
  for (const auto& p : e.parts) reply(b, p);
}

void Worker::netClock(uint16_t flags, int clock) {
  Batch b(rank_, sent_, received_);
  sendToAllServers(b, conns_, kClock, clock, flags);
  b.waitAll();
}

namespace {
// One message of a pushRows / pullRows to server `server`: rows [start, start + n) of the caller's ids
// when one server owns every row (idx undefined), else the rows at positions idx.
struct RowMessage {
  int server = 0;
  int64_t start = 0, n = 0;
  at::Tensor idx;
};

// The messages that carry ids: grouped by owning server (row % S), at most `chunk` rows each.
std::vector<RowMessage> rowMessages(const at::Tensor& ids, int num_servers, int64_t chunk) {
  std::vector<RowMessage> out;
  const int64_t total = ids.numel();
  if (num_servers == 1) {
    for (int64_t start = 0; start < total; start += chunk) out.push_back({0, start, std::min(total - start, chunk), {}});
    return out;
  }
  const int64_t* p = ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> by(static_cast<size_t>(num_servers));
  for (int64_t i = 0; i < total; ++i) by[static_cast<size_t>(p[i] % num_servers)].push_back(i);
  for (int s = 0; s < num_servers; ++s) {
    auto& pos = by[static_cast<size_t>(s)];
    const int64_t count = static_cast<int64_t>(pos.size());
    for (int64_t start = 0; start < count; start += chunk) {
      const int64_t n = std::min(count - start, chunk);
      out.push_back({s, start, n, at::from_blob(pos.data() + start, {n}, at::kLong).clone()});
    }
  }
  return out;
}

// The message's rows of t (ids or per-row values): a view when they are contiguous in t.
at::Tensor rowsOf(const at::Tensor& t, const RowMessage& m) {
  return m.idx.defined() ? t.index_select(0, m.idx) : t.narrow(0, m.start, m.n);
}

Header rowsHeader(uint16_t op, uint32_t key, int clock, int64_t n, int64_t dim) {
  Header h;
  h.op = op;
  h.key = key;
  h.clock = clock;
  h.count = n;
  h.row_dim = dim;
  return h;
}
}  // namespace

void Worker::netPushRows(const Entry& e, const at::Tensor& ids, const at::Tensor& g, int clock) {
  std::vector<at::Tensor> keep;  // the selected rows stay alive until every send completed
  Batch b(rank_, sent_, received_);
  for (const auto& m : rowMessages(ids, num_servers_, maxRowsPerMessage(opts_, e.dim))) {
    auto sid = rowsOf(ids, m), sg = rowsOf(g, m);
    keep.push_back(sid);
    keep.push_back(sg);
    auto& pg = *conns_[static_cast<size_t>(m.server)]->pg;
    b.sendHeader(m.server, pg, rowsHeader(kPushRows, e.key, clock, m.n, e.dim));
    b.send(m.server, pg, sid.data_ptr<int64_t>(), sid.numel(), DType::i64);
    b.send(m.server, pg, sg.data_ptr<float>(), sg.numel(), DType::f32);
  }
  b.waitAll();
}

void Worker::netPullRows(const Entry& e, const at::Tensor& ids, const at::Tensor& out, int clock) {
  struct Req {
    RowMessage m;
    at::Tensor sid, values;  // values: a slice of out when the message's rows are contiguous in it
  };
  std::vector<Req> reqs;
  Batch b(rank_, sent_, received_);
  for (auto& m : rowMessages(ids, num_servers_, maxRowsPerMessage(opts_, e.dim))) {
    Req r;
    r.sid = rowsOf(ids, m);
    r.values = m.idx.defined() ? at::empty({m.n, e.dim}, at::kFloat) : rowsOf(out, m);
    auto& pg = *conns_[static_cast<size_t>(m.server)]->pg;
    b.sendHeader(m.server, pg, rowsHeader(kPullRows, e.key, clock, m.n, e.dim));
    b.send(m.server, pg, r.sid.data_ptr<int64_t>(), r.sid.numel(), DType::i64);
    r.m = std::move(m);
    reqs.push_back(std::move(r));
  }
  b.waitAll();
  for (auto& r : reqs) {
    const int s = r.m.server;
    auto& pg = *conns_[static_cast<size_t>(s)]->pg;
    Header h = b.recvReply(s, pg, kValues);
    if (h.key != e.key || h.count != r.m.n || h.row_dim != e.dim) {
      throw ProtocolError(fmt::format("[worker {}] server {}: pullRows reply {} x {} for table {}, expected {} x {}",
                                      rank_, s, h.count, h.row_dim, h.key, r.m.n, e.dim));
    }
    b.recv(s, pg, r.values.data_ptr<float>(), r.values.numel(), DType::f32);
    if (r.m.idx.defined()) out.index_copy_(0, r.m.idx, r.values);
  }
}

void Worker::netFinish() {
  Batch b(rank_, sent_, received_);
  sendToAllServers(b, conns_, kBye, clock_);
  b.waitAll();
  for (int s = 0; s < num_servers_; ++s) b.recvReply(s, *conns_[static_cast<size_t>(s)]->pg, kAck);
}

// ------------------------------------------------------------------------------------------------
// Worker: server state for checkpoints
// ------------------------------------------------------------------------------------------------

namespace {
// Floats of state per element: the value, then the momentum buffer or Adam's m and v.
int64_t stateSlots(const PSOptions& o) {
  if (o.update == PSOptions::Update::adam) return 3;
  if (o.update == PSOptions::Update::sgd && o.momentum != 0) return 2;
  return 1;
}
// Rows of a table that server s of S serves (ids s, s+S, ...).
int64_t localRowCount(int64_t num_rows, int s, int S) { return num_rows > s ? (num_rows - s + S - 1) / S : 0; }
}  // namespace

std::map<std::string, at::Tensor> Worker::saveState() {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: saveState after finish()");
  DTRAIN_CHECK(connected(), InvalidArgument,
               "ps: saveState on a process that does not talk to the servers (local rank > 0 under local "
               "aggregation): call it on rank 0");
  std::map<std::string, at::Tensor> state;
  const int c = clock_;
  submit("saveState", [this, &state, c] {
    const int64_t slots = stateSlots(opts_);
    Batch b(rank_, sent_, received_);
    for (const auto& [name, e] : entries_) {
      if (!e.sparse) {
        auto all = at::empty({slots, e.numel}, at::kFloat);
        auto steps = at::empty({static_cast<int64_t>(e.parts.size())}, at::kLong);
        auto versions = at::empty_like(steps);
        for (size_t i = 0; i < e.parts.size(); ++i) {
          const auto& p = e.parts[i];
          auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
          Header h;
          h.op = kGetState;
          h.key = p.key;
          h.clock = c;
          b.sendHeader(p.server, pg, h);
          b.waitAll();
          Header r = b.recvReply(p.server, pg, kValues);
          if (r.key != p.key || r.count != p.count || r.row_dim != slots) {
            throw ProtocolError(fmt::format("[worker {}] server {}: state of partition {} is {} x {}, expected {} x {} "
                                            "(do the servers run the same update?)",
                                            rank_, p.server, p.key, r.row_dim, r.count, slots, p.count));
          }
          auto buf = at::empty({slots, p.count}, at::kFloat);
          b.recv(p.server, pg, buf.data_ptr<float>(), buf.numel(), DType::f32);
          all.narrow(1, p.offset, p.count).copy_(buf);
          steps[static_cast<int64_t>(i)] = r.aux;
          versions[static_cast<int64_t>(i)] = static_cast<int64_t>(r.clock);
        }
        state[name] = all;
        state[name + "#step"] = steps;
        state[name + "#version"] = versions;
      } else {
        std::vector<at::Tensor> ids, steps, data;
        for (int s = 0; s < num_servers_; ++s) {
          auto& pg = *conns_[static_cast<size_t>(s)]->pg;
          Header h;
          h.op = kGetState;
          h.flags = kFlagRows;
          h.key = e.key;
          h.clock = c;
          b.sendHeader(s, pg, h);
          b.waitAll();
          Header r = b.recvReply(s, pg, kValues);
          if (r.key != e.key || r.count < 0 || r.count > localRowCount(e.num_rows, s, num_servers_) ||
              r.row_dim != slots * e.dim) {
            throw ProtocolError(fmt::format("[worker {}] server {}: state of table {}: {} rows x {}, expected at most "
                                            "{} x {}",
                                            rank_, s, e.key, r.count, r.row_dim,
                                            localRowCount(e.num_rows, s, num_servers_), slots * e.dim));
          }
          auto i = at::empty({r.count}, at::kLong), st = at::empty({r.count}, at::kLong);
          auto d = at::empty({r.count, slots * e.dim}, at::kFloat);
          b.recv(s, pg, i.data_ptr<int64_t>(), r.count, DType::i64);
          b.recv(s, pg, st.data_ptr<int64_t>(), r.count, DType::i64);
          b.recv(s, pg, d.data_ptr<float>(), d.numel(), DType::f32);
          ids.push_back(i);
          steps.push_back(st);
          data.push_back(d);
        }
        state[name + "#rows"] = at::cat(ids);
        state[name + "#steps"] = at::cat(steps);
        state[name + "#data"] = at::cat(data);
      }
    }
    state["#clock"] = at::full({1}, static_cast<int64_t>(c), at::kLong);
  })->wait();
  return state;
}

void Worker::loadState(const std::map<std::string, at::Tensor>& state) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: loadState after finish()");
  auto get = [&](const std::string& key, at::ScalarType t) {
    auto it = state.find(key);
    DTRAIN_CHECK(it != state.end(), InvalidArgument, "ps: loadState: the state has no '{}'", key);
    DTRAIN_CHECK(it->second.scalar_type() == t && it->second.device().is_cpu(), InvalidArgument,
                 "ps: loadState: '{}' is {}, expected {}", key, c10::toString(it->second.scalar_type()),
                 c10::toString(t));
    return it->second.contiguous();
  };
  const int64_t slots = stateSlots(opts_);
  auto clk = get("#clock", at::kLong);
  DTRAIN_CHECK(clk.numel() == 1 && clk.item<int64_t>() >= 0 && clk.item<int64_t>() < INT32_MAX, InvalidArgument,
               "ps: loadState: bad '#clock'");
  // Validate everything before anything is sent.
  for (const auto& [name, e] : entries_) {
    if (!e.sparse) {
      auto v = get(name, at::kFloat);
      DTRAIN_CHECK(v.dim() == 2 && v.size(0) == slots && v.size(1) == e.numel, InvalidArgument,
                   "ps: loadState: '{}' is {}, expected [{}, {}] (the same tensors and update mode)", name,
                   fmt::join(v.sizes(), ", "), slots, e.numel);
      for (const char* k : {"#step", "#version"})
        DTRAIN_CHECK(get(name + k, at::kLong).numel() == static_cast<int64_t>(e.parts.size()), InvalidArgument,
                     "ps: loadState: '{}{}' has the wrong length (another partition_bytes?)", name, k);
    } else {
      auto ids = get(name + "#rows", at::kLong);
      auto st = get(name + "#steps", at::kLong);
      auto d = get(name + "#data", at::kFloat);
      DTRAIN_CHECK(ids.dim() == 1 && st.numel() == ids.numel() && d.dim() == 2 && d.size(0) == ids.numel() &&
                       d.size(1) == slots * e.dim,
                   InvalidArgument, "ps: loadState: table '{}' state has inconsistent shapes", name);
      checkRows(ids, e, name);
    }
  }
  const int c = static_cast<int>(clk.item<int64_t>());
  clock_ = c;
  submit("loadState", [this, &get, slots, c] {
    if (!connected()) return;
    Batch b(rank_, sent_, received_);
    if (rank_ == 0) {
      for (const auto& [name, e] : entries_) {
        if (!e.sparse) {
          auto v = get(name, at::kFloat);
          auto steps = get(name + "#step", at::kLong), versions = get(name + "#version", at::kLong);
          for (size_t i = 0; i < e.parts.size(); ++i) {
            const auto& p = e.parts[i];
            auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
            auto buf = v.narrow(1, p.offset, p.count).contiguous();
            Header h;
            h.op = kSetState;
            h.key = p.key;
            h.count = p.count;
            h.row_dim = slots;
            h.aux = steps[static_cast<int64_t>(i)].item<int64_t>();
            h.clock = static_cast<int32_t>(versions[static_cast<int64_t>(i)].item<int64_t>());
            b.sendHeader(p.server, pg, h);
            b.send(p.server, pg, buf.data_ptr<float>(), buf.numel(), DType::f32);
            b.waitAll();
            b.recvReply(p.server, pg, kAck);
          }
        } else {
          auto ids = get(name + "#rows", at::kLong), st = get(name + "#steps", at::kLong);
          auto d = get(name + "#data", at::kFloat);
          auto owner = ids.remainder(num_servers_);
          for (int s = 0; s < num_servers_; ++s) {
            auto idx = (owner == s).nonzero().flatten();
            auto si = ids.index_select(0, idx).contiguous(), ss = st.index_select(0, idx).contiguous();
            auto sd = d.index_select(0, idx).contiguous();
            auto& pg = *conns_[static_cast<size_t>(s)]->pg;
            Header h;
            h.op = kSetState;
            h.flags = kFlagRows;
            h.key = e.key;
            h.count = si.numel();
            h.row_dim = slots * e.dim;
            b.sendHeader(s, pg, h);
            b.send(s, pg, si.data_ptr<int64_t>(), si.numel(), DType::i64);
            b.send(s, pg, ss.data_ptr<int64_t>(), ss.numel(), DType::i64);
            b.send(s, pg, sd.data_ptr<float>(), sd.numel(), DType::f32);
            b.waitAll();
            b.recvReply(s, pg, kAck);
          }
        }
      }
    }
    netClock(kFlagSet, c);
    for (int s = 0; s < num_servers_; ++s) b.recvReply(s, *conns_[static_cast<size_t>(s)]->pg, kAck);
  })->wait();
}

// ------------------------------------------------------------------------------------------------
// Server
// ------------------------------------------------------------------------------------------------

struct Server::State {
  struct Dense {
    int64_t n = 0;
    at::Tensor value, buf, m, v;
    int64_t t = 0;        // adam steps
    int64_t version = 0;  // updates applied (bsp: steps)
    std::vector<at::Tensor> pending;  // bsp: this step's push of each worker
    int npending = 0;
  };
  // A sparse table's rows on this server (ids index, index + S, ...): one flat store, rows in chunks
  // allocated as rows are first touched, and an id -> position array. A row holds its value, then its
  // optimizer state (momentum buffer; or Adam's m and v): `slots` x dim floats.
  struct Rows {
    static constexpr int64_t kChunkRows = 1024;
    int64_t num_rows = 0, dim = 0, slots = 1, stride = 0;
    int num_servers = 1;
    std::vector<int32_t> where;                    // id / S -> position, -1 absent
    std::vector<int64_t> ids;                      // position -> id
    std::vector<int64_t> steps;                    // position -> updates applied (adam's t; momentum started)
    std::vector<std::unique_ptr<float[]>> chunks;  // zero-initialised
    // Guards the rows (not the table's existence, which `mu` guards): pulls copy rows under a shared
    // lock, so the connections' threads copy in parallel; pushes and restores take it exclusively.
    std::shared_mutex rw;

    void init(int64_t rows, int64_t d, int64_t sl, int index, int S) {
      num_rows = rows;
      dim = d;
      slots = sl;
      stride = d * sl;
      num_servers = S;
      where.assign(static_cast<size_t>(localRowCount(rows, index, S)), -1);
    }
    float* at(int64_t pos) { return chunks[static_cast<size_t>(pos / kChunkRows)].get() + (pos % kChunkRows) * stride; }
    // The row's position, or -1.
    int64_t find(int64_t id) const { return where[static_cast<size_t>(id / num_servers)]; }
    // The row's position, created as zeros if absent.
    int64_t touch(int64_t id) {
      int32_t& w = where[static_cast<size_t>(id / num_servers)];
      if (w >= 0) return w;
      const int64_t pos = static_cast<int64_t>(ids.size());
      if (pos % kChunkRows == 0) chunks.emplace_back(new float[static_cast<size_t>(kChunkRows * stride)]());
      ids.push_back(id);
      steps.push_back(0);
      w = static_cast<int32_t>(pos);
      return pos;
    }
    void clear() {
      std::fill(where.begin(), where.end(), -1);
      ids.clear();
      steps.clear();
      chunks.clear();
    }
  };

  std::shared_ptr<comm::Store> store;
  int index, num_servers, num_workers;
  PSOptions opts;

  std::mutex mu;
  std::condition_variable cv;
  std::map<uint32_t, Dense> dense;
  std::map<uint32_t, Rows> tables;
  std::vector<int> clocks;
  std::vector<int> restores;  // loadState clock-sets received, per worker
  std::vector<bool> done;
  std::vector<std::shared_ptr<ProcessGroup>> pgs;
  bool failed = false;
  std::string fail_msg;
  std::exception_ptr first_error;

  std::string tag() const { return fmt::format("[server {}]", index); }

  int minClock() const {
    int m = INT_MAX;
    for (int w = 0; w < num_workers; ++w)
      if (!done[static_cast<size_t>(w)]) m = std::min(m, clocks[static_cast<size_t>(w)]);
    return m;
  }

  // Waits (lock held) until pred() or failure; a wait past the timeout throws TimeoutError(why()).
  template <class Pred, class Why>
  void waitFor(std::unique_lock<std::mutex>& lk, Pred pred, Why why) {
    auto deadline = Clock::now() + opts.timeout;
    while (!failed && !pred()) {
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && !failed && !pred()) {
        throw TimeoutError(fmt::format("{} {} after {} ms", tag(), why(), opts.timeout.count()));
      }
    }
    if (failed) throw Error(fail_msg);
  }

  std::string missingPushes(const Dense& d) const {
    std::vector<int> miss;
    for (int w = 0; w < num_workers; ++w)
      if (!d.pending[static_cast<size_t>(w)].defined()) miss.push_back(w);
    return fmt::format("[{}]", fmt::join(miss, ", "));
  }
  std::string behind(int needed) const {
    std::vector<std::string> miss;
    for (int w = 0; w < num_workers; ++w)
      if (!done[static_cast<size_t>(w)] && clocks[static_cast<size_t>(w)] < needed)
        miss.push_back(fmt::format("{} (clock {})", w, clocks[static_cast<size_t>(w)]));
    return fmt::format("[{}]", fmt::join(miss, ", "));
  }

  // The optimizer step on a dense partition (lock held).
  void apply(Dense& d, const at::Tensor& grad) {
    switch (opts.update) {
      case PSOptions::Update::sum_only:
        if (opts.consistency == Consistency::bsp) {
          d.value.copy_(grad);
        } else {
          d.value.add_(grad);
        }
        break;
      case PSOptions::Update::sgd:
        if (opts.momentum != 0) {
          if (!d.buf.defined()) {
            d.buf = grad.clone();
          } else {
            d.buf.mul_(opts.momentum).add_(grad);
          }
          d.value.add_(d.buf, -opts.lr);
        } else {
          d.value.add_(grad, -opts.lr);
        }
        break;
      case PSOptions::Update::adam: {
        if (!d.m.defined()) {
          d.m = at::zeros_like(d.value);
          d.v = at::zeros_like(d.value);
        }
        ++d.t;
        d.m.mul_(opts.beta1).add_(grad, 1 - opts.beta1);
        d.v.mul_(opts.beta2).addcmul_(grad, grad, 1 - opts.beta2);
        double bc1 = 1 - std::pow(opts.beta1, static_cast<double>(d.t));
        double bc2 = 1 - std::pow(opts.beta2, static_cast<double>(d.t));
        auto denom = (d.v.sqrt() / std::sqrt(bc2)).add_(opts.eps);
        d.value.addcdiv_(d.m, denom, -opts.lr / bc1);
        break;
      }
    }
    ++d.version;
  }

  static void prefetchRow(Rows& t, int64_t pos) {
    if (pos < 0) return;
    const char* p = reinterpret_cast<const char*>(t.at(pos));
    for (int64_t b = 0; b < t.stride * 4; b += 64) __builtin_prefetch(p + b);
  }

  // The update of one sparse row (its table's rw lock held exclusively). Each push is applied at once.
  void applyRow(Rows& t, int64_t pos, const float* g) {
    const int64_t dim = t.dim;
    float* p = t.at(pos);
    int64_t& step = t.steps[static_cast<size_t>(pos)];
    switch (opts.update) {
      case PSOptions::Update::sum_only:
        for (int64_t i = 0; i < dim; ++i) p[i] += g[i];
        break;
      case PSOptions::Update::sgd:
        if (opts.momentum != 0) {
          float* b = p + dim;
          const bool first = step++ == 0;
          const auto mom = static_cast<float>(opts.momentum), lr = static_cast<float>(opts.lr);
          for (int64_t i = 0; i < dim; ++i) {
            b[i] = first ? g[i] : mom * b[i] + g[i];
            p[i] -= lr * b[i];
          }
        } else {
          const auto lr = static_cast<float>(opts.lr);
          for (int64_t i = 0; i < dim; ++i) p[i] -= lr * g[i];
        }
        break;
      case PSOptions::Update::adam: {
        float* m = p + dim;
        float* v = p + 2 * dim;
        ++step;
        double bc1 = 1 - std::pow(opts.beta1, static_cast<double>(step));
        double bc2 = 1 - std::pow(opts.beta2, static_cast<double>(step));
        for (int64_t i = 0; i < dim; ++i) {
          m[i] = static_cast<float>(opts.beta1 * m[i] + (1 - opts.beta1) * g[i]);
          v[i] = static_cast<float>(opts.beta2 * v[i] + (1 - opts.beta2) * g[i] * g[i]);
          double denom = std::sqrt(v[i]) / std::sqrt(bc2) + opts.eps;
          p[i] = static_cast<float>(p[i] - opts.lr / bc1 * m[i] / denom);
        }
        break;
      }
    }
  }

  void fail(const std::string& msg, std::exception_ptr err) {
    std::vector<std::shared_ptr<ProcessGroup>> others;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (failed) return;
      failed = true;
      fail_msg = msg;
      first_error = err;
      others = pgs;
    }
    cv.notify_all();
    for (auto& pg : others) {
      if (!pg) continue;
      try {
        pg->abort(msg);
      } catch (...) {
      }
    }
  }

  void serve(int w);
  bool handle(int w, ProcessGroup& pg, const Header& h);
};

namespace {
void sendAll(ProcessGroup& pg, const std::vector<std::pair<const void*, std::pair<size_t, DType>>>& parts) {
  std::vector<WorkPtr> ws;
  for (const auto& [p, cd] : parts)
    if (cd.first > 0) ws.push_back(pg.send(p, cd.first, cd.second, 0));
  for (auto& w : ws) w->wait();
}
void recvNow(ProcessGroup& pg, void* p, size_t count, DType t) {
  if (count > 0) pg.recv(p, count, t, 0)->wait();
}
void reply(ProcessGroup& pg, uint16_t op, uint32_t key, int64_t count, int64_t row_dim, const void* payload,
           size_t payload_count, DType t) {
  Header h;
  h.op = op;
  h.key = key;
  h.count = count;
  h.row_dim = row_dim;
  sendAll(pg, {{&h, {sizeof(Header), DType::u8}}, {payload, {payload_count, t}}});
}
}  // namespace

// Handles one request; returns false after the goodbye.
bool Server::State::handle(int w, ProcessGroup& pg, const Header& h) {
  const std::string who = fmt::format("{} worker {}", tag(), w);
  const int64_t limit = partLimit(opts);
  const size_t W = static_cast<size_t>(num_workers);
  switch (h.op) {
    case kDeclare: {
      if (h.count < 1 || h.count > limit) {
        throw ProtocolError(fmt::format("{}: declare of partition {} with {} elements (limit {})", who, h.key,
                                        h.count, limit));
      }
      bool init = h.flags & kFlagInit;
      if (init != (w == 0)) throw ProtocolError(fmt::format("{}: only worker 0 sends initial values", who));
      if (init) {
        auto value = at::empty({h.count}, at::kFloat);
        recvNow(pg, value.data_ptr<float>(), static_cast<size_t>(h.count), DType::f32);
        {
          std::lock_guard<std::mutex> lk(mu);
          if (dense.count(h.key)) throw ProtocolError(fmt::format("{}: partition {} declared twice", who, h.key));
          Dense d;
          d.n = h.count;
          d.value = value;
          d.version = std::max(0, h.clock);  // declared at step c: the first bsp step is c
          d.pending.resize(W);
          dense.emplace(h.key, std::move(d));
        }
        cv.notify_all();
      } else {
        std::unique_lock<std::mutex> lk(mu);
        waitFor(lk, [&] { return dense.count(h.key) > 0; },
                [&] { return fmt::format("worker {} declared partition {} but worker 0 never did", w, h.key); });
        if (dense.at(h.key).n != h.count) {
          throw ProtocolError(fmt::format("{}: partition {} has {} elements here, {} at worker 0 (declare the same "
                                          "tensors in the same order on every worker)",
                                          who, h.key, h.count, dense.at(h.key).n));
        }
      }
      reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
      return true;
    }
    case kDeclareRows: {
      if (h.count < 1 || h.row_dim < 1 || h.row_dim > limit) {
        throw ProtocolError(fmt::format("{}: table {} of {} x {} (row limit {})", who, h.key, h.count, h.row_dim,
                                        limit));
      }
      std::unique_lock<std::mutex> lk(mu);
      if (w == 0) {
        if (tables.count(h.key)) throw ProtocolError(fmt::format("{}: table {} declared twice", who, h.key));
        tables[h.key].init(h.count, h.row_dim, stateSlots(opts), index, num_servers);
        cv.notify_all();
      } else {
        waitFor(lk, [&] { return tables.count(h.key) > 0; },
                [&] { return fmt::format("worker {} declared table {} but worker 0 never did", w, h.key); });
        const auto& t = tables.at(h.key);
        if (t.num_rows != h.count || t.dim != h.row_dim) {
          throw ProtocolError(fmt::format("{}: table {} is {} x {} here, {} x {} at worker 0", who, h.key, h.count,
                                          h.row_dim, t.num_rows, t.dim));
        }
      }
      lk.unlock();
      reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
      return true;
    }
    case kPush:
    case kPull:
    case kPushPull: {
      int64_t n;
      {
        std::lock_guard<std::mutex> lk(mu);
        auto it = dense.find(h.key);
        if (it == dense.end()) throw ProtocolError(fmt::format("{}: {} of unknown partition {}", who, opName(h.op), h.key));
        n = it->second.n;
      }
      if (h.count != n) {
        throw ProtocolError(fmt::format("{}: {} of partition {} with {} elements, declared {}", who, opName(h.op),
                                        h.key, h.count, n));
      }
      at::Tensor grad;
      if (h.op != kPull) {
        grad = at::empty({n}, at::kFloat);
        recvNow(pg, grad.data_ptr<float>(), static_cast<size_t>(n), DType::f32);
      }
      std::unique_lock<std::mutex> lk(mu);
      Dense& d = dense.at(h.key);
      if (grad.defined()) {
        if (opts.consistency == Consistency::bsp) {
          if (h.clock < d.version) {
            throw ProtocolError(fmt::format("{}: push of clock {} to partition {}, which is at step {}", who, h.clock,
                                            h.key, d.version));
          }
          // One step in flight: a push for the next step waits until this one is applied.
          waitFor(lk, [&] { return h.clock <= d.version; }, [&] {
            return fmt::format("BSP: worker {}'s push of clock {} waits for step {} of partition {}, which misses "
                               "pushes from workers {}",
                               w, h.clock, d.version, h.key, missingPushes(d));
          });
          if (d.pending[static_cast<size_t>(w)].defined()) {
            throw ProtocolError(fmt::format("{}: pushed partition {} twice in step {}", who, h.key, h.clock));
          }
          d.pending[static_cast<size_t>(w)] = grad;
          if (++d.npending == num_workers) {
            // Sum in worker order (deterministic), then one update with the mean.
            at::Tensor sum = d.pending[0].clone();
            for (size_t k = 1; k < W; ++k) sum.add_(d.pending[k]);
            if (opts.update != PSOptions::Update::sum_only) sum.div_(static_cast<double>(num_workers));
            apply(d, sum);
            for (auto& p : d.pending) p = at::Tensor();
            d.npending = 0;
            cv.notify_all();
          }
        } else {
          apply(d, grad);
          cv.notify_all();
        }
      }
      if (h.op == kPush) return true;
      // The pull's gate.
      if (opts.consistency == Consistency::bsp) {
        int64_t need = h.op == kPushPull ? int64_t{h.clock} + 1 : int64_t{h.clock};
        waitFor(lk, [&] { return d.version >= need; }, [&] {
          return fmt::format("BSP: worker {}'s pull of partition {} at clock {} waits for step {}, which misses "
                             "pushes from workers {}",
                             w, h.key, need, d.version, missingPushes(d));
        });
      } else if (opts.consistency == Consistency::ssp) {
        waitFor(lk, [&] { return int64_t{h.clock} - minClock() <= opts.staleness; }, [&] {
          return fmt::format("SSP({}): worker {}'s pull at clock {} waits for workers {}", opts.staleness, w, h.clock,
                             behind(h.clock - opts.staleness));
        });
      }
      auto values = d.value.clone();
      lk.unlock();
      reply(pg, kValues, h.key, n, 0, values.data_ptr<float>(), static_cast<size_t>(n), DType::f32);
      return true;
    }
    case kPushRows:
    case kPullRows: {
      int64_t dim;
      {
        std::lock_guard<std::mutex> lk(mu);
        auto it = tables.find(h.key);
        if (it == tables.end()) throw ProtocolError(fmt::format("{}: {} of unknown table {}", who, opName(h.op), h.key));
        dim = it->second.dim;
      }
      if (h.row_dim != dim || h.count < 1 || h.count > maxRowsPerMessage(opts, dim)) {
        throw ProtocolError(fmt::format("{}: {} of {} rows x {} on table {} (dim {}, at most {} rows per message)",
                                        who, opName(h.op), h.count, h.row_dim, h.key, dim,
                                        maxRowsPerMessage(opts, dim)));
      }
      const int64_t n = h.count;
      // Per connection thread, reused across requests: no fresh pages per request.
      thread_local std::vector<int64_t> ids;
      thread_local std::vector<float> vals;
      ids.resize(static_cast<size_t>(n));
      vals.resize(static_cast<size_t>(n * dim));
      recvNow(pg, ids.data(), static_cast<size_t>(n), DType::i64);
      if (h.op == kPushRows) recvNow(pg, vals.data(), static_cast<size_t>(n * dim), DType::f32);
      std::unique_lock<std::mutex> lk(mu);
      Rows& t = tables.at(h.key);  // std::map: the reference stays valid
      for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[static_cast<size_t>(i)];
        if (id < 0 || id >= t.num_rows || id % num_servers != index) {
          throw ProtocolError(fmt::format("{}: row {} of table {} is not served here ({} rows, {} servers)", who, id,
                                          h.key, t.num_rows, num_servers));
        }
      }
      // Rows are random accesses over a large table: look the positions up first (prefetching the index),
      // then touch the rows (prefetching a few ahead).
      thread_local std::vector<int64_t> pos;
      pos.resize(static_cast<size_t>(n));
      constexpr int64_t kAhead = 8;
      if (h.op == kPushRows) {
        lk.unlock();
        {
          std::unique_lock<std::shared_mutex> wl(t.rw);
          for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = t.touch(ids[static_cast<size_t>(i)]);
          for (int64_t i = 0; i < n; ++i) {
            if (i + kAhead < n) prefetchRow(t, pos[static_cast<size_t>(i + kAhead)]);
            applyRow(t, pos[static_cast<size_t>(i)], vals.data() + i * dim);
          }
        }
        cv.notify_all();
        return true;
      }
      if (opts.consistency == Consistency::bsp) {
        waitFor(lk, [&] { return minClock() >= h.clock; }, [&] {
          return fmt::format("BSP: worker {}'s pullRows at clock {} waits for workers {}", w, h.clock,
                             behind(h.clock));
        });
      } else if (opts.consistency == Consistency::ssp) {
        waitFor(lk, [&] { return int64_t{h.clock} - minClock() <= opts.staleness; }, [&] {
          return fmt::format("SSP({}): worker {}'s pullRows at clock {} waits for workers {}", opts.staleness, w,
                             h.clock, behind(h.clock - opts.staleness));
        });
      }
      lk.unlock();
      {
        std::shared_lock<std::shared_mutex> rl(t.rw);
        for (int64_t i = 0; i < n; ++i) {
          if (i + 2 * kAhead < n) __builtin_prefetch(&t.where[static_cast<size_t>(ids[static_cast<size_t>(i + 2 * kAhead)] / num_servers)]);
          pos[static_cast<size_t>(i)] = t.find(ids[static_cast<size_t>(i)]);
        }
        for (int64_t i = 0; i < n; ++i) {
          if (i + kAhead < n) prefetchRow(t, pos[static_cast<size_t>(i + kAhead)]);
          const int64_t p = pos[static_cast<size_t>(i)];
          float* dst = vals.data() + i * dim;
          if (p < 0) {
            std::fill(dst, dst + dim, 0.0f);
          } else {
            std::memcpy(dst, t.at(p), static_cast<size_t>(dim) * sizeof(float));
          }
        }
      }
      reply(pg, kValues, h.key, n, dim, vals.data(), static_cast<size_t>(n * dim), DType::f32);
      return true;
    }
    case kGetState: {
      const int64_t slots = stateSlots(opts);
      std::unique_lock<std::mutex> lk(mu);
      // Gated like a pull at the requester's clock.
      if (opts.consistency == Consistency::bsp || opts.consistency == Consistency::ssp) {
        const int64_t lag = opts.consistency == Consistency::ssp ? opts.staleness : 0;
        waitFor(lk, [&] { return int64_t{h.clock} - minClock() <= lag; }, [&] {
          return fmt::format("worker {}'s saveState at clock {} waits for workers {}", w, h.clock,
                             behind(static_cast<int>(h.clock - lag)));
        });
      }
      if (h.flags & kFlagRows) {
        auto it = tables.find(h.key);
        if (it == tables.end()) throw ProtocolError(fmt::format("{}: getState of unknown table {}", who, h.key));
        Rows& t = it->second;
        std::shared_lock<std::shared_mutex> rl(t.rw);
        const int64_t m = static_cast<int64_t>(t.ids.size());
        std::vector<float> data(static_cast<size_t>(m * t.stride));
        for (int64_t pos = 0; pos < m; ++pos)
          std::memcpy(data.data() + pos * t.stride, t.at(pos), static_cast<size_t>(t.stride) * sizeof(float));
        std::vector<int64_t> ids = t.ids, steps = t.steps;
        rl.unlock();
        lk.unlock();
        Header r;
        r.op = kValues;
        r.key = h.key;
        r.count = m;
        r.row_dim = t.stride;
        sendAll(pg, {{&r, {sizeof(Header), DType::u8}},
                     {ids.data(), {ids.size(), DType::i64}},
                     {steps.data(), {steps.size(), DType::i64}},
                     {data.data(), {data.size(), DType::f32}}});
        return true;
      }
      auto it = dense.find(h.key);
      if (it == dense.end()) throw ProtocolError(fmt::format("{}: getState of unknown partition {}", who, h.key));
      Dense& d = it->second;
      if (opts.consistency == Consistency::bsp) {
        waitFor(lk, [&] { return d.version >= h.clock; }, [&] {
          return fmt::format("BSP: worker {}'s saveState of partition {} at clock {} waits for step {}, which misses "
                             "pushes from workers {}",
                             w, h.key, h.clock, d.version, missingPushes(d));
        });
      }
      auto all = at::zeros({slots, d.n}, at::kFloat);
      all[0].copy_(d.value);
      if (slots == 2 && d.buf.defined()) all[1].copy_(d.buf);
      if (slots == 3 && d.m.defined()) {
        all[1].copy_(d.m);
        all[2].copy_(d.v);
      }
      Header r;
      r.op = kValues;
      r.key = h.key;
      r.count = d.n;
      r.row_dim = slots;
      r.aux = d.t;
      r.clock = static_cast<int32_t>(d.version);
      lk.unlock();
      sendAll(pg, {{&r, {sizeof(Header), DType::u8}}, {all.data_ptr<float>(), {static_cast<size_t>(all.numel()), DType::f32}}});
      return true;
    }
    case kSetState: {
      const int64_t slots = stateSlots(opts);
      if (w != 0) throw ProtocolError(fmt::format("{}: only worker 0 restores state", who));
      if (h.flags & kFlagRows) {
        int64_t limit_rows, stride;
        {
          std::lock_guard<std::mutex> lk(mu);
          auto it = tables.find(h.key);
          if (it == tables.end()) throw ProtocolError(fmt::format("{}: setState of unknown table {}", who, h.key));
          limit_rows = static_cast<int64_t>(it->second.where.size());
          stride = it->second.stride;
        }
        if (h.count < 0 || h.count > limit_rows || h.row_dim != stride) {
          throw ProtocolError(fmt::format("{}: setState of table {} with {} rows x {} (at most {} x {} here)", who,
                                          h.key, h.count, h.row_dim, limit_rows, stride));
        }
        std::vector<int64_t> ids(static_cast<size_t>(h.count)), steps(static_cast<size_t>(h.count));
        std::vector<float> data(static_cast<size_t>(h.count * stride));
        recvNow(pg, ids.data(), ids.size(), DType::i64);
        recvNow(pg, steps.data(), steps.size(), DType::i64);
        recvNow(pg, data.data(), data.size(), DType::f32);
        {
          std::lock_guard<std::mutex> lk(mu);
          Rows& t = tables.at(h.key);
          std::unique_lock<std::shared_mutex> wl(t.rw);
          t.clear();
          for (size_t i = 0; i < ids.size(); ++i) {
            if (ids[i] < 0 || ids[i] >= t.num_rows || ids[i] % num_servers != index || t.find(ids[i]) >= 0) {
              throw ProtocolError(fmt::format("{}: setState of table {}: row {} is not served here or repeated", who,
                                              h.key, ids[i]));
            }
            const int64_t pos = t.touch(ids[i]);
            t.steps[static_cast<size_t>(pos)] = steps[i];
            std::memcpy(t.at(pos), data.data() + static_cast<int64_t>(i) * stride,
                        static_cast<size_t>(stride) * sizeof(float));
          }
        }
        reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
        return true;
      }
      int64_t n;
      {
        std::lock_guard<std::mutex> lk(mu);
        auto it = dense.find(h.key);
        if (it == dense.end()) throw ProtocolError(fmt::format("{}: setState of unknown partition {}", who, h.key));
        n = it->second.n;
      }
      if (h.count != n || h.row_dim != slots || h.clock < 0 || h.aux < 0) {
        throw ProtocolError(fmt::format("{}: setState of partition {} as {} x {} (here {} x {})", who, h.key,
                                        h.row_dim, h.count, slots, n));
      }
      auto all = at::empty({slots, n}, at::kFloat);
      recvNow(pg, all.data_ptr<float>(), static_cast<size_t>(all.numel()), DType::f32);
      {
        std::lock_guard<std::mutex> lk(mu);
        Dense& d = dense.at(h.key);
        d.value.copy_(all[0]);
        if (slots == 2) d.buf = all[1].clone();
        if (slots == 3) {
          d.m = all[1].clone();
          d.v = all[2].clone();
        }
        d.t = h.aux;
        d.version = h.clock;
        for (auto& p : d.pending) p = at::Tensor();
        d.npending = 0;
      }
      cv.notify_all();
      reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
      return true;
    }
    case kClock: {
      const bool set = h.flags & kFlagSet;
      {
        std::unique_lock<std::mutex> lk(mu);
        int& c = clocks[static_cast<size_t>(w)];
        if (set) {
          // loadState: worker 0 restored this server's state before this message; the others wait for
          // that (their next pushes must not land before the restore), then everyone is acknowledged.
          if (h.clock < 0) throw ProtocolError(fmt::format("{}: clock set to {}", who, h.clock));
          c = h.clock;
          const int k = ++restores[static_cast<size_t>(w)];
          if (w == 0) {
            cv.notify_all();
          } else {
            waitFor(lk, [&] { return restores[0] >= k; },
                    [&] { return fmt::format("worker {}'s loadState waits for worker 0's", w); });
          }
        } else {
          if (h.clock != c + 1) throw ProtocolError(fmt::format("{}: clock {} after {}", who, h.clock, c));
          c = h.clock;
        }
      }
      cv.notify_all();
      if (set) reply(pg, kAck, 0, 0, 0, nullptr, 0, DType::u8);
      return true;
    }
    case kBye: {
      {
        std::lock_guard<std::mutex> lk(mu);
        done[static_cast<size_t>(w)] = true;
      }
      cv.notify_all();
      reply(pg, kAck, 0, 0, 0, nullptr, 0, DType::u8);
      return false;
    }
    default:
      throw ProtocolError(fmt::format("{}: unknown request op {}", who, h.op));
  }
}

void Server::State::serve(int w) {
  std::shared_ptr<ProcessGroup> pg;
  try {
    // The server waits for a worker's next request as long as it takes (a worker may compute for a long
    // time); dead workers are found by the transport at once. Its own waits (BSP/SSP) use opts.timeout.
    // A store connection per worker thread: the rendezvous waits of one do not hold up the others (nor,
    // for a colocated server, the worker in this process).
    pg = ProcessGroup::create(pairStore(store->clone(), w, index), 1, 2, groupOptions(std::chrono::hours(24 * 7)));
    {
      std::lock_guard<std::mutex> lk(mu);
      pgs[static_cast<size_t>(w)] = pg;
      if (failed) pg->abort(fail_msg);
    }
    for (;;) {
      Header h;
      recvNow(*pg, &h, sizeof(Header), DType::u8);
      if (h.magic != kMagic) {
        throw ProtocolError(fmt::format("{} worker {}: bad request magic {:#x}", tag(), w, h.magic));
      }
      if (!handle(w, *pg, h)) break;
    }
  } catch (const std::exception& e) {
    bool mine = false;
    std::string msg;
    {
      std::lock_guard<std::mutex> lk(mu);
      mine = !failed;
      msg = failed ? fail_msg : std::string(e.what());
    }
    if (mine && msg.find(tag()) == std::string::npos) msg = fmt::format("{} worker {}: {}", tag(), w, msg);
    // Tell this worker why (it reads the error at its next reply), then everyone else.
    if (pg) {
      try {
        std::string m = msg.substr(0, static_cast<size_t>(kMaxErrorBytes));
        Header h;
        h.op = kError;
        h.count = static_cast<int64_t>(m.size());
        auto w1 = pg->send(&h, sizeof(Header), DType::u8, 0);
        auto w2 = pg->send(m.data(), m.size(), DType::u8, 0);
        w1->wait(std::chrono::seconds(2));
        w2->wait(std::chrono::seconds(2));
      } catch (...) {
      }
    }
    if (mine) {
      fail(msg, sameType(e, msg));
    }
  }
}

Server::Server(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers, PSOptions opts)
    : state_(std::make_unique<State>()) {
  DTRAIN_CHECK(num_servers >= 1 && index >= 0 && index < num_servers, InvalidArgument,
               "ps::Server: index {} of {} servers", index, num_servers);
  DTRAIN_CHECK(num_workers >= 1, InvalidArgument, "ps::Server: {} workers", num_workers);
  DTRAIN_CHECK(opts.staleness >= 0, InvalidArgument, "ps: staleness {} < 0", opts.staleness);
  DTRAIN_CHECK(store != nullptr, InvalidArgument, "ps::Server: no store");
  auto& s = *state_;
  s.store = std::move(store);
  s.index = index;
  s.num_servers = num_servers;
  s.num_workers = num_workers;
  s.opts = opts;
  s.clocks.assign(static_cast<size_t>(num_workers), 0);
  s.restores.assign(static_cast<size_t>(num_workers), 0);
  s.done.assign(static_cast<size_t>(num_workers), false);
  s.pgs.resize(static_cast<size_t>(num_workers));
}

Server::~Server() = default;

void Server::abort(const std::string& reason) {
  const std::string msg = fmt::format("{} {}", state_->tag(), reason);
  state_->fail(msg, std::make_exception_ptr(Error(msg)));
}

void Server::run() {
  auto& s = *state_;
  std::vector<std::thread> threads;
  for (int w = 0; w < s.num_workers; ++w) threads.emplace_back([&s, w] { s.serve(w); });
  for (auto& t : threads) t.join();
  if (s.first_error) std::rethrow_exception(s.first_error);
}

ColocatedServer::ColocatedServer(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers,
                                 PSOptions opts)
    : server_(std::make_unique<Server>(std::move(store), index, num_servers, num_workers, opts)),
      timeout_(opts.timeout) {
  thread_ = std::thread([this] {
    try {
      server_->run();
    } catch (...) {
      error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      ended_ = true;
    }
    cv_.notify_all();
  });
}

ColocatedServer::~ColocatedServer() {
  if (!thread_.joinable()) return;
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, timeout_, [&] { return ended_; })) {
    lk.unlock();
    server_->abort(fmt::format("colocated server stopped: its process is shutting down and the workers did not "
                               "finish within {} ms",
                               timeout_.count()));
  } else {
    lk.unlock();
  }
  thread_.join();
}

void ColocatedServer::join() {
  if (thread_.joinable()) thread_.join();
  if (error_) std::rethrow_exception(error_);
}

// ------------------------------------------------------------------------------------------------
// Environment
// ------------------------------------------------------------------------------------------------

namespace {
int envInt(const char* name, int def) {
  const char* v = std::getenv(name);
  if (!v || !*v) return def;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > INT_MAX) throw RendezvousError(fmt::format("{}='{}' is not a valid count", name, v));
  return static_cast<int>(x);
}
}  // namespace

std::shared_ptr<comm::Store> storeFromEnv(std::chrono::milliseconds timeout) {
  // The same address as dtrain::init() (MASTER_ADDR/MASTER_PORT checked at once, Slurm's first node).
  comm::StoreAddress where = comm::storeAddress(comm::InitOptions{});
  const std::string& host = where.host;
  const int port = where.port;
  int restart = envInt("DTRAIN_RESTART_COUNT", envInt("TORCHELASTIC_RESTART_COUNT", 0));
  std::shared_ptr<comm::Store> base;
  try {
    base = std::make_shared<comm::TcpStore>(host, static_cast<uint16_t>(port), timeout);
  } catch (const Error& e) {
    throw RendezvousError(fmt::format("ps: cannot reach the store at {}:{}: {}", host, port, e.what()));
  }
  return std::make_shared<comm::PrefixStore>(fmt::format("gen{}/ps", restart), base);
}

bool runServerIfRole(PSOptions opts) {
  const char* role = std::getenv("DTRAIN_ROLE");
  if (!role || std::string(role) != "server") return false;
  int index = envInt("DTRAIN_SERVER_INDEX", -1);
  int servers = envInt("DTRAIN_NUM_SERVERS", -1);
  // With local aggregation the servers' workers are the hosts.
  const char* count_var = opts.local_aggregation ? "DTRAIN_NUM_NODES" : "DTRAIN_NUM_WORKERS";
  int workers = envInt(count_var, -1);
  if (index < 0 || servers < 1 || workers < 1) {
    throw RendezvousError(fmt::format("ps: DTRAIN_ROLE=server needs DTRAIN_SERVER_INDEX, DTRAIN_NUM_SERVERS and {}",
                                      count_var));
  }
  Server server(storeFromEnv(), index, servers, workers, opts);
  server.run();
  return true;
}

}  // namespace dtrain::ps
