// ProcessGroup::localStep (a step of one rank in the group's issue order) and attachment (state that lives
// as long as the group): what the torch layer's device paths build on (src/torch/device/).
#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/process_group.h"
#include "harness.h"

namespace dtrain::comm {
namespace {

using namespace std::chrono_literals;

GroupOptions quick() {
  GroupOptions o;
  o.timeout = std::chrono::seconds(10);
  return o;
}

// A local step runs after the ops issued before it and before those issued after it: here it fills the
// buffer that the next allreduce sends, after a slow allreduce that must not see it yet.
TEST(LocalStep, RunsInIssueOrderBetweenCollectives) {
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 2, quick());
    std::vector<float> first(1 << 16, 1.0f), second(1 << 16, 0.0f);
    auto a = pg->allreduce(first.data(), first.size(), DType::f32);
    auto step = pg->localStep("fill", [&] {
      EXPECT_TRUE(a->isCompleted());  // the allreduce issued before has ended
      std::fill(second.begin(), second.end(), static_cast<float>(rank + 1));
    });
    auto b = pg->allreduce(second.data(), second.size(), DType::f32);
    b->wait();
    EXPECT_TRUE(step->isCompleted());
    EXPECT_EQ(first[7], 2.0f);
    EXPECT_EQ(second[7], 3.0f);  // 1 + 2: both ranks filled it before sending
    EXPECT_EQ(second.back(), 3.0f);
  });
  test::expectAllOk(results);
}

// A step that throws breaks the group as abort() does: the peer's next collective fails naming the reason
// instead of waiting for its deadline.
TEST(LocalStep, AThrowingStepFailsTheGroupAndThePeer) {
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 2, quick());
    float x = 1;
    if (rank == 1) pg->localStep("stage", [] { throw Error("the copy to the host failed"); });
    const auto t0 = std::chrono::steady_clock::now();
    std::string err = test::errorOf([&] { pg->allreduce(&x, 1, DType::f32)->wait(); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s) << err;
    if (rank == 1) EXPECT_NE(err.find("the copy to the host failed"), std::string::npos) << err;
    else EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
  });
  test::expectAllOk(results);
}

TEST(LocalStep, AWorldOfOneRunsItInline) {
  auto pg = ProcessGroup::create(nullptr, 0, 1);
  bool ran = false;
  auto w = pg->localStep("inline", [&] { ran = true; });
  EXPECT_TRUE(ran);
  w->wait();
  EXPECT_EQ(w->describe(), "inline");
}

TEST(Attachment, MadeOnceAndKeptWithTheGroup) {
  auto pg = ProcessGroup::create(nullptr, 0, 1);
  std::atomic<int> made{0};
  auto make = [&] {
    ++made;
    return std::static_pointer_cast<void>(std::make_shared<int>(42));
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([&] { EXPECT_EQ(*std::static_pointer_cast<int>(pg->attachment("k", make)), 42); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(made.load(), 1);
  std::weak_ptr<void> kept = pg->attachment("k", make);
  pg->attachment("other", make);
  EXPECT_EQ(made.load(), 2);
  pg.reset();
  EXPECT_TRUE(kept.expired());  // released with the group
}

// Without a GPU (or without CUDA in the build) a NCCL communicator cannot be made: every rank fails at
// once with a reason, none waits for the others until its deadline.
TEST(NcclComm, WithoutAGpuEveryRankFailsPromptlyWithTheReason) {
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 2, quick());
    const auto t0 = std::chrono::steady_clock::now();
    std::string err = test::errorOf([&] { NcclComm::create(*pg, 0); });
    if (err == "no dtrain::Error") {  // said to the parent, which reports the test as skipped
      std::printf("dtrain-test: a GPU is here\n");
      return;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << err;
    EXPECT_NE(err.find("[rank " + std::to_string(rank) + "]"), std::string::npos) << err;
    // No usable GPU: CUDA's reason. One GPU for both ranks: NCCL's refusal, worded differently by each
    // version ("Duplicate GPU detected" up to 2.29, "Multiple Ranks are using the same GPU" in 2.30).
    if (ncclBuilt()) EXPECT_TRUE(err.find("CUDA") != std::string::npos || err.find("NCCL error") != std::string::npos) << err;
    else EXPECT_NE(err.find("built without CUDA"), std::string::npos) << err;
  });
  test::expectAllOk(results);
  for (const auto& r : results)
    if (r.output.find("dtrain-test: a GPU is here") != std::string::npos) GTEST_SKIP() << "a GPU is here: tests/gpu covers it";
}

TEST(NcclComm, BuildSaysWhatItHas) {
  if (ncclBuilt()) EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(ncclVersionText()[0]))) << ncclVersionText();
  else EXPECT_EQ(ncclVersionText(), "");
}

}  // namespace
}  // namespace dtrain::comm
