// The examples run unchanged alone (distribution off) and under dtrain-run, and learn.
#include <gtest/gtest.h>

#include "harness.h"

#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <utility>
#include <vector>

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

// A custom Dataset through a DataLoader with dtrain::DistributedLoaderSampler, a BatchNorm model: it
// learns, each rank reads its share (32 of 94 batches on 3 ranks), every rank evaluates the same
// model with the same BatchNorm statistics (identical accuracy lines), and setEpoch is not forgotten.
// The slow-links options (issue 12): compression, LAMB with the scaling rule, local SGD still learn on
// 2 ranks; bad values are refused naming the option.
TEST(Examples, DdpSlowLinkOptions) {
  const std::string launch = DTRAIN_BIN_DIR "/dtrain-run --standalone --nproc-per-node 2 " DTRAIN_BIN_DIR "/example-ddp ";
  for (const char* args : {"--comm-hook powersgd:2:10", "--comm-hook topk:0.1", "--optimizer lamb --batch 128 --scale-lr",
                           "--optimizer lars", "--local-sgd 4"}) {
    auto [rc, out] = run(launch + args);
    EXPECT_EQ(rc, 0) << args << ": " << out;
    EXPECT_GT(lastAccuracy(out), 0.9) << args << ": " << out;
  }
  for (const auto& [args, what] : std::vector<std::pair<std::string, std::string>>{
           {"--optimizer adamw", "--optimizer 'adamw'"}, {"--comm-hook powersgd:0", "--comm-hook 'powersgd:0'"},
           {"--local-sgd 4 --comm-hook fp16", "choose one"}, {"--batch", "--batch needs a value"}}) {
    auto [rc, out] = run(DTRAIN_BIN_DIR "/example-ddp " + args);
    EXPECT_NE(rc, 0) << args << ": " << out;
    EXPECT_NE(out.find(what), std::string::npos) << args << ": " << out;
  }
}

TEST(Examples, DdpDataLoaderTrainsAloneAndUnderTheLauncher) {
  auto [rc1, out1] = run(DTRAIN_BIN_DIR "/example-ddp-dataloader");
  EXPECT_EQ(rc1, 0) << out1;
  EXPECT_NE(out1.find("(94 steps, 1 ranks)"), std::string::npos) << out1;
  EXPECT_GT(lastAccuracy(out1), 0.9) << out1;
  auto [rc3, out3] =
      run(DTRAIN_BIN_DIR "/dtrain-run --standalone --nproc-per-node 3 " DTRAIN_BIN_DIR "/example-ddp-dataloader");
  EXPECT_EQ(rc3, 0) << out3;
  EXPECT_GT(lastAccuracy(out3), 0.9) << out3;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out3, m, std::regex("\\[rank 0\\]: epoch 7 .*accuracy ([0-9.]+)  \\(32 steps, 3 ranks\\)")))
      << out3;
  for (int r = 1; r < 3; ++r)
    EXPECT_NE(out3.find("[rank " + std::to_string(r) + "]: epoch 7 "), std::string::npos) << out3;
  std::regex acc7("\\[rank [0-9]\\]: epoch 7 .*accuracy ([0-9.]+)");
  for (std::sregex_iterator it(out3.begin(), out3.end(), acc7), end; it != end; ++it)
    EXPECT_EQ((*it)[1], m[1]) << "ranks disagree about the model:\n" << out3;
  EXPECT_EQ(out3.find("setEpoch"), std::string::npos) << out3;
}

TEST(Examples, AllreduceOnFourWorkers) {
  auto [rc, out] = run(DTRAIN_BIN_DIR "/dtrain-run --standalone --nproc-per-node 4 " DTRAIN_BIN_DIR "/example-allreduce");
  EXPECT_EQ(rc, 0) << out;
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(out.find("rank " + std::to_string(r) + " of 4 (shm): sum = 6 (expected 6)"), std::string::npos) << out;
}

// dtrain-run --job-secret: the workers get a fresh secret in their environment, never on a command line
// (each worker scans every process's), and the store and the tcp links authenticate with it.
TEST(Examples, AllreduceWithAJobSecretThatNoCommandLineShows) {
  dtrain::test::TempDir dir;
  const std::string script = dir.path() + "/worker.sh";
  std::ofstream(script) << "[ ${#DTRAIN_SECRET} = 64 ] || { echo no secret; exit 9; }\n"
                           "for f in /proc/[0-9]*/cmdline; do\n"
                           "  c=$(tr '\\0' ' ' < $f 2>/dev/null)\n"
                           "  if [[ $c == *\"$DTRAIN_SECRET\"* ]]; then echo \"secret on the command line of $f\"; exit 8; fi\n"
                           "done\n"
                           "exec " DTRAIN_BIN_DIR "/example-allreduce\n";
  auto [rc, out] = run("env DTRAIN_TRANSPORT=tcp " DTRAIN_BIN_DIR "/dtrain-run --standalone --job-secret --nproc-per-node 2 "
                       "bash " + script);
  EXPECT_EQ(rc, 0) << out;
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(out.find("rank " + std::to_string(r) + " of 2 (tcp): sum = 1 (expected 1)"), std::string::npos) << out;
  EXPECT_FALSE(std::regex_search(out, std::regex("[0-9a-f]{64}"))) << "a secret in the output: " << out;
}

}  // namespace
