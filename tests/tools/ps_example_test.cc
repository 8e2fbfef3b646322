// The parameter-server CTR example trains under dtrain-run (1 server, 2 workers) and learns: rank 0
// prints one line per epoch and the held-out AUC and loss of the last epoch beat the first's. Alone
// (no launcher), it runs as one worker with a colocated server.
#include <gtest/gtest.h>

#include "harness.h"
#include <sys/wait.h>

#include <cstdio>
#include <regex>
#include <string>
#include <vector>

namespace {

// Every command here is bounded by `timeout 120`.
std::pair<int, std::string> run(const std::string& cmd) { return dtrain::test::runCommand(cmd, 120); }

struct Epoch {
  int epoch;
  double test_loss, auc;
};

std::vector<Epoch> epochs(const std::string& out) {
  std::regex re(R"((?:\[rank 0\]: )?epoch (\d+) .*test_loss ([0-9.]+)\s+auc ([0-9.]+))");
  std::vector<Epoch> v;
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    v.push_back({std::stoi((*it)[1]), std::stod((*it)[2]), std::stod((*it)[3])});
  return v;
}

TEST(PsExample, CtrTrainsWithOneServerAndTwoWorkers) {
  auto [rc, out] = run(DTRAIN_BIN_DIR "/dtrain-run --standalone --servers 1 --nproc-per-node 2 " DTRAIN_BIN_DIR
                                      "/example-ps-ctr");
  ASSERT_EQ(rc, 0) << out;
  auto e = epochs(out);
  ASSERT_EQ(e.size(), 5u) << out;
  for (size_t i = 0; i < e.size(); ++i) EXPECT_EQ(e[i].epoch, static_cast<int>(i)) << out;
  EXPECT_NE(out.find("(2 workers"), std::string::npos) << out;
  EXPECT_GT(e.back().auc, e.front().auc + 0.01) << out;
  EXPECT_LT(e.back().test_loss, e.front().test_loss) << out;
  EXPECT_GT(e.back().auc, 0.7) << out;
}

// Without a launcher: ps::init() makes a world of one with a server thread (no getenv in the example).
TEST(PsExample, CtrRunsAloneWithAColocatedServer) {
  auto [rc, out] = run("env -u RANK -u WORLD_SIZE -u DTRAIN_NUM_SERVERS -u DTRAIN_ROLE -u MASTER_ADDR -u MASTER_PORT " DTRAIN_BIN_DIR
                       "/example-ps-ctr 2");
  ASSERT_EQ(rc, 0) << out;
  auto e = epochs(out);
  ASSERT_EQ(e.size(), 2u) << out;
  EXPECT_NE(out.find("(1 workers"), std::string::npos) << out;
  EXPECT_LT(e.back().test_loss, e.front().test_loss) << out;
}

}  // namespace
