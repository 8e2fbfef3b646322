// Parameter-server benchmarks: the reference MLP trained through the PS, and sparse embedding rows
// through the PS against a dense allreduce of the whole table's gradient.
#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::bench {
void addPsCommand(CLI::App& app);
}
