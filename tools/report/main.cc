// dtrain-report: one self-contained HTML page (Chart.js inline, works offline) from a run directory.
//   dtrain-report runs/milnce -o runs/milnce/report.html
// Reads RUN_DIR/metrics.jsonl (required) and RUN_DIR/timeline/trace.json (optional: the merged trace of
// DTRAIN_TIMELINE and `dtrain-trace merge`); the page says which optional parts were absent.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "dtrain/comm/error.h"
#include "metrics.h"
#include "page.h"
#include "trace_window.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Options {
  fs::path run_dir, output, metrics, trace;
  std::string title;
  dtrain::report::TraceWindowOptions window;
};

// The timeline's data, or null with the reason in `absent` (a bad trace is a warning, not a failure:
// the metrics are still worth a page).
json timeline(const Options& o, json& absent, json& warnings, std::string& said) {
  std::error_code ec;
  if (!fs::exists(o.trace, ec)) {
    absent.push_back(fmt::format("no timeline: {} not found (run with DTRAIN_TIMELINE=DIR, then "
                                 "`dtrain-trace merge DIR`)", o.trace.string()));
    said = "no trace";
    return nullptr;
  }
  try {
    auto w = dtrain::report::readTraceWindow(o.trace, o.window);
    said = fmt::format("timeline of {} of {} events on {} rows", w.shown_events, w.total_events, w.rows);
    return w.data;
  } catch (const dtrain::Error& e) {
    warnings.push_back(e.what());
    absent.push_back(fmt::format("no timeline: {}", e.what()));
    said = "trace unreadable";
    return nullptr;
  }
}

void writeFile(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      throw dtrain::Error(fmt::format("{}: cannot write the report (through {}: does its directory exist?)",
                                      path.string(), tmp.string()));
    }
    out << text;
    out.close();
    if (!out) throw dtrain::Error(fmt::format("{}: write failed", tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);  // a reader never sees half a page
  if (ec) throw dtrain::Error(fmt::format("{}: cannot rename to {}: {}", tmp.string(), path.string(), ec.message()));
}

int build(const Options& o) {
  std::error_code ec;
  if (!fs::is_directory(o.run_dir, ec)) {
    throw dtrain::Error(fmt::format("{}: no such run directory", o.run_dir.string()));
  }
  auto m = dtrain::report::readMetrics(o.metrics);
  json absent = json::array(), warnings = json::array();
  for (const auto& w : m.warnings) warnings.push_back(w);
  if (m.run.is_null()) absent.push_back("no run record in metrics.jsonl: app, world size and config unknown");
  if (m.step_records == 0) absent.push_back("no step records in metrics.jsonl: no per-step charts");
  if (m.evals.empty()) absent.push_back("no eval records in metrics.jsonl: no retrieval metrics");
  std::string said;
  json tl = timeline(o, absent, warnings, said);
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const fs::path dir = fs::weakly_canonical(o.run_dir, ec);  // "." -> its name
  json data = {{"title", o.title.empty() ? (ec ? o.run_dir : dir).filename().string() : o.title},
               {"run_dir", o.run_dir.string()},
               {"generated_unix", now},
               {"run", m.run},
               {"run_records", m.run_records},
               {"step_records", m.step_records},
               {"steps", m.steps},
               {"evals", m.evals},
               {"benches", m.benches},
               {"timeline", tl},
               {"absent", absent},
               {"warnings", warnings}};
  const std::string page = dtrain::report::renderPage(data);
  writeFile(o.output, page);
  for (const auto& w : warnings) std::fprintf(stderr, "dtrain-report: warning: %s\n", w.get<std::string>().c_str());
  std::printf("dtrain-report: wrote %s (%.1f MB): %d steps, %zu evals, %s\n", o.output.string().c_str(),
              page.size() / 1e6, m.step_records, m.evals.size(), said.c_str());
  for (const auto& a : absent) std::printf("  absent: %s\n", a.get<std::string>().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"dtrain-report RUN_DIR [-o report.html]\n\n"
               "Writes one self-contained HTML page (works offline) about a training run: loss and learning\n"
               "rate, throughput, compute vs exposed communication, bytes sent, memory, retrieval metrics,\n"
               "pipeline bubble, and a timeline of a few steps. Reads RUN_DIR/metrics.jsonl and, when\n"
               "present, RUN_DIR/timeline/trace.json.",
               "dtrain-report"};
  app.add_option("RUN_DIR", o.run_dir, "The run's directory (milnce train --out)")->required();
  app.add_option("-o,--output", o.output, "The page to write (default RUN_DIR/report.html)");
  app.add_option("--metrics", o.metrics, "Metrics JSON lines (default RUN_DIR/metrics.jsonl)");
  app.add_option("--trace", o.trace, "Merged Chrome trace (default RUN_DIR/timeline/trace.json)");
  app.add_option("--title", o.title, "The page's title (default the run directory's name)");
  app.add_option("--skip-steps", o.window.skip, "Timeline: rank 0's steps skipped before the window (warm-up)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--steps", o.window.steps, "Timeline: rank 0's steps in the window")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--window-ms", o.window.window_ms, "Timeline: the window's length when the trace has too few steps")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--max-events", o.window.max_events, "Timeline: events drawn at most (the earliest)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (o.output.empty()) o.output = o.run_dir / "report.html";
  if (o.metrics.empty()) o.metrics = o.run_dir / "metrics.jsonl";
  if (o.trace.empty()) o.trace = o.run_dir / "timeline" / "trace.json";
  try {
    return build(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-report: %s\n", e.what());
    return 1;
  }
}
