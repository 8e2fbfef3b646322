// The milnce command line end to end: gen-data, train on 2 workers under dtrain-run (retrieval before
// and after), resume, eval of the newest checkpoint; and bad input named clearly.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "harness.h"

namespace {

// Every command here is bounded by `timeout 240`.
std::pair<int, std::string> run(const std::string& cmd) { return dtrain::test::runCommand(cmd, 240); }

const std::string kMilnce = DTRAIN_BIN_DIR "/milnce";
const std::string kRun = DTRAIN_BIN_DIR "/dtrain-run";

TEST(MilNceCli, GenerateTrainResumeEvaluate) {
  dtrain::test::TempDir dir;
  const std::string data = dir.path() + "/data", out = dir.path() + "/run";
  auto [rc, gen] = run(kMilnce + " gen-data --out " + data + " --videos 200 --eval-videos 20 --seed 5");
  ASSERT_EQ(rc, 0) << gen;
  auto [rc1, first] = run(kRun + " --standalone --nproc-per-node 2 " + kMilnce + " train --data " + data + " --out " +
                          out + " --epochs 4 --stop-after 2 --batch 16");
  ASSERT_EQ(rc1, 0) << first;
  EXPECT_NE(first.find("[rank 0]:   before training"), std::string::npos) << first;
  EXPECT_NE(first.find("epoch 2/4"), std::string::npos) << first;
  EXPECT_EQ(first.find("epoch 3/4"), std::string::npos) << first;
  auto [rc2, second] = run(kRun + " --standalone --nproc-per-node 2 " + kMilnce + " train --data " + data + " --out " +
                           out + " --epochs 4 --batch 16 --resume");
  ASSERT_EQ(rc2, 0) << second;
  EXPECT_NE(second.find("resumed from epoch 2"), std::string::npos) << second;
  EXPECT_NE(second.find("after training (4 epochs)"), std::string::npos) << second;
  EXPECT_NE(second.find("chance"), std::string::npos) << second;
  // Four epochs of metrics, one JSON line each.
  std::ifstream m(out + "/metrics.jsonl");
  int lines = 0;
  for (std::string l; std::getline(m, l);) ++lines;
  EXPECT_EQ(lines, 4);
  auto [rc3, ev] = run(kMilnce + " eval --data " + data + " --run " + out);
  ASSERT_EQ(rc3, 0) << ev;
  EXPECT_NE(ev.find("epoch 4"), std::string::npos) << ev;
  EXPECT_TRUE(std::ifstream(out + "/eval-epoch4.json").good());
}

TEST(MilNceCli, BadInputIsNamed) {
  auto [rc, out] = run(kMilnce + " train --data /nonexistent/milnce-data --no-eval");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("/nonexistent/milnce-data"), std::string::npos) << out;
  auto [rc2, out2] = run(kMilnce + " gen-data --out /tmp/x --misalign 2");
  EXPECT_NE(rc2, 0) << out2;
  EXPECT_NE(out2.find("misalign"), std::string::npos) << out2;
}

}  // namespace
