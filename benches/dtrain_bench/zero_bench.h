// Sharded training state (ZeRO stages 1-3) against DDP with Adam: speed and memory per rank.
#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::bench {
void addZeroCommand(CLI::App& app);
}
