// Picks a few steps out of a merged Chrome trace (timeline/trace.json, tens of MB) for the report's
// timeline view, so the page embeds hundreds of events rather than the whole run.
//   TraceWindow w = readTraceWindow("runs/milnce/timeline/trace.json", {});
//   w.data   // {"window": {...}, "rows": [{"label": "rank 0 · main"}, ...], "events": [[row, start_ms, ...]]}
// The window runs from the (skip+1)-th to the (skip+steps+1)-th start of a "forward" X event on pid 0
// (rank 0), or of a "backward" one when there are not enough forwards: `steps` whole steps after `skip`
// warm-up ones. With fewer, it starts at the (skip+1)-th or the last there is (or at the first event)
// and lasts window_ms, or to the trace's end. Errors (dtrain::Error) name the file.
#pragma once
#include <nlohmann/json.hpp>

#include <filesystem>

namespace dtrain::report {

struct TraceWindowOptions {
  int skip = 2;             // steps (forward passes) of rank 0 skipped before the window (warm-up)
  int steps = 3;            // steps of rank 0 inside the window
  double window_ms = 200;   // the window's length when the trace has too few steps
  size_t max_events = 4000; // events embedded at most (the earliest ones)
};

struct TraceWindow {
  nlohmann::json data;      // window, rows, events, other_data (see above)
  size_t total_events = 0;  // X events in the whole trace
  size_t shown_events = 0;  // X events in the page
  size_t rows = 0;
};

TraceWindow readTraceWindow(const std::filesystem::path& file, const TraceWindowOptions& opts);

}  // namespace dtrain::report
