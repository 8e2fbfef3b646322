// dtrain-trace merge: being written by the timeline helper of issue 11.
#include <stdexcept>

#include "commands.h"

namespace dtrain::tools {

int runMerge(const MergeArgs&) {
  throw std::runtime_error("merge is not implemented yet");
}

}  // namespace dtrain::tools
