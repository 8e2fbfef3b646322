// dtrain-run --hang-timeout S: the job is hung when no worker of this node completes an op for S
// seconds (a worker that has completed none counts from the attempt's start). Then every worker whose
// flight recorder runs is asked for a dump (the reason written into its progress file, then SIGUSR1),
// the launcher waits for the dumps (at most kDumpWait), stops the workers its usual way and prints the
// diagnosis of dtrain-trace analyze.
//
// Each worker reports progress through a small file the launcher creates in the attempt's dump
// directory (include/dtrain/flight_progress.h): the worker maps it and counts its completed ops, the
// launcher reads it once per tick. Across nodes, each node's launcher watches its own workers and
// analyzes their dumps; a node that stops its workers makes the other nodes' workers fail (and dump).
//
// \code
//   HangWatch hang(std::chrono::seconds(60), dir, {0, 1, 2, 3});
//   for (...) env.merge(hang.envFor(rank));               // before the workers start
//   hang.watch(rank, pid);                                 // once each has started
//   while (...) if (hang.poll(Clock::now())) stopWorkers(); // every tick
//   if (hang.declared()) hang.printDiagnosis();           // once they are stopped
// \endcode
#pragma once
#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace dtrain::run {

class HangWatch {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds kDumpWait{10};
  // What the launcher exits with when it stopped a hung job (as timeout(1) does).
  static constexpr int kExitCode = 124;

  // Creates `dir` and one zero-filled progress file per rank of `ranks` in it. IoError naming the path.
  HangWatch(std::chrono::milliseconds timeout, std::string dir, const std::vector<int>& ranks);

  // DTRAIN_FLIGHT_DIR and DTRAIN_FLIGHT_PROGRESS for worker `rank`.
  std::map<std::string, std::string> envFor(int rank) const;
  // The worker of `rank` runs as `pid`, the leader of its process group.
  void watch(int rank, pid_t pid);
  // Every tick while no stop is under way: true once the job is hung and the dumps are in (or the wait
  // for them is over), when the workers are to be stopped.
  bool poll(Clock::time_point now);
  bool declared() const { return declared_; }
  // The diagnosis of the dumps, on stderr.
  void printDiagnosis() const;

 private:
  struct Worker {
    int rank;
    std::string progress_path;
    pid_t group = 0;             // its process group (the launcher's child)
    uint64_t completed = 0;      // as last read
    pid_t signaled = 0;          // the process asked for a dump
    uint64_t dumps_before = 0;   // its dump count then
  };
  void requestDumps();
  bool dumpsIn();

  std::chrono::milliseconds timeout_;
  std::string dir_;
  std::vector<Worker> workers_;
  Clock::time_point last_progress_;
  bool declared_ = false;
  Clock::time_point dump_deadline_;
};

}  // namespace dtrain::run
