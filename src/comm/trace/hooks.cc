// The process groups' calls into the recorders: stamp the time, pass the record on.
#include "comm/trace/trace_internal.h"

namespace dtrain::comm::trace {

std::string errorText(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

void opIssued(OpRecord& r) {
  r.issued_us = nowUs();
  flight::issued(r);
}

void opStarted(OpRecord& r) {
  r.started_us = nowUs();
  flight::started(r);
  r.timeline_started = timeline::on();
  if (r.timeline_started) timeline::opStarted(r);
}

void opFinished(OpRecord& r, const std::exception_ptr& error) {
  r.finished_us = nowUs();
  flight::finished(r, error);
  if (timeline::on()) timeline::op(r, error);
  if (r.timeline_started) timeline::opEnded(r);
}

}  // namespace dtrain::comm::trace
