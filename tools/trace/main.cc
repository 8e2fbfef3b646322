// dtrain-trace: tools for dtrain's timelines and flight-recorder dumps (docs/OBSERVABILITY.md).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"dtrain-trace: merge per-rank timelines; diagnose hangs from flight-recorder dumps"};
  app.require_subcommand(1);
  dtrain::tools::MergeArgs merge;
  auto* m = app.add_subcommand("merge", "merge DIR/trace-rank*.json into one Chrome trace, clocks aligned");
  m->add_option("dir", merge.dir, "the DTRAIN_TIMELINE directory")->required();
  m->add_option("-o,--output", merge.output, "output file (default DIR/trace.json)");
  dtrain::tools::AnalyzeArgs analyze;
  auto* a = app.add_subcommand("analyze", "say which collective a job is stuck in and who everyone waits for");
  a->add_option("dir", analyze.dir, "the directory of the ranks' flight-recorder dumps")->required();
  CLI11_PARSE(app, argc, argv);
  try {
    if (m->parsed()) return dtrain::tools::runMerge(merge);
    return dtrain::tools::runAnalyze(analyze);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-trace: %s\n", e.what());
    return 1;
  }
}
