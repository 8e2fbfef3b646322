// What the timeline tests share: a forked rank's environment for initWorld() with a store the test
// serves, and the merged trace that dtrain-trace merge writes, read back.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness.h"

namespace dtrain::test {

using nlohmann::json;

// What dtrain-run sets for rank `rank` of `world` on one node, the store being the test's.
inline void setRankEnv(const StoreServer& s, int rank, int world) {
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(s.port()).c_str(), 1);
  setenv("DTRAIN_USE_AGENT_STORE", "1", 1);
  setenv("DTRAIN_TIMEOUT", "30", 1);
}

struct Merged {
  int exit_code = -1;
  std::string output;  // what dtrain-trace printed
  json trace;          // DIR/trace.json when it exited 0
};

inline Merged mergeTimeline(const std::string& dir) {
  Merged m;
  std::tie(m.exit_code, m.output) = runCommand(std::string(DTRAIN_BIN_DIR) + "/dtrain-trace merge " + dir, 60);
  if (m.exit_code == 0) {
    std::ifstream f(dir + "/trace.json");
    m.trace = json::parse(f);
  }
  return m;
}

// The merged trace's events of phase `ph`, of rank `pid` (-1: every rank), named `name` ("": any).
inline std::vector<json> eventsOf(const json& trace, const std::string& ph, int pid = -1, const std::string& name = "") {
  std::vector<json> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("ph", "") != ph) continue;
    if (pid >= 0 && e.value("pid", -1) != pid) continue;
    if (!name.empty() && e.value("name", "") != name) continue;
    out.push_back(e);
  }
  return out;
}

// Every flow end (f, bound to its enclosing slice) has a flow start (s) with its id, on another rank,
// at or before it, and every start has its end; returns the number of pairs.
inline size_t checkFlows(const json& trace) {
  std::map<uint64_t, json> starts;
  for (const auto& s : eventsOf(trace, "s")) {
    EXPECT_TRUE(starts.emplace(s.at("id").get<uint64_t>(), s).second) << "two flow starts with one id: " << s;
  }
  size_t pairs = 0;
  for (const auto& f : eventsOf(trace, "f")) {
    EXPECT_EQ(f.value("bp", ""), "e") << f;
    auto it = starts.find(f.at("id").get<uint64_t>());
    if (it == starts.end()) {
      ADD_FAILURE() << "a flow end without its start: " << f;
      continue;
    }
    const json& s = it->second;
    EXPECT_NE(s.at("pid"), f.at("pid")) << "a message from a rank to itself: " << s << " " << f;
    EXPECT_GE(f.at("ts").get<int64_t>(), s.at("ts").get<int64_t>()) << "received before sent: " << s << " " << f;
    EXPECT_EQ(s.value("name", ""), f.value("name", ""));
    EXPECT_EQ(s.value("cat", ""), f.value("cat", ""));
    starts.erase(it);
    ++pairs;
  }
  for (const auto& [id, s] : starts) ADD_FAILURE() << "a flow start without its end: " << s;
  return pairs;
}

// The fields every complete (X) event carries.
inline void checkComplete(const json& e) {
  for (const char* k : {"ts", "dur", "pid", "tid"}) EXPECT_TRUE(e.contains(k) && e[k].is_number_integer()) << k << ": " << e;
  for (const char* k : {"name", "cat"}) EXPECT_TRUE(e.contains(k) && e[k].is_string()) << k << ": " << e;
  EXPECT_GE(e.value("dur", -1), 0) << e;
}

}  // namespace dtrain::test
