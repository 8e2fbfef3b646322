// Parameter server: see include/dtrain/ps.h for the model, the protocol and the consistency rules.
//
// Layout of this file: the wire header and error helpers; the Worker (partitioning, requests, replies);
// the Server (one thread per worker connection, shared partition state under one mutex + condition
// variable, the optimizer updates); the environment helpers.
#include "dtrain/ps.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "dtrain/comm/error.h"

namespace dtrain::ps {
namespace {

using comm::DType;
using comm::ProcessGroup;
using comm::WorkPtr;
using Clock = std::chrono::steady_clock;

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
  kAck = 20,
  kValues = 21,
  kError = 22,
};
constexpr uint16_t kFlagInit = 1;
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
    case kAck: return "ack";
    case kValues: return "values";
    case kError: return "error";
    default: return "unknown";
  }
}

int64_t partLimit(const PSOptions& o) { return std::max<int64_t>(1, static_cast<int64_t>(o.partition_bytes / 4)); }
int64_t maxRowsPerMessage(const PSOptions& o, int64_t dim) { return std::max<int64_t>(1, partLimit(o) / dim); }

// Rethrows the current exception as the same dtrain type with `prefix` in front of its message.
[[noreturn]] void rethrowPrefixed(const std::string& prefix) {
  try {
    throw;
  } catch (const ProtocolError& e) {
    throw ProtocolError(prefix + e.what());
  } catch (const TimeoutError& e) {
    throw TimeoutError(prefix + e.what());
  } catch (const IoError& e) {
    throw IoError(prefix + e.what());
  } catch (const RendezvousError& e) {
    throw RendezvousError(prefix + e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(prefix + e.what());
  } catch (const Error& e) {
    throw Error(prefix + e.what());
  } catch (const std::exception& e) {
    throw Error(prefix + e.what());
  }
}

// An exception of e's dtrain type carrying msg.
std::exception_ptr sameType(const std::exception& e, const std::string& msg) {
  if (dynamic_cast<const ProtocolError*>(&e)) return std::make_exception_ptr(ProtocolError(msg));
  if (dynamic_cast<const TimeoutError*>(&e)) return std::make_exception_ptr(TimeoutError(msg));
  if (dynamic_cast<const IoError*>(&e)) return std::make_exception_ptr(IoError(msg));
  if (dynamic_cast<const RendezvousError*>(&e)) return std::make_exception_ptr(RendezvousError(msg));
  if (dynamic_cast<const InvalidArgument*>(&e)) return std::make_exception_ptr(InvalidArgument(msg));
  return std::make_exception_ptr(Error(msg));
}

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
      rethrowPrefixed(fmt::format("[worker {}] server {}: ", rank_, s));
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
void sendToAllServers(Batch& b, const Conns& conns, uint16_t op, int32_t clock) {
  for (size_t s = 0; s < conns.size(); ++s) {
    Header h;
    h.op = op;
    h.clock = clock;
    b.sendHeader(static_cast<int>(s), *conns[s]->pg, h);
  }
}

}  // namespace

Worker::Worker(std::shared_ptr<comm::Store> store, int rank, int num_workers, int num_servers, PSOptions opts)
    : rank_(rank), num_workers_(num_workers), num_servers_(num_servers), opts_(opts) {
  DTRAIN_CHECK(num_workers >= 1 && rank >= 0 && rank < num_workers, InvalidArgument,
               "ps::Worker: rank {} of {} workers", rank, num_workers);
  DTRAIN_CHECK(num_servers >= 1, InvalidArgument, "ps::Worker: {} servers", num_servers);
  DTRAIN_CHECK(opts.staleness >= 0, InvalidArgument, "ps: staleness {} < 0", opts.staleness);
  DTRAIN_CHECK(store != nullptr, InvalidArgument, "ps::Worker: no store");
  load_.assign(static_cast<size_t>(num_servers), 0);
  auto grace = std::max<std::chrono::milliseconds>(std::chrono::seconds(1), opts.timeout / 4);
  auto gopts = groupOptions(opts.timeout + grace);
  for (int s = 0; s < num_servers; ++s) {
    auto c = std::make_unique<Conn>();
    c->server = s;
    try {
      c->pg = ProcessGroup::create(pairStore(store, rank, s), 0, 2, gopts);
    } catch (...) {
      rethrowPrefixed(fmt::format("[worker {}] connecting to server {}: ", rank, s));
    }
    conns_.push_back(std::move(c));
  }
}

Worker::~Worker() {
  try {
    finish();
  } catch (...) {
  }
}

const Worker::Entry& Worker::entry(const std::string& name, bool sparse) const {
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
  Batch b(rank_, sent_, received_);
  const float* data = t.data_ptr<float>();
  for (const auto& p : e.parts) {
    Header h;
    h.op = kDeclare;
    h.key = p.key;
    h.count = p.count;
    h.flags = rank_ == 0 ? kFlagInit : 0;
    auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
    b.sendHeader(p.server, pg, h);
    if (rank_ == 0) b.send(p.server, pg, data + p.offset, p.count, DType::f32);
  }
  b.waitAll();
  for (const auto& p : e.parts) b.recvReply(p.server, *conns_[static_cast<size_t>(p.server)]->pg, kAck);
  entries_.emplace(name, std::move(e));
}

void Worker::declareRows(const std::string& name, int64_t num_rows, int64_t dim) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: declareRows after finish()");
  DTRAIN_CHECK(!entries_.count(name), InvalidArgument, "ps: '{}' declared twice", name);
  DTRAIN_CHECK(num_rows > 0 && dim > 0, InvalidArgument, "ps: table '{}' of {} x {}", name, num_rows, dim);
  DTRAIN_CHECK(dim <= partLimit(opts_), InvalidArgument, "ps: table '{}' rows of {} floats exceed partition_bytes",
               name, dim);
  Entry e;
  e.sparse = true;
  e.num_rows = num_rows;
  e.dim = dim;
  e.key = next_key_++;
  Batch b(rank_, sent_, received_);
  for (int s = 0; s < num_servers_; ++s) {
    Header h;
    h.op = kDeclareRows;
    h.key = e.key;
    h.count = num_rows;
    h.row_dim = dim;
    h.flags = rank_ == 0 ? kFlagInit : 0;
    b.sendHeader(s, *conns_[static_cast<size_t>(s)]->pg, h);
  }
  b.waitAll();
  for (int s = 0; s < num_servers_; ++s) b.recvReply(s, *conns_[static_cast<size_t>(s)]->pg, kAck);
  entries_.emplace(name, std::move(e));
}

void Worker::push(const std::string& name, const at::Tensor& grad) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: push after finish()");
  const auto& e = entry(name, false);
  auto g = floatCpu(grad, "gradient");
  DTRAIN_CHECK_EQ(g.numel(), e.numel, fmt::format("ps: push '{}': numel", name));
  Batch b(rank_, sent_, received_);
  const float* data = g.data_ptr<float>();
  for (const auto& p : e.parts) {
    Header h;
    h.op = kPush;
    h.key = p.key;
    h.clock = clock_;
    h.count = p.count;
    auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
    b.sendHeader(p.server, pg, h);
    b.send(p.server, pg, data + p.offset, p.count, DType::f32);
  }
  b.waitAll();
}

void Worker::pullImpl(const std::string& name, const at::Tensor* grad, at::Tensor& out) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: pull after finish()");
  const auto& e = entry(name, false);
  DTRAIN_CHECK(out.defined() && out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
               InvalidArgument, "ps: pull '{}': out must be a contiguous float32 CPU tensor", name);
  DTRAIN_CHECK_EQ(out.numel(), e.numel, fmt::format("ps: pull '{}': numel", name));
  at::Tensor g;
  if (grad) {
    g = floatCpu(*grad, "gradient");
    DTRAIN_CHECK_EQ(g.numel(), e.numel, fmt::format("ps: pushPull '{}': numel", name));
  }
  float* dst = out.data_ptr<float>();
  // Sends a partition's request (and, for pushPull, its gradient) to its server.
  auto request = [&](Batch& b, const Part& p) {
    Header h;
    h.op = grad ? kPushPull : kPull;
    h.key = p.key;
    h.clock = clock_;
    h.count = p.count;
    auto& pg = *conns_[static_cast<size_t>(p.server)]->pg;
    b.sendHeader(p.server, pg, h);
    if (grad) b.send(p.server, pg, g.data_ptr<float>() + p.offset, p.count, DType::f32);
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

void Worker::pull(const std::string& name, at::Tensor& out) { pullImpl(name, nullptr, out); }

void Worker::pushPull(const std::string& name, const at::Tensor& grad, at::Tensor& out) {
  pullImpl(name, &grad, out);
}

void Worker::clock() {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: clock after finish()");
  ++clock_;
  Batch b(rank_, sent_, received_);
  sendToAllServers(b, conns_, kClock, clock_);
  b.waitAll();
}

namespace {
// Row ids checked and grouped by owning server (row % S): positions into the caller's rows.
std::vector<std::vector<int64_t>> groupRows(const at::Tensor& rows, const Worker::Entry& e, int num_servers,
                                           const std::string& name) {
  DTRAIN_CHECK(rows.defined() && rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.device().is_cpu(),
               InvalidArgument, "ps: rows of '{}' must be a 1-d int64 CPU tensor", name);
  auto r = rows.contiguous();
  const int64_t* ids = r.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> by(static_cast<size_t>(num_servers));
  for (int64_t i = 0; i < r.numel(); ++i) {
    DTRAIN_CHECK(ids[i] >= 0 && ids[i] < e.num_rows, InvalidArgument, "ps: row {} of '{}' out of range [0, {})",
                 ids[i], name, e.num_rows);
    by[static_cast<size_t>(ids[i] % num_servers)].push_back(i);
  }
  return by;
}
}  // namespace

void Worker::pushRows(const std::string& name, const at::Tensor& rows, const at::Tensor& grads) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: pushRows after finish()");
  const auto& e = entry(name, true);
  auto g = floatCpu(grads, "row gradients");
  DTRAIN_CHECK(g.dim() == 2 && g.size(0) == rows.numel() && g.size(1) == e.dim, InvalidArgument,
               "ps: pushRows '{}': grads must be [{}, {}]", name, rows.numel(), e.dim);
  auto by = groupRows(rows, e, num_servers_, name);
  auto ids = rows.contiguous();
  const int64_t chunk = maxRowsPerMessage(opts_, e.dim);
  // Owned copies stay alive until every send completed.
  std::vector<at::Tensor> keep;
  Batch b(rank_, sent_, received_);
  for (int s = 0; s < num_servers_; ++s) {
    const auto& pos = by[static_cast<size_t>(s)];
    for (size_t start = 0; start < pos.size(); start += static_cast<size_t>(chunk)) {
      size_t n = std::min(pos.size() - start, static_cast<size_t>(chunk));
      auto idx = at::from_blob(const_cast<int64_t*>(pos.data() + start), {static_cast<int64_t>(n)}, at::kLong).clone();
      auto sid = ids.index_select(0, idx).contiguous();
      auto sg = g.index_select(0, idx).contiguous();
      keep.push_back(sid);
      keep.push_back(sg);
      Header h;
      h.op = kPushRows;
      h.key = e.key;
      h.clock = clock_;
      h.count = static_cast<int64_t>(n);
      h.row_dim = e.dim;
      auto& pg = *conns_[static_cast<size_t>(s)]->pg;
      b.sendHeader(s, pg, h);
      b.send(s, pg, sid.data_ptr<int64_t>(), sid.numel(), DType::i64);
      b.send(s, pg, sg.data_ptr<float>(), sg.numel(), DType::f32);
    }
  }
  b.waitAll();
}

at::Tensor Worker::pullRows(const std::string& name, const at::Tensor& rows) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: pullRows after finish()");
  const auto& e = entry(name, true);
  auto by = groupRows(rows, e, num_servers_, name);
  auto ids = rows.contiguous();
  auto out = at::empty({rows.numel(), e.dim}, at::kFloat);
  const int64_t chunk = maxRowsPerMessage(opts_, e.dim);
  struct Req {
    int s;
    at::Tensor idx, sid, values;
  };
  std::vector<Req> reqs;
  Batch b(rank_, sent_, received_);
  for (int s = 0; s < num_servers_; ++s) {
    const auto& pos = by[static_cast<size_t>(s)];
    for (size_t start = 0; start < pos.size(); start += static_cast<size_t>(chunk)) {
      size_t n = std::min(pos.size() - start, static_cast<size_t>(chunk));
      Req r;
      r.s = s;
      r.idx = at::from_blob(const_cast<int64_t*>(pos.data() + start), {static_cast<int64_t>(n)}, at::kLong).clone();
      r.sid = ids.index_select(0, r.idx).contiguous();
      r.values = at::empty({static_cast<int64_t>(n), e.dim}, at::kFloat);
      Header h;
      h.op = kPullRows;
      h.key = e.key;
      h.clock = clock_;
      h.count = static_cast<int64_t>(n);
      h.row_dim = e.dim;
      auto& pg = *conns_[static_cast<size_t>(s)]->pg;
      b.sendHeader(s, pg, h);
      b.send(s, pg, r.sid.data_ptr<int64_t>(), r.sid.numel(), DType::i64);
      reqs.push_back(std::move(r));
    }
  }
  b.waitAll();
  for (auto& r : reqs) {
    auto& pg = *conns_[static_cast<size_t>(r.s)]->pg;
    Header h = b.recvReply(r.s, pg, kValues);
    if (h.key != e.key || h.count != r.values.size(0) || h.row_dim != e.dim) {
      throw ProtocolError(fmt::format("[worker {}] server {}: pullRows reply {} x {} for table {}, expected {} x {}",
                                      rank_, r.s, h.count, h.row_dim, h.key, r.values.size(0), e.dim));
    }
    b.recv(r.s, pg, r.values.data_ptr<float>(), r.values.numel(), DType::f32);
    out.index_copy_(0, r.idx, r.values);
  }
  return out;
}

void Worker::finish() {
  if (finished_) return;
  finished_ = true;
  Batch b(rank_, sent_, received_);
  sendToAllServers(b, conns_, kBye, clock_);
  b.waitAll();
  for (int s = 0; s < num_servers_; ++s) b.recvReply(s, *conns_[static_cast<size_t>(s)]->pg, kAck);
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
  struct Rows {
    int64_t num_rows = 0, dim = 0;
    // Per row: value, then optimizer state (momentum buffer; or adam's m and v).
    std::unordered_map<int64_t, std::vector<float>> rows;
    std::unordered_map<int64_t, int64_t> steps;  // adam
  };

  std::shared_ptr<comm::Store> store;
  int index, num_servers, num_workers;
  PSOptions opts;

  std::mutex mu;
  std::condition_variable cv;
  std::map<uint32_t, Dense> dense;
  std::map<uint32_t, Rows> tables;
  std::vector<int> clocks;
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

  // The update of one sparse row (lock held). Each push is applied at once.
  void applyRow(Rows& t, int64_t id, const float* g) {
    const int64_t dim = t.dim;
    int slots = opts.update == PSOptions::Update::adam ? 3
                : (opts.update == PSOptions::Update::sgd && opts.momentum != 0) ? 2
                                                                                 : 1;
    auto& r = t.rows[id];
    if (r.empty()) r.assign(static_cast<size_t>(dim * slots), 0.0f);
    float* p = r.data();
    switch (opts.update) {
      case PSOptions::Update::sum_only:
        for (int64_t i = 0; i < dim; ++i) p[i] += g[i];
        break;
      case PSOptions::Update::sgd:
        if (opts.momentum != 0) {
          float* b = p + dim;
          bool first = !t.steps.count(id);
          t.steps[id] = 1;
          for (int64_t i = 0; i < dim; ++i) {
            b[i] = first ? g[i] : static_cast<float>(opts.momentum) * b[i] + g[i];
            p[i] -= static_cast<float>(opts.lr) * b[i];
          }
        } else {
          for (int64_t i = 0; i < dim; ++i) p[i] -= static_cast<float>(opts.lr) * g[i];
        }
        break;
      case PSOptions::Update::adam: {
        float* m = p + dim;
        float* v = p + 2 * dim;
        int64_t step = ++t.steps[id];
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
        Rows t;
        t.num_rows = h.count;
        t.dim = h.row_dim;
        tables.emplace(h.key, std::move(t));
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
      std::vector<int64_t> ids(static_cast<size_t>(n));
      recvNow(pg, ids.data(), static_cast<size_t>(n), DType::i64);
      std::vector<float> vals(static_cast<size_t>(n * dim));
      if (h.op == kPushRows) recvNow(pg, vals.data(), vals.size(), DType::f32);
      std::unique_lock<std::mutex> lk(mu);
      Rows& t = tables.at(h.key);
      for (int64_t id : ids) {
        if (id < 0 || id >= t.num_rows || id % num_servers != index) {
          throw ProtocolError(fmt::format("{}: row {} of table {} is not served here ({} rows, {} servers)", who, id,
                                          h.key, t.num_rows, num_servers));
        }
      }
      if (h.op == kPushRows) {
        for (int64_t i = 0; i < n; ++i) applyRow(t, ids[static_cast<size_t>(i)], vals.data() + i * dim);
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
      for (int64_t i = 0; i < n; ++i) {
        auto it = t.rows.find(ids[static_cast<size_t>(i)]);
        float* dst = vals.data() + i * dim;
        if (it == t.rows.end()) {
          std::fill(dst, dst + dim, 0.0f);
        } else {
          std::copy(it->second.begin(), it->second.begin() + dim, dst);
        }
      }
      lk.unlock();
      reply(pg, kValues, h.key, n, dim, vals.data(), vals.size(), DType::f32);
      return true;
    }
    case kClock: {
      {
        std::lock_guard<std::mutex> lk(mu);
        int& c = clocks[static_cast<size_t>(w)];
        if (h.clock != c + 1) throw ProtocolError(fmt::format("{}: clock {} after {}", who, h.clock, c));
        c = h.clock;
      }
      cv.notify_all();
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
    pg = ProcessGroup::create(pairStore(store, w, index), 1, 2, groupOptions(std::chrono::hours(24 * 7)));
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
  s.done.assign(static_cast<size_t>(num_workers), false);
  s.pgs.resize(static_cast<size_t>(num_workers));
}

Server::~Server() = default;

void Server::run() {
  auto& s = *state_;
  std::vector<std::thread> threads;
  for (int w = 0; w < s.num_workers; ++w) threads.emplace_back([&s, w] { s.serve(w); });
  for (auto& t : threads) t.join();
  if (s.first_error) std::rethrow_exception(s.first_error);
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
  const char* addr = std::getenv("MASTER_ADDR");
  std::string host = addr && *addr ? addr : "127.0.0.1";
  int port = envInt("MASTER_PORT", 29500);
  int restart = envInt("DTRAIN_RESTART_COUNT", 0);
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
  int workers = envInt("DTRAIN_NUM_WORKERS", -1);
  if (index < 0 || servers < 1 || workers < 1) {
    throw RendezvousError("ps: DTRAIN_ROLE=server needs DTRAIN_SERVER_INDEX, DTRAIN_NUM_SERVERS and DTRAIN_NUM_WORKERS");
  }
  Server server(storeFromEnv(), index, servers, workers, opts);
  server.run();
  return true;
}

}  // namespace dtrain::ps
