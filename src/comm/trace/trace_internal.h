// What the process groups tell the recorders (internal to dtrain): every op's record, filled by the
// group (process_group.cc) and read by the flight recorder (flight_recorder.cc) and the timeline
// (timeline.cc). hooks.cc stamps the times and passes each record on.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/trace.h"

namespace dtrain::comm::transport {
struct Op;
}

namespace dtrain::comm::trace {

using ::dtrain::trace::nowUs;

// A steady-clock time point on the trace clock (nowUs()).
inline int64_t usOf(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

// span.cc: the calling thread's number (OpenSpans::thread) and the names threads gave themselves.
uint64_t threadNumber();
bool threadHasName();
std::vector<std::pair<uint64_t, std::string>> namedThreads();

// The message of a failed op's exception (hooks.cc).
std::string errorText(const std::exception_ptr& error);

// A group as traces and dumps name it.
struct GroupInfo {
  std::string name;               // "world", "world/sub0", "group3": the same on every member
  int rank = 0;                   // this process's rank in the group
  int size = 1;
  std::vector<int> global_ranks;  // member i's rank in the world; identity when not known
  // The timeline's count of point-to-point messages sent to (first size) and received from (next size)
  // each member, which names them in flow events. The group's ops run one at a time.
  mutable std::vector<uint64_t> p2p_messages;

  // A member's rank in the world (itself when not known or out of range).
  int globalRank(int group_rank) const {
    return group_rank >= 0 && static_cast<size_t>(group_rank) < global_ranks.size()
               ? global_ranks[static_cast<size_t>(group_rank)]
               : group_rank;
  }
};

// One op of a process group.
struct OpRecord {
  static constexpr uint64_t kNoSeq = ~uint64_t{0};
  std::shared_ptr<const GroupInfo> group;
  uint64_t seq = kNoSeq;          // the group's collective sequence number; kNoSeq for point to point
  const char* op = "";            // "allreduce", "send", ... (transport::opName)
  const char* dtype = "";
  size_t count = 0;               // elements
  size_t bytes = 0;               // count * element size
  int root = -1;
  std::vector<int> peers;         // point to point: the group ranks it sends to / receives from
  const char* algorithm = "";     // the algorithm the group's thread ran ("ring", ...), when it chose one
  const std::string* what = nullptr;  // the op's label ("allreduce seq=3 f32 x 1024 sum"), owned by the op
  int64_t issued_us = 0;          // nowUs() on the caller's thread
  int64_t started_us = 0;         // on the group's thread
  int64_t finished_us = 0;
  uint64_t slot = 0;              // the flight recorder's handle for this op
  bool timeline_started = false;  // the timeline saw it start (opEnded pairs with opStarted)
};

// Called by the process group: on the caller's thread when the op is issued, on the group's thread when
// it starts and when it finishes (error null on success).
void opIssued(OpRecord& r);
void opStarted(OpRecord& r);
void opFinished(OpRecord& r, const std::exception_ptr& error);

namespace flight {  // flight_recorder.cc
void issued(OpRecord& r);
void started(OpRecord& r);
void finished(OpRecord& r, const std::exception_ptr& error);
}  // namespace flight

namespace timeline {  // timeline.cc; the file written by timeline_writer.cc, started by timeline_start.cc
// True once initWorld() opened this rank's timeline (DTRAIN_TIMELINE); every call below is made only then.
extern std::atomic<bool> g_on;
inline bool on() { return g_on.load(std::memory_order_relaxed); }
// A finished op (X event on the thread that ran it, with the record's fields as args).
void op(const OpRecord& r, const std::exception_ptr& error);
// A closed span (Span's destructor). `copy`: the name does not outlive the call (Span's owned name).
void span(const char* name, const char* category, int64_t start_us, int64_t end_us, bool copy = false);

// Integer args of library events; key null (`Arg{}`): none.
struct Arg {
  const char* key;
  int64_t value;
};
// A span named `prefix` followed by `index` ("bucket " and 3: "bucket 3"), with up to four args; the
// library's events whose times are not one scope (DDP backward, pipeline micro-batches).
void span(const char* prefix, int64_t index, const char* category, int64_t start_us, int64_t end_us,
          Arg a = {}, Arg b = {}, Arg c = {}, Arg d = {});
// An async slice (b/e events, its own track in the viewer): events that overlap on one thread (DDP
// buckets from ready to done).
void asyncSpan(const char* prefix, int64_t index, const char* category, int64_t start_us, int64_t end_us,
               Arg a = {}, Arg b = {}, Arg c = {}, Arg d = {});

// Flow events between ranks (algo::Context::run): hooks.cc tells which op this thread runs, so that
// sender and receiver name each message alike (group, seq, source, destination, k-th between them).
void opStarted(const OpRecord& r);
void opEnded(const OpRecord& r);
void sending(const std::vector<transport::Op>& ops);   // a flow start (s) per send, now
void received(const std::vector<transport::Op>& ops);  // a flow end (f) per receive, now

// span.cc: a thread named itself while the timeline is on.
void threadNamed(uint64_t thread, const std::string& name);
// Writes what was recorded so far to the spool and, with `json`, the spool to the JSON file, which is
// complete afterwards (dtrain::trace::flush() and flushSpool()).
void flush(bool json = true);
// Pauses or resumes recording while the file is open (dtrain::trace::setTimelineRecording).
void setRecording(bool on);
}  // namespace timeline

}  // namespace dtrain::comm::trace
