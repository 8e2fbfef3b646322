// WorkExecutor: how a thread that waits for a Work may run the group's queued ops itself. Internal
// to dtrain::comm (the ProcessGroup's op queue implements it; Work::wait calls it).
#pragma once

namespace dtrain::comm {

class Work;

// Whoever runs a Work's op may let a thread that waits for it run queued ops itself (saving two
// thread hand-offs per op, which dominate small-message latency).
class WorkExecutor {
 public:
  virtual ~WorkExecutor() = default;
  // Runs queued ops on the calling thread, in order, while `w` is incomplete and nobody else is
  // running one. Returns when w is complete or another thread is busy.
  virtual void help(const Work& w) = 0;
};

// Whether an IssueAndMoveOn guard lives on the calling thread (work.cc).
bool issuingAndMovingOn();

}  // namespace dtrain::comm
