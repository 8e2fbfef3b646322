// dtrain-run --hang-timeout (see hang.h).
#include "hang.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "dtrain/comm/error.h"
#include "dtrain/flight_progress.h"
#include "flight_analysis.h"
#include "output.h"

namespace dtrain::run {

namespace {

using trace::FlightProgress;

// The worker's progress as it stands; false while its recorder has not started.
bool readProgress(const std::string& path, FlightProgress& p) {
  comm::net::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  return fd.valid() && ::pread(fd.get(), &p, sizeof p, 0) == static_cast<ssize_t>(sizeof p) &&
         p.magic == FlightProgress::kMagic;
}

std::string seconds(std::chrono::milliseconds d) { return fmt::format("{:g}s", static_cast<double>(d.count()) / 1e3); }

}  // namespace

HangWatch::HangWatch(std::chrono::milliseconds timeout, std::string dir, const std::vector<int>& ranks)
    : timeout_(timeout), dir_(std::move(dir)), last_progress_(Clock::now()) {
  makeDir(dir_);
  const FlightProgress zero{};
  for (int r : ranks) {
    Worker w{r, fmt::format("{}/progress-rank{}", dir_, r)};
    comm::net::Fd fd(::open(w.progress_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid() || ::write(fd.get(), &zero, sizeof zero) != static_cast<ssize_t>(sizeof zero)) {
      throw IoError(fmt::format("cannot create the progress file {}: {}", w.progress_path, strerror(errno)));
    }
    workers_.push_back(std::move(w));
  }
}

std::map<std::string, std::string> HangWatch::envFor(int rank) const {
  for (const auto& w : workers_) {
    if (w.rank == rank) return {{"DTRAIN_FLIGHT_DIR", dir_}, {"DTRAIN_FLIGHT_PROGRESS", w.progress_path}};
  }
  return {{"DTRAIN_FLIGHT_DIR", dir_}};
}

void HangWatch::watch(int rank, pid_t pid) {
  for (auto& w : workers_)
    if (w.rank == rank) w.group = pid;
}

bool HangWatch::poll(Clock::time_point now) {
  if (!declared_) {
    for (auto& w : workers_) {
      FlightProgress p{};
      if (readProgress(w.progress_path, p) && p.completed != w.completed) {
        w.completed = p.completed;
        last_progress_ = now;
      }
    }
    if (now - last_progress_ < timeout_) return false;
    declared_ = true;
    dump_deadline_ = now + kDumpWait;
    requestDumps();
  }
  if (dumpsIn()) return true;
  if (now < dump_deadline_) return false;
  std::vector<int> late;
  for (const auto& w : workers_)
    if (w.signaled) late.push_back(w.rank);
  say("no flight-recorder dump from rank(s) {} within {}s; stopping the workers anyway", fmt::join(late, ", "),
      kDumpWait.count());
  return true;
}

void HangWatch::requestDumps() {
  const std::string why =
      fmt::format("dtrain-run --hang-timeout: no rank on this node completed an op for {}", seconds(timeout_));
  say("the job is hung: no rank on this node completed an op for {} (--hang-timeout); asking the workers for "
      "flight-recorder dumps in {}", seconds(timeout_), dir_);
  for (auto& w : workers_) {
    FlightProgress p{};
    if (!readProgress(w.progress_path, p) || p.pid <= 0) {
      say("rank {} has no flight recorder running (no op issued yet, or DTRAIN_TRACE_BUFFER=0): no dump from it",
          w.rank);
      continue;
    }
    // Only a process of the worker's own process group: a stale or forged pid is not signaled.
    if (::getpgid(static_cast<pid_t>(p.pid)) != w.group) {
      say("rank {}: pid {} in {} is not one of its processes; not signaled", w.rank, p.pid, w.progress_path);
      continue;
    }
    comm::net::Fd fd(::open(w.progress_path.c_str(), O_WRONLY | O_CLOEXEC));
    char request[sizeof p.request] = {};
    std::strncpy(request, why.c_str(), sizeof request - 1);
    if (!fd.valid() || ::pwrite(fd.get(), request, sizeof request, offsetof(FlightProgress, request)) < 0) {
      say("rank {}: cannot write the dump request into {}: {}", w.rank, w.progress_path, strerror(errno));
    }
    w.dumps_before = p.dumps;
    w.signaled = static_cast<pid_t>(p.pid);
    ::kill(w.signaled, SIGUSR1);
  }
}

bool HangWatch::dumpsIn() {
  for (auto& w : workers_) {
    if (!w.signaled) continue;
    FlightProgress p{};
    bool dumped = readProgress(w.progress_path, p) && p.dumps > w.dumps_before;
    if (dumped || ::getpgid(w.signaled) != w.group) w.signaled = 0;  // dumped, or gone
  }
  for (const auto& w : workers_)
    if (w.signaled) return false;
  return true;
}

void HangWatch::printDiagnosis() const {
  std::string text;
  try {
    text = tools::analyzeFlightDumps(dir_);
  } catch (const std::exception& e) {
    say("no hang diagnosis: {}", e.what());
    return;
  }
  say("hang diagnosis (dtrain-trace analyze {}):\n{}", dir_, text);
}

}  // namespace dtrain::run
