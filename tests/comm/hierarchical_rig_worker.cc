// The hierarchical collectives' equality checks (hierarchical_checks.h) on the emulated cluster: a
// dtrain-run worker, not a test itself; cluster_test runs it as
//   scripts/cluster.sh --hosts 3 --nproc-per-host 2 -- hierarchical_rig_worker
// Ranks 2h and 2h+1 are on host h (a network namespace), so the world is 3x2 and its sub-groups give
// every layout the issue asks for, with real hosts: 2x2 {0,1,2,3}, 2x1 {0,2}, 3x1 {1,3,5} and 2+1
// {0,1,4}. Every rank runs every layout's checks on the groups it belongs to; a rank that fails makes
// its group's other ranks fail too (their collectives time out naming it, or get its abort). Exit 0 when
// every check passed on this rank.
#include <gtest/gtest.h>

#include "dtrain/comm/rendezvous.h"
#include "hierarchical_checks.h"

namespace {

struct RigLayout {
  std::string name;
  std::vector<int> ranks;  // of the 3x2 world
};

const std::vector<RigLayout> kLayouts = {
    {"hosts3x2", {0, 1, 2, 3, 4, 5}}, {"hosts2x2", {0, 1, 2, 3}}, {"hosts2x1", {0, 2}},
    {"hosts3x1", {1, 3, 5}},          {"hosts2plus1", {0, 1, 4}},
};

std::shared_ptr<dtrain::comm::ProcessGroup> g_world;
std::vector<std::shared_ptr<dtrain::comm::ProcessGroup>> g_groups;  // per layout; nullptr: not a member

class Rig : public ::testing::TestWithParam<size_t> {
 protected:
  // The layout's group, or nullptr when this rank is not in it. Every group spans several hosts, so its
  // mesh is tcp: anything else means the namespaces did not look like hosts.
  dtrain::comm::ProcessGroup* group() {
    auto& g = g_groups[GetParam()];
    if (g) {
      EXPECT_EQ(g->transportName(), "tcp") << kLayouts[GetParam()].name;
    }
    return g.get();
  }
};

TEST_P(Rig, EqualsFlat) {
  if (auto* g = group()) dtrain::test::checkEqualsFlat(*g);
}
TEST_P(Rig, BroadcastFromEveryRoot) {
  if (auto* g = group()) dtrain::test::checkBroadcastFromEveryRoot(*g);
}
TEST_P(Rig, AllgatherEqualsExpected) {
  if (auto* g = group()) dtrain::test::checkAllgatherEqualsExpected(*g);
}
TEST_P(Rig, ReduceScatterEqualsExpected) {
  if (auto* g = group()) dtrain::test::checkReduceScatterEqualsExpected(*g);
}
TEST_P(Rig, EveryRankBitIdentical) {
  if (auto* g = group()) dtrain::test::checkEveryRankBitIdentical(*g);
}
TEST_P(Rig, InterleavedWithOtherOps) {
  if (auto* g = group()) dtrain::test::checkInterleavedWithOtherOps(*g);
}

INSTANTIATE_TEST_SUITE_P(Layouts, Rig, ::testing::Range(size_t(0), kLayouts.size()),
                         [](const ::testing::TestParamInfo<size_t>& p) { return kLayouts[p.param].name; });

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  dtrain::comm::InitOptions opts;
  auto group = dtrain::comm::GroupOptions::fromEnv();
  group.segment_bytes = 4096;  // tiny rings: large counts wrap many times
  opts.group = group;
  g_world = dtrain::comm::initWorld(opts);
  if (g_world->size() != 6) {
    std::fprintf(stderr, "hierarchical_rig_worker: wants 3 hosts x 2 processes (world 6), got world %d\n",
                 g_world->size());
    return 2;
  }
  for (const auto& l : kLayouts) g_groups.push_back(g_world->newGroup(l.ranks));  // every rank calls each
  return RUN_ALL_TESTS();
}
