// Pipeline-parallel benchmark: the bubble of the GPipe and 1F1B schedules against the theory, and the
// activations each stage holds, on a deep MLP.
#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::bench {
void addPipelineCommand(CLI::App& app);
}
