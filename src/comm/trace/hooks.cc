// The process groups' calls into the recorders: stamp the time, pass the record on.
#include "comm/trace/trace_internal.h"

namespace dtrain::comm::trace {

void opIssued(OpRecord& r) {
  r.issued_us = nowUs();
  flight::issued(r);
}

void opStarted(OpRecord& r) {
  r.started_us = nowUs();
  flight::started(r);
}

void opFinished(OpRecord& r, const std::exception_ptr& error) {
  r.finished_us = nowUs();
  flight::finished(r, error);
  if (timeline::on()) timeline::op(r, error);
}

}  // namespace dtrain::comm::trace
