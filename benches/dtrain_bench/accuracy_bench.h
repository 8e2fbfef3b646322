// Held-out accuracy of the remedies for slow links (hooks, local SGD, large-batch optimizers) on a
// generated classification task that does not saturate.
#pragma once
#include <CLI/CLI.hpp>

namespace dtrain::bench {
void addAccuracyCommand(CLI::App& app);
}
