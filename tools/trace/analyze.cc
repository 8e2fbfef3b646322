// dtrain-trace analyze DIR: the hang diagnosis of a directory of flight-recorder dumps, printed on
// stdout (the analysis itself is in flight_analysis.cc, shared with dtrain-run --hang-timeout).
#include <cstdio>

#include "commands.h"
#include "flight_analysis.h"

namespace dtrain::tools {

int runAnalyze(const AnalyzeArgs& a) {
  std::fputs(analyzeFlightDumps(a.dir).c_str(), stdout);
  return 0;
}

}  // namespace dtrain::tools
