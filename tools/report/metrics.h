// Reads a run's metrics.jsonl (the JSON lines rank 0's metrics logger writes) into columns for the
// report's charts.
//   Metrics m = readMetrics("runs/milnce/metrics.jsonl");
//   m.steps["loss"]   // [1.9, 1.7, null, ...], one entry per step record, null where it had none
// Records: {"kind":"run",...} (app, world_size, start_unix, config), {"kind":"step","step":12,...},
// {"kind":"eval","epoch":1,"R@1":12.5,...}, {"kind":"bench",...}. Errors (dtrain::Error) name the file,
// and the line for a malformed one; an incomplete last line (a run still writing) is skipped with a warning.
// Several runs appended to one file (each from a run record on) join into one history: a resumed run
// replaces the steps the run before logged from its first step on; a run started afresh replaces all.
#pragma once
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace dtrain::report {

struct Metrics {
  nlohmann::json run;                              // the last run record, or null
  int run_records = 0;                             // more than one: resumed or restarted runs
  int step_records = 0;                            // the steps shown (see readMetrics)
  nlohmann::json steps = nlohmann::json::object();  // field -> column (numbers and nulls), one row per step
  nlohmann::json evals = nlohmann::json::array();   // the eval records, in file order
  nlohmann::json benches = nlohmann::json::array(); // the bench records, in file order
  std::vector<std::string> warnings;               // lines skipped, unknown kinds
};

Metrics readMetrics(const std::filesystem::path& file);

}  // namespace dtrain::report
