// The examples run unchanged alone (distribution off) and under dtrain-run, and learn.
#include <gtest/gtest.h>

#include "harness.h"

#include <cstdio>
#include <regex>
#include <string>

namespace {

// Every command here is bounded by `timeout 120`.
std::pair<int, std::string> run(const std::string& cmd) { return dtrain::test::runCommand(cmd, 120); }

double lastAccuracy(const std::string& out) {
  std::regex re("accuracy ([0-9.]+)");
  double acc = -1;
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) acc = std::stod((*it)[1]);
  return acc;
}

TEST(Examples, DdpTrainsAloneAndUnderTheLauncher) {
  auto [rc1, out1] = run(DTRAIN_BIN_DIR "/example-ddp");
  EXPECT_EQ(rc1, 0) << out1;
  EXPECT_NE(out1.find("distributed training disabled"), std::string::npos) << out1;
  EXPECT_NE(out1.find("(1 ranks)"), std::string::npos) << out1;
  EXPECT_GT(lastAccuracy(out1), 0.9) << out1;
  auto [rc2, out2] = run(DTRAIN_BIN_DIR "/dtrain-run --standalone --nproc-per-node 2 " DTRAIN_BIN_DIR "/example-ddp");
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("[rank 0]: epoch 4"), std::string::npos) << out2;
  EXPECT_NE(out2.find("(2 ranks)"), std::string::npos) << out2;
  EXPECT_GT(lastAccuracy(out2), 0.9) << out2;
}

TEST(Examples, AllreduceOnFourWorkers) {
  auto [rc, out] = run(DTRAIN_BIN_DIR "/dtrain-run --standalone --nproc-per-node 4 " DTRAIN_BIN_DIR "/example-allreduce");
  EXPECT_EQ(rc, 0) << out;
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(out.find("rank " + std::to_string(r) + " of 4 (shm): sum = 6 (expected 6)"), std::string::npos) << out;
}

}  // namespace
