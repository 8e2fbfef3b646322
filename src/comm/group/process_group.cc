// ProcessGroup: argument checks, the op queue and its worker thread, transport choice, sub-groups,
// and the DTRAIN_DEBUG=detail fingerprint check.
#include "dtrain/comm/process_group.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <thread>


#include "comm/collectives/collectives.h"
#include "comm/group/naming.h"
#include "comm/group/tune.h"
#include "comm/group/work_executor.h"
#include "comm/rendezvous/environment.h"
#include "comm/trace/trace_internal.h"
#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm {

using transport::Clock;
using transport::OpCode;

namespace {

// The ops in which some rank does not receive, directly or through ranks that checked, from every other
// rank (a broadcast root, a gather's senders, the branches of a tree): over a transport that compares
// fingerprints only in frame headers, the group exchanges fingerprints first so that every rank fails.
bool needsExchange(OpCode op) {
  return op == OpCode::broadcast || op == OpCode::reduce || op == OpCode::gather || op == OpCode::scatter;
}

// The payload of the DTRAIN_DEBUG=detail exchange: every rank's call, to list who called what.
struct Called {
  transport::Fingerprint fp;
  uint64_t seq = 0;
};


}  // namespace

// An op's record (what the flight recorder and the timeline see) and its Work, in one allocation that
// lives as long as the Work: the queued Task carries pointers, so moving it through the queue copies
// no record (a Task that holds the record outgrows the queue's nodes and costs an allocation per op).
struct OpState {
  trace::OpRecord rec;
  std::optional<Work> work;  // made by submit(), once the label and deadline are known
};

// An op waiting to run: what it is, its deadline, and the algorithm call.
struct Task {
  WorkPtr work;  // points into `state`
  std::shared_ptr<OpState> state = std::make_shared<OpState>();
  trace::OpRecord* rec = &state->rec;
  transport::Label label;
  transport::Deadline deadline;
  bool collective = true;
  std::function<void(algo::Context&)> fn;
  Clock::time_point pushed_at;   // set by OpQueue::push
  bool issuer_may_help = false;  // pushed by a thread other than the worker, outside IssueAndMoveOn
};

// The ops of one group, run one at a time in issue order: by the group's worker thread, or by a thread
// that waits for one of them while nobody else is running (see WorkExecutor). `busy` is the baton.
class OpQueue : public WorkExecutor {
 public:
  explicit OpQueue(std::function<void(Task&)> run) : run_(std::move(run)) {}

  // The worker thread is named after the group in traces and dumps ("group world").
  void start(const std::string& group) {
    worker_ = std::thread([this, name = "group " + group] {
      dtrain::trace::setThreadName(name);
      workerLoop();
    });
  }

  void push(Task t) {
    t.pushed_at = Clock::now();
    bool wake;
    {
      std::lock_guard<std::mutex> g(mu_);
      t.issuer_may_help = !issuingAndMovingOn() && std::this_thread::get_id() != worker_id_;
      wake = !watching_ || !t.issuer_may_help;  // an op nobody will help must start now
      last_push_ = t.pushed_at;
      queue_.push_back(std::move(t));
    }
    if (wake) worker_cv_.notify_one();
  }

  void help(const Work& w) override {
    std::unique_lock<std::mutex> lk(mu_);
    while (!stopping_ && !busy_ && !queue_.empty() && !w.isCompleted()) runFront(lk);
  }

  // Fails what is still queued, lets a running op finish (it has a deadline), and joins the worker.
  void stop(int rank) {
    std::deque<Task> left;
    {
      std::unique_lock<std::mutex> lk(mu_);
      stopping_ = true;
      left.swap(queue_);
      worker_cv_.notify_one();
      cv_.wait(lk, [&] { return !busy_; });
    }
    if (worker_.joinable()) worker_.join();
    for (auto& t : left) {
      t.work->finish(std::make_exception_ptr(
          Error(fmt::format("[rank {}] {} not run: the process group was destroyed", rank, t.label.what))));
    }
  }

 private:
  void runFront(std::unique_lock<std::mutex>& lk) {
    Task t = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    run_(t);
    lk.lock();
    busy_ = false;
    if (!watching_ && !queue_.empty()) worker_cv_.notify_one();
    cv_.notify_all();  // stop() waits for the op to end
  }

  // A thread that issues an op and then waits for it runs it itself (help), saving two thread hand-offs.
  // When the worker, woken by the push, took the op first, the issuer slept instead, and how often that
  // happened swung with the threads' timing (a third to a half of a 4 KiB allreduce loop's ops on 2
  // cores, more with the timeline on). So the worker leaves an op issued by another thread to that
  // thread for kIssuerWindow and runs it only if nobody has by then (an op nobody waits for, such as a
  // DDP bucket's, starts that much later). And while ops keep coming, the worker looks at the queue on a
  // timer instead of being woken by every push (a push then costs no system call); the timer slows down,
  // up to kMaxLook, while every op it finds was taken by its issuer, and the worker sleeps until the next
  // push once a look finds that nothing was pushed since the one before. An op issued under
  // IssueAndMoveOn (a DDP bucket's) always wakes the worker; one issued by a thread that goes on without
  // waiting for it may start up to kMaxLook late during such a loop. Each look preempts a thread of this
  // rank for a few microseconds: at 1 ms, a 4 KiB allreduce loop at world 2 on 2 cores had a p99 of
  // 10-14 us against a p50 of 3-4 (docs/PERFORMANCE.md, "Small-message tails").
  static constexpr std::chrono::microseconds kIssuerWindow{100};
  static constexpr std::chrono::microseconds kMaxLook{10000};

  void workerLoop() {
    std::unique_lock<std::mutex> lk(mu_);
    worker_id_ = std::this_thread::get_id();
    auto look = std::chrono::microseconds(kIssuerWindow);
    Clock::time_point last_look;
    while (!stopping_) {
      const auto now = Clock::now();
      if (!busy_ && !queue_.empty()) {
        const Task& front = queue_.front();
        const auto due = front.issuer_may_help ? front.pushed_at + kIssuerWindow : now;
        if (due <= now) {
          look = kIssuerWindow;
          runFront(lk);
        } else {
          worker_cv_.wait_until(lk, due);
        }
        continue;
      }
      if (last_push_ > last_look) {
        last_look = now;
        worker_cv_.wait_until(lk, now + look);
        look = std::min(2 * look, std::chrono::microseconds(kMaxLook));
        continue;
      }
      // Nothing pushed since the last look: sleep until a push (or the op running elsewhere) wakes us.
      watching_ = false;
      look = kIssuerWindow;
      worker_cv_.wait(lk, [&] { return stopping_ || (!busy_ && !queue_.empty()); });
      watching_ = true;
    }
  }

  std::function<void(Task&)> run_;
  std::mutex mu_;
  std::condition_variable cv_;         // the running op ended (stop() waits for it)
  std::condition_variable worker_cv_;  // something for a sleeping worker to run, or stop
  std::deque<Task> queue_;
  Clock::time_point last_push_;
  bool watching_ = true;  // the worker looks at the queue on a timer: pushes need not wake it
  bool busy_ = false;
  bool stopping_ = false;
  std::thread::id worker_id_;  // under mu_
  std::thread worker_;
};

struct ProcessGroup::Impl {
  int rank = 0;
  int size = 1;
  GroupOptions opts;
  std::shared_ptr<Store> store;
  std::unique_ptr<transport::Transport> tx;
  std::unique_ptr<algo::Hierarchy> hier;  // when the group spans several hosts (algo::makeHierarchy)
  algo::Thresholds thresholds;            // the automatic choice's (DTRAIN_TUNE: probed when made)
  uint64_t seq = 0;        // collectives issued (caller side)
  uint64_t sub_groups = 0; // newGroup calls
  std::vector<uint8_t> scratch;
  std::exception_ptr broken;  // the first failure; later ops fail with it
  std::shared_ptr<OpQueue> ops;
  std::shared_ptr<const trace::GroupInfo> info;
  std::mutex attach_mu;  // attachment()
  std::map<std::string, std::shared_ptr<void>> attached;

  ~Impl() {
    if (ops) ops->stop(rank);
  }

  void execute(Task& t) {
    trace::opStarted(*t.rec);
    if (broken) {
      finish(t, std::make_exception_ptr(Error(fmt::format("[rank {}] {} not run: this group failed earlier: {}", rank,
                                                          t.label.what, trace::errorText(broken)))));
      return;
    }
    try {
      algo::Context c{tx.get(), rank, size, t.label, t.deadline, scratch};
      c.hier = hier.get();
      c.thresholds = &thresholds;
      const bool check = t.collective && size > 1;
      if (check) {
        if (opts.check_fingerprints) listMismatch(c);
        bool every_rank = tx->beginCollective(t.label, t.deadline);
        c.guard_output = every_rank;
        if (!every_rank && !opts.check_fingerprints && needsExchange(t.label.op)) exchangeFingerprints(c);
      }
      t.fn(c);
      t.rec->algorithm = c.algorithm;
      if (check) tx->compareCalls(t.label, t.deadline);
      finish(t, nullptr);
    } catch (const std::exception& e) {
      if (tx) tx->abort(e);
      if (hier && hier->local) hier->local->abort(e);  // ranks in a hierarchical op's shm stage fail too
      broken = std::current_exception();
      finish(t, broken);
    }
  }

  // The recorders see the op complete before its waiters do.
  static void finish(Task& t, const std::exception_ptr& error) {
    trace::opFinished(*t.rec, error);
    t.work->finish(error);
  }

  // Sends `bytes` at `mine` to every other rank and receives each rank p's into theirs + p * bytes, in
  // fingerprint frames whose headers carry `fp` (compared by the receivers when it is a collective's).
  void exchangeWithAll(algo::Context& c, const void* mine, void* theirs, size_t bytes,
                       const transport::Fingerprint& fp) {
    std::vector<transport::Op> ops;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      ops.push_back(transport::sendOp(p, 0, mine, bytes));
      ops.push_back(transport::recvOp(p, 0, static_cast<char*>(theirs) + p * bytes, bytes));
    }
    transport::Label l = c.label;
    l.op = OpCode::fingerprint;
    l.fp = fp;
    tx->run(ops, c.deadline, l);
  }

  // Every rank sends its fingerprint (in the frame header) to every other, which compares it.
  void exchangeFingerprints(algo::Context& c) { exchangeWithAll(c, nullptr, nullptr, 0, c.label.fp); }

  // DTRAIN_DEBUG=detail: every rank's call goes to every rank first, and a mismatch lists them all
  // ("ranks 0, 2 called allreduce(...); rank 1 called broadcast(...)").
  void listMismatch(algo::Context& c) {
    std::vector<Called> all(size);
    const Called mine{c.label.fp, c.label.seq};
    all[rank] = mine;
    // Headers without a call: the calls are compared below, all at once, rather than frame by frame.
    exchangeWithAll(c, &all[rank], all.data(), sizeof(Called), transport::Fingerprint{});
    bool same = std::all_of(all.begin(), all.end(), [&](const Called& f) { return f.fp == mine.fp && f.seq == mine.seq; });
    if (same) return;
    std::vector<std::pair<std::string, std::vector<int>>> groups;
    for (int p = 0; p < size; ++p) {
      std::string s = all[p].fp.describe(static_cast<uint32_t>(all[p].seq));
      auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == s; });
      if (it == groups.end()) groups.push_back({s, {p}});
      else it->second.push_back(p);
    }
    std::string detail;
    for (auto& [what, ranks] : groups) {
      std::string rs;
      for (int r : ranks) rs += (rs.empty() ? "" : ", ") + std::to_string(r);
      detail += fmt::format("{}{} {} called {}", detail.empty() ? "" : "; ", ranks.size() > 1 ? "ranks" : "rank",
                            rs, what);
    }
    throw ProtocolError(fmt::format("[rank {}] DTRAIN_DEBUG=detail: collective mismatch at seq={}: {}", rank,
                                    mine.seq, detail));
  }

  WorkPtr submit(Task t) {
    t.state->work.emplace(t.label.what, t.deadline, rank, ops);
    t.work = WorkPtr(t.state, &*t.state->work);
    WorkPtr w = t.work;
    t.rec->group = info;
    t.rec->what = &w->describe();
    trace::opIssued(*t.rec);
    if (!ops) {  // a world of one: run inline, no thread
      execute(t);
      return w;
    }
    ops->push(std::move(t));
    return w;
  }

  // Builds the task of a collective: label, fingerprint, deadline from now. rop is compared for the ops
  // that reduce; counts_hash and algo only where they apply.
  Task collective(OpCode op, DType dt, size_t count, int root, std::optional<ReduceOp> rop, std::string extra,
                  std::function<void(algo::Context&)> fn, uint64_t counts_hash = 0, uint8_t algo = 0) {
    Task t;
    uint64_t s = seq++;
    t.label.op = op;
    t.label.seq = static_cast<uint32_t>(s);
    t.label.what = opLabel(transport::opName(op), s, dtypeName(dt), count, extra);
    t.label.timeout = opts.timeout;
    t.deadline = Clock::now() + opts.timeout;
    auto& fp = t.label.fp;
    fp.op = static_cast<uint16_t>(op);
    fp.dtype = static_cast<uint8_t>(dt);
    fp.rop = rop ? static_cast<uint8_t>(*rop) : 0xFF;
    fp.algo = algo;
    fp.root = root;
    fp.count = count;
    fp.counts_hash = counts_hash;
    t.fn = std::move(fn);
    t.rec->seq = s;
    t.rec->op = transport::opName(op);
    t.rec->dtype = dtypeName(dt);
    t.rec->count = count;
    t.rec->bytes = count * dtypeSize(dt);
    t.rec->root = root;
    return t;
  }

  void checkRoot(int root, const char* op) const {
    DTRAIN_CHECK(root >= 0 && root < size, InvalidArgument, "[rank {}] {}: root {} is not a rank of this group (size {})",
                 rank, op, root, size);
  }
  void checkBuf(const void* p, size_t count, const char* what, const char* op) const {
    DTRAIN_CHECK(p != nullptr || count == 0, InvalidArgument, "[rank {}] {}: {} is null but count is {}", rank, op,
                 what, count);
  }
  void checkCounts(const std::vector<size_t>& counts, const char* op) const {
    DTRAIN_CHECK(counts.size() == static_cast<size_t>(size), InvalidArgument,
                 "[rank {}] {}: {} counts given for a group of {} ranks", rank, op, counts.size(), size);
  }
};

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::create(std::shared_ptr<Store> store, int rank, int size,
                                                   GroupOptions opts) {
  DTRAIN_CHECK(size >= 1, InvalidArgument, "process group size must be >= 1, got {}", size);
  DTRAIN_CHECK(rank >= 0 && rank < size, InvalidArgument, "rank {} is out of range for a group of {}", rank, size);
  auto impl = std::make_unique<Impl>();
  impl->rank = rank;
  impl->size = size;
  const auto env = rendezvous::Environment::read();  // get() points into it
  const char* forced = env.get("DTRAIN_ALGO");
  if (forced && opts.allreduce_algorithm == AllreduceAlgorithm::automatic)
    opts.allreduce_algorithm = algo::parseAllreduceAlgorithm(forced);
  impl->opts = opts;
  impl->store = store;
  impl->info = groupInfo(opts.name, rank, size, {});
  if (size > 1) {
    DTRAIN_CHECK(store != nullptr, InvalidArgument, "[rank {}] a process group of {} ranks needs a store", rank, size);
    std::string kind = opts.transport;
    std::vector<std::string> hosts;
    if (kind == "auto" || kind == "shm") {  // DTRAIN_TRANSPORT=tcp: no hosts, no hierarchy
      hosts = algo::exchangeHostIds(*store, rank, size, kind == "shm", opts.allreduce_algorithm);
      kind = std::count(hosts.begin(), hosts.end(), hosts[0]) == size ? "shm" : "tcp";
    }
    const int ranks_on_host = hosts.empty() ? 0 : static_cast<int>(std::count(hosts.begin(), hosts.end(), hosts[rank]));
    const transport::TransportOptions to{opts.timeout, opts.listen_host, opts.segment_bytes, opts.secret, opts.spin_us,
                                         ranks_on_host};
    impl->tx = transport::createTransport(kind, *store, rank, size, to);
    if (opts.transport != "tcp" && kind == "tcp") impl->hier = algo::makeHierarchy(store, rank, hosts, to);
    impl->ops = std::make_shared<OpQueue>([raw = impl.get()](Task& t) { raw->execute(t); });
    impl->ops->start(impl->info->name);
  }
  Impl* raw = impl.get();
  auto pg = std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
  // DTRAIN_TUNE (tune.h): the allreduce threshold this group leaves open, probed or cached.
  if (size > 1) raw->thresholds = tune::forNewGroup(*pg, raw->opts.allreduce_algorithm, raw->hier.get(), *raw->tx);
  return pg;
}

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
std::string ProcessGroup::transportName() const { return impl_->tx ? impl_->tx->name() : "local"; }
const GroupOptions& ProcessGroup::options() const { return impl_->opts; }

WorkPtr ProcessGroup::allreduce(const void* in, void* out, size_t count, DType t, ReduceOp op,
                                AllreduceAlgorithm algo) {
  impl_->checkBuf(in, count, "input", "allreduce");
  impl_->checkBuf(out, count, "output", "allreduce");
  if (algo == AllreduceAlgorithm::automatic) algo = impl_->opts.allreduce_algorithm;
  return impl_->submit(impl_->collective(OpCode::allreduce, t, count, -1, op, std::string(" ") + reduceOpName(op),
                                         [=](algo::Context& c) { algo::allreduce(c, in, out, count, t, op, algo); }, 0,
                                         static_cast<uint8_t>(algo)));
}

WorkPtr ProcessGroup::broadcast(void* buf, size_t count, DType t, int root) {
  impl_->checkRoot(root, "broadcast");
  impl_->checkBuf(buf, count, "buffer", "broadcast");
  return impl_->submit(impl_->collective(OpCode::broadcast, t, count, root, std::nullopt,
                                         fmt::format(" root={}", root),
                                         [=](algo::Context& c) { algo::broadcast(c, buf, count, t, root); }));
}

WorkPtr ProcessGroup::reduce(const void* in, void* out, size_t count, DType t, ReduceOp op, int root) {
  impl_->checkRoot(root, "reduce");
  impl_->checkBuf(in, count, "input", "reduce");
  if (impl_->rank == root) impl_->checkBuf(out, count, "output", "reduce");
  return impl_->submit(impl_->collective(OpCode::reduce, t, count, root, op,
                                         fmt::format(" {} root={}", reduceOpName(op), root),
                                         [=](algo::Context& c) { algo::reduce(c, in, out, count, t, op, root); }));
}

WorkPtr ProcessGroup::allgather(const void* in, void* out, size_t count, DType t) {
  return allgatherv(in, out, std::vector<size_t>(impl_->size, count), t);
}

WorkPtr ProcessGroup::allgatherv(const void* in, void* out, std::vector<size_t> counts, DType t) {
  impl_->checkCounts(counts, "allgather");
  size_t total = 0;
  for (size_t c : counts) total += c;
  impl_->checkBuf(in, counts[impl_->rank], "input", "allgather");
  impl_->checkBuf(out, total, "output", "allgather");
  uint64_t h = unevenHash(counts);
  return impl_->submit(impl_->collective(OpCode::allgather, t, total, -1, std::nullopt, countsText(counts, h),
                                         [=](algo::Context& c) { algo::allgatherv(c, in, out, counts, t); }, h));
}

WorkPtr ProcessGroup::reduceScatter(const void* in, void* out, size_t count, DType t, ReduceOp op) {
  return reduceScatterv(in, out, std::vector<size_t>(impl_->size, count), t, op);
}

WorkPtr ProcessGroup::reduceScatterv(const void* in, void* out, std::vector<size_t> counts, DType t, ReduceOp op) {
  impl_->checkCounts(counts, "reduce_scatter");
  size_t total = 0;
  for (size_t c : counts) total += c;
  impl_->checkBuf(in, total, "input", "reduce_scatter");
  impl_->checkBuf(out, counts[impl_->rank], "output", "reduce_scatter");
  uint64_t h = unevenHash(counts);
  return impl_->submit(impl_->collective(OpCode::reduce_scatter, t, total, -1, op,
                                         fmt::format(" {}{}", reduceOpName(op), countsText(counts, h)),
                                         [=](algo::Context& c) { algo::reduceScatterv(c, in, out, counts, t, op); }, h));
}

WorkPtr ProcessGroup::alltoall(const void* in, void* out, size_t count, DType t) {
  impl_->checkBuf(in, count, "input", "alltoall");
  impl_->checkBuf(out, count, "output", "alltoall");
  return impl_->submit(impl_->collective(OpCode::alltoall, t, count, -1, std::nullopt, " per rank",
                                         [=](algo::Context& c) { algo::alltoall(c, in, out, count, t); }));
}

WorkPtr ProcessGroup::gather(const void* in, void* out, size_t count, DType t, int root) {
  impl_->checkRoot(root, "gather");
  impl_->checkBuf(in, count, "input", "gather");
  if (impl_->rank == root) impl_->checkBuf(out, count, "output", "gather");
  return impl_->submit(impl_->collective(OpCode::gather, t, count, root, std::nullopt,
                                         fmt::format(" root={}", root),
                                         [=](algo::Context& c) { algo::gather(c, in, out, count, t, root); }));
}

WorkPtr ProcessGroup::scatter(const void* in, void* out, size_t count, DType t, int root) {
  impl_->checkRoot(root, "scatter");
  impl_->checkBuf(out, count, "output", "scatter");
  if (impl_->rank == root) impl_->checkBuf(in, count, "input", "scatter");
  return impl_->submit(impl_->collective(OpCode::scatter, t, count, root, std::nullopt,
                                         fmt::format(" root={}", root),
                                         [=](algo::Context& c) { algo::scatter(c, in, out, count, t, root); }));
}

WorkPtr ProcessGroup::barrier() {
  return impl_->submit(impl_->collective(OpCode::barrier, DType::u8, 0, -1, std::nullopt, "",
                                         [](algo::Context& c) { algo::barrier(c); }));
}

WorkPtr ProcessGroup::send(const void* buf, size_t count, DType t, int dst, uint32_t tag) {
  return sendRecv({P2POp{P2POp::kSend, const_cast<void*>(buf), count, t, dst, tag}});
}

WorkPtr ProcessGroup::recv(void* buf, size_t count, DType t, int src, uint32_t tag) {
  return sendRecv({P2POp{P2POp::kRecv, buf, count, t, src, tag}});
}

WorkPtr ProcessGroup::sendRecv(std::vector<P2POp> ops) {
  Impl& m = *impl_;
  std::string what;
  for (const auto& o : ops) {
    DTRAIN_CHECK(o.peer >= 0 && o.peer < m.size && o.peer != m.rank, InvalidArgument,
                 "[rank {}] {}: peer {} is not another rank of this group (size {})", m.rank,
                 o.kind == P2POp::kSend ? "send" : "recv", o.peer, m.size);
    m.checkBuf(o.buf, o.count, "buffer", o.kind == P2POp::kSend ? "send" : "recv");
    what += fmt::format("{}{} {} x {} {} rank {} tag {}", what.empty() ? "" : ", ",
                        o.kind == P2POp::kSend ? "send" : "recv", dtypeName(o.dtype), o.count,
                        o.kind == P2POp::kSend ? "to" : "from", o.peer, o.tag);
  }
  Task t;
  t.collective = false;
  t.label.op = OpCode::send;
  t.label.what = what;
  bool sends = false, recvs = false;
  for (const auto& o : ops) {
    (o.kind == P2POp::kSend ? sends : recvs) = true;
    t.rec->count += o.count;
    t.rec->bytes += o.count * dtypeSize(o.dtype);
    t.rec->peers.push_back(o.peer);
  }
  t.rec->op = sends && recvs ? "sendrecv" : sends ? "send" : "recv";
  t.rec->dtype = ops.empty() ? "" : dtypeName(ops[0].dtype);
  t.label.timeout = m.opts.timeout;
  t.deadline = Clock::now() + m.opts.timeout;
  t.fn = [ops](algo::Context& c) {
    std::vector<transport::Op> tops;
    for (const auto& o : ops) {
      size_t bytes = o.count * dtypeSize(o.dtype);
      tops.push_back(o.kind == P2POp::kSend ? transport::sendOp(o.peer, o.tag, o.buf, bytes)
                                            : transport::recvOp(o.peer, o.tag, o.buf, bytes));
    }
    if (!tops.empty()) c.run(tops);
  };
  return m.submit(std::move(t));
}

namespace {
// A step of this rank alone in the group's issue order; `op` is its name in traces and dumps.
WorkPtr submitLocal(ProcessGroup::Impl& m, std::string what, const char* op, std::function<void()> fn) {
  Task t;
  t.collective = false;
  t.label.op = OpCode::none;
  t.label.what = std::move(what);
  t.rec->op = op;
  t.label.timeout = m.opts.timeout;
  t.deadline = Clock::now() + m.opts.timeout;
  t.fn = [fn = std::move(fn)](algo::Context&) { fn(); };
  return m.submit(std::move(t));
}
}  // namespace

WorkPtr ProcessGroup::abort(const std::string& reason) {
  // Thrown inside the op, it takes the normal failure path: peers are told, the group is broken. The
  // reason names this process by its rank in the world (a sub-group's peers show it to their users).
  return submitLocal(*impl_, "abort", "abort",
                     [msg = fmt::format("[rank {}] {}", impl_->info->globalRank(impl_->rank), reason)]() -> void {
                       throw Error(msg);
                     });
}

WorkPtr ProcessGroup::localStep(std::string what, std::function<void()> fn) {
  return submitLocal(*impl_, std::move(what), "local", std::move(fn));
}

std::shared_ptr<void> ProcessGroup::attachment(const std::string& key,
                                               const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard<std::mutex> g(impl_->attach_mu);
  auto& slot = impl_->attached[key];
  if (!slot) slot = make();
  return slot;
}

std::shared_ptr<ProcessGroup> ProcessGroup::newGroup(const std::vector<int>& ranks) {
  Impl& m = *impl_;
  DTRAIN_CHECK(!ranks.empty(), InvalidArgument, "[rank {}] newGroup: empty rank list", m.rank);
  std::set<int> seen;
  int my_new_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    DTRAIN_CHECK(r >= 0 && r < m.size, InvalidArgument, "[rank {}] newGroup: rank {} is not in this group (size {})",
                 m.rank, r, m.size);
    DTRAIN_CHECK(seen.insert(r).second, InvalidArgument, "[rank {}] newGroup: rank {} listed twice", m.rank, r);
    if (r == m.rank) my_new_rank = static_cast<int>(i);
  }
  uint64_t id = m.sub_groups++;
  if (my_new_rank < 0) return nullptr;
  std::shared_ptr<Store> st;
  if (ranks.size() > 1) st = std::make_shared<PrefixStore>(fmt::format("sub{}", id), m.store);
  GroupOptions sub = m.opts;
  sub.name = fmt::format("{}/sub{}", m.info->name, id);
  std::vector<int> global;
  for (int r : ranks) global.push_back(m.info->global_ranks[r]);
  auto g = create(st, my_new_rank, static_cast<int>(ranks.size()), sub);
  g->impl_->info = groupInfo(sub.name, my_new_rank, static_cast<int>(ranks.size()), std::move(global));
  return g;
}

}  // namespace dtrain::comm
