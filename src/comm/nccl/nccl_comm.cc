// The NCCL backend (dtrain/comm/nccl.h): a non-blocking communicator per process group, ops on the
// communicator's own stream ordered after the caller's stream by an event, and a watchdog thread that
// completes each op's Work when its end event fires, and aborts the communicator on a deadline or an
// asynchronous NCCL error, so that a stuck or dead peer is an error, never a hang (wait by polling the
// event and NCCL's asynchronous error, never by synchronizing a stream).
// The collective algorithms are NCCL's; this file only sets up, orders, watches and names. Its CUDA and
// NCCL calls go through nccl::DeviceApi (device_api.h), so that the tests can drive every path here with
// a fake, on machines without a GPU and under the sanitizers.
//
// Locking: `issue_mu` makes issuing one step (fingerprint, launch, queue), so that two threads cannot
// launch in different orders on different ranks. `mu` guards the communicator handle and the state, and is
// held for every call on the communicator, so that no thread is inside NCCL when it is aborted (NCCL's
// rule for a safe abort). After an abort the handle is cleared, and every user checks it under `mu`.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/nccl/device_api.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::comm {

using Clock = std::chrono::steady_clock;
using nccl::Handle;
using nccl::Status;

namespace {

// How long an abort, a finalize or a destroy may stay in progress (then the communicator is left as it
// is, and the error says so): the group's deadline, at most this.
constexpr auto kTeardownLimit = std::chrono::seconds(10);
constexpr auto kPoll = std::chrono::microseconds(50);

// What the ranks compare before every op (see nccl.h): equal on every rank or the op fails everywhere.
struct Fingerprint {
  uint64_t seq = 0;
  uint64_t count = 0;
  int32_t root = -1;
  uint8_t op = 0, dtype = 0, rop = 0xFF, pad = 0;
  bool operator==(const Fingerprint& o) const { return std::memcmp(this, &o, sizeof(*this)) == 0; }
};

const char* opName(uint8_t op) {
  static const char* kNames[] = {"allreduce", "broadcast", "allgather", "reduce_scatter"};
  return op < 4 ? kNames[op] : "?";
}

std::string describe(const Fingerprint& f) {
  std::string s = fmt::format("nccl {} seq={} {} x {}", opName(f.op), f.seq, dtypeName(static_cast<DType>(f.dtype)), f.count);
  if (f.rop != 0xFF) s += std::string(" ") + reduceOpName(static_cast<ReduceOp>(f.rop));
  if (f.root >= 0) s += fmt::format(" root {}", f.root);
  return s;
}

Fingerprint fingerprintOf(const nccl::Launch& l) {
  Fingerprint f;
  f.op = static_cast<uint8_t>(l.call);
  f.count = l.count;
  f.dtype = static_cast<uint8_t>(l.dtype);
  if (l.call == nccl::Call::allreduce || l.call == nccl::Call::reduce_scatter) f.rop = static_cast<uint8_t>(l.op);
  if (l.call == nccl::Call::broadcast) f.root = l.root;
  return f;
}

// An op on the GPU: its Work, its end event, its deadline.
struct Pending {
  std::shared_ptr<Work> work;
  Handle end = nullptr;
  Clock::time_point deadline;
};

// Sets the device for the calls of one scope, and puts the caller's back afterwards.
class DeviceGuard {
 public:
  DeviceGuard(nccl::DeviceApi& api, int device) : api_(api) {
    int current = -1;
    if (api_.currentDevice(&current).kind == Status::ok && current == device) return;
    Status s = api_.setDevice(device);
    if (s.kind != Status::ok) throw Error(fmt::format("cudaSetDevice({}): {}", device, s.text));
    previous_ = current;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) api_.setDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  nccl::DeviceApi& api_;
  int previous_ = -1;
};

}  // namespace

struct NcclComm::Impl {
  std::shared_ptr<nccl::DeviceApi> api;
  ProcessGroup* pg = nullptr;  // outlives this (the communicator is one of its attachments)
  int rank = 0, size = 1, device = 0;
  Duration timeout{};
  bool check_calls = false;  // compare every op's fingerprint first (GroupOptions::check_fingerprints)
  std::string ranks_text;    // "group 'world' of 4 ranks" for errors
  Handle stream = nullptr;
  std::mutex issue_mu;  // one issuer at a time (see the top of this file)
  uint64_t seq = 0;     // guarded by issue_mu
  std::mutex mu;        // guards what follows
  std::condition_variable cv;
  Handle comm = nullptr;  // cleared once aborted or destroyed
  std::deque<Pending> pending;
  std::exception_ptr broken;  // the first failure: later ops fail with it
  bool stopping = false;
  std::string teardown_problem;  // an abort that did not finish (kept for the destructor's log line)
  std::thread watchdog;

  std::string where() const { return fmt::format("[rank {}] on cuda:{}", rank, device); }
  double seconds() const { return std::chrono::duration<double>(timeout).count(); }
  Clock::duration teardownLimit() const {
    return std::min<Clock::duration>(std::chrono::duration_cast<Clock::duration>(timeout), kTeardownLimit);
  }

  void check(const Status& s, const std::string& what) const {
    if (s.kind != Status::ok) throw Error(fmt::format("{} {}: {}", where(), what, s.text));
  }

  // Holding `lk` (on mu): polls the communicator while a call answered in_progress, releasing the lock
  // between polls. Throws TimeoutError past `deadline`, or the group's failure if it broke meanwhile.
  Status settle(std::unique_lock<std::mutex>& lk, Status s, Clock::time_point deadline, const std::string& what) {
    while (s.kind == Status::in_progress) {
      if (Clock::now() > deadline)
        throw TimeoutError(fmt::format("{} {} timed out after {} s waiting for the ranks of the {}", where(), what,
                                       seconds(), ranks_text));
      lk.unlock();
      std::this_thread::sleep_for(kPoll);
      lk.lock();
      if (broken) std::rethrow_exception(broken);
      s = api->asyncError(comm);
    }
    return s;
  }

  // Holding mu: polls communicator c while a teardown call (abort, finalize) answered in progress, for
  // at most teardownLimit(); the last answer.
  Status finishTeardownCall(Handle c, Status s) {
    const auto until = Clock::now() + teardownLimit();
    while (s.kind == Status::in_progress && Clock::now() < until) {
      std::this_thread::sleep_for(kPoll);
      s = api->asyncError(c);
    }
    return s;
  }

  // Holding mu: aborts the communicator, polling while NCCL answers in progress, and forgets it. Returns
  // "" or why the abort did not finish.
  std::string abortLocked() {
    if (!comm) return "";
    Handle c = comm;
    comm = nullptr;  // never used again, whatever the abort answers
    const Status s = finishTeardownCall(c, api->abort(c));
    if (s.kind == Status::in_progress)
      return fmt::format("ncclCommAbort was still in progress after {} s (the communicator is left to the process)",
                         std::chrono::duration<double>(teardownLimit()).count());
    return s.kind == Status::failed ? "ncclCommAbort: " + s.text : "";
  }

  // The one failure path: keep the first error, abort the communicator (no kernel may still use a
  // buffer once its Work has failed), then fail every pending op with `e`.
  void breakDown(const std::exception_ptr& e) {
    std::deque<Pending> left;
    {
      std::lock_guard<std::mutex> g(mu);
      if (!broken) broken = e;
      std::string problem = abortLocked();
      if (!problem.empty() && teardown_problem.empty()) teardown_problem = problem;
      left.swap(pending);
    }
    cv.notify_all();
    for (auto& p : left) {
      if (p.end) api->destroyEvent(p.end);
      p.work->finish(e);
    }
  }

  // Every rank's fingerprint over the host group: a mismatch fails every rank, naming who called what.
  void compare(const Fingerprint& mine) {
    if (size == 1) return;
    std::vector<Fingerprint> all(static_cast<size_t>(size));
    pg->allgather(&mine, all.data(), sizeof(Fingerprint), DType::u8)->wait();
    for (int r = 0; r < size; ++r) {
      if (all[static_cast<size_t>(r)] == mine) continue;
      throw ProtocolError(fmt::format("[rank {}] collective mismatch on the NCCL communicator: rank {} called {}, "
                                      "rank {} called {}", rank, rank, describe(mine), r, describe(all[static_cast<size_t>(r)])));
    }
  }

  // Orders the communicator's stream after the caller's, launches, records the end event and queues the
  // op for the watchdog. Holding lk.
  void enqueue(std::unique_lock<std::mutex>& lk, const std::shared_ptr<Work>& work, Handle caller,
               const nccl::Launch& call, Clock::time_point deadline, const std::string& what) {
    if (broken) std::rethrow_exception(broken);
    Handle ready = nullptr, end = nullptr;
    check(api->createEvent(&ready), what + ": cudaEventCreate");
    Status s = api->recordEvent(ready, caller);
    if (s.kind == Status::ok) s = api->streamWaitEvent(stream, ready);
    api->destroyEvent(ready);  // released once the wait has been enqueued
    check(s, what + ": ordering after the caller's stream");
    check(settle(lk, api->launch(comm, stream, call), deadline, what), what);
    check(api->createEvent(&end), what + ": cudaEventCreate");
    s = api->recordEvent(end, stream);
    if (s.kind != Status::ok) {
      api->destroyEvent(end);
      check(s, what + ": cudaEventRecord");
    }
    pending.push_back(Pending{work, end, deadline});
    cv.notify_all();
  }

  WorkPtr launch(void* caller, const nccl::Launch& call) {
    std::lock_guard<std::mutex> issue(issue_mu);
    Fingerprint f = fingerprintOf(call);
    f.seq = seq++;
    const std::string what = describe(f);
    const Clock::time_point deadline = Clock::now() + timeout;
    auto work = std::make_shared<Work>(what, deadline, rank);
    try {
      {
        std::lock_guard<std::mutex> g(mu);
        if (broken) std::rethrow_exception(broken);
      }
      if (check_calls) compare(f);
      DeviceGuard guard(*api, device);
      std::unique_lock<std::mutex> lk(mu);
      enqueue(lk, work, caller, call, deadline, what);
    } catch (...) {
      breakDown(std::current_exception());
      std::exception_ptr first;
      {
        std::lock_guard<std::mutex> g(mu);
        first = broken;
      }
      work->finish(first);
    }
    return work;
  }

  // Why the front op failed, or "" while it may still finish. Holding mu.
  std::string frontProblem(const Pending& p, Status q) {
    if (q.kind == Status::failed) return fmt::format("{} failed on the GPU: {}", p.work->describe(), q.text);
    if (comm) {
      Status a = api->asyncError(comm);
      if (a.kind == Status::failed) return fmt::format("{}: NCCL's asynchronous error: {}", p.work->describe(), a.text);
    }
    if (Clock::now() > p.deadline)
      return fmt::format("{} timed out after {} s: a rank of the {} did not join it or died inside it",
                         p.work->describe(), seconds(), ranks_text);
    return "";
  }

  // The watchdog: completes finished ops in order, and turns deadlines and NCCL's asynchronous errors
  // into failures (after aborting, which unblocks kernels waiting for a peer that will not come).
  void watch() {
    api->setDevice(device);  // this thread's own device, for its event queries
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      if (pending.empty()) {
        if (stopping) return;
        cv.wait_for(lk, std::chrono::milliseconds(5));
        continue;
      }
      // Only this thread pops; breakDown takes the whole queue under mu, so the front checked here is
      // still the front when it is popped.
      Status q = api->queryEvent(pending.front().end);
      if (q.kind == Status::ok) {
        Pending done = std::move(pending.front());
        pending.pop_front();
        lk.unlock();
        api->destroyEvent(done.end);
        done.work->finish();
        lk.lock();
        continue;
      }
      const Pending& p = pending.front();
      const std::string why = frontProblem(p, q);
      if (why.empty()) {
        cv.wait_for(lk, kPoll);
        continue;
      }
      const bool late = Clock::now() > p.deadline && q.kind != Status::failed;
      const std::string text = fmt::format("{} {}; the communicator was aborted", where(), why);
      lk.unlock();
      breakDown(late ? std::make_exception_ptr(TimeoutError(text)) : std::make_exception_ptr(Error(text)));
      lk.lock();
    }
  }

  // Ends the communicator within teardownLimit(): finalize (flushes what was issued), then destroy; an
  // abort instead when it broke, or when finalize does not finish in time. Never throws (a destructor's).
  void teardown() {
    std::lock_guard<std::mutex> g(mu);
    if (!comm) return;
    Status s = finishTeardownCall(comm, api->finalize(comm));
    if (s.kind != Status::ok) {
      std::string problem = abortLocked();
      teardown_problem = s.kind == Status::failed ? "ncclCommFinalize: " + s.text
                                                  : "ncclCommFinalize did not finish in time (aborted instead)";
      if (!problem.empty()) teardown_problem += "; " + problem;
      return;
    }
    Handle c = comm;
    comm = nullptr;
    s = api->destroy(c);
    if (s.kind != Status::ok) teardown_problem = "ncclCommDestroy: " + s.text;
  }
};

namespace nccl {

std::shared_ptr<NcclComm> createComm(ProcessGroup& pg, int device, std::shared_ptr<DeviceApi> api) {
  auto m = std::make_unique<NcclComm::Impl>();
  m->api = std::move(api);
  m->pg = &pg;
  m->rank = pg.rank();
  m->size = pg.size();
  m->device = device;
  m->timeout = pg.options().timeout;
  m->check_calls = pg.options().check_fingerprints;
  m->ranks_text = fmt::format("group '{}' of {} ranks", pg.options().name, pg.size());
  const std::string what = fmt::format("NCCL communicator of {} ranks", m->size);
  DeviceApi& a = *m->api;
  // Every rank says first whether it can take part (a GPU, the device, an id for rank 0): one that cannot
  // must not leave the others waiting for it in the id's broadcast or in NCCL's initialisation.
  std::string problem;
  UniqueId id;
  std::unique_ptr<DeviceGuard> guard;
  try {
    int count = 0;
    m->check(a.deviceCount(&count), what + ": no usable CUDA device");
    DTRAIN_CHECK(device >= 0 && device < count, InvalidArgument, "[rank {}] {}: cuda:{} does not exist ({} visible)",
                 m->rank, what, device, count);
    guard = std::make_unique<DeviceGuard>(a, device);
    if (m->rank == 0) m->check(a.uniqueId(&id), what + ": ncclGetUniqueId");
  } catch (const Error& e) {
    problem = e.what();
  }
  if (m->size > 1) {
    std::vector<uint8_t> bad(static_cast<size_t>(m->size));
    const uint8_t mine = problem.empty() ? 0 : 1;
    pg.allgather(&mine, bad.data(), 1, DType::u8)->wait();
    std::string who;
    for (int r = 0; r < m->size; ++r)
      if (bad[static_cast<size_t>(r)]) who += (who.empty() ? "" : ", ") + std::to_string(r);
    if (!who.empty() && problem.empty())
      problem = fmt::format("[rank {}] {}: rank(s) {} could not set up CUDA or NCCL (their errors say why)", m->rank, what, who);
  }
  if (!problem.empty()) throw Error(problem);
  // Rank 0 drew the id; every rank gets it over the host group before anyone initialises.
  if (m->size > 1) pg.broadcast(id.bytes, sizeof(id.bytes), DType::u8, 0)->wait();
  const Clock::time_point deadline = Clock::now() + m->timeout;
  {
    std::unique_lock<std::mutex> lk(m->mu);
    Status s = a.initComm(&m->comm, m->size, id, m->rank);
    try {
      if (m->comm) s = m->settle(lk, s, deadline, what + " init");
      m->check(s, what + " init");
    } catch (...) {
      m->abortLocked();
      throw;
    }
    Status st = a.createStream(&m->stream);
    if (st.kind != Status::ok) {
      m->abortLocked();
      m->check(st, what + ": its stream");
    }
  }
  NcclComm::Impl* raw = m.get();
  m->watchdog = std::thread([raw] { raw->watch(); });
  return std::shared_ptr<NcclComm>(new NcclComm(std::move(m)));
}

}  // namespace nccl

std::shared_ptr<NcclComm> NcclComm::create(ProcessGroup& pg, int device) {
  return nccl::createComm(pg, device, nccl::cudaNcclApi(pg.rank(), device));
}

NcclComm::NcclComm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

// Every pending op has a deadline, and the watchdog fails it then (aborting), so the join is bounded by
// the group's timeout; the teardown after it by kTeardownLimit.
NcclComm::~NcclComm() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> g(m.mu);
    m.stopping = true;  // the watchdog leaves once every op has completed or failed
  }
  m.cv.notify_all();
  if (m.watchdog.joinable()) m.watchdog.join();
  m.teardown();
  if (m.stream) m.api->destroyStream(m.stream);
  if (!m.teardown_problem.empty())
    fmt::print(stderr, "dtrain: {} NCCL communicator of the {}: {}\n", m.where(), m.ranks_text, m.teardown_problem);
}

WorkPtr NcclComm::allreduce(const void* in, void* out, size_t count, DType t, ReduceOp op, void* stream) {
  nccl::Launch l;
  l.call = nccl::Call::allreduce, l.in = in, l.out = out, l.count = count, l.dtype = t, l.op = op;
  return impl_->launch(stream, l);
}

WorkPtr NcclComm::broadcast(void* buf, size_t count, DType t, int root, void* stream) {
  Impl& m = *impl_;
  DTRAIN_CHECK(root >= 0 && root < m.size, InvalidArgument, "[rank {}] nccl broadcast: root {} outside the group of {}",
               m.rank, root, m.size);
  nccl::Launch l;
  l.call = nccl::Call::broadcast, l.in = buf, l.out = buf, l.count = count, l.dtype = t, l.root = root;
  return m.launch(stream, l);
}

WorkPtr NcclComm::allgather(const void* in, void* out, size_t count, DType t, void* stream) {
  nccl::Launch l;
  l.call = nccl::Call::allgather, l.in = in, l.out = out, l.count = count, l.dtype = t;
  return impl_->launch(stream, l);
}

WorkPtr NcclComm::reduceScatter(const void* in, void* out, size_t count, DType t, ReduceOp op, void* stream) {
  nccl::Launch l;
  l.call = nccl::Call::reduce_scatter, l.in = in, l.out = out, l.count = count, l.dtype = t, l.op = op;
  return impl_->launch(stream, l);
}

int NcclComm::device() const { return impl_->device; }
int NcclComm::rank() const { return impl_->rank; }
int NcclComm::size() const { return impl_->size; }

}  // namespace dtrain::comm
