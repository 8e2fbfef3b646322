// DDP and DataParallel training throughput on the reference MLP of ../shared/anchors/torch_ddp.py.
#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::bench {
void addDdpCommand(CLI::App& app);
}
