// Spans: a stack per thread of the spans open on it, registered process-wide so that another thread
// (the flight recorder's dumper) can list them; closing a span writes it to the timeline when it is on.
#include <time.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include "comm/trace/timeline_spool.h"
#include "comm/trace/trace_internal.h"

namespace dtrain::trace {

namespace {

struct Entry {
  const char* name;
  const char* category;
  int64_t start_us;
};

struct ThreadSpans {
  std::mutex mu;  // taken by this thread on open/close, by readers in openSpans()
  uint64_t id = 0;
  std::string name;
  std::vector<Entry> stack;
};

struct Registry {
  std::mutex mu;
  std::vector<ThreadSpans*> threads;
  std::atomic<uint64_t> next_id{1};
};

// Never destroyed: threads may close spans during static destruction.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// Registers this thread's stack on first use and unregisters it when the thread ends.
struct ThreadSlot {
  ThreadSpans spans;
  ThreadSlot() {
    auto& r = registry();
    spans.id = r.next_id++;
    std::lock_guard<std::mutex> g(r.mu);
    r.threads.push_back(&spans);
  }
  ~ThreadSlot() {
    auto& r = registry();
    std::lock_guard<std::mutex> g(r.mu);
    r.threads.erase(std::remove(r.threads.begin(), r.threads.end(), &spans), r.threads.end());
  }
};

ThreadSpans& mine() {
  thread_local ThreadSlot slot;
  return slot.spans;
}

}  // namespace

// CLOCK_MONOTONIC is steady_clock's clock (usOf() converts its time points alike); read directly, it
// costs a third less than through chrono, and every op reads it three times (the flight recorder's times).
int64_t nowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

bool timelineOn() { return comm::trace::timeline::on(); }

void setTimelineRecording(bool on) { comm::trace::timeline::setRecording(on); }

Span::Span(const char* name, const char* category) { open(name, category); }

Span::Span(std::string name, const char* category) : owned_(std::move(name)) { open(owned_.c_str(), category); }

void Span::open(const char* name, const char* category) {
  auto& t = mine();
  std::lock_guard<std::mutex> g(t.mu);
  t.stack.push_back(Entry{name, category, nowUs()});
}

Span::~Span() {
  auto& t = mine();
  Entry e;
  {
    std::lock_guard<std::mutex> g(t.mu);
    if (t.stack.empty()) return;  // unbalanced use; nothing to close
    e = t.stack.back();
    t.stack.pop_back();
  }
  if (comm::trace::timeline::on())
    comm::trace::timeline::span(e.name, e.category, e.start_us, nowUs(), /*copy=*/e.name == owned_.c_str());
}

std::vector<OpenSpans> openSpans() {
  auto& r = registry();
  std::vector<OpenSpans> out;
  std::lock_guard<std::mutex> g(r.mu);
  for (ThreadSpans* t : r.threads) {
    std::lock_guard<std::mutex> tg(t->mu);
    if (t->stack.empty()) continue;
    OpenSpans s;
    s.thread = t->id;
    s.thread_name = t->name;
    for (const auto& e : t->stack) {
      s.names.emplace_back(e.name);
      s.since_us.push_back(e.start_us);
    }
    out.push_back(std::move(s));
  }
  return out;
}

void setThreadName(std::string name) {
  auto& t = mine();
  {
    std::lock_guard<std::mutex> g(t.mu);
    t.name = name;
  }
  if (comm::trace::timeline::on()) comm::trace::timeline::threadNamed(t.id, name);
}

void flush() { comm::trace::timeline::flush(true); }

void flushSpool() { comm::trace::timeline::flush(false); }

std::string spoolEvents(const std::string& path) { return comm::trace::timeline::spoolFileToJson(path); }

}  // namespace dtrain::trace

namespace dtrain::comm::trace {

uint64_t threadNumber() { return ::dtrain::trace::mine().id; }

bool threadHasName() {
  auto& t = ::dtrain::trace::mine();
  std::lock_guard<std::mutex> g(t.mu);
  return !t.name.empty();
}

std::vector<std::pair<uint64_t, std::string>> namedThreads() {
  auto& r = ::dtrain::trace::registry();
  std::vector<std::pair<uint64_t, std::string>> out;
  std::lock_guard<std::mutex> g(r.mu);
  for (auto* t : r.threads) {
    std::lock_guard<std::mutex> tg(t->mu);
    if (!t->name.empty()) out.emplace_back(t->id, t->name);
  }
  return out;
}

}  // namespace dtrain::comm::trace
