// Hang diagnosis end to end: dtrain-run --hang-timeout stops a 4-rank job in which rank 2 skips a
// collective (or hangs in a span), and both the launcher's diagnosis and `dtrain-trace analyze` on the
// dumps name rank 2, the collective and its sequence number, and what rank 2 did instead. Also the
// analysis of hand-written dumps: stragglers across two hosts, a missing rank, a file that does not parse.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness.h"

namespace {

using dtrain::test::runCommand;
using dtrain::test::TempDir;

const std::string kLauncher = DTRAIN_BIN_DIR "/dtrain-run";
const std::string kTrace = DTRAIN_BIN_DIR "/dtrain-trace";
const std::string kWorker = DTRAIN_BIN_DIR "/flight_worker";  // tests/tools/flight_worker.cc

void expectContains(const std::string& text, const std::string& what) {
  EXPECT_NE(text.find(what), std::string::npos) << "missing: " << what << "\n--- in:\n" << text;
}

// Runs the 4-rank flight_worker job in `mode` under --hang-timeout 4 (collectives time out after 60 s,
// so only the launcher can stop it in time), checks that the launcher's diagnosis and dtrain-trace
// analyze's on the dumps it collected both contain every line of `diagnosis`, and returns the latter.
std::string checkHungJob(const std::string& mode, const std::vector<std::string>& diagnosis) {
  TempDir dir;
  auto [code, out] = runCommand("env DTRAIN_TIMEOUT=60 DTRAIN_FLIGHT_DIR=" + dir.path() + " " + kLauncher +
                                    " --standalone --nproc-per-node 4 --hang-timeout 4 --grace-period 2 " + kWorker +
                                    " " + mode + " 2>&1",
                                50);
  EXPECT_EQ(code, 124) << out;  // the launcher's hang exit code, well within the command's 50 s
  expectContains(out, "the job is hung: no rank on this node completed an op for 4s");
  for (int r = 0; r < 4; ++r) expectContains(out, fmt::format("attempt_0/rank{}.json", r));
  auto [analyze_code, analysis] = runCommand(kTrace + " analyze " + dir.path() + "/attempt_0 2>&1", 30);
  EXPECT_EQ(analyze_code, 0) << analysis;
  for (const auto& d : diagnosis) {
    expectContains(out, d);
    expectContains(analysis, d);
  }
  return analysis;
}

TEST(HangDiagnosis, RankSkipsCollective) {
  std::string analysis = checkHungJob("skip", {
      "The job is stuck in allreduce seq=2 of group world (ranks 0, 1, 2 and 3",
      "Ranks 0, 1 and 3 issued it and never finished it",
      "Rank 2 never issued it: it is waiting in barrier seq=0 of group world/sub0 instead",
      "rank 1 never issued that one",
  });
  expectContains(analysis, "Stragglers over the recorded window (2 collectives every member with a dump recorded");
}

TEST(HangDiagnosis, RankHangsInSpan) {
  checkHungJob("span", {
      "The job is stuck in allreduce seq=2 of group world",
      "Rank 2 never issued it: it is inside span 'load shard' (open for",
  });
}

// Workers that never issue an op (here not even dtrain programs) are stopped too; none is signaled,
// and the launcher says why there is no diagnosis.
TEST(HangDiagnosis, WorkersWithoutRecorder) {
  TempDir dir;
  auto [code, out] = runCommand("env DTRAIN_FLIGHT_DIR=" + dir.path() + " " + kLauncher +
                                    " --standalone --nproc-per-node 2 --hang-timeout 1 --grace-period 1 sleep 30 2>&1",
                                30);
  EXPECT_EQ(code, 124) << out;
  expectContains(out, "rank 0 has no flight recorder running (no op issued yet, or DTRAIN_TRACE_BUFFER=0)");
  expectContains(out, "rank 1 has no flight recorder running");
  expectContains(out, "no hang diagnosis: no flight-recorder dump (rank<R>.json) in " + dir.path() + "/attempt_0");
}

// A dump as the recorder writes it, with the fields the analysis reads.
nlohmann::json dump(int rank, const std::string& host, int64_t steady_offset) {
  return {{"format", "dtrain-flight-recorder"},
          {"version", 1},
          {"rank", rank},
          {"world_size", 4},
          {"host", host},
          {"pid", 100 + rank},
          {"reason", "SIGUSR1"},
          {"wall_us", 1'000'000'000 + 2'000'000},
          {"steady_us", 2'000'000 + steady_offset},
          {"capacity", 4096},
          {"recorded", 3},
          {"dropped", 0},
          {"groups", {{"world", {{"rank", rank}, {"size", 4}, {"ranks", {0, 1, 2, 3}}}}}},
          {"entries", nlohmann::json::array()},
          {"threads", nlohmann::json::array()}};
}

void addOp(nlohmann::json& d, int seq, const std::string& state, int64_t started_wall_offset_us,
           int64_t steady_offset) {
  const int64_t started = 100'000 + started_wall_offset_us + steady_offset;
  d["entries"].push_back({{"id", seq + 1},     {"group", "world"}, {"seq", seq},      {"op", "allreduce"},
                          {"dtype", "f32"},    {"count", 1024},    {"bytes", 4096},   {"state", state},
                          {"issued_us", started}, {"started_us", started},
                          {"finished_us", state == "completed" ? nlohmann::json(started + 50) : nlohmann::json()}});
}

// Ranks 0 and 1 on host a, rank 2 on host b whose steady clock reads 4 s ahead (same wall clock);
// rank 3 wrote no dump. seq 0: rank 1 starts 5 ms after rank 0 and 4 ms after rank 2 (9 ms of waiting);
// seq 1: rank 2 starts 10 ms after both (20 ms); seq 2: ranks 0 and 1 wait, rank 2 is in a span.
TEST(FlightAnalysis, StragglersAcrossHostsAndMissingRank) {
  TempDir dir;
  const int64_t ahead = 4'000'000;
  auto r0 = dump(0, "a", 0), r1 = dump(1, "a", 0), r2 = dump(2, "b", ahead);
  addOp(r0, 0, "completed", 0, 0);
  addOp(r1, 0, "completed", 5'000, 0);
  addOp(r2, 0, "completed", 1'000, ahead);
  addOp(r0, 1, "completed", 100'000, 0);
  addOp(r1, 1, "completed", 100'000, 0);
  addOp(r2, 1, "completed", 110'000, ahead);
  addOp(r0, 2, "started", 200'000, 0);
  addOp(r1, 2, "started", 200'000, 0);
  r2["threads"].push_back(
      {{"thread", 1}, {"name", "main"}, {"spans", {{{"name", "eval"}, {"since_us", 1}, {"open_us", 1'500'000}}}}});
  for (const auto& [name, d] : {std::pair{"rank0.json", r0}, std::pair{"rank1.json", r1}, std::pair{"rank2.json", r2}})
    std::ofstream(dir.path() + "/" + name) << d.dump(2);
  auto [code, out] = runCommand(kTrace + " analyze " + dir.path() + " 2>&1", 30);
  EXPECT_EQ(code, 0) << out;
  expectContains(out, "No dump from rank 3 (of a world of 4).");
  expectContains(out, "The job is stuck in allreduce seq=2 of group world");
  expectContains(out, "Ranks 0 and 1 issued it and never finished it");
  expectContains(out, "Rank 2 never issued it: it is inside span 'eval' (open for 1.5 s, thread main)");
  expectContains(out, "Rank 3 wrote no dump");
  expectContains(out, "(2 collectives every member with a dump recorded;");
  expectContains(out, "rank 2 20.0 ms (last to start 1 of them), rank 1 9.0 ms (last to start 1 of them)");
  expectContains(out, "through their wall clocks: approximate");
}

// Only a point-to-point op waits (a pipeline stage waiting for its neighbour): no collective is stuck,
// and the op in flight is named with its peer.
TEST(FlightAnalysis, PointToPointInFlight) {
  TempDir dir;
  auto r0 = dump(0, "a", 0), r1 = dump(1, "a", 0);
  addOp(r0, 0, "completed", 0, 0);
  addOp(r1, 0, "completed", 0, 0);
  r0["entries"].push_back({{"id", 2}, {"group", "world"}, {"seq", nullptr}, {"op", "recv"}, {"dtype", "f32"},
                           {"count", 8}, {"peers", {1}}, {"state", "started"}, {"issued_us", 1'500'000},
                           {"started_us", 1'500'000}, {"finished_us", nullptr}});
  std::ofstream(dir.path() + "/rank0.json") << r0.dump();
  std::ofstream(dir.path() + "/rank1.json") << r1.dump();
  auto [code, out] = runCommand(kTrace + " analyze " + dir.path() + " 2>&1", 30);
  EXPECT_EQ(code, 0) << out;
  expectContains(out, "No dump from ranks 2 and 3 (of a world of 4).");
  expectContains(out, "No collective is stuck");
  expectContains(out,
                 "Ops in flight: rank 0 waits in recv of group world with rank 1 (issued 500.0 ms before its dump).");
}

TEST(FlightAnalysis, NamesAFileThatDoesNotParseAndAnEmptyDirectory) {
  TempDir dir;
  auto [empty_code, empty] = runCommand(kTrace + " analyze " + dir.path() + " 2>&1", 30);
  EXPECT_NE(empty_code, 0);
  expectContains(empty, "no flight-recorder dump (rank<R>.json) in " + dir.path());
  std::ofstream(dir.path() + "/rank0.json") << dump(0, "a", 0).dump();
  std::ofstream(dir.path() + "/rank1.json") << "{\"format\": \"dtrain-flight-recorder\", \"rank\": ";
  auto [code, out] = runCommand(kTrace + " analyze " + dir.path() + " 2>&1", 30);
  EXPECT_NE(code, 0);
  expectContains(out, dir.path() + "/rank1.json is not a readable flight-recorder dump");
}

}  // namespace
