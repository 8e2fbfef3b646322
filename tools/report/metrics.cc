// metrics.jsonl -> columns. Strict about what the charts read (a known field that is not a number is an
// error naming the line), lenient about the rest (unknown fields and kinds are kept out of the charts).
// The logger appends, so one file can hold several runs, each starting with a run record: a run that
// resumed keeps the steps logged before its first step (those after it were redone); a run that started
// afresh (its first step no later than the previous run's first) replaces what came before.
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
  template <size_t N>
  void requireNumbers(const json& record, const std::array<const char*, N>& fields) const {
    for (const char* name : fields) {
      auto f = record.find(name);
      if (f != record.end() && !f->is_number() && !f->is_null()) {
        fail(fmt::format("field \"{}\" is {} (expected a number or null)", name, f->dump()));
      }
    }
  }

 private:
  const std::filesystem::path& file_;
  int line_;
};

// The records of one run (from a run record to the next).
struct Segment {
  std::vector<json> steps, evals;
  int line = 0;  // of its run record
};

void addRecord(std::vector<Segment>& runs, Metrics& m, const json& record, const LineReader& line, int number,
               std::map<std::string, int>& unknown) {
  if (!record.is_object()) line.fail(fmt::format("not a JSON object: {:.80}", record.dump()));
  auto kind = record.find("kind");
  if (kind == record.end() || !kind->is_string()) {
    line.fail("record without a string \"kind\" (each line is {\"kind\": \"run\", \"step\", \"eval\" or \"bench\", ...})");
  }
  const auto& k = kind->get_ref<const std::string&>();
  if (k == "step") {
    if (!record.contains("step") || !record["step"].is_number()) line.fail("step record without a numeric \"step\"");
    line.requireNumbers(record, kStepFields);
    runs.back().steps.push_back(record);
  } else if (k == "eval") {
    line.requireNumbers(record, kEvalFields);
    if (!record.contains("epoch") && !record.contains("step")) line.fail("eval record without \"epoch\" or \"step\"");
    runs.back().evals.push_back(record);
  } else if (k == "run") {
    ++m.run_records;
    m.run = record;  // the newest run's configuration
    if (!runs.back().steps.empty() || !runs.back().evals.empty()) runs.emplace_back();
    runs.back().line = number;
  } else if (k == "bench") {
    m.benches.push_back(record);
  } else {
    ++unknown[k];
  }
}

// Joins the runs of one file into one history (see the top of the file); says what was dropped.
std::vector<json> joinRuns(std::vector<Segment>& runs, Metrics& m, const std::filesystem::path& file) {
  std::vector<json> steps;
  for (auto& run : runs) {
    if (!run.steps.empty()) {
      const double first = run.steps.front()["step"].get<double>();
      if (!steps.empty() && first <= steps.front()["step"].get<double>()) {
        m.warnings.push_back(fmt::format("{}:{}: a run started afresh at step {:g}: the {} step and {} eval "
                                         "record(s) before it are not shown", file.string(), run.line, first,
                                         steps.size(), m.evals.size()));
        steps.clear();
        m.evals = json::array();
      }
      size_t kept = steps.size();
      while (kept > 0 && steps[kept - 1]["step"].get<double>() >= first) --kept;
      if (kept < steps.size()) {
        m.warnings.push_back(fmt::format("{}:{}: a run resumed at step {:g}: {} step record(s) logged after that "
                                         "step by the run before are not shown", file.string(), run.line, first,
                                         steps.size() - kept));
        steps.resize(kept);
      }
      for (auto& s : run.steps) steps.push_back(std::move(s));
    }
    for (auto& e : run.evals) m.evals.push_back(std::move(e));
  }
  return steps;
}

// One column per numeric field: null where a step record has no such field.
json columns(const std::vector<json>& steps) {
  json cols = json::object();
  for (size_t row = 0; row < steps.size(); ++row) {
    for (const auto& [key, value] : steps[row].items()) {
      if (key == "kind" || !value.is_number()) continue;
      json& column = cols[key];
      if (column.is_null()) column = json::array();
      while (column.size() < row) column.push_back(nullptr);
      column.push_back(value);
    }
  }
  for (auto& [key, column] : cols.items()) {
    while (column.size() < steps.size()) column.push_back(nullptr);
  }
  return cols;
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
  std::vector<Segment> runs(1);
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
    addRecord(runs, m, record, line, number, unknown);
  }
  if (in.bad()) throw Error(fmt::format("{}: read error after line {}", file.string(), number));
  for (const auto& [kind, count] : unknown) {
    m.warnings.push_back(fmt::format("{}: {} record(s) of unknown kind \"{}\" ignored", file.string(), count, kind));
  }
  const auto steps = joinRuns(runs, m, file);
  m.step_records = static_cast<int>(steps.size());
  m.steps = columns(steps);
  return m;
}

}  // namespace dtrain::report
