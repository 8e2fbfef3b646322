// The parameter server's environment parsed from plain values (no setenv): the launcher's roles, and
// the job's store set up as initWorld() sets up the world's, so a PS job also runs through a
// file:// store and takes torchrun's restart count when dtrain's is unset.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <string>

#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"
#include "dtrain/ps.h"
#include "harness.h"
#include "ps_test_util.h"
#include "torch/ps/env.h"

namespace dtrain::test {
namespace {

using comm::rendezvous::Environment;
using namespace std::chrono_literals;

TEST(PSEnvironment, LaunchRoles) {
  ps::LaunchRoles none = ps::launchRoles(Environment());
  EXPECT_FALSE(none.server);
  EXPECT_EQ(none.server_index, -1);
  EXPECT_EQ(none.num_servers, -1);
  EXPECT_EQ(none.num_workers, -1);
  EXPECT_EQ(none.num_nodes, -1);
  auto r = ps::launchRoles(Environment::of({{"DTRAIN_ROLE", "server"},
                                            {"DTRAIN_SERVER_INDEX", "0"},
                                            {"DTRAIN_NUM_SERVERS", "2"},
                                            {"DTRAIN_NUM_WORKERS", "4"},
                                            {"DTRAIN_NUM_NODES", "2"}}));
  EXPECT_TRUE(r.server);
  EXPECT_EQ(r.server_index, 0);
  EXPECT_EQ(r.num_servers, 2);
  EXPECT_EQ(r.num_workers, 4);
  EXPECT_EQ(r.num_nodes, 2);
  EXPECT_FALSE(ps::launchRoles(Environment::of({{"DTRAIN_ROLE", "worker"}})).server);
  std::string m = errorOf([] { ps::launchRoles(Environment::of({{"DTRAIN_NUM_SERVERS", "0"}})); });
  EXPECT_NE(m.find("DTRAIN_NUM_SERVERS='0'"), std::string::npos) << m;
  // A server without its index is named before it serves anything.
  ps::PSOptions o;
  m = errorOf([&] {
    ps::runServerIfRole(Environment::of({{"DTRAIN_ROLE", "server"}, {"DTRAIN_NUM_SERVERS", "1"}}), o);
  });
  EXPECT_NE(m.find("DTRAIN_ROLE=server needs DTRAIN_SERVER_INDEX, DTRAIN_NUM_SERVERS and DTRAIN_NUM_WORKERS"),
            std::string::npos)
      << m;
  EXPECT_FALSE(ps::runServerIfRole(Environment(), o));
}

TEST(PSEnvironment, StoreThroughAFileWithTorchrunsRestartCount) {
  TempDir dir;
  const std::string path = dir.path() + "/store";
  auto env = Environment::of({{"DTRAIN_INIT_METHOD", "file://" + path}, {"TORCHELASTIC_RESTART_COUNT", "3"}});
  ps::storeFrom(env, 5s)->set("k", comm::toBytes("v"));
  comm::FileStore raw(path, 5s);
  EXPECT_EQ(comm::toString(raw.get("gen3/ps/k")), "v");
  // DTRAIN_RESTART_COUNT, when set, wins.
  auto env2 = Environment::of({{"DTRAIN_INIT_METHOD", "file://" + path},
                               {"TORCHELASTIC_RESTART_COUNT", "3"},
                               {"DTRAIN_RESTART_COUNT", "1"}});
  ps::storeFrom(env2, 5s)->set("k", comm::toBytes("w"));
  EXPECT_EQ(comm::toString(raw.get("gen1/ps/k")), "w");
}

// A whole job (one server, two workers) whose only meeting point is a file: what dtrain-run --servers 1
// would set, with DTRAIN_INIT_METHOD=file://... instead of MASTER_ADDR/MASTER_PORT.
TEST(PSEnvironment, JobThroughAFileStore) {
  TempDir dir;
  const std::string method = "file://" + dir.path() + "/store";
  const int W = 2;
  auto results = runRanks(W + 1, [&](int p) {
    std::map<std::string, std::string> vars = {{"DTRAIN_INIT_METHOD", method},
                                               {"TORCHELASTIC_RESTART_COUNT", "2"},
                                               {"DTRAIN_NUM_SERVERS", "1"},
                                               {"DTRAIN_NUM_WORKERS", std::to_string(W)},
                                               {"DTRAIN_ROLE", p < W ? "worker" : "server"}};
    if (p == W) vars["DTRAIN_SERVER_INDEX"] = "0";
    const auto env = Environment::of(vars);
    ps::PSOptions o;
    o.update = ps::PSOptions::Update::sum_only;
    o.timeout = 20s;
    if (ps::runServerIfRole(env, o)) {
      EXPECT_EQ(p, W);
      return;
    }
    ps::Worker wk(ps::storeFrom(env, o.timeout), p, W, 1, o);
    expectTwoWorkersSum(wk, p);
    wk.finish();
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
