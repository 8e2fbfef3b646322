// Work::then: dependent steps, where they run, and how errors reach the end of a chain.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

WorkPtr op(const std::string& what) { return std::make_shared<Work>(what, Clock::now() + std::chrono::seconds(30), 0); }

std::string errorOf(const WorkPtr& w) {
  try {
    w->wait(std::chrono::seconds(10));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(WorkThen, StepsRunInOrderAndTheChainEndsWithTheLast) {
  auto a = op("a"), b = op("b");
  std::vector<std::string> ran;
  auto chain = a->then([&] {
    ran.push_back("after a");
    return b->then([&] {
      ran.push_back("after b");
      return WorkPtr();
    });
  });
  EXPECT_FALSE(chain->isCompleted());
  a->finish();  // runs the first step here, on the completing thread
  EXPECT_EQ(ran, (std::vector<std::string>{"after a"}));
  EXPECT_FALSE(chain->isCompleted());
  b->finish();
  EXPECT_EQ(ran, (std::vector<std::string>{"after a", "after b"}));
  EXPECT_TRUE(chain->isCompleted());
  EXPECT_EQ(errorOf(chain), "");
  // then() on a completed Work runs the step at once.
  bool again = false;
  a->then([&] {
    again = true;
    return WorkPtr();
  })->wait();
  EXPECT_TRUE(again);
}

// Two threads may race to complete one op (a watchdog seeing its end, an issuer failing the group): the
// first result stays, and the callbacks run once.
TEST(WorkFinish, TheFirstResultWinsAndCallbacksRunOnce) {
  auto a = op("nccl allreduce seq=7");
  int calls = 0;
  a->onComplete([&] { ++calls; });
  a->finish(std::make_exception_ptr(TimeoutError("[rank 0] nccl allreduce seq=7 timed out")));
  a->finish();  // too late: must not turn the failure into success
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(errorOf(a), "[rank 0] nccl allreduce seq=7 timed out");
  auto b = op("b");
  b->finish();
  b->finish(std::make_exception_ptr(Error("late")));
  EXPECT_EQ(errorOf(b), "");
  // Racing threads: one success and one failure, many times; either may win, but only one does.
  for (int i = 0; i < 200; ++i) {
    auto w = op("w");
    std::atomic<int> n{0};
    w->onComplete([&] { ++n; });
    std::thread t1([&] { w->finish(); });
    std::thread t2([&] { w->finish(std::make_exception_ptr(Error("lost"))); });
    t1.join();
    t2.join();
    EXPECT_EQ(n.load(), 1);
    const std::string e = errorOf(w);
    EXPECT_TRUE(e.empty() || e == "lost") << e;
  }
}

TEST(WorkThen, ErrorsReachTheEndNamingTheOp) {
  // The first op failed: the next step never runs, the chain carries the op's error.
  auto a = op("allreduce seq=3");
  bool ran = false;
  auto chain = a->then([&] {
    ran = true;
    return WorkPtr();
  });
  a->finish(std::make_exception_ptr(TimeoutError("[rank 0] allreduce seq=3 timed out")));
  EXPECT_FALSE(ran);
  EXPECT_THROW(chain->wait(), TimeoutError);
  // A step throws: the chain's error names the op it followed.
  auto b = op("allgather seq=4");
  auto c2 = b->then([]() -> WorkPtr { throw std::runtime_error("boom"); });
  b->finish();
  EXPECT_EQ(errorOf(c2), "[rank 0] the continuation after allgather seq=4 failed: boom");
  // The next step fails: its error.
  auto c = op("c"), d = op("allgatherv seq=5");
  auto c3 = c->then([&] { return d; });
  c->finish();
  d->finish(std::make_exception_ptr(ProtocolError("[rank 0] allgatherv seq=5: collective mismatch")));
  EXPECT_EQ(errorOf(c3), "[rank 0] allgatherv seq=5: collective mismatch");
}

TEST(WorkThen, PostRunsTheStepElsewhere) {
  auto a = op("a");
  std::thread::id where;
  std::function<void()> queued;
  auto chain = a->then(
      [&] {
        where = std::this_thread::get_id();
        return WorkPtr();
      },
      [&](std::function<void()> task) { queued = std::move(task); });
  a->finish();
  ASSERT_TRUE(queued);  // posted, not run
  EXPECT_FALSE(chain->isCompleted());
  std::thread t([&] { queued(); });
  t.join();
  EXPECT_NE(where, std::this_thread::get_id());
  EXPECT_EQ(errorOf(chain), "");
}

}  // namespace
}  // namespace dtrain::comm
