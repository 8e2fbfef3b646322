// The hang diagnosis from the ranks' flight-recorder dumps (DIR/rank<R>.json), shared by
// `dtrain-trace analyze DIR` and `dtrain-run --hang-timeout` (compiled into both):
//
// \code
//   std::string text = dtrain::tools::analyzeFlightDumps("/tmp/run/flight/attempt_0");
//   std::fputs(text.c_str(), stdout);  // one paragraph on the stuck op, then the stragglers
// \endcode
#pragma once
#include <string>

namespace dtrain::tools {

// Reads every DIR/rank<R>.json and returns the diagnosis: which collective the job is stuck in (the
// op the most ranks wait in, the earliest issued among equals), which ranks never issued it and which
// issued but never finished it, what each rank that never issued it did instead (the other op it
// waits in, else its innermost open span), which ranks wrote no dump; then the stragglers: per rank,
// how long the others waited for it over the recorded window.
// Throws std::runtime_error naming DIR when it holds no dump, or the file that does not parse.
std::string analyzeFlightDumps(const std::string& dir);

}  // namespace dtrain::tools
