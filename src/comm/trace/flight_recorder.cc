// The flight recorder: every process keeps its last DTRAIN_TRACE_BUFFER ops (default 4096) in a ring
// and writes them, with every thread's open spans, to DTRAIN_FLIGHT_DIR/rank<R>.json when an op fails
// (once per process), on SIGUSR1 and when dtrain-run --hang-timeout asks (docs/OBSERVABILITY.md).
//
// It is always on, so the hooks are cheap (counted in the "1% more instructions per 4 KiB allreduce"
// budget): issuing claims a slot with one atomic increment and fills it under that slot's own spin flag
// (the dumper takes it to copy the slot); starting and finishing move the slot's state with one
// compare-and-swap on its tag (id and state in one word, so an op older than the ring never touches
// the newer op in its slot) and store a time. Nothing is allocated or formatted per op: names are the
// OpRecord's static strings, groups are kept alive by the recorder for good (known ones are found among
// a few pointers), and a failed op's error text is the only string stored, on the failure path. The
// recorder starts at this process's first op (reading the environment then) and is never destroyed:
// threads may still finish ops at exit.
#include "comm/trace/flight_recorder.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/rendezvous/environment.h"
#include "dtrain/comm/error.h"
#include "dtrain/flight_progress.h"

namespace dtrain::comm::trace::flight {

namespace {

constexpr int kDefaultCapacity = 4096;

// A ring slot. `busy` guards `e` (written when the op is issued, read by the dumper); the rest is
// written by the op's group thread without it.
struct Slot {
  std::atomic<bool> busy{false};
  std::atomic<uint64_t> tag{0};  // id << 2 | State
  std::atomic<int64_t> started_us{0};
  std::atomic<int64_t> finished_us{0};
  std::atomic<const char*> algorithm{""};
  Entry e;
};

constexpr uint64_t tagOf(uint64_t id, State st) { return id << 2 | static_cast<uint64_t>(st); }

class SlotGuard {
 public:
  // Held for a few stores (or the dumper's copy of one slot): spinning is cheaper than anything else.
  explicit SlotGuard(Slot& s) : s_(s) {
    while (s_.busy.exchange(true, std::memory_order_acquire)) {
    }
  }
  ~SlotGuard() { s_.busy.store(false, std::memory_order_release); }
  SlotGuard(const SlotGuard&) = delete;
  SlotGuard& operator=(const SlotGuard&) = delete;

 private:
  Slot& s_;
};

// Replaces characters that do not belong in a file name.
std::string fileSafe(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') c = '_';
  return s;
}

// The job's name in the default dump directory: the same on every rank of one job.
std::string jobName(const rendezvous::Environment& env) {
  if (const char* j = env.get("SLURM_JOB_ID")) {
    const char* step = env.get("SLURM_STEP_ID") ? env.get("SLURM_STEP_ID") : env.get("SLURM_STEPID");
    return fileSafe(step ? fmt::format("slurm-{}.{}", j, step) : fmt::format("slurm-{}", j));
  }
  if (const char* id = env.get("TORCHELASTIC_RUN_ID")) return fileSafe(id);
  const char* addr = env.get("MASTER_ADDR");
  const char* port = env.get("MASTER_PORT");
  if (addr && port) return fileSafe(fmt::format("{}-{}", addr, port));
  return "";  // a group built by hand: no name the ranks share
}

class Recorder {
 public:
  explicit Recorder(const OpRecord& first) {
    auto env = rendezvous::Environment::read();
    capacity_ = static_cast<size_t>(env.integer("DTRAIN_TRACE_BUFFER", kDefaultCapacity, 0));
    job_ = jobName(env);
    const char* tmp = env.get("TMPDIR");
    dir_ = env.get("DTRAIN_FLIGHT_DIR") ? env.get("DTRAIN_FLIGHT_DIR")
           : job_.empty()               ? fmt::format("{}/dtrain-flight", tmp ? tmp : "/tmp")
                                        : fmt::format("{}/dtrain-flight-{}", tmp ? tmp : "/tmp", job_);
    if (first.group) {
      const GroupInfo& g = *first.group;
      rank_ = g.global_ranks.at(static_cast<size_t>(g.rank));
      world_size_ = g.name == "world" ? g.size : 0;
      for (int r : g.global_ranks) world_size_ = std::max(world_size_, r + 1);
    }
    const char* role = env.get("DTRAIN_ROLE");
    if (role && std::strcmp(role, "server") == 0) {
      const char* index = env.get("DTRAIN_SERVER_INDEX");
      stem_ = fmt::format("server{}", index ? index : "");
    } else {
      stem_ = fmt::format("rank{}", rank_);
    }
    if (capacity_ > 0) slots_ = std::make_unique<Slot[]>(capacity_);
    if (const char* p = env.get("DTRAIN_FLIGHT_PROGRESS")) mapProgress(p);
  }

  bool on() const { return capacity_ > 0; }
  const std::string& dir() const { return dir_; }

  void issued(OpRecord& r) {
    const uint64_t id = next_.fetch_add(1, std::memory_order_relaxed) + 1;
    r.slot = id;
    fill(slots_[(id - 1) % capacity_], r, id);
    // The group is alive while `r` is; it is kept alive for good before the op is issued.
    if (!known(r.group.get())) retain(r.group);
  }

  void fill(Slot& s, const OpRecord& r, uint64_t id) {
    SlotGuard g(s);
    Entry& e = s.e;
    e.group = r.group.get();
    e.seq = r.seq;
    e.op = r.op;
    e.dtype = r.dtype;
    e.count = r.count;
    e.bytes = r.bytes;
    e.root = r.root;
    e.npeers = static_cast<uint32_t>(r.peers.size());
    const size_t n = std::min(r.peers.size(), Entry::kInlinePeers);
    for (size_t i = 0; i < n; ++i) e.peers[i] = r.peers[i];
    e.issued_us = r.issued_us;
    // started_us, finished_us, algorithm and the error are read only in the states that set them.
    s.tag.store(tagOf(id, State::issued), std::memory_order_release);
  }

  // An op older than the ring (its slot holds a newer op) is not recorded: the swap fails.
  void started(const OpRecord& r) {
    Slot& s = slots_[(r.slot - 1) % capacity_];
    uint64_t expect = tagOf(r.slot, State::issued);
    if (s.tag.compare_exchange_strong(expect, tagOf(r.slot, State::started), std::memory_order_relaxed))
      s.started_us.store(r.started_us, std::memory_order_relaxed);
  }

  void completed(const OpRecord& r) {
    Slot& s = slots_[(r.slot - 1) % capacity_];
    uint64_t expect = s.tag.load(std::memory_order_relaxed);
    if (expect >> 2 == r.slot &&
        s.tag.compare_exchange_strong(expect, tagOf(r.slot, State::completed), std::memory_order_relaxed)) {
      s.finished_us.store(r.finished_us, std::memory_order_relaxed);
      s.algorithm.store(r.algorithm, std::memory_order_relaxed);
    }
  }

  void failed(const OpRecord& r, const std::string& error) {
    Slot& s = slots_[(r.slot - 1) % capacity_];
    SlotGuard g(s);  // the error string is the dumper's to read under the flag
    uint64_t expect = s.tag.load(std::memory_order_relaxed);
    if (expect >> 2 != r.slot) return;
    s.finished_us.store(r.finished_us, std::memory_order_relaxed);
    s.e.error = error;
    s.tag.store(tagOf(r.slot, State::failed), std::memory_order_relaxed);
  }

  // Counts a completed op in the launcher's progress file.
  void progressed() {
    if (progress_) __atomic_fetch_add(&progress_->completed, 1, __ATOMIC_RELAXED);
  }

  Snapshot snapshot() const {
    Snapshot out;
    out.file_stem = stem_;
    out.rank = rank_;
    out.world_size = world_size_;
    out.job = job_;
    out.capacity = capacity_;
    const uint64_t last = next_.load(std::memory_order_relaxed);
    out.recorded = last;
    const uint64_t first = last > capacity_ ? last - capacity_ + 1 : 1;
    for (uint64_t id = first; id <= last; ++id) {
      Slot& s = slots_[(id - 1) % capacity_];
      SlotGuard g(s);
      const uint64_t tag = s.tag.load(std::memory_order_acquire);
      if (tag >> 2 != id) continue;  // claimed but not written yet, or overwritten since
      out.entries.push_back(s.e);
      Entry& e = out.entries.back();
      e.id = id;
      e.state = static_cast<State>(tag & 3);
      const bool ran = e.state != State::issued, ended = e.state == State::completed || e.state == State::failed;
      e.started_us = ran ? s.started_us.load(std::memory_order_relaxed) : 0;
      e.finished_us = ended ? s.finished_us.load(std::memory_order_relaxed) : 0;
      e.algorithm = e.state == State::completed ? s.algorithm.load(std::memory_order_relaxed) : "";
      if (e.state != State::failed) e.error.clear();
    }
    return out;
  }

  // The reason dtrain-run left in the progress file for its SIGUSR1, cleared once read.
  std::string takeRequest() {
    if (!progress_) return "";
    std::string why(progress_->request, strnlen(progress_->request, sizeof progress_->request));
    std::memset(progress_->request, 0, sizeof progress_->request);
    return why;
  }

  void dumped() {
    if (progress_) __atomic_fetch_add(&progress_->dumps, 1, __ATOMIC_RELEASE);
  }

  std::mutex dump_mu;  // one dump at a time (the watcher and a failing op may race)
  std::atomic<bool> failure_dumped{false};

 private:
  // The launcher created the file (zero-filled, sizeof(FlightProgress) bytes); a missing or short one
  // is reported, and the recorder runs without it.
  void mapProgress(const char* path) {
    int fd = ::open(path, O_RDWR | O_CLOEXEC);
    constexpr size_t kBytes = sizeof(::dtrain::trace::FlightProgress);
    void* p = fd < 0 ? MAP_FAILED : ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    if (fd >= 0) ::close(fd);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "[rank %d] dtrain flight recorder: cannot map DTRAIN_FLIGHT_PROGRESS=%s (%s); "
                   "the launcher will not see this process's progress\n", rank_, path, std::strerror(err));
      return;
    }
    progress_ = static_cast<::dtrain::trace::FlightProgress*>(p);
    progress_->pid = on() ? ::getpid() : 0;  // 0: no dumps here (DTRAIN_TRACE_BUFFER=0), do not signal
    __atomic_store_n(&progress_->magic, ::dtrain::trace::FlightProgress::kMagic, __ATOMIC_RELEASE);
  }

  // Groups are kept alive by the recorder for good, so that entries may point to them. The first
  // groups seen are found among a few pointers without a lock; others take the mutex.
  bool known(const GroupInfo* p) const {
    for (const auto& k : known_) {
      const GroupInfo* v = k.load(std::memory_order_acquire);
      if (v == p) return true;
      if (!v) break;
    }
    return false;
  }

  [[gnu::noinline, gnu::cold]] void retain(const std::shared_ptr<const GroupInfo>& g) {
    std::lock_guard<std::mutex> lock(groups_mu_);
    if (std::find(groups_.begin(), groups_.end(), g) != groups_.end()) return;
    groups_.push_back(g);
    for (auto& k : known_) {
      if (k.load(std::memory_order_relaxed)) continue;
      k.store(g.get(), std::memory_order_release);
      break;
    }
  }

  size_t capacity_ = 0;
  std::unique_ptr<Slot[]> slots_;
  std::array<std::atomic<const GroupInfo*>, 8> known_{};
  std::mutex groups_mu_;
  std::vector<std::shared_ptr<const GroupInfo>> groups_;
  std::atomic<uint64_t> next_{0};
  std::string dir_, job_, stem_;
  int rank_ = -1;
  int world_size_ = 0;
  ::dtrain::trace::FlightProgress* progress_ = nullptr;
};

std::atomic<Recorder*> g_recorder{nullptr};  // once started
std::atomic<Recorder*> g_ring{nullptr};      // once started, when its ring is on

std::string takeRequest() {
  Recorder* r = g_recorder.load(std::memory_order_acquire);
  return r ? r->takeRequest() : "";
}

// The recorder, started by the first op (whose group names this process's rank). Out of line, like
// every rare path here, so that the hooks' common paths stay short.
[[gnu::noinline, gnu::cold]] void issuedFirst(OpRecord& first) {
  static Recorder* r = [&] {
    auto* rec = new Recorder(first);  // never destroyed: see the file's comment
    g_recorder.store(rec, std::memory_order_release);
    if (rec->on()) {
      watchSignal(&takeRequest);
      g_ring.store(rec, std::memory_order_release);
    }
    return rec;
  }();
  if (r->on()) r->issued(first);
}

}  // namespace

const char* stateName(State s) {
  switch (s) {
    case State::issued: return "issued";
    case State::started: return "started";
    case State::completed: return "completed";
    case State::failed: return "failed";
  }
  return "?";
}

void issued(OpRecord& r) {
  if (Recorder* rec = g_ring.load(std::memory_order_acquire)) return rec->issued(r);
  issuedFirst(r);
}

void started(OpRecord& r) {
  if (r.slot == 0) return;  // not recorded (the ring is off)
  g_recorder.load(std::memory_order_relaxed)->started(r);
}

namespace {
[[gnu::noinline, gnu::cold]] void failedOp(Recorder* rec, OpRecord& r, const std::exception_ptr& error) {
  const std::string why = errorText(error);
  if (r.slot != 0) rec->failed(r, why);
  dumpOnFailure(why);
}
}  // namespace

void finished(OpRecord& r, const std::exception_ptr& error) {
  Recorder* rec = g_recorder.load(std::memory_order_relaxed);
  if (!rec) return;
  if (error) return failedOp(rec, r, error);
  rec->progressed();
  if (r.slot != 0) rec->completed(r);
}

std::string dump(const std::string& reason) {
  Recorder* rec = g_recorder.load(std::memory_order_acquire);
  if (!rec || !rec->on()) return "";
  std::lock_guard<std::mutex> g(rec->dump_mu);
  Snapshot s = rec->snapshot();
  try {
    std::string path = writeDumpFile(rec->dir(), s.file_stem, formatDump(s, reason, ::dtrain::trace::openSpans()));
    // The reason in full is in the file; an error message can be long.
    const std::string said = reason.size() > 160 ? reason.substr(0, 157) + "..." : reason;
    std::fprintf(stderr, "[rank %d] dtrain flight recorder: %s: wrote %s\n", s.rank, said.c_str(), path.c_str());
    rec->dumped();  // after saying so: a launcher waiting for it may stop this process next
    return path;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] dtrain flight recorder: %s: no dump: %s\n", s.rank, reason.c_str(), e.what());
    return "";
  }
}

void dumpOnFailure(const std::string& reason) {
  Recorder* rec = g_recorder.load(std::memory_order_acquire);
  if (!rec || rec->failure_dumped.exchange(true)) return;
  dump(reason);
}

}  // namespace dtrain::comm::trace::flight
