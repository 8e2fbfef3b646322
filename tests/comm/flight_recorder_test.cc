// The flight recorder in real ranks: SIGUSR1 writes a dump without disturbing the run, a timed-out
// collective writes one (naming the error), DTRAIN_TRACE_BUFFER bounds the ring, and the dump holds
// the open spans. Each child sets the recorder's variables before its first op (when it reads them).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/trace.h"
#include "harness.h"

namespace {

using namespace dtrain;
using namespace dtrain::test;
using comm::DType;
using comm::ProcessGroup;
using Clock = std::chrono::steady_clock;

// Runs fn(rank, group) in 2 forked ranks (a group named "world" with ops timing out after `timeout`)
// whose recorders dump to `dir`; `buffer`: their DTRAIN_TRACE_BUFFER. Fails unless both succeed.
void runPair(const std::string& dir, std::chrono::milliseconds timeout,
             const std::function<void(int, ProcessGroup&)>& fn, const char* buffer = nullptr) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    ::setenv("DTRAIN_FLIGHT_DIR", dir.c_str(), 1);  // read at the first op
    if (buffer) ::setenv("DTRAIN_TRACE_BUFFER", buffer, 1);
    comm::GroupOptions o;
    o.name = "world";
    o.timeout = timeout;
    fn(rank, *ProcessGroup::create(server.client(), rank, 2, o));
  });
  expectAllOk(results);
}

nlohmann::json readDump(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "no dump at " << path;
  return in ? nlohmann::json::parse(in) : nlohmann::json();
}

// Raises SIGUSR1 and waits (at most 10 s) for the watcher's dump to replace whatever was at `path`.
void signalAndWaitForDump(const std::string& path) {
  std::remove(path.c_str());
  ::kill(::getpid(), SIGUSR1);
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!std::ifstream(path) && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(std::ifstream(path).good()) << "no dump at " << path << " 10 s after SIGUSR1";
}

void allreduceAndCheck(ProcessGroup& pg, int world) {
  std::vector<float> x(1024, 1.0f);
  pg.allreduce(x.data(), x.size(), DType::f32)->wait();
  ASSERT_EQ(x[0], static_cast<float>(world));
  ASSERT_EQ(x[1023], static_cast<float>(world));
}

TEST(FlightRecorder, SignalDumpsWithoutDisturbingTheRun) {
  TempDir dir;
  runPair(dir.path(), std::chrono::seconds(20), [&](int rank, ProcessGroup& pg) {
    for (int i = 0; i < 5; ++i) allreduceAndCheck(pg, 2);
    if (rank == 0) {
      DTRAIN_SPAN("checking the dump");
      signalAndWaitForDump(dir.path() + "/rank0.json");
    }
    for (int i = 0; i < 5; ++i) allreduceAndCheck(pg, 2);  // the run goes on, results unchanged
  });
  auto d = readDump(dir.path() + "/rank0.json");
  ASSERT_FALSE(d.is_null());
  EXPECT_EQ(d["rank"], 0);
  EXPECT_EQ(d["world_size"], 2);
  EXPECT_EQ(d["reason"], "SIGUSR1");
  EXPECT_EQ(d["groups"]["world"]["ranks"], nlohmann::json({0, 1}));
  ASSERT_EQ(d["entries"].size(), 5u);  // the dump was written between the 5th and the 6th op
  for (int i = 0; i < 5; ++i) {
    const auto& e = d["entries"][static_cast<size_t>(i)];
    EXPECT_EQ(e["seq"], i);
    EXPECT_EQ(e["op"], "allreduce");
    EXPECT_EQ(e["dtype"], "f32");
    EXPECT_EQ(e["count"], 1024);
    EXPECT_EQ(e["bytes"], 4096);
    EXPECT_EQ(e["state"], "completed");
    EXPECT_LE(e["issued_us"].get<int64_t>(), e["started_us"].get<int64_t>());
    EXPECT_LE(e["started_us"].get<int64_t>(), e["finished_us"].get<int64_t>());
  }
  bool span_seen = false;
  for (const auto& t : d["threads"])
    for (const auto& s : t["spans"]) span_seen = span_seen || s["name"] == "checking the dump";
  EXPECT_TRUE(span_seen) << d["threads"].dump();
}

volatile sig_atomic_t g_user_handler_ran = 0;

// A handler the program installed before its first op keeps running: the recorder calls it after
// noting the signal.
TEST(FlightRecorder, SignalChainsToTheProgramsEarlierHandler) {
  TempDir dir;
  runPair(dir.path(), std::chrono::seconds(20), [&](int rank, ProcessGroup& pg) {
    if (rank == 0) {
      struct sigaction sa {};
      sa.sa_handler = [](int) { g_user_handler_ran = 1; };
      sigemptyset(&sa.sa_mask);
      ASSERT_EQ(::sigaction(SIGUSR1, &sa, nullptr), 0);
    }
    allreduceAndCheck(pg, 2);  // the recorder starts here
    if (rank == 0) {
      signalAndWaitForDump(dir.path() + "/rank0.json");
      EXPECT_EQ(g_user_handler_ran, 1);
    }
    allreduceAndCheck(pg, 2);
  });
}

TEST(FlightRecorder, TimeoutWritesADump) {
  TempDir dir;
  runPair(dir.path(), std::chrono::milliseconds(1000), [&](int rank, ProcessGroup& pg) {
    allreduceAndCheck(pg, 2);
    if (rank == 1) {  // stays connected but never joins the second allreduce
      std::this_thread::sleep_for(std::chrono::seconds(3));
      return;
    }
    std::vector<float> x(16, 1.0f);
    EXPECT_THROW(pg.allreduce(x.data(), x.size(), DType::f32)->wait(), TimeoutError);
  });
  auto d = readDump(dir.path() + "/rank0.json");
  ASSERT_FALSE(d.is_null());
  EXPECT_NE(d["reason"].get<std::string>().find("timed out"), std::string::npos) << d["reason"];
  ASSERT_EQ(d["entries"].size(), 2u);
  const auto& e = d["entries"][1];
  EXPECT_EQ(e["seq"], 1);
  EXPECT_EQ(e["state"], "failed");
  EXPECT_NE(e["error"].get<std::string>().find("allreduce seq=1"), std::string::npos) << e["error"];
  EXPECT_FALSE(std::ifstream(dir.path() + "/rank1.json").good()) << "rank 1 failed nothing";
}

// Rank 0 aborts the group while rank 1 waits in an allreduce: both fail, and both dump once (rank 1's
// later op, failing with the same error, writes no second dump).
TEST(FlightRecorder, AbortWritesADumpOnEveryRank) {
  TempDir dir;
  runPair(dir.path(), std::chrono::seconds(20), [&](int rank, ProcessGroup& pg) {
    allreduceAndCheck(pg, 2);
    std::vector<float> x(16, 1.0f);
    if (rank == 0) {
      EXPECT_THROW(pg.abort("rank 0 cannot go on")->wait(), Error);
      return;
    }
    EXPECT_THROW(pg.allreduce(x.data(), x.size(), DType::f32)->wait(), Error);
    const std::string mine = dir.path() + "/rank1.json";
    auto d = readDump(mine);  // written before the error reached this thread
    ASSERT_FALSE(d.is_null());
    EXPECT_NE(d["reason"].get<std::string>().find("rank 0 cannot go on"), std::string::npos) << d["reason"];
    EXPECT_EQ(d["entries"].back()["op"], "allreduce");
    EXPECT_EQ(d["entries"].back()["state"], "failed");
    std::remove(mine.c_str());
    EXPECT_THROW(pg.allreduce(x.data(), x.size(), DType::f32)->wait(), Error);
    EXPECT_FALSE(std::ifstream(mine).good()) << "a second failure dumped again";
  });
  auto d = readDump(dir.path() + "/rank0.json");
  ASSERT_FALSE(d.is_null());
  EXPECT_NE(d["reason"].get<std::string>().find("rank 0 cannot go on"), std::string::npos) << d["reason"];
  EXPECT_EQ(d["entries"].back()["op"], "abort");
  EXPECT_EQ(d["entries"].back()["state"], "failed");
}

TEST(FlightRecorder, BufferSizeBoundsTheRing) {
  TempDir dir;
  runPair(
      dir.path(), std::chrono::seconds(20),
      [&](int rank, ProcessGroup& pg) {
        for (int i = 0; i < 20; ++i) allreduceAndCheck(pg, 2);
        if (rank == 1) signalAndWaitForDump(dir.path() + "/rank1.json");
        pg.barrier()->wait();
      },
      "8");
  auto d = readDump(dir.path() + "/rank1.json");
  ASSERT_FALSE(d.is_null());
  EXPECT_EQ(d["capacity"], 8);
  EXPECT_EQ(d["recorded"], 20);
  EXPECT_EQ(d["dropped"], 12);
  ASSERT_EQ(d["entries"].size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(d["entries"][i]["seq"], 12 + i);  // the newest 8, oldest first
}

// DTRAIN_TRACE_BUFFER=0 turns the recorder off: a failure writes no dump.
TEST(FlightRecorder, BufferZeroTurnsItOff) {
  TempDir dir;
  runPair(
      dir.path(), std::chrono::seconds(20),
      [&](int rank, ProcessGroup& pg) {
        allreduceAndCheck(pg, 2);
        std::vector<float> x(16, 1.0f);
        if (rank == 0) {
          EXPECT_THROW(pg.abort("rank 0 cannot go on")->wait(), Error);
        } else {
          EXPECT_THROW(pg.allreduce(x.data(), x.size(), DType::f32)->wait(), Error);
        }
      },
      "0");
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(std::ifstream(dir.path() + "/rank" + std::to_string(r) + ".json").good()) << "rank " << r;
  }
}

}  // namespace
