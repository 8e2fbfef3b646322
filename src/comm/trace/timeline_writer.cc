// The timeline's writer: a thread that, every kPeriod or when asked (flush(), a failed op, exit),
// formats what the recording threads published and appends it to DIR/trace-rank<R>.json, then writes
// the closing "]}" after it. The file is complete JSON between rounds, and a rank that dies mid-write
// leaves a file whose lines up to the last whole one are still events (dtrain-trace merge reads them).
//
// Layout: {"otherData":{...},"displayTimeUnit":"ms","traceEvents":[   then one event per line, each
// but the first starting with a comma, then  ]}  (overwritten by the next round's events). Every thread
// whose events appear has a thread_name event (its name, or "thread N").
#include <fcntl.h>
#include <fmt/format.h>
#include <pthread.h>
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
  std::set<uint64_t> named;  // threads with a thread_name event
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

bool writeAt(WriterState& w, const std::string& text, off_t at) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::pwrite(w.fd, text.data() + done, text.size() - done, at + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (!w.failed) std::fprintf(stderr, "dtrain: timeline: writing %s failed: %s; no more events are written\n",
                                  w.path.c_str(), std::strerror(errno));
      w.failed = true;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

void appendThreadName(std::string& out, int pid, uint64_t tid, const std::string& name) {
  fmt::format_to(std::back_inserter(out), "\n,{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":",
                 pid, tid);
  dtrain::detail::appendJsonQuoted(out, name);
  fmt::format_to(std::back_inserter(out), "}}}}\n,{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{},\"tid\":{},"
                 "\"args\":{{\"sort_index\":{}}}}}", pid, tid, tid);
}

// Formats what `b` published since the last round; frees the chunks its owner left.
void drain(WriterState& w, ThreadBuffer& b, std::string& out) {
  for (;;) {
    Chunk* c = b.head;
    const uint32_t n = c->published.load(std::memory_order_acquire);
    for (; b.read < n; ++b.read) {
      format(out, c->events[b.read], w.pid, b.thread, w.skew_us);
    }
    Chunk* next = c->next.load(std::memory_order_acquire);
    if (!next) return;
    if (c->published.load(std::memory_order_acquire) != b.read) continue;  // published before it moved on
    b.recycle(c);
    b.head = next;
    b.read = 0;
  }
}

void round(WriterState& w) {
  std::string out;
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
    const size_t before = out.size();
    drain(w, *b, out);
    if (out.size() != before && w.named.insert(b->thread).second)
      appendThreadName(out, w.pid, b->thread, fmt::format("thread {}", b->thread));
    if (exited) gone.push_back(b);
  }
  if (!gone.empty()) {
    std::lock_guard<std::mutex> g(registryMutex());
    auto& all = registry();
    for (ThreadBuffer* b : gone) {
      all.erase(std::remove(all.begin(), all.end(), b), all.end());
      delete b->head;
      delete b;
    }
  }
  if (out.empty() || w.failed) return;
  if (writeAt(w, out, w.end)) {
    w.end += static_cast<off_t>(out.size());
    writeAt(w, kCloser, w.end);
  }
}

void loop() {
  WriterState& w = ws();
  std::unique_lock<std::mutex> lk(w.mu);
  for (;;) {
    w.cv.wait_for(lk, kPeriod, [&] { return w.stop || w.requested > w.completed; });
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
  w.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.fd < 0)
    throw IoError(fmt::format("[rank {}] DTRAIN_TIMELINE: cannot write {}: {}", rank, path, std::strerror(errno)));
  w.path = path;
  w.pid = rank;
  w.skew_us = skew_us;
  std::string head = fmt::format(
      "{{\"otherData\":{{{}}},\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n"
      "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{},\"tid\":0,\"args\":{{\"name\":\"rank {}\"}}}}\n,"
      "{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{},\"tid\":0,\"args\":{{\"sort_index\":{}}}}}",
      other, rank, rank, rank, rank);
  if (!writeAt(w, head, 0) || !writeAt(w, kCloser, static_cast<off_t>(head.size()))) {
    ::close(w.fd);
    throw IoError(fmt::format("[rank {}] DTRAIN_TIMELINE: cannot write {}: {}", rank, path, std::strerror(errno)));
  }
  w.end = static_cast<off_t>(head.size());
  auto named = namedThreads();
  {
    std::lock_guard<std::mutex> r(registryMutex());
    for (auto& n : named) pendingNames().push_back(std::move(n));
  }
  w.open = true;
  g_on.store(true);
  w.thread = std::thread(loop);
  std::atexit(finish);
  pthread_atfork(nullptr, nullptr, afterFork);
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
