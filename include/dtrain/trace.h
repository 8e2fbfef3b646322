/// @file
/// Spans: named stretches of your own code, shown on the timeline (DTRAIN_TIMELINE=DIR writes a Chrome
/// trace per rank; see docs/OBSERVABILITY.md) and named in the flight recorder's dumps, so that a hang
/// diagnosis can say "rank 2 is in 'load shard'" rather than "rank 2 did not call allreduce".
///
/// \code
///   #include <dtrain/trace.h>
///
///   void loadShard(int i) {
///     DTRAIN_SPAN("load shard");                       // open until the end of the scope
///     ...
///   }
///   {
///     dtrain::trace::Span s(fmt::format("epoch {}", e)); // a name built at run time (copied)
///     ...
///   }
/// \endcode
///
/// A span costs a few tens of nanoseconds when the timeline is off (it is kept on a per-thread stack for
/// the flight recorder); spans nest, and must be closed on the thread that opened them (scoped objects).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

/// Spans on the timeline and in the flight recorder's dumps, and the trace clock.
namespace dtrain::trace {

/// A named stretch of code, open from construction to destruction: a scoped object.
///
/// The categories dtrain's own spans use: "compute", "comm", "ddp", "data", "optim", "pipeline", "ps",
/// "checkpoint"; user spans default to "user".
class Span {
 public:
  /// `name` and `category` must outlive the span (string literals do).
  explicit Span(const char* name, const char* category = "user");
  /// A name built at run time: copied.
  explicit Span(std::string name, const char* category = "user");
  /// Closes the span (on the thread that opened it).
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  void open(const char* name, const char* category);
  std::string owned_;
};

/// The trace clock: microseconds of the steady clock (shared by the processes of one host).
int64_t nowUs();

/// True when this process records a timeline now (DTRAIN_TIMELINE is set and recording is not paused).
bool timelineOn();

/// Pauses (false) and resumes (true) recording, to keep a long run's trace to the steps you look at (as
/// torch.profiler's schedule does); the file stays open and valid JSON. An op or span is recorded when
/// recording is on as it ends. A no-op when the timeline is off. Recording starts on.
void setTimelineRecording(bool on);

/// The spans open on one thread of this process, outermost first: an entry of openSpans().
struct OpenSpans {
  uint64_t thread = 0;            ///< a small per-process thread number (1, 2, ...)
  std::string thread_name;        ///< as given to setThreadName, else ""
  std::vector<std::string> names; ///< outermost first
  std::vector<int64_t> since_us;  ///< when each was opened (nowUs)
};
/// The spans open right now on every thread of this process, outermost first, one entry per thread
/// that has any (the flight recorder's dumps carry them).
std::vector<OpenSpans> openSpans();

/// Names the calling thread in traces and dumps ("main", "ddp hooks", "group world").
void setThreadName(std::string name);

/// Writes the timeline's events so far to this rank's file, which is complete JSON afterwards (the
/// timeline also does this when an op fails and at exit; call it before a process ends without exit(),
/// e.g. through _exit or a signal). A no-op when the timeline is off.
void flush();

/// While a rank runs, its events go every quarter second to a compact spool beside its file
/// (`DIR/trace-rank<R>.spool`), and become JSON at flush() or exit: that keeps the cost to a loop of small
/// collectives low. flushSpool() does the quarter second's work now, without making the JSON (e.g.
/// before timing the next stretch of work, so that the writer's catching up does not fall in it).
void flushSpool();

/// The events of a spool as the JSON file's lines ("\n," and one event each): dtrain-trace merge reads
/// the spool a rank left when it ended without exit (killed). Throws naming the file if it is no spool.
std::string spoolEvents(const std::string& path);

}  // namespace dtrain::trace

#define DTRAIN_TRACE_JOIN2(a, b) a##b
#define DTRAIN_TRACE_JOIN(a, b) DTRAIN_TRACE_JOIN2(a, b)
/// DTRAIN_SPAN("name") or DTRAIN_SPAN("name", "category"): a span until the end of the enclosing scope.
#define DTRAIN_SPAN(...) ::dtrain::trace::Span DTRAIN_TRACE_JOIN(dtrain_span_, __LINE__)(__VA_ARGS__)
