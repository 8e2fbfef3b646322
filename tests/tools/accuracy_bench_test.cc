// dtrain-bench accuracy (the slow-link remedies' accuracy study, benches/accuracy.sh): every kind of
// configuration the study runs trains for one epoch on 2 ranks and learns (chance is 10%, the task's
// ceiling about 91%), the summary line carries what the script reads, the 16-bit hook compresses when
// told to always, and bad options are refused naming them.
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <utility>

#include "harness.h"

namespace {

std::pair<int, std::string> accuracy(const std::string& args, int epochs = 1) {
  return dtrain::test::runCommand(DTRAIN_BIN_DIR "/dtrain-run --standalone --nproc-per-node 2 " DTRAIN_BIN_DIR
                                  "/dtrain-bench accuracy --progress off --epochs " + std::to_string(epochs) + " " + args + " 2>&1",
                                  120);
}

double field(const std::string& out, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("dtrain-accuracy .*" + key + "=([0-9.]+)"))) return -1;
  return std::stod(m[1]);
}

TEST(AccuracyBench, EveryRemedyLearnsInAnEpoch) {
  double plain_bytes = 0;
  for (const char* args : {"", "--hook fp16:always", "--hook powersgd:2:64", "--hook topk:0.05", "--local-sgd 4",
                           "--optimizer lamb --batch 256 --scale-lr --warmup-epochs 0",
                           "--optimizer lars --batch 256 --scale-lr --warmup-epochs 0",
                           "--optimizer adam --target 0.5"}) {
    auto [rc, out] = accuracy(args);
    ASSERT_EQ(rc, 0) << args << ": " << out;
    EXPECT_GT(field(out, "final_acc"), 0.6) << args << ": " << out;
    EXPECT_NE(out.find("epoch=1 samples=65536"), std::string::npos) << args << ": " << out;
    const double bytes = field(out, "bytes_per_step");
    if (*args == 0) {
      plain_bytes = bytes;
    } else if (std::string(args) == "--hook fp16:always") {
      EXPECT_LT(bytes, 0.6 * plain_bytes) << out;
    }
    if (std::string(args).find("--target") != std::string::npos) {
      EXPECT_GE(field(out, "time_to_target_s"), 0) << out;
    }
  }
  EXPECT_GT(plain_bytes, 1e6) << "a 284k-parameter model's gradients each step";
}

TEST(AccuracyBench, RefusesBadOptionsNamingThem) {
  for (auto [args, want] : {std::pair<const char*, const char*>{"--optimizer sgdd", "--optimizer"},
                            {"--hook fp16:2", "--hook 'fp16:2'"},
                            {"--local-sgd 4 --hook fp16", "choose one"},
                            {"--batch 100000", "is more than the"},
                            {"--scale-lr", "--warmup-epochs (1) must be fewer than --epochs (1)"}}) {
    auto [rc, out] = accuracy(args);
    EXPECT_NE(rc, 0) << args << ": " << out;
    EXPECT_NE(out.find(want), std::string::npos) << args << ": " << out;
  }
}

}  // namespace
