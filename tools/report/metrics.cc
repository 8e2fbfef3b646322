// metrics.jsonl -> columns. Strict about what the charts read (a known field that is not a number is an
// error naming the line), lenient about the rest (unknown fields and kinds are kept out of the charts).
#include "metrics.h"

#include <fmt/format.h>

#include <array>
#include <fstream>
#include <map>

#include "dtrain/comm/error.h"

namespace dtrain::report {
namespace {

using nlohmann::json;

// The step fields the report plots: each must be a number or null when present.
constexpr std::array<const char*, 14> kStepFields = {
    "step",          "epoch",  "time_s",         "loss",      "lr",              "samples_per_s", "step_s",
    "comm_s",        "exposed_comm_s", "compute_s", "hidden_fraction", "bytes_sent",    "rss_bytes",
    "bubble_fraction"};
constexpr std::array<const char*, 6> kEvalFields = {"epoch", "step", "R@1", "R@5", "R@10", "median_rank"};

class LineReader {
 public:
  LineReader(const std::filesystem::path& file, int line) : file_(file), line_(line) {}
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(fmt::format("{}:{}: {}", file_.string(), line_, what));
  }
  void requireNumbers(const json& record, const char* const* first, const char* const* last) const {
    for (auto it = first; it != last; ++it) {
      auto f = record.find(*it);
      if (f != record.end() && !f->is_number() && !f->is_null()) {
        fail(fmt::format("field \"{}\" is {} (expected a number or null)", *it, f->dump()));
      }
    }
  }

 private:
  const std::filesystem::path& file_;
  int line_;
};

void addStep(Metrics& m, const json& record, const LineReader& line) {
  if (!record.contains("step") || !record["step"].is_number()) line.fail("step record without a numeric \"step\"");
  line.requireNumbers(record, kStepFields.begin(), kStepFields.end());
  const auto row = static_cast<size_t>(m.step_records);
  for (const auto& [key, value] : record.items()) {
    if (key == "kind" || !value.is_number()) continue;
    json& column = m.steps[key];
    if (column.is_null()) column = json::array();
    while (column.size() < row) column.push_back(nullptr);  // a field first seen at this row
    column.push_back(value);
  }
  ++m.step_records;
  for (auto& [key, column] : m.steps.items()) {
    while (column.size() < row + 1) column.push_back(nullptr);
  }
}

void addRecord(Metrics& m, const json& record, const LineReader& line, std::map<std::string, int>& unknown) {
  if (!record.is_object()) line.fail(fmt::format("not a JSON object: {:.80}", record.dump()));
  auto kind = record.find("kind");
  if (kind == record.end() || !kind->is_string()) line.fail("record without a string \"kind\"");
  const auto& k = kind->get_ref<const std::string&>();
  if (k == "step") {
    addStep(m, record, line);
  } else if (k == "eval") {
    line.requireNumbers(record, kEvalFields.begin(), kEvalFields.end());
    if (!record.contains("epoch") && !record.contains("step")) line.fail("eval record without \"epoch\" or \"step\"");
    m.evals.push_back(record);
  } else if (k == "run") {
    if (m.run_records++ == 0) m.run = record;
  } else if (k == "bench") {
    m.benches.push_back(record);
  } else {
    ++unknown[k];
  }
}

}  // namespace

Metrics readMetrics(const std::filesystem::path& file) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) {
    throw Error(fmt::format("{}: no such file (the run's metrics, written by rank 0's metrics logger)",
                            file.string()));
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open for reading", file.string()));
  Metrics m;
  std::map<std::string, int> unknown;
  std::string text;
  int number = 0;
  while (std::getline(in, text)) {
    ++number;
    const bool complete = !in.eof();  // getline stopped at a newline, not at the end of the file
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    LineReader line(file, number);
    json record;
    try {
      record = json::parse(text);
    } catch (const json::parse_error& e) {
      if (!complete) {
        m.warnings.push_back(fmt::format("{}:{}: incomplete last line skipped (the run may still be writing)",
                                         file.string(), number));
        break;
      }
      line.fail(fmt::format("not valid JSON ({}): {:.80}", e.what(), text));
    }
    addRecord(m, record, line, unknown);
  }
  if (in.bad()) throw Error(fmt::format("{}: read error after line {}", file.string(), number));
  for (const auto& [kind, count] : unknown) {
    m.warnings.push_back(fmt::format("{}: {} record(s) of unknown kind \"{}\" ignored", file.string(), count, kind));
  }
  return m;
}

}  // namespace dtrain::report
