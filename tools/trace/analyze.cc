// dtrain-trace analyze: being written by the flight-recorder helper of issue 11.
#include <stdexcept>

#include "commands.h"

namespace dtrain::tools {

int runAnalyze(const AnalyzeArgs&) {
  throw std::runtime_error("analyze is not implemented yet");
}

}  // namespace dtrain::tools
