// Hierarchical allreduce (src/comm/collectives/hierarchical.cc) on one machine: each forked rank sets
// the DTRAIN_HOST_ID test hook, so ranks with different ids look like ranks of different hosts. The
// group's mesh is then tcp and each "host" with several ranks gets its own shm transport, as across real
// hosts. The checks (hierarchical_checks.h, also run on the emulated cluster by cluster_test) run on
// layouts 2x2, 2x1, 3x1, 2+1, 2+1 with the hosts' ranks interleaved and 3+1+2. A rank killed mid-op must
// fail every other rank, naming it, within the deadline; ranks that disagree on a call all fail.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <fmt/format.h>

#include <random>
#include <thread>

#include "comm/collectives/collectives.h"
#include "hierarchical_checks.h"
#include "dtrain/comm/error.h"

namespace dtrain::test {
namespace {

using comm::AllreduceAlgorithm;
using comm::GroupOptions;
using comm::ProcessGroup;
using Clock = std::chrono::steady_clock;

// The fake host of each rank.
struct Layout {
  std::string name;
  std::vector<std::string> hosts;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

std::string layoutName(const ::testing::TestParamInfo<Layout>& p) { return p.param.name; }

GroupOptions options(std::chrono::milliseconds timeout) {
  GroupOptions o;
  o.timeout = timeout;
  o.segment_bytes = 4096;  // tiny rings: large counts wrap many times
  return o;
}

// Runs fn(pg) on every rank of a group whose rank r pretends to be on host layout.hosts[r].
void runLayout(const Layout& layout, const std::function<void(ProcessGroup&)>& fn,
               std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  StoreServer server;
  const int world = static_cast<int>(layout.hosts.size());
  auto results = runRanks(world, [&](int rank) {
    setenv("DTRAIN_HOST_ID", layout.hosts[static_cast<size_t>(rank)].c_str(), 1);
    auto pg = ProcessGroup::create(server.client(), rank, world, options(timeout));
    ASSERT_EQ(pg->transportName(), "tcp");
    fn(*pg);
  });
  expectAllOk(results);
}

class Hierarchical : public ::testing::TestWithParam<Layout> {};

TEST_P(Hierarchical, EqualsFlat) { runLayout(GetParam(), checkEqualsFlat); }
TEST_P(Hierarchical, BroadcastFromEveryRoot) { runLayout(GetParam(), checkBroadcastFromEveryRoot); }
TEST_P(Hierarchical, AllgatherEqualsExpected) { runLayout(GetParam(), checkAllgatherEqualsExpected); }
TEST_P(Hierarchical, ReduceScatterEqualsExpected) { runLayout(GetParam(), checkReduceScatterEqualsExpected); }
TEST_P(Hierarchical, EveryRankBitIdentical) { runLayout(GetParam(), checkEveryRankBitIdentical); }
TEST_P(Hierarchical, InterleavedWithOtherOps) { runLayout(GetParam(), checkInterleavedWithOtherOps); }

INSTANTIATE_TEST_SUITE_P(Layouts, Hierarchical,
                         ::testing::Values(Layout{"hosts2x2", {"a", "a", "b", "b"}}, Layout{"hosts2x1", {"a", "b"}},
                                           Layout{"hosts3x1", {"a", "b", "c"}},
                                           Layout{"hosts2plus1", {"a", "a", "b"}},
                                           Layout{"hosts2plus1_interleaved", {"a", "b", "a"}},
                                           Layout{"hosts3plus1plus2", {"a", "b", "a", "c", "c", "a"}}),
                         layoutName);

// The automatic choice (select.cc): hierarchical when the group spans hosts and some host has several
// ranks; never on one host; forcing it on one host falls back to the flat choice.
TEST(HierarchicalChoice, AutomaticWhereAHostHasSeveralRanks) {
  std::vector<uint8_t> scratch;
  comm::algo::Context c{nullptr, 0, 4, {}, {}, scratch};
  EXPECT_NE(comm::algo::chooseAllreduce(c, 1000, DType::f32, AllreduceAlgorithm::hierarchical),
            AllreduceAlgorithm::hierarchical);
  comm::algo::Hierarchy h;
  h.hosts = {{0, 1}, {2, 3}};
  h.shards = 2;
  c.hier = &h;
  for (size_t count : {size_t(1), size_t(1) << 20})
    EXPECT_EQ(comm::algo::chooseAllreduce(c, count, DType::f32, AllreduceAlgorithm::automatic),
              AllreduceAlgorithm::hierarchical);
  EXPECT_EQ(comm::algo::chooseAllreduce(c, 1000, DType::f32, AllreduceAlgorithm::ring), AllreduceAlgorithm::ring);
  h.hosts = {{0}, {1}};
  h.shards = 1;
  EXPECT_EQ(comm::algo::chooseAllreduce(c, 1000, DType::f32, AllreduceAlgorithm::automatic),
            AllreduceAlgorithm::recursive_doubling);
  EXPECT_EQ(comm::algo::chooseAllreduce(c, 1000, DType::f32, AllreduceAlgorithm::hierarchical),
            AllreduceAlgorithm::hierarchical);
}

TEST(HierarchicalChoice, DtrainAlgoNames) {
  using comm::algo::parseAllreduceAlgorithm;
  EXPECT_EQ(parseAllreduceAlgorithm("hierarchical"), AllreduceAlgorithm::hierarchical);
  EXPECT_EQ(parseAllreduceAlgorithm("ring"), AllreduceAlgorithm::ring);
  EXPECT_EQ(parseAllreduceAlgorithm("recursive_doubling"), AllreduceAlgorithm::recursive_doubling);
  EXPECT_EQ(parseAllreduceAlgorithm("rd"), AllreduceAlgorithm::recursive_doubling);
  EXPECT_EQ(parseAllreduceAlgorithm("auto"), AllreduceAlgorithm::automatic);
  try {
    parseAllreduceAlgorithm("tree");
    ADD_FAILURE() << "DTRAIN_ALGO=tree accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_ALGO='tree'"), std::string::npos) << e.what();
  }
}

// DTRAIN_ALGO reaches the group, and ranks that force different algorithms (which would wait for each
// other in different algorithms until the deadline) fail together when the group is created.
TEST(HierarchicalChoice, DtrainAlgoMustAgree) {
  StoreServer server;
  auto results = runRanks(4, [&](int rank) {
    setenv("DTRAIN_HOST_ID", rank < 2 ? "a" : "b", 1);
    setenv("DTRAIN_ALGO", "hierarchical", 1);
    auto pg = ProcessGroup::create(server.client(), rank, 4, options(std::chrono::seconds(10)));
    EXPECT_EQ(pg->options().allreduce_algorithm, AllreduceAlgorithm::hierarchical);
    std::vector<int32_t> x(100, rank);
    pg->allreduce(x.data(), x.size(), DType::i32)->wait();
    EXPECT_EQ(x[99], 6);
  });
  expectAllOk(results);
  StoreServer server2;
  results = runRanks(4, [&](int rank) {
    setenv("DTRAIN_HOST_ID", rank < 2 ? "a" : "b", 1);
    setenv("DTRAIN_ALGO", rank == 3 ? "ring" : "hierarchical", 1);
    try {
      ProcessGroup::create(server2.client(), rank, 4, options(std::chrono::seconds(10)));
      ADD_FAILURE() << "rank " << rank << ": a group whose ranks force different algorithms was created";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 hierarchical, rank 3 ring"), std::string::npos) << e.what();
    }
  });
  expectAllOk(results);
}

// Calls that differ in their arguments are still caught through the stages: rank 3 allreduces one element
// fewer than the others, at the same point. Every rank fails with a ProtocolError naming the mismatched
// calls, long before the deadline (shm compares the calls of a host's ranks, tcp every frame's).
TEST(HierarchicalMismatch, DifferentCountsFailEveryRank) {
  StoreServer server;
  auto results = runRanks(4, [&](int rank) {
    setenv("DTRAIN_HOST_ID", rank < 2 ? "a" : "b", 1);
    auto pg = ProcessGroup::create(server.client(), rank, 4, options(std::chrono::seconds(20)));
    std::vector<float> x(1000, 1.0f);
    pg->allreduce(x.data(), x.size(), DType::f32)->wait();
    const auto t0 = Clock::now();
    try {
      pg->allreduce(x.data(), rank == 3 ? 999 : 1000, DType::f32)->wait();
      ADD_FAILURE() << "rank " << rank << ": mismatched allreduce succeeded";
    } catch (const ProtocolError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("f32 x 999"), std::string::npos) << msg;
      EXPECT_NE(msg.find("f32 x 1000"), std::string::npos) << msg;
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0) << msg;
    }
  });
  expectAllOk(results);
}

// A rank is SIGKILLed during a stream of large hierarchical allreduces. Every survivor raises IoError or
// TimeoutError naming it, within 2x the timeout, whichever stage it was in (the shm stage on the
// victim's host, the tcp stage, or the shm stage of another host behind them).
struct Victim {
  std::string name;
  std::vector<std::string> hosts;
  int rank;
};
void PrintTo(const Victim& v, std::ostream* os) { *os << v.name; }

class HierarchicalFaults : public ::testing::TestWithParam<Victim> {};

TEST_P(HierarchicalFaults, KilledRankIsNamedByEveryone) {
  StoreServer server;
  const auto timeout = std::chrono::seconds(5);
  const Victim v = GetParam();
  const int world = static_cast<int>(v.hosts.size());
  auto results = runRanks(world, [&](int rank) {
    setenv("DTRAIN_HOST_ID", v.hosts[static_cast<size_t>(rank)].c_str(), 1);
    auto pg = ProcessGroup::create(server.client(), rank, world, options(timeout));
    std::vector<float> buf(1 << 20, 1.0f);
    pg->allreduce(buf.data(), buf.size(), DType::f32)->wait();
    if (rank == v.rank) {
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        kill(getpid(), SIGKILL);
      }).detach();
    }
    const auto t0 = Clock::now();
    try {
      for (int i = 0; i < 100000; ++i) pg->allreduce(buf.data(), buf.size(), DType::f32)->wait();
      ADD_FAILURE() << "rank " << rank << ": allreduce kept succeeding after rank " << v.rank << " was killed";
    } catch (const Error& e) {
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      const std::string msg = e.what();
      EXPECT_TRUE(dynamic_cast<const IoError*>(&e) || dynamic_cast<const TimeoutError*>(&e)) << msg;
      EXPECT_EQ(msg.rfind(fmt::format("[rank {}]", rank), 0), 0u) << msg;
      EXPECT_NE(msg.find(fmt::format("rank {} (", v.rank)), std::string::npos) << msg;
      EXPECT_NE(msg.find("allreduce seq="), std::string::npos) << msg;
      EXPECT_NE(msg.find("hierarchical"), std::string::npos) << msg;
      EXPECT_LT(secs, 2.0 * 5) << msg;
    }
  }, std::chrono::seconds(60));
  for (const auto& c : results) {
    if (c.rank == v.rank) {
      EXPECT_EQ(c.signal, SIGKILL) << c.describe();
    } else {
      EXPECT_TRUE(c.ok()) << c.describe();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Victims, HierarchicalFaults,
                         ::testing::Values(Victim{"hosts2x2_rank3", {"a", "a", "b", "b"}, 3},
                                           Victim{"hosts2x2_rank0", {"a", "a", "b", "b"}, 0},
                                           Victim{"hosts2plus1_alone", {"a", "a", "b"}, 2},
                                           Victim{"hosts2plus1_shared", {"a", "a", "b"}, 1}),
                         [](const ::testing::TestParamInfo<Victim>& p) { return p.param.name; });

}  // namespace
}  // namespace dtrain::test
