// zeroFirst with real ranks: rank 0's block finishes before any other rank's starts; when rank 0's
// block throws (or rank 0 dies) the others get a dtrain::Error promptly instead of running or hanging.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/distributed.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: one clock for all processes on the host

int64_t nowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
}

void writeNumber(const std::string& path, int64_t v) { std::ofstream(path) << v << "\n"; }

// -1 when the file does not exist.
int64_t readNumber(const std::string& path) {
  std::ifstream in(path);
  int64_t v = -1;
  if (in) in >> v;
  return v;
}

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// A Distributed whose node is the whole world (local == world), as on one host.
Distributed makeDistributed(const StoreServer& server, int rank, int world, std::chrono::seconds timeout) {
  comm::GroupOptions opts;
  opts.timeout = timeout;
  auto pg = comm::ProcessGroup::create(server.client(), rank, world, opts);
  comm::WorldInfo info;
  info.rank = rank;
  info.size = world;
  info.local_rank = rank;
  info.local_size = world;
  info.source = "explicit";
  return Distributed(pg, pg, info);
}

class ZeroFirst : public ::testing::TestWithParam<bool> {};  // param: local

TEST_P(ZeroFirst, RankZeroFinishesBeforeOthersStart) {
  const bool local = GetParam();
  constexpr int kWorld = 3;
  StoreServer server;
  TempDir dir;
  auto results = runRanks(kWorld, [&](int rank) {
    auto dist = makeDistributed(server, rank, kWorld, std::chrono::seconds(30));
    const std::string p = dir.path() + "/" + std::to_string(rank);
    zeroFirst(
        dist,
        [&] {
          writeNumber(p + ".start", nowUs());
          // The others must not have started: rank 0 takes long enough for an early start to show.
          if (rank == 0) {
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            for (int r = 1; r < kWorld; ++r) EXPECT_FALSE(exists(dir.path() + "/" + std::to_string(r) + ".start"));
          } else {
            EXPECT_TRUE(exists(dir.path() + "/0.end")) << "rank " << rank << " started before rank 0 ended";
          }
          writeNumber(p + ".end", nowUs());
        },
        local);
  });
  expectAllOk(results);
  const int64_t end0 = readNumber(dir.path() + "/0.end");
  ASSERT_GT(end0, 0);
  for (int r = 1; r < kWorld; ++r) {
    const int64_t start = readNumber(dir.path() + "/" + std::to_string(r) + ".start");
    ASSERT_GT(start, 0) << "rank " << r << " never ran its block";
    EXPECT_LE(end0, start) << "rank " << r << " started before rank 0 finished";
  }
}

TEST_P(ZeroFirst, RankZeroThrowingFailsTheOthers) {
  const bool local = GetParam();
  constexpr int kWorld = 3;
  StoreServer server;
  TempDir dir;
  auto results = runRanks(kWorld, [&](int rank) {
    // A deadline far above the bound checked below: the others must be released by rank 0's
    // report, not by timing out.
    auto dist = makeDistributed(server, rank, kWorld, std::chrono::seconds(60));
    const auto t0 = Clock::now();
    try {
      zeroFirst(
          dist,
          [&] {
            if (rank == 0) throw std::runtime_error("download failed: 404");
            writeNumber(dir.path() + "/ran-" + std::to_string(rank), 1);
          },
          local);
      ADD_FAILURE() << "rank " << rank << ": zeroFirst returned normally";
    } catch (const Error& e) {
      ASSERT_NE(rank, 0) << "rank 0 must get its own exception back, not " << e.what();
      const std::string msg = e.what();
      EXPECT_NE(msg.find("[rank " + std::to_string(rank) + "]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("download failed: 404"), std::string::npos) << msg;
    } catch (const std::runtime_error& e) {
      // Rank 0 sees the exception its block threw, type and message intact.
      EXPECT_EQ(rank, 0) << e.what();
      EXPECT_STREQ(e.what(), "download failed: 404");
    }
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(20)) << "rank " << rank << " was released too late";
  });
  expectAllOk(results);
  for (int r = 1; r < kWorld; ++r) EXPECT_FALSE(exists(dir.path() + "/ran-" + std::to_string(r)));
}

TEST_P(ZeroFirst, RankZeroThrowingANonStdExceptionFailsTheOthers) {
  const bool local = GetParam();
  constexpr int kWorld = 3;
  StoreServer server;
  auto results = runRanks(kWorld, [&](int rank) {
    auto dist = makeDistributed(server, rank, kWorld, std::chrono::seconds(60));
    const auto t0 = Clock::now();
    try {
      zeroFirst(dist, [&] { if (rank == 0) throw 42; }, local);
      ADD_FAILURE() << "rank " << rank << ": zeroFirst returned normally";
    } catch (const Error& e) {
      EXPECT_NE(rank, 0) << e.what();
    } catch (int v) {
      EXPECT_EQ(rank, 0);
      EXPECT_EQ(v, 42);
    }
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(20)) << "rank " << rank << " was released too late";
  });
  expectAllOk(results);
}

TEST(ZeroFirstFailure, RankZeroDyingFailsTheOthersWithinTheDeadline) {
  constexpr int kWorld = 3;
  StoreServer server;
  TempDir dir;
  auto results = runRanks(kWorld, [&](int rank) {
    auto dist = makeDistributed(server, rank, kWorld, std::chrono::seconds(5));
    try {
      zeroFirst(dist, [&] {
        if (rank == 0) _exit(3);  // a crash inside the block: no exception, no report
        writeNumber(dir.path() + "/ran-" + std::to_string(rank), 1);
      });
      ADD_FAILURE() << "rank " << rank << ": zeroFirst returned normally";
    } catch (const Error& e) {
      std::cout << "rank " << rank << " released by: " << e.what() << "\n";
    }
  });
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[0].exit_code, 3) << results[0].describe();
  for (int r = 1; r < kWorld; ++r) {
    EXPECT_TRUE(results[r].ok()) << results[r].describe();
    EXPECT_FALSE(exists(dir.path() + "/ran-" + std::to_string(r)));
  }
}

TEST(ZeroFirstFailure, WorldOfOneJustRuns) {
  StoreServer server;
  auto results = runRanks(1, [&](int rank) {
    auto dist = makeDistributed(server, rank, 1, std::chrono::seconds(5));
    int calls = 0;
    zeroFirst(dist, [&] { ++calls; });
    zeroFirst(dist, [&] { ++calls; }, /*local=*/false);
    EXPECT_EQ(calls, 2);
  });
  expectAllOk(results);
}

INSTANTIATE_TEST_SUITE_P(Groups, ZeroFirst, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "local" : "world"; });

}  // namespace
}  // namespace dtrain::test
