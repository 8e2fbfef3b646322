// DDP and DataParallel training throughput on the reference MLP of benches/peers/torch_ddp.py, verified
// against a one-process run (reference_mlp.h).
#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::bench {
void addDdpCommand(CLI::App& app);
}
