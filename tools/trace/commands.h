// dtrain-trace's subcommands (main.cc parses the command line).
#pragma once
#include <string>
#include <vector>

namespace dtrain::tools {

// dtrain-trace merge DIR [-o FILE]: the ranks' timelines in DIR, clocks aligned, in one Chrome trace.
struct MergeArgs {
  std::string dir;
  std::string output;  // empty: DIR/trace.json
};
int runMerge(const MergeArgs& a);

// dtrain-trace analyze DIR: which collective a job is stuck in, and who it waits for.
struct AnalyzeArgs {
  std::string dir;
};
int runAnalyze(const AnalyzeArgs& a);

}  // namespace dtrain::tools
