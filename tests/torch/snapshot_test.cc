// In-memory snapshots (dtrain/snapshot.h): each "node" is a rank with its own TcpStoreServer standing in
// for its dtrain-run agent (served by this test process, which outlives the ranks as an agent outlives its
// workers). A lost node is a store server destroyed between two runs of ranks ("rounds").
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "dtrain/distributed.h"
#include "dtrain/snapshot.h"
#include "harness.h"

namespace dtrain {
namespace {

using test::expectAllOk;
using test::runRanks;
using test::StoreServer;

// One store per node, as dtrain-run's agents serve them.
struct Agents {
  explicit Agents(int n) {
    for (int i = 0; i < n; ++i) servers.push_back(std::make_unique<comm::TcpStoreServer>("127.0.0.1", 0));
  }
  // "host:port,..." of the nodes still alive, in the order given.
  std::string list(const std::vector<int>& nodes) const {
    std::vector<std::string> out;
    for (int n : nodes) out.push_back(fmt::format("127.0.0.1:{}", servers[static_cast<size_t>(n)]->port()));
    return fmt::format("{}", fmt::join(out, ","));
  }
  std::vector<std::unique_ptr<comm::TcpStoreServer>> servers;
};

// A state whose tensor says who saved it and when.
CheckpointState stateOf(int part, int64_t step) {
  CheckpointState s;
  s.step = step;
  s.epoch = step / 10;
  s.samples = step * 7;
  s.model["w"] = torch::full({4, 3}, static_cast<float>(part * 1000 + step));
  s.metrics["part"] = part;
  return s;
}

// world ranks, one per node (node = rank), round `round`, stores `stores`; fn(rank, dist, snaps).
void runRound(int world, int64_t round, const std::string& stores, bool replicated,
              const std::function<void(int, const Distributed&, PeerSnapshots&)>& fn) {
  StoreServer server;
  expectAllOk(runRanks(world, [&](int rank) {
    comm::GroupOptions opts;
    opts.timeout = std::chrono::seconds(30);
    auto pg = comm::ProcessGroup::create(server.client(), rank, world, opts);
    comm::WorldInfo info;
    info.rank = rank;
    info.size = world;
    info.node = rank;
    info.num_nodes = world;
    Distributed dist(pg, pg, info);
    SnapshotOptions so;
    so.replicated = replicated;
    so.stores = stores;
    so.round = round;
    so.timeout = std::chrono::seconds(10);
    PeerSnapshots snaps(dist, so);
    fn(rank, dist, snaps);
  }));
}

void expectError(const std::string& msg, const std::string& part) {
  EXPECT_NE(msg.find(part), std::string::npos) << msg;
}

void expectState(const CheckpointState& s, int part, int64_t step) {
  EXPECT_EQ(s.step, step);
  EXPECT_EQ(s.samples, step * 7);
  EXPECT_EQ(s.metrics.at("part"), part);
  EXPECT_TRUE(torch::equal(s.model.at("w"), torch::full({4, 3}, static_cast<float>(part * 1000 + step))));
}

TEST(PeerSnapshots, ShardedPartsSurviveTheLossOfAnyOneNode) {
  for (int lost = 0; lost < 3; ++lost) {
    SCOPED_TRACE(fmt::format("node {} lost", lost));
    Agents agents(3);
    runRound(3, 0, agents.list({0, 1, 2}), /*replicated=*/false, [](int rank, const Distributed&, PeerSnapshots& s) {
      EXPECT_TRUE(s.writes());
      EXPECT_FALSE(s.loadLatest());  // nothing yet
      for (int64_t step : {5, 10, 15}) s.save(stateOf(rank, step));
      s.flush();
      EXPECT_EQ(s.stats().snapshots, 3);
      EXPECT_GT(s.stats().last_bytes, 0);
    });
    agents.servers[static_cast<size_t>(lost)].reset();
    std::vector<int> alive;
    for (int n = 0; n < 3; ++n)
      if (n != lost) alive.push_back(n);
    runRound(2, 1, agents.list(alive), false, [](int, const Distributed&, PeerSnapshots& s) {
      auto snap = s.loadLatest();
      ASSERT_TRUE(snap);
      EXPECT_EQ(snap->round, 0);
      EXPECT_EQ(snap->step, 15);
      EXPECT_EQ(snap->world_size, 3);
      ASSERT_EQ(snap->parts.size(), 3u);
      for (int p = 0; p < 3; ++p) expectState(snap->parts[static_cast<size_t>(p)], p, 15);
    });
  }
}

TEST(PeerSnapshots, ReplicatedStateIsReadFromAnySurvivor) {
  Agents agents(3);
  runRound(3, 0, agents.list({0, 1, 2}), /*replicated=*/true, [](int, const Distributed&, PeerSnapshots& s) {
    for (int64_t step : {4, 8}) s.save(stateOf(0, step));
  });
  agents.servers[0].reset();
  agents.servers[1].reset();
  runRound(1, 1, agents.list({2}), true, [](int, const Distributed&, PeerSnapshots& s) {
    auto snap = s.loadLatest();
    ASSERT_TRUE(snap);
    ASSERT_EQ(snap->parts.size(), 1u);
    expectState(snap->parts[0], 0, 8);
    EXPECT_EQ(snap->world_size, 3);
  });
}

TEST(PeerSnapshots, ANewerSnapshotWithAPartMissingIsPassedOver) {
  Agents agents(2);
  runRound(2, 0, agents.list({0, 1}), false, [](int rank, const Distributed&, PeerSnapshots& s) {
    s.save(stateOf(rank, 10));
    if (rank == 0) s.save(stateOf(rank, 20));  // rank 1 died before its step-20 snapshot
  });
  runRound(2, 1, agents.list({0, 1}), false, [](int, const Distributed&, PeerSnapshots& s) {
    auto snap = s.loadLatest();
    ASSERT_TRUE(snap);
    EXPECT_EQ(snap->step, 10);
    for (int p = 0; p < 2; ++p) expectState(snap->parts[static_cast<size_t>(p)], p, 10);
  });
}

TEST(PeerSnapshots, NothingWhenAPartIsLostEverywhere) {
  Agents agents(3);
  runRound(3, 0, agents.list({0, 1, 2}), false, [](int rank, const Distributed&, PeerSnapshots& s) {
    s.save(stateOf(rank, 3));
  });
  agents.servers[0].reset();  // rank 0's part was on nodes 0 and 1
  agents.servers[1].reset();
  runRound(1, 1, agents.list({2}), false, [](int, const Distributed&, PeerSnapshots& s) { EXPECT_FALSE(s.loadLatest()); });
}

TEST(PeerSnapshots, ALaterRoundsSnapshotWinsAndOldOnesAreDeleted) {
  Agents agents(2);
  runRound(2, 0, agents.list({0, 1}), false, [](int rank, const Distributed&, PeerSnapshots& s) {
    for (int64_t step = 1; step <= 6; ++step) s.save(stateOf(rank, step));
  });
  // Round 1 resumed from step 6 and snapshotted step 6 again, at world size 1.
  runRound(1, 1, agents.list({0, 1}), false, [](int, const Distributed&, PeerSnapshots& s) {
    auto snap = s.loadLatest();
    ASSERT_TRUE(snap);
    EXPECT_EQ(snap->step, 6);
    EXPECT_EQ(snap->world_size, 2);
    s.save(stateOf(0, 6));
  });
  runRound(1, 2, agents.list({0, 1}), false, [](int, const Distributed&, PeerSnapshots& s) {
    auto snap = s.loadLatest();
    ASSERT_TRUE(snap);
    EXPECT_EQ(snap->round, 1);
    EXPECT_EQ(snap->world_size, 1);
    expectState(snap->parts[0], 0, 6);
  });
  // Round 0's writers kept their two newest per store (steps 5 and 6); round 1's load deleted all but the
  // snapshot it chose (step 6 of round 0), round 2's all but round 1's.
  comm::TcpStore store("127.0.0.1", agents.servers[0]->port(), std::chrono::seconds(5));
  for (const char* gone : {"snap/d/0/0/4", "snap/d/0/0/5", "snap/d/0/0/6", "snap/d/0/1/6"})
    EXPECT_FALSE(store.check({gone})) << gone;
  EXPECT_TRUE(store.check({"snap/d/1/0/6"}));
}

TEST(PeerSnapshots, WritersKeepTheirTwoNewest) {
  Agents agents(2);
  runRound(2, 0, agents.list({0, 1}), false, [](int rank, const Distributed&, PeerSnapshots& s) {
    for (int64_t step = 1; step <= 5; ++step) s.save(stateOf(rank, step));
  });
  comm::TcpStore store("127.0.0.1", agents.servers[1]->port(), std::chrono::seconds(5));
  for (int part = 0; part < 2; ++part) {  // node 1 holds rank 1's parts and, as rank 0's next node, rank 0's
    for (int step = 1; step <= 5; ++step) {
      const std::string key = fmt::format("snap/d/0/{}/{}", part, step);
      EXPECT_EQ(store.check({key}), step >= 4) << key;
    }
  }
}

TEST(PeerSnapshots, OffWithoutStoresAndClearErrors) {
  StoreServer server;
  auto pg = comm::ProcessGroup::create(server.client(), 0, 1);
  comm::WorldInfo info;
  Distributed dist(pg, pg, info);
  SnapshotOptions so;
  so.round = 0;
  PeerSnapshots off(dist, so);
  EXPECT_FALSE(off.enabled());
  off.save(stateOf(0, 1));  // nothing happens
  EXPECT_FALSE(off.loadLatest());

  so.stores = "127.0.0.1";
  expectError(test::errorOf([&] { PeerSnapshots bad(dist, so); }), "SnapshotOptions::stores '127.0.0.1': '127.0.0.1' is not HOST:PORT");
  info.node = 1;
  info.num_nodes = 2;
  Distributed second(pg, pg, info);
  so.stores = "127.0.0.1:1";
  expectError(test::errorOf([&] { PeerSnapshots few(second, so); }), "lists 1 store(s); this rank is on node 1 of 2");

  uint16_t gone = 0;
  {
    comm::TcpStoreServer s("127.0.0.1", 0);
    gone = s.port();
  }
  so.stores = fmt::format("127.0.0.1:{}", gone);
  so.timeout = std::chrono::seconds(1);
  PeerSnapshots dead(dist, so);
  dead.save(stateOf(0, 1));
  expectError(test::errorOf([&] { dead.flush(); }),
              fmt::format("the store of node 0 (127.0.0.1:{}) cannot be reached", gone));
}

}  // namespace
}  // namespace dtrain
