// The timeline's writer: a thread that, every kPeriod or when asked (flush(), a failed op, exit),
// formats what the recording threads published and appends it to DIR/trace-rank<R>.json, then writes
// the closing "]}" after it. The file is complete JSON between rounds, and a rank that dies mid-write
// leaves a file whose lines up to the last whole one are still events (dtrain-trace merge reads them).
//
// Writing: a busy rank makes tens of MB of events a second, and copying them through the page cache cost
// the kernel about 10 us per 4 KiB page on the machine this was measured on (a sixth of a core, taken
// from the ranks). So the file is written with O_DIRECT where the file system allows it (not tmpfs):
// whole 4 KiB blocks from an aligned buffer, the last one padded and the file then cut to its real end;
// the partial last block is kept in memory and written again, longer, by the next round.
//
// Layout: {"otherData":{...},"displayTimeUnit":"ms","traceEvents":[   then one event per line, each
// but the first starting with a comma, then  ]}  (overwritten by the next round's events). Every thread
// whose events appear has a thread_name event (its name, or "thread N").
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
#include <iterator>
#include <set>
#include <thread>

#include "comm/trace/timeline_buffer.h"
#include "comm/util/json_text.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::trace::timeline {

namespace {

constexpr auto kPeriod = std::chrono::milliseconds(250);
constexpr auto kFlushWait = std::chrono::seconds(5);
constexpr const char* kCloser = "\n]}\n";
constexpr size_t kBlock = 4096;  // O_DIRECT's alignment of memory, file offsets and lengths
// A round's text goes out in pieces of about this size, so the writer's buffers stay small and warm
// (a round of a busy rank is tens of MB; buffers that size fault a fresh page per 4 KiB as they grow).
constexpr size_t kPiece = size_t{1} << 20;

struct WriterState {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false, stop = false;
  uint64_t requested = 0, completed = 0;  // flush rounds
  std::thread thread;
  // The writer thread's own (and openFile's before it starts).
  int fd = -1;
  std::string path;
  int pid = 0;
  int64_t skew_us = 0;
  off_t end = 0;  // where the closer goes
  bool failed = false;
  // O_DIRECT writing: the file from block_start (a multiple of kBlock) to `end` is also in `tail`.
  bool direct = false;
  off_t block_start = 0;
  std::string tail;
  char* block_buf = nullptr;  // aligned to kBlock; block_cap bytes
  size_t block_cap = 0;
  std::string out;  // a round's events
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

bool writeFailed(WriterState& w) {
  if (!w.failed) std::fprintf(stderr, "dtrain: timeline: writing %s failed: %s; no more events are written\n",
                              w.path.c_str(), std::strerror(errno));
  w.failed = true;
  return false;
}

bool writeAt(WriterState& w, const char* text, size_t size, off_t at) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::pwrite(w.fd, text + done, size - done, at + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return writeFailed(w);
    done += static_cast<size_t>(n);
  }
  return true;
}
bool writeAt(WriterState& w, const std::string& text, off_t at) { return writeAt(w, text.data(), text.size(), at); }

// Appends `out` and the closer after the file's end (O_DIRECT): the kept partial block, `out` and the
// closer go out as whole blocks padded with spaces, the file is cut to its real size, and the new
// partial block is kept.
bool appendDirect(WriterState& w, const std::string& out) {
  const size_t closer = std::strlen(kCloser);
  const size_t data = w.tail.size() + out.size();
  const size_t padded = (data + closer + kBlock - 1) / kBlock * kBlock;
  if (padded > w.block_cap) {
    std::free(w.block_buf);
    w.block_cap = std::max(padded, 2 * w.block_cap);
    w.block_buf = static_cast<char*>(std::aligned_alloc(kBlock, w.block_cap));
    if (!w.block_buf) {
      w.block_cap = 0;
      errno = ENOMEM;
      return writeFailed(w);
    }
  }
  char* b = w.block_buf;
  std::memcpy(b, w.tail.data(), w.tail.size());
  std::memcpy(b + w.tail.size(), out.data(), out.size());
  std::memcpy(b + data, kCloser, closer);
  std::memset(b + data + closer, ' ', padded - data - closer);
  for (size_t done = 0; done < padded;) {
    ssize_t n = ::pwrite(w.fd, b + done, padded - done, w.block_start + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL && done == 0) {  // opened with O_DIRECT, but this file system will not do it
      w.direct = false;
      if (::fcntl(w.fd, F_SETFL, ::fcntl(w.fd, F_GETFL) & ~O_DIRECT) != 0) return writeFailed(w);
      if (!writeAt(w, b, data + closer, w.block_start)) return false;
      w.end = w.block_start + static_cast<off_t>(data);
      return true;
    }
    if (n <= 0) return writeFailed(w);
    done += static_cast<size_t>(n);
  }
  if (::ftruncate(w.fd, w.block_start + static_cast<off_t>(data + closer)) != 0) return writeFailed(w);
  const size_t whole = data / kBlock * kBlock;
  w.tail.assign(b + whole, data - whole);
  w.block_start += static_cast<off_t>(whole);
  w.end = w.block_start + static_cast<off_t>(w.tail.size());
  return true;
}

void appendThreadName(std::string& out, int pid, uint64_t tid, const std::string& name) {
  fmt::format_to(std::back_inserter(out), "\n,{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":",
                 pid, tid);
  dtrain::detail::appendJsonQuoted(out, name);
  fmt::format_to(std::back_inserter(out), "}}}}\n,{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{},\"tid\":{},"
                 "\"args\":{{\"sort_index\":{}}}}}", pid, tid, tid);
}

// Appends w.out (and the closer after it) to the file, and empties it.
void spill(WriterState& w) {
  std::string& out = w.out;
  if (out.empty() || w.failed) {
    out.clear();
    return;
  }
  if (w.direct) {
    appendDirect(w, out);
  } else if (writeAt(w, out, w.end)) {
    w.end += static_cast<off_t>(out.size());
    writeAt(w, kCloser, w.end);
  }
  out.clear();
}

// Formats what `b` published since the last round, spilling each kPiece; frees the chunks its owner
// left. Returns whether there was any.
bool drain(WriterState& w, ThreadBuffer& b) {
  std::string& out = w.out;
  bool any = false;
  for (;;) {
    Chunk* c = b.head;
    const uint32_t n = c->published.load(std::memory_order_acquire);
    any |= b.read < n;
    for (; b.read < n; ++b.read) {
      format(out, c->events[b.read], w.pid, b.thread, w.skew_us);
      if (out.size() >= kPiece) spill(w);
    }
    Chunk* next = c->next.load(std::memory_order_acquire);
    if (!next) return any;
    if (c->published.load(std::memory_order_acquire) != b.read) continue;  // published before it moved on
    forgetShapes();  // its arena's shapes will be overwritten
    b.recycle(c);
    b.head = next;
    b.read = 0;
  }
}

void round(WriterState& w) {
  std::string& out = w.out;
  out.clear();
  std::vector<ThreadBuffer*> buffers;
  {
    std::lock_guard<std::mutex> g(registryMutex());
    for (auto& [tid, name] : pendingNames()) {
      appendThreadName(out, w.pid, tid, name);
      w.named.insert(tid);
    }
    pendingNames().clear();
    buffers = registry();
  }
  std::vector<ThreadBuffer*> gone;
  for (ThreadBuffer* b : buffers) {
    const bool exited = b->exited.load(std::memory_order_acquire);
    if (drain(w, *b) && w.named.insert(b->thread).second)
      appendThreadName(out, w.pid, b->thread, fmt::format("thread {}", b->thread));
    if (exited) gone.push_back(b);
  }
  if (!gone.empty()) {
    std::lock_guard<std::mutex> g(registryMutex());
    auto& all = registry();
    forgetShapes();
    for (ThreadBuffer* b : gone) {
      all.erase(std::remove(all.begin(), all.end(), b), all.end());
      delete b->head;
      delete b;
    }
  }
  spill(w);
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
    lk.unlock();
    round(w);
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
}

}  // namespace

void openFile(const std::string& path, int rank, int64_t skew_us, const std::string& other) {
  WriterState& w = ws();
  std::lock_guard<std::mutex> g(w.mu);
  DTRAIN_CHECK(!w.open, InvalidArgument, "[rank {}] the timeline is already being written to {}", rank, w.path);
  w.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  w.direct = w.fd >= 0;
  if (!w.direct) w.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
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
  const bool wrote = w.direct ? appendDirect(w, head)
                              : writeAt(w, head, 0) && writeAt(w, kCloser, static_cast<off_t>(head.size()));
  if (!wrote) {
    ::close(w.fd);
    throw IoError(fmt::format("[rank {}] DTRAIN_TIMELINE: cannot write {}: {}", rank, path, std::strerror(errno)));
  }
  if (!w.direct) w.end = static_cast<off_t>(head.size());
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

void nudgeWriter() {
  WriterState& w = ws();
  // No lock: a nudge the writer misses between its check and its wait costs at most one period.
  if (!w.nudged.exchange(true, std::memory_order_relaxed)) w.cv.notify_one();
}

void flush() {
  if (g_forked.load()) return;
  WriterState& w = ws();
  std::unique_lock<std::mutex> lk(w.mu);
  if (!w.open || w.stop) return;
  const uint64_t target = ++w.requested;
  w.cv.notify_all();
  w.cv.wait_for(lk, kFlushWait, [&] { return w.completed >= target; });
}

}  // namespace dtrain::comm::trace::timeline
