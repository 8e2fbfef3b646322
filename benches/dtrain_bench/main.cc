// dtrain-bench: benchmark programs that print numbers (never timed assertions).
//
//   dtrain-run --standalone --nproc-per-node 2 build/bin/dtrain-bench allreduce --transport shm
//
// Each family lives in its own file and registers a subcommand here.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "accuracy_bench.h"
#include "collectives_bench.h"
#include "ddp_bench.h"
#include "pipeline_bench.h"
#include "ps_bench.h"
#include "zero_bench.h"
#include "dtrain/comm/error.h"

int main(int argc, char** argv) {
  CLI::App app{"dtrain-bench: dtrain's benchmarks (run under dtrain-run; rank 0 prints)"};
  app.require_subcommand(1);
  dtrain::bench::addAccuracyCommand(app);
  dtrain::bench::addCollectiveCommands(app);
  dtrain::bench::addDdpCommand(app);
  dtrain::bench::addPipelineCommand(app);
  dtrain::bench::addPsCommand(app);
  dtrain::bench::addZeroCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // Subcommand callbacks run inside parse(); errors from them surface here.
  return 0;
}
