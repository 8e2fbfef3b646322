// What the process groups tell the recorders (internal to dtrain): every op's record, filled by the
// group (process_group.cc) and read by the flight recorder (flight_recorder.cc) and the timeline
// (timeline.cc). hooks.cc stamps the times and passes each record on.
#pragma once
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/trace.h"

namespace dtrain::comm::trace {

using ::dtrain::trace::nowUs;

// A group as traces and dumps name it.
struct GroupInfo {
  std::string name;               // "world", "world/sub0", "group3": the same on every member
  int rank = 0;                   // this process's rank in the group
  int size = 1;
  std::vector<int> global_ranks;  // member i's rank in the world; identity when not known
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

namespace timeline {  // timeline.cc
bool on();
void op(const OpRecord& r, const std::exception_ptr& error);
// A closed span (Span's destructor).
void span(const char* name, const char* category, int64_t start_us, int64_t end_us);
}  // namespace timeline

}  // namespace dtrain::comm::trace
