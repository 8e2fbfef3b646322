// What every dtrain-bench family shows and records besides its printed table: progress on stderr (one
// unit per measured point, --progress) and, with --metrics FILE, a JSON-lines file of a run record and a
// bench record per point (docs/OBSERVABILITY.md, "Metrics"), written by rank 0.
//
// \code
//   auto obs = std::make_shared<Observe>();
//   obs->addOptions(sub);                                      // --metrics FILE, --progress MODE
//   ...
//   auto log = obs->open(dist.isMain(), "allreduce", n, dtrain::Record().set("transport", "shm"));
//   dtrain::Progress progress("allreduce", sizes, obs->progress(dist.isMain(), "size"));
//   if (log) log->write(dtrain::Record("bench").set("name", "allreduce").set("size_bytes", 4096));
// \endcode
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>

#include "dtrain/metrics.h"
#include "dtrain/progress.h"

namespace dtrain::bench {

struct Observe {
  std::string metrics;  // --metrics: the JSON-lines file; empty: none
  ProgressOptions::Mode progress_mode = ProgressOptions::Mode::automatic;

  void addOptions(CLI::App* sub);
  // On the main rank with --metrics: the log, its run record written (app "dtrain-bench", config plus
  // "benchmark": name); otherwise null.
  std::unique_ptr<MetricsLog> open(bool main, const std::string& name, int world_size, Record config) const;
  // Progress options counting `unit`; off except on the main rank.
  ProgressOptions progress(bool main, const std::string& unit) const;
};

// A subcommand's callback: runs `body` and exits with its status; an exception is printed as
// "dtrain-bench NAME: what" and exits 1.
[[noreturn]] void runAndExit(const char* name, const std::function<int()>& body);

}  // namespace dtrain::bench
