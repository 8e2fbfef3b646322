// dtrain-trace merge DIR [-o FILE]: the ranks' timelines (DIR/trace-rank<R>.json, written under
// DTRAIN_TIMELINE=DIR) in one Chrome trace, each rank's timestamps moved onto rank 0's clock by the
// offset it measured at start-up (otherData.clock_offset_us), sorted by time. Perfetto
// (ui.perfetto.dev) and chrome://tracing open the result.
//
// The measured offsets are off by up to half their round trip. Messages bound them further: a message
// from rank A to rank B is received after it was sent, so B's offset minus A's is at least the send
// time minus the receive time. Where a measured offset breaks such a bound (by a few microseconds when
// the ranks share a core), it moves just enough to keep every message's receive after its send, and
// the move is printed beside the measurement.
//
// A rank that died mid-write leaves a file cut inside its last event: its whole events are kept and
// the cut is reported. A rank that ended without exit also leaves its spool (DIR/trace-rank<R>.spool,
// the events not yet in its JSON): they are read too. Any other file that does not parse is an error naming it and the line.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "commands.h"
#include "dtrain/trace.h"

namespace dtrain::tools {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct RankTrace {
  std::string file;
  json other = json::object();  // otherData
  std::vector<json> events;
  bool truncated = false;
  size_t from_spool = 0;    // events read from the rank's spool (it ended without exit)
  int64_t measured_us = 0;  // otherData.clock_offset_us
  int64_t offset_us = 0;    // applied: measured, moved to respect the messages' order
};

std::string readAll(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error(fmt::format("cannot read {}", p.string()));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// One line of a timeline's events (a leading or trailing comma dropped): its events (an async slice is
// two on a line), or a discarded value when the line does not parse.
json eventsOfLine(std::string line) {
  if (!line.empty() && line.front() == ',') line.erase(0, 1);
  if (!line.empty() && line.back() == ',') line.pop_back();
  return json::parse("[" + line + "]", nullptr, false);
}

// A file that does not parse as a whole, read line by line as the timeline writes it: the header
// line, one event per line (two for an async slice), the closing "]}". A cut last line is tolerated.
void readLines(RankTrace& t, const std::string& text, const std::string& whole_error) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  const std::string marker = "\"traceEvents\":[";
  if (lines.empty() || lines[0].size() < marker.size() ||
      lines[0].compare(lines[0].size() - marker.size(), marker.size(), marker) != 0)
    throw std::runtime_error(fmt::format("{} is not a dtrain timeline: {}", t.file, whole_error));
  json head = json::parse(lines[0] + "]}", nullptr, false);
  if (head.is_discarded() || !head.is_object())
    throw std::runtime_error(fmt::format("{} is not a dtrain timeline: {}", t.file, whole_error));
  t.other = head.value("otherData", json::object());
  size_t last = lines.size();
  while (last > 1 && lines[last - 1].empty()) --last;
  bool closed = false;
  for (size_t i = 1; i < last; ++i) {
    const std::string& line = lines[i];
    if (line == "]}") {
      closed = true;
      break;
    }
    json ev = eventsOfLine(line);
    if (ev.is_discarded()) {
      if (i + 1 == last) break;  // the writer was stopped inside this line
      throw std::runtime_error(fmt::format("{}: line {} is not a trace event: {}", t.file, i + 1, line.substr(0, 200)));
    }
    for (auto& e : ev) t.events.push_back(std::move(e));
  }
  if (closed)  // a whole file that still did not parse
    throw std::runtime_error(fmt::format("{} does not parse: {}", t.file, whole_error));
  t.truncated = true;
}

RankTrace readTrace(const fs::path& p) {
  RankTrace t;
  t.file = p.string();
  const std::string text = readAll(p);
  try {
    json j = json::parse(text);
    if (!j.is_object() || !j.contains("traceEvents") || !j["traceEvents"].is_array())
      throw std::runtime_error(fmt::format("{} has no traceEvents array", t.file));
    t.other = j.value("otherData", json::object());
    for (auto& e : j["traceEvents"]) t.events.push_back(std::move(e));
  } catch (const json::parse_error& e) {
    readLines(t, text, e.what());
  }
  return t;
}

// The spool a rank left beside its JSON (it ended without exit; include/dtrain/trace.h): its events
// join the rank's. A rank killed while turning its spool into JSON has some events in both: kept once.
void readSpool(RankTrace& t, const fs::path& spool) {
  if (!fs::exists(spool)) return;
  const std::string lines = dtrain::trace::spoolEvents(spool.string());
  if (lines.empty()) return;
  std::unordered_set<std::string> seen;
  for (const auto& e : t.events) seen.insert(e.dump());
  std::istringstream in(lines);
  size_t added = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    json ev = eventsOfLine(line);
    if (ev.is_discarded()) throw std::runtime_error(fmt::format("{}: an event does not parse: {}", spool.string(), line.substr(0, 200)));
    for (auto& e : ev) {
      if (seen.count(e.dump())) continue;
      t.events.push_back(std::move(e));
      ++added;
    }
  }
  t.from_spool = added;
}

// The ranks' files, by rank.
std::map<int, RankTrace> readAllRanks(const std::string& dir) {
  if (!fs::is_directory(dir)) throw std::runtime_error(fmt::format("{} is not a directory", dir));
  static const std::regex kName(R"(trace-rank(\d+)\.json)");
  std::map<int, RankTrace> ranks;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, m, kName)) continue;
    RankTrace t = readTrace(entry.path());
    readSpool(t, fs::path(entry.path()).replace_extension(".spool"));
    const int rank = t.other.value("rank", std::stoi(m[1].str()));
    if (ranks.count(rank))
      throw std::runtime_error(fmt::format("{} and {} both hold rank {}", ranks[rank].file, t.file, rank));
    ranks[rank] = std::move(t);
  }
  if (ranks.empty())
    throw std::runtime_error(fmt::format("no trace-rank*.json in {} (was the job run with DTRAIN_TIMELINE={}?)", dir, dir));
  return ranks;
}

// The bounds messages set: for each pair of ranks (A, B) with a message from A to B, the least value of
// offset(B) - offset(A) that puts every receive at or after its send (raw timestamps).
std::map<std::pair<int, int>, int64_t> messageBounds(const std::map<int, RankTrace>& ranks) {
  std::map<uint64_t, std::pair<int, int64_t>> sent;
  for (const auto& [rank, t] : ranks)
    for (const auto& e : t.events)
      if (e.value("ph", "") == "s" && e.contains("id")) sent[e["id"].get<uint64_t>()] = {rank, e["ts"].get<int64_t>()};
  std::map<std::pair<int, int>, int64_t> bounds;
  for (const auto& [rank, t] : ranks) {
    for (const auto& e : t.events) {
      if (e.value("ph", "") != "f" || !e.contains("id")) continue;
      auto it = sent.find(e["id"].get<uint64_t>());
      if (it == sent.end() || it->second.first == rank) continue;
      const int64_t need = it->second.second - e["ts"].get<int64_t>();
      auto [b, fresh] = bounds.try_emplace({it->second.first, rank}, need);
      if (!fresh) b->second = std::max(b->second, need);
    }
  }
  return bounds;
}

// Moves the offsets (the lowest rank's stays) until every bound holds: Bellman-Ford on the difference
// constraints, each move the smallest that fixes one. False when they cannot all hold (clocks that
// drifted apart during a long run): the offsets are then left as measured.
bool respectMessages(std::map<int, RankTrace>& ranks) {
  const auto bounds = messageBounds(ranks);
  const int reference = ranks.begin()->first;
  for (size_t round = 0; round <= ranks.size(); ++round) {
    bool moved = false;
    for (const auto& [pair, need] : bounds) {
      auto& a = ranks[pair.first].offset_us;
      auto& b = ranks[pair.second].offset_us;
      if (b - a >= need) continue;
      if (pair.second != reference) b = a + need;
      else a = b - need;
      moved = true;
    }
    if (!moved) return true;
  }
  for (auto& [rank, t] : ranks) t.offset_us = t.measured_us;
  return false;
}

// Messages whose receive appears before their send after alignment, and by how much at most.
std::pair<size_t, int64_t> causalityViolations(const std::vector<json>& events) {
  std::map<uint64_t, int64_t> sent;
  for (const auto& e : events)
    if (e.value("ph", "") == "s" && e.contains("id")) sent[e["id"].get<uint64_t>()] = e["ts"].get<int64_t>();
  size_t n = 0;
  int64_t worst = 0;
  for (const auto& e : events) {
    if (e.value("ph", "") != "f" || !e.contains("id")) continue;
    auto it = sent.find(e["id"].get<uint64_t>());
    if (it == sent.end()) continue;
    const int64_t early = it->second - e["ts"].get<int64_t>();
    if (early > 0) {
      ++n;
      worst = std::max(worst, early);
    }
  }
  return {n, worst};
}

void printRank(int rank, const RankTrace& t) {
  const bool synced = t.other.value("clock_synced", true);
  std::string clock = rank == 0 ? "(rank 0's clock)"
                      : synced  ? fmt::format("(+-{} us)", t.other.value("clock_rtt_us", int64_t{0}) / 2)
                                : "(not measured: rank 0 wrote no timeline)";
  if (t.offset_us != t.measured_us)
    clock += fmt::format(" [measured {:+d} us, moved {:+d} us so that every message arrives after it left]",
                         t.measured_us, t.offset_us - t.measured_us);
  std::printf("rank %d  %s  %zu events  clock offset %+lld us %s\n", rank, fs::path(t.file).filename().c_str(),
              t.events.size(), static_cast<long long>(t.offset_us), clock.c_str());
  if (t.truncated)
    std::printf("  %s is cut short (the rank stopped while writing it): its %zu whole events are kept\n",
                fs::path(t.file).filename().c_str(), t.events.size());
  if (t.from_spool > 0)
    std::printf("  %zu of them from its spool (the rank ended without exit, before they went into its JSON)\n",
                t.from_spool);
}

}  // namespace

int runMerge(const MergeArgs& a) {
  auto ranks = readAllRanks(a.dir);
  std::vector<json> all;
  json info = json::array();
  for (auto& [rank, t] : ranks) t.offset_us = t.measured_us = t.other.value("clock_offset_us", int64_t{0});
  const bool consistent = respectMessages(ranks);
  for (auto& [rank, t] : ranks) {
    for (auto& e : t.events) {
      if (e.is_object() && e.contains("ts") && e["ts"].is_number()) e["ts"] = e["ts"].get<int64_t>() + t.offset_us;
      all.push_back(std::move(e));
    }
    printRank(rank, t);
    info.push_back({{"rank", rank},
                    {"file", fs::path(t.file).filename().string()},
                    {"clock_offset_us", t.offset_us},
                    {"clock_offset_measured_us", t.measured_us},
                    {"clock_rtt_us", t.other.value("clock_rtt_us", int64_t{0})},
                    {"truncated", t.truncated}});
  }
  // Metadata first, then by time (stable: a rank's events keep their order at equal times).
  auto key = [](const json& e) {
    return e.contains("ts") && e["ts"].is_number() ? e["ts"].get<int64_t>() : std::numeric_limits<int64_t>::min();
  };
  std::stable_sort(all.begin(), all.end(), [&](const json& x, const json& y) { return key(x) < key(y); });
  auto [late, worst] = causalityViolations(all);
  if (!consistent)
    std::printf("warning: no clock offsets put every message's receive after its send (clocks that drifted during "
                "the run?): the measured offsets are used\n");
  if (late)
    std::printf("warning: %zu message(s) appear received before they were sent, by up to %lld us: the clock offsets "
                "are off by about that much\n",
                late, static_cast<long long>(worst));
  const std::string out_path = a.output.empty() ? (fs::path(a.dir) / "trace.json").string() : a.output;
  const size_t n = all.size();
  json out = {{"traceEvents", std::move(all)}, {"displayTimeUnit", "ms"}, {"otherData", {{"ranks", info}}}};
  std::ofstream f(out_path, std::ios::binary | std::ios::trunc);
  if (!f) throw std::runtime_error(fmt::format("cannot write {}", out_path));
  f << out.dump() << "\n";
  f.close();
  if (!f) throw std::runtime_error(fmt::format("writing {} failed", out_path));
  std::printf("wrote %s: %zu events from %zu rank(s); open it in https://ui.perfetto.dev or chrome://tracing\n",
              out_path.c_str(), n, ranks.size());
  return 0;
}

}  // namespace dtrain::tools
