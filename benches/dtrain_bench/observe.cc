// The --metrics and --progress options of every dtrain-bench family (observe.h).
#include "observe.h"

#include <cstdio>
#include <cstdlib>

namespace dtrain::bench {

void Observe::addOptions(CLI::App* sub) {
  sub->add_option("--metrics", metrics, "also write the results as JSON lines to this file (rank 0)");
  sub->add_option_function<std::string>(
         "--progress", [this](const std::string& s) { progress_mode = parseProgressMode(s); },
         "progress on stderr: auto (a bar on a terminal, else a line per measured point), bar, lines or off")
      ->check(CLI::IsMember({"auto", "bar", "lines", "off"}));
}

std::unique_ptr<MetricsLog> Observe::open(bool main, const std::string& name, int world_size, Record config) const {
  if (!main || metrics.empty()) return nullptr;
  auto log = std::make_unique<MetricsLog>(metrics);
  log->writeRun("dtrain-bench", world_size, config.set("benchmark", name));
  return log;
}

void runAndExit(const char* name, const std::function<int()>& body) {
  int rc = 1;
  try {
    rc = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-bench %s: %s\n", name, e.what());
  }
  std::fflush(stdout);
  std::exit(rc);
}

ProgressOptions Observe::progress(bool main, const std::string& unit) const {
  ProgressOptions po;
  po.mode = main ? progress_mode : ProgressOptions::Mode::off;
  po.unit = unit;
  return po;
}

}  // namespace dtrain::bench
