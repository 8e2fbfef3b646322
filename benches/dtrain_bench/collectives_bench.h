// Collective benchmarks in nccl-tests form: allreduce, allgather, reduce_scatter, broadcast.
#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::bench {
void addCollectiveCommands(CLI::App& app);
}
