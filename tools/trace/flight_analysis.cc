// The hang diagnosis (see flight_analysis.h). A collective is named by its group and sequence number,
// the same on every member; for each member a dump says whether it issued, started, completed or failed
// it. Ops of one group run in issue order, so a member whose ring holds a later op of the group has
// issued this one; a member whose ring dropped entries and holds nothing of the group may have run it
// before its window began ("unknown", never counted as blocking).
#include "flight_analysis.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>
#include <vector>

namespace dtrain::tools {

namespace {

using nlohmann::json;

struct Op {
  std::string group;
  int64_t seq = -1;  // -1: point to point
  std::string op, dtype, state, error;
  std::vector<int> peers;  // point to point: world ranks
  int64_t count = 0, bytes = 0;
  int64_t issued = 0, started = 0, finished = 0;  // steady-clock us of the dumping process, 0: not yet
  bool done() const { return state == "completed"; }
  bool waiting() const { return state == "issued" || state == "started"; }
};

struct Thread {
  std::string name;
  std::vector<std::string> spans;  // outermost first
  std::vector<int64_t> open_us;
};

struct Dump {
  std::string file, host, reason;
  int rank = -1, world_size = 0;
  int64_t wall_us = 0, steady_us = 0, dropped = 0;
  std::map<std::string, std::vector<int>> groups;  // name -> members' world ranks
  std::vector<Op> ops;                             // oldest first
  std::vector<Thread> threads;
};

int64_t numberOr(const json& j, const char* key, int64_t dflt) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? dflt : it->get<int64_t>();
}

Dump parseDump(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("cannot read {}", path));
  Dump d;
  d.file = path;
  try {
    json j = json::parse(in);
    if (j.value("format", "") != "dtrain-flight-recorder") {
      throw std::runtime_error("no \"format\": \"dtrain-flight-recorder\"");
    }
    d.rank = j.at("rank").get<int>();
    d.world_size = j.at("world_size").get<int>();
    d.host = j.value("host", "");
    d.reason = j.value("reason", "");
    d.wall_us = j.at("wall_us").get<int64_t>();
    d.steady_us = j.at("steady_us").get<int64_t>();
    d.dropped = numberOr(j, "dropped", 0);
    for (const auto& [name, g] : j.at("groups").items()) d.groups[name] = g.at("ranks").get<std::vector<int>>();
    for (const auto& e : j.at("entries")) {
      Op o;
      o.group = e.at("group").get<std::string>();
      if (!d.groups.count(o.group)) {
        throw std::runtime_error(fmt::format("group '{}' of an entry is not in \"groups\"", o.group));
      }
      o.seq = numberOr(e, "seq", -1);
      o.op = e.at("op").get<std::string>();
      o.dtype = e.value("dtype", "");
      o.state = e.at("state").get<std::string>();
      o.error = e.value("error", "");
      if (e.contains("peers")) o.peers = e.at("peers").get<std::vector<int>>();
      o.count = numberOr(e, "count", 0);
      o.bytes = numberOr(e, "bytes", 0);
      o.issued = numberOr(e, "issued_us", 0);
      o.started = numberOr(e, "started_us", 0);
      o.finished = numberOr(e, "finished_us", 0);
      d.ops.push_back(std::move(o));
    }
    for (const auto& t : j.at("threads")) {
      Thread th;
      th.name = t.value("name", "");
      for (const auto& s : t.at("spans")) {
        th.spans.push_back(s.at("name").get<std::string>());
        th.open_us.push_back(s.at("open_us").get<int64_t>());
      }
      d.threads.push_back(std::move(th));
    }
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{} is not a readable flight-recorder dump: {}", path, e.what()));
  }
  return d;
}

std::string duration(int64_t us) {
  if (us < 1000) return fmt::format("{} us", us);
  if (us < 1000000) return fmt::format("{:.1f} ms", static_cast<double>(us) / 1e3);
  return fmt::format("{:.1f} s", static_cast<double>(us) / 1e6);
}

// "rank 2", "ranks 0, 1 and 3".
std::string rankList(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += fmt::format("{}{}", i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ", ranks[i]);
  }
  return out;
}

// "ranks 0 and 1" -> "Ranks 0 and 1", to open a sentence.
std::string capital(std::string s) {
  if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
  return s;
}

std::string describe(const Op& o) {
  if (o.seq >= 0) return fmt::format("{} seq={} of group {}", o.op, o.seq, o.group);
  if (o.peers.empty()) return fmt::format("{} of group {}", o.op, o.group);
  return fmt::format("{} of group {} with rank{} {}", o.op, o.group, o.peers.size() == 1 ? "" : "s",
                     fmt::join(o.peers, ", "));
}

// What one member did about one collective.
enum class Part { completed, waiting, failed, never, passed, unknown, no_dump };

struct Key {
  std::string group;
  int64_t seq;
  bool operator<(const Key& o) const { return std::tie(group, seq) < std::tie(o.group, o.seq); }
};

class Analysis {
 public:
  explicit Analysis(std::vector<Dump> dumps) : dumps_(std::move(dumps)) {
    for (auto& d : dumps_) {
      by_rank_[d.rank] = &d;
      world_ = std::max(world_, d.world_size);
      for (const auto& [name, ranks] : d.groups) members_.emplace(name, ranks);
      // Ranks of one host share the steady clock: they share its offset to the wall clock too.
      offsets_.emplace(d.host, d.wall_us - d.steady_us);
      for (const auto& o : d.ops)
        if (o.seq >= 0) keys_.insert({o.group, o.seq});
    }
  }

  std::string run() const {
    std::string out;
    std::vector<int> missing;
    for (int r = 0; r < world_; ++r)
      if (!by_rank_.count(r)) missing.push_back(r);
    if (!missing.empty()) out += fmt::format("No dump from {} (of a world of {}).\n", rankList(missing), world_);
    out += stuck() + "\n" + stragglers();
    return out;
  }

 private:
  const Op* find(const Dump& d, const Key& k) const {
    for (const auto& o : d.ops)
      if (o.seq == k.seq && o.group == k.group) return &o;
    return nullptr;
  }

  Part part(int rank, const Key& k) const {
    auto it = by_rank_.find(rank);
    if (it == by_rank_.end()) return Part::no_dump;
    const Dump& d = *it->second;
    if (const Op* o = find(d, k)) return o->done() ? Part::completed : o->waiting() ? Part::waiting : Part::failed;
    bool any_of_group = false;
    for (const auto& o : d.ops) {
      if (o.group != k.group || o.seq < 0) continue;
      if (o.seq > k.seq) return Part::passed;
      any_of_group = true;
    }
    return !any_of_group && d.dropped > 0 ? Part::unknown : Part::never;
  }

  int64_t wall(int rank, int64_t steady_us) const {
    const Dump& d = *by_rank_.at(rank);
    return steady_us + offsets_.at(d.host);
  }

  const std::vector<int>& members(const std::string& group) const { return members_.at(group); }

  // The stuck collective: the one the most members wait in (issued, not finished), the earliest issued
  // among equals; only collectives that some member has not completed.
  std::optional<Key> stuckKey() const {
    std::optional<Key> best;
    size_t best_waiting = 0;
    int64_t best_issued = 0;
    for (const Key& k : keys_) {
      size_t waiting = 0, blocking = 0;
      int64_t issued = INT64_MAX;
      for (int r : members(k.group)) {
        Part p = part(r, k);
        if (p == Part::waiting || p == Part::failed) {
          ++waiting;
          issued = std::min(issued, wall(r, find(*by_rank_.at(r), k)->issued));
        }
        if (p == Part::waiting || p == Part::failed || p == Part::never) ++blocking;
      }
      if (waiting == 0 || blocking == 0) continue;
      if (!best || waiting > best_waiting || (waiting == best_waiting && issued < best_issued)) {
        best = k;
        best_waiting = waiting;
        best_issued = issued;
      }
    }
    return best;
  }

  // What a rank that never issued the stuck op is doing: the op it waits in, its innermost spans.
  std::string instead(int rank) const {
    const Dump& d = *by_rank_.at(rank);
    std::string out;
    for (const auto& o : d.ops) {
      if (!o.waiting()) continue;
      std::vector<int> absent;  // who that op waits for in turn
      if (o.seq >= 0)
        for (int r : members(o.group))
          if (part(r, {o.group, o.seq}) == Part::never) absent.push_back(r);
      out = fmt::format("is waiting in {} instead (issued {} before its dump{})", describe(o),
                        duration(d.steady_us - o.issued),
                        absent.empty() ? "" : fmt::format("; {} never issued that one", rankList(absent)));
      break;
    }
    std::vector<std::string> spans;
    for (const auto& t : d.threads) {
      if (t.spans.empty()) continue;
      spans.push_back(fmt::format("'{}' (open for {}{})", t.spans.back(), duration(t.open_us.back()),
                                  t.name.empty() ? "" : ", thread " + t.name));
    }
    if (!spans.empty()) {
      out += fmt::format("{} span{} {}", out.empty() ? "is inside" : ", inside", spans.size() == 1 ? "" : "s",
                         fmt::join(spans, " and "));
    }
    if (out.empty()) {
      const Op* last = d.ops.empty() ? nullptr : &d.ops.back();
      out = last ? fmt::format("has no op in flight and no open span; its last op was {} ({}, {} before its dump)",
                               describe(*last), last->state, duration(d.steady_us - last->issued))
                 : "has recorded no op and has no open span";
    }
    return out;
  }

  std::string stuck() const {
    std::optional<Key> k = stuckKey();
    if (!k) return notStuck();
    const std::vector<int>& group = members(k->group);
    std::map<Part, std::vector<int>> by;
    for (int r : group) by[part(r, *k)].push_back(r);
    const Op* sample = nullptr;
    int64_t wait_us = 0;
    for (int r : by[Part::waiting]) {
      sample = find(*by_rank_.at(r), *k);
      wait_us = std::max(wait_us, by_rank_.at(r)->steady_us - sample->issued);
    }
    for (int r : by[Part::failed]) sample = sample ? sample : find(*by_rank_.at(r), *k);
    std::string out = fmt::format("The job is stuck in {} ({}, {} x {}; group of {}).", describe(*sample),
                                  rankList(group), sample->dtype, sample->count, group.size());
    if (!by[Part::waiting].empty()) {
      out += fmt::format(" {} issued it and never finished it (waiting up to {}).",
                         capital(rankList(by[Part::waiting])), duration(wait_us));
    }
    for (int r : by[Part::failed]) {
      out += fmt::format(" Rank {} issued it and it failed: {}", r, find(*by_rank_.at(r), *k)->error);
    }
    if (by[Part::never].size() == 1) {
      out += fmt::format(" Rank {} never issued it: it {}.", by[Part::never][0], instead(by[Part::never][0]));
    } else if (!by[Part::never].empty()) {
      out += fmt::format(" {} never issued it.", capital(rankList(by[Part::never])));
      for (int r : by[Part::never]) out += fmt::format(" Rank {} {}.", r, instead(r));
    }
    if (!by[Part::unknown].empty()) {
      out += fmt::format(" The recorded window of {} does not reach back to it.", rankList(by[Part::unknown]));
    }
    if (!by[Part::no_dump].empty()) out += fmt::format(" {} wrote no dump.", capital(rankList(by[Part::no_dump])));
    if (!by[Part::completed].empty() || !by[Part::passed].empty()) {
      std::vector<int> done = by[Part::completed];
      done.insert(done.end(), by[Part::passed].begin(), by[Part::passed].end());
      std::sort(done.begin(), done.end());
      out += fmt::format(" {} completed it.", capital(rankList(done)));
    }
    return out + "\n";
  }

  // No collective is stuck; point-to-point ops may be (a pipeline waiting for a stage).
  std::string notStuck() const {
    std::vector<std::string> waiting;
    for (const auto& [rank, d] : by_rank_) {
      for (const auto& o : d->ops) {
        if (!o.waiting()) continue;
        waiting.push_back(fmt::format("rank {} waits in {} (issued {} before its dump)", rank, describe(o),
                                      duration(d->steady_us - o.issued)));
        break;
      }
    }
    std::string out = "No collective is stuck: every collective some rank issued was completed by every member that "
                      "recorded it.";
    if (!waiting.empty()) out += fmt::format(" Ops in flight: {}.", fmt::join(waiting, "; "));
    return out + "\n";
  }

  // For every collective that every member with a dump started within its window, the last to start
  // kept each other member waiting (its start - theirs).
  std::string stragglers() const {
    std::map<int, int64_t> waited;
    std::map<int, int> last_count;
    int complete = 0;
    for (const Key& k : keys_) {
      std::vector<std::pair<int64_t, int>> starts;
      bool all = true;
      for (int r : members(k.group)) {
        auto it = by_rank_.find(r);
        if (it == by_rank_.end()) continue;
        const Op* o = find(*it->second, k);
        all = all && o && o->started != 0;
        if (all) starts.emplace_back(wall(r, o->started), r);
      }
      if (!all || starts.size() < 2) continue;
      ++complete;
      auto last = *std::max_element(starts.begin(), starts.end());
      for (const auto& [t, r] : starts) waited[last.second] += last.first - t;
      ++last_count[last.second];
    }
    if (complete == 0) {
      return "Stragglers: no collective in the recorded window was started by all its members with a dump.\n";
    }
    std::vector<std::pair<int64_t, int>> order;
    for (const auto& [r, us] : waited) order.emplace_back(-us, r);
    std::sort(order.begin(), order.end());
    std::vector<std::string> parts;
    for (const auto& [neg, r] : order) {
      parts.push_back(fmt::format("rank {} {} (last to start {} of them)", r, duration(-neg), last_count.at(r)));
    }
    return fmt::format(
        "Stragglers over the recorded window ({} collectives every member with a dump recorded; how long the "
        "others waited for each rank, summed): {}.{}\n",
        complete, fmt::join(parts, ", "),
        offsets_.size() > 1 ? " Ranks on different hosts are compared through their wall clocks: approximate." : "");
  }

  std::vector<Dump> dumps_;
  std::map<int, const Dump*> by_rank_;
  std::map<std::string, std::vector<int>> members_;
  std::map<std::string, int64_t> offsets_;  // host -> wall - steady
  std::set<Key> keys_;
  int world_ = 0;
};

}  // namespace

std::string analyzeFlightDumps(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw std::runtime_error(fmt::format("{} is not a directory", dir));
  static const std::regex kName(R"(rank(\d+)\.json)");
  std::vector<Dump> dumps;
  std::set<int> seen;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, kName)) continue;
    dumps.push_back(parseDump(entry.path().string()));
    if (!seen.insert(dumps.back().rank).second) {
      throw std::runtime_error(fmt::format("{}: rank {} has two dumps in {}", name, dumps.back().rank, dir));
    }
  }
  if (dumps.empty()) throw std::runtime_error(fmt::format("no flight-recorder dump (rank<R>.json) in {}", dir));
  return Analysis(std::move(dumps)).run();
}

}  // namespace dtrain::tools
