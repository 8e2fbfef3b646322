// The timeline's writer: a thread that, every kPeriod or when a recording thread nudges it, copies what
// the recording threads published into DIR/trace-rank<R>.spool (timeline_spool.h: compact binary), and
// when asked (flush(), a failed op, exit) turns the spool into JSON appended to DIR/trace-rank<R>.json,
// writes the closing "]}" after it and empties the spool. The JSON file is complete after every flush;
// a rank that dies leaves its JSON (whole up to its last whole line) and its spool, and dtrain-trace
// merge reads both.
//
// Why a spool: a tight loop of 4 KiB allreduces over shared memory records a million events a second
// per rank. Formatting them as JSON (some 250 bytes each) and writing that while the loop ran cost it
// some 12% on the machine this was measured on, against some 3% for recording alone; the ranks spin on
// both cores, and every slice the writer takes stalls a rank and its peer. The spool is some 40 bytes an
// op, copied without formatting. (O_DIRECT writes were tried too: twice the cost of buffered ones here.)
// Measured with `dtrain-bench allreduce --timeline-blocks` (docs/PERFORMANCE.md).
//
// Layout of the JSON: {"otherData":{...},"displayTimeUnit":"ms","traceEvents":[   then one event per
// line, each but the first starting with a comma, then  ]}  (overwritten by the next flush's events).
// Every thread whose events appear has a thread_name event (its name, or "thread N").
#include <fcntl.h>
#include <fmt/format.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <set>
#include <thread>

#include "comm/trace/timeline_buffer.h"
#include "comm/trace/timeline_spool.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::trace::timeline {

namespace {

constexpr auto kPeriod = std::chrono::milliseconds(250);
constexpr auto kFlushWait = std::chrono::seconds(5);
constexpr const char* kCloser = "\n]}\n";
// Spool and JSON go out in pieces of about this size, so the writer's buffers stay small and warm (a
// round of a busy rank is MBs; buffers that size fault a fresh page per 4 KiB as they grow).
constexpr size_t kPiece = size_t{1} << 20;

struct WriterState {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false, stop = false;
  uint64_t requested = 0, completed = 0;  // flush rounds
  uint64_t json_requested = 0;            // the last of them that wants the JSON made
  std::thread thread;
  // The writer thread's own (and openFile's before it starts).
  int fd = -1;  // the JSON file
  std::string path;
  int spool_fd = -1;
  std::string spool_path;
  off_t spool_end = 0;
  SpoolWriter spool;
  int pid = 0;
  int64_t skew_us = 0;
  off_t end = 0;  // where the JSON's closer goes
  bool failed = false;
  std::string out;   // a round's spool records
  std::string json;  // a conversion's events
  std::set<uint64_t> named;  // threads with a thread_name event
  std::atomic<bool> nudged{false};  // a recording thread asked for a round (nudgeWriter)
};

// A child forked after the timeline started has no writer thread (and perhaps a lock the writer held):
// it records nothing and leaves the parent's file alone.
std::atomic<bool> g_forked{false};
void afterFork() {
  g_forked.store(true);
  g_on.store(false);
}

// Never destroyed: the exit handler and late recorders may still use it.
WriterState& ws() {
  static WriterState* w = new WriterState;
  return *w;
}

bool writeFailed(WriterState& w, const std::string& path) {
  if (!w.failed) std::fprintf(stderr, "dtrain: timeline: writing %s failed: %s; no more events are written\n",
                              path.c_str(), std::strerror(errno));
  w.failed = true;
  return false;
}

bool writeAt(WriterState& w, int fd, const std::string& path, const char* text, size_t size, off_t at) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::pwrite(fd, text + done, size - done, at + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return writeFailed(w, path);
    done += static_cast<size_t>(n);
  }
  return true;
}
bool writeJson(WriterState& w, const std::string& text, off_t at) {
  return writeAt(w, w.fd, w.path, text.data(), text.size(), at);
}

// Appends w.out to the spool, and empties it.
void spillSpool(WriterState& w) {
  if (!w.failed && !w.out.empty() && writeAt(w, w.spool_fd, w.spool_path, w.out.data(), w.out.size(), w.spool_end))
    w.spool_end += static_cast<off_t>(w.out.size());
  w.out.clear();
}

// Appends `text` (JSON lines) and the closer after it to the JSON file, and empties it.
void spillJson(WriterState& w, std::string& text) {
  if (!w.failed && !text.empty() && writeJson(w, text, w.end)) {
    w.end += static_cast<off_t>(text.size());
    writeJson(w, kCloser, w.end);
  }
  text.clear();
}

// Spools what `b` published since the last round, spilling each kPiece; frees the chunks its owner
// left. Returns whether there was any.
bool drain(WriterState& w, ThreadBuffer& b) {
  bool any = false;
  for (;;) {
    Chunk* c = b.head;
    const uint32_t n = c->published.load(std::memory_order_acquire);
    any |= b.read < n;
    for (; b.read < n; ++b.read) {
      w.spool.event(w.out, c->events[b.read], *c, b.thread);
      if (w.out.size() >= kPiece) spillSpool(w);
    }
    Chunk* next = c->next.load(std::memory_order_acquire);
    if (!next) return any;
    if (c->published.load(std::memory_order_acquire) != b.read) continue;  // published before it moved on
    w.spool.forgetShapes();  // its arena's shapes will be overwritten
    b.recycle(c);
    b.head = next;
    b.read = 0;
  }
}

void round(WriterState& w) {
  std::vector<ThreadBuffer*> buffers;
  {
    std::lock_guard<std::mutex> g(registryMutex());
    for (auto& [tid, name] : pendingNames()) {
      w.spool.threadName(w.out, tid, name);
      w.named.insert(tid);
    }
    pendingNames().clear();
    buffers = registry();
  }
  std::vector<ThreadBuffer*> gone;
  for (ThreadBuffer* b : buffers) {
    const bool exited = b->exited.load(std::memory_order_acquire);
    if (drain(w, *b) && w.named.insert(b->thread).second)
      w.spool.threadName(w.out, b->thread, fmt::format("thread {}", b->thread));
    if (exited) gone.push_back(b);
  }
  if (!gone.empty()) {
    std::lock_guard<std::mutex> g(registryMutex());
    auto& all = registry();
    w.spool.forgetShapes();
    for (ThreadBuffer* b : gone) {
      all.erase(std::remove(all.begin(), all.end(), b), all.end());
      delete b->head;
      delete b;
    }
  }
  spillSpool(w);
}

// Starts the spool afresh: its header, no definitions.
void restartSpool(WriterState& w) {
  w.out.clear();
  w.spool.begin(w.out, w.pid, w.skew_us);
  w.spool_end = 0;
  spillSpool(w);
}

// Turns the spool into JSON events appended to the JSON file, and empties the spool. (A rank that dies
// between the two leaves those events in both; dtrain-trace merge keeps them once.)
void convert(WriterState& w) {
  if (w.failed || w.spool_end <= static_cast<off_t>(kSpoolHeader)) return;
  forgetShapes();  // format()'s memory of the last op's shape: the reader's shapes are new
  SpoolReader reader;
  std::string buf;
  std::vector<char> piece(kPiece);
  bool head = false;
  try {
    for (off_t at = 0; at < w.spool_end;) {
      const ssize_t n = ::pread(w.spool_fd, piece.data(), std::min<off_t>(kPiece, w.spool_end - at), at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (n == 0) errno = EIO;
        writeFailed(w, w.spool_path);
        return;
      }
      at += n;
      buf.append(piece.data(), static_cast<size_t>(n));
      size_t used = 0;
      if (!head) {
        if (buf.size() < kSpoolHeader) continue;
        used = reader.header(buf.data(), buf.size());
        head = true;
      }
      used += reader.read(buf.data() + used, buf.size() - used, w.json);
      buf.erase(0, used);
      if (w.json.size() >= kPiece) spillJson(w, w.json);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain: timeline: reading back %s failed: %s; no more events are written\n",
                 w.spool_path.c_str(), e.what());
    w.failed = true;
    return;
  }
  spillJson(w, w.json);
  if (w.failed) return;
  if (::ftruncate(w.spool_fd, 0) != 0) {
    writeFailed(w, w.spool_path);
    return;
  }
  restartSpool(w);
}

// The writer's nice value. The ranks of a tight loop of small collectives keep every core busy, and a
// writer at their priority took its share from them in bursts every round (each burst also stalls the
// peers waiting for the preempted rank). At nice 10 it yields to them when a core is contended, and still
// gets about a tenth of a core against a busy rank (CFS weights 110 against 1024): some three times what
// the busiest loop measured needs (about 3% of a core for a million events a second), so it keeps up.
constexpr int kWriterNice = 10;

void loop() {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kWriterNice);  // best effort
  WriterState& w = ws();
  std::unique_lock<std::mutex> lk(w.mu);
  for (;;) {
    w.cv.wait_for(lk, kPeriod, [&] {
      return w.stop || w.requested > w.completed || w.nudged.exchange(false, std::memory_order_relaxed);
    });
    const uint64_t target = w.requested;
    const bool stopping = w.stop;
    const bool asked = stopping || w.json_requested > w.completed;
    lk.unlock();
    round(w);
    if (asked) convert(w);
    lk.lock();
    w.completed = target;
    w.cv.notify_all();
    if (stopping) return;
  }
}

// At exit: the last round, then the file is closed.
void finish() {
  if (g_forked.load()) return;
  WriterState& w = ws();
  {
    std::lock_guard<std::mutex> g(w.mu);
    if (!w.open || w.stop) return;
    w.stop = true;
  }
  w.cv.notify_all();
  if (w.thread.joinable()) w.thread.join();
  g_on.store(false);
  ::close(w.fd);
  ::close(w.spool_fd);
  // An empty spool (all its events are in the JSON) goes; one that could not be converted stays for merge.
  if (!w.failed && w.spool_end <= static_cast<off_t>(kSpoolHeader)) ::unlink(w.spool_path.c_str());
}

}  // namespace

void openFile(const std::string& path, int rank, int64_t skew_us, const std::string& other) {
  WriterState& w = ws();
  std::lock_guard<std::mutex> g(w.mu);
  DTRAIN_CHECK(!w.open, InvalidArgument, "[rank {}] the timeline is already being written to {}", rank, w.path);
  w.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.fd < 0)
    throw IoError(fmt::format("[rank {}] DTRAIN_TIMELINE: cannot write {}: {}", rank, path, std::strerror(errno)));
  w.path = path;
  w.out.reserve(kPiece + (size_t{64} << 10));
  w.pid = rank;
  w.skew_us = skew_us;
  std::string head = fmt::format(
      "{{\"otherData\":{{{}}},\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n"
      "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{},\"tid\":0,\"args\":{{\"name\":\"rank {}\"}}}}\n,"
      "{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{},\"tid\":0,\"args\":{{\"sort_index\":{}}}}}",
      other, rank, rank, rank, rank);
  if (!writeJson(w, head, 0) || !writeJson(w, kCloser, static_cast<off_t>(head.size()))) {
    ::close(w.fd);
    throw IoError(fmt::format("[rank {}] DTRAIN_TIMELINE: cannot write {}: {}", rank, path, std::strerror(errno)));
  }
  w.end = static_cast<off_t>(head.size());
  w.spool_path = std::filesystem::path(path).replace_extension(".spool").string();  // (merge.cc's rule)
  w.spool_fd = ::open(w.spool_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.spool_fd >= 0) restartSpool(w);
  if (w.spool_fd < 0 || w.failed) {
    const std::string why = std::strerror(errno);
    ::close(w.fd);
    if (w.spool_fd >= 0) ::close(w.spool_fd);
    throw IoError(fmt::format("[rank {}] DTRAIN_TIMELINE: cannot write {}: {}", rank, w.spool_path, why));
  }
  auto named = namedThreads();
  {
    std::lock_guard<std::mutex> r(registryMutex());
    for (auto& n : named) pendingNames().push_back(std::move(n));
  }
  prepareChunks();
  w.open = true;
  g_on.store(true);
  w.thread = std::thread(loop);
  std::atexit(finish);
  pthread_atfork(nullptr, nullptr, afterFork);
}

void setRecording(bool on) {
  if (g_forked.load()) return;
  WriterState& w = ws();
  std::lock_guard<std::mutex> g(w.mu);
  if (w.open && !w.stop) g_on.store(on);
}

void nudgeWriter() {
  WriterState& w = ws();
  // No lock: a nudge the writer misses between its check and its wait costs at most one period.
  if (!w.nudged.exchange(true, std::memory_order_relaxed)) w.cv.notify_one();
}

void flush(bool json) {
  if (g_forked.load()) return;
  WriterState& w = ws();
  std::unique_lock<std::mutex> lk(w.mu);
  if (!w.open || w.stop) return;
  const uint64_t target = ++w.requested;
  if (json) w.json_requested = target;
  w.cv.notify_all();
  w.cv.wait_for(lk, kFlushWait, [&] { return w.completed >= target; });
}

}  // namespace dtrain::comm::trace::timeline
