// The NCCL communicator's host-side logic (src/comm/nccl/nccl_comm.cc) driven through a fake of the CUDA
// and NCCL calls (src/comm/nccl/device_api.h): the watchdog, the one failure path (abort first, then fail
// the pending ops), teardown, the issue order, the caller's device and what each call launches (its
// collective, buffers, count, dtype, reduce op and root; a root or device out of range is refused). No
// GPU needed; CI runs these under ASan + UBSan and ThreadSanitizer too (scripts/sanitize.sh).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "comm/nccl/device_api.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/process_group.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using comm::DType;
using comm::GroupOptions;
using comm::NcclComm;
using comm::ProcessGroup;
using comm::ReduceOp;
using comm::nccl::Handle;
using comm::nccl::Status;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

thread_local int t_device = 0;  // the fake's current device, per thread (as CUDA's)

// A fake of CUDA and NCCL. Ops "run" on the communicator's stream: their end events fire at once, or
// only when the test says (hang), or fail. It records what a correct caller must never do: use a
// communicator after its abort, be inside a communicator call while another thread aborts it, or issue
// from two threads at once.
class FakeApi : public comm::nccl::DeviceApi {
 public:
  enum class Ops { finish, hang, gpu_error };
  std::atomic<Ops> ops{Ops::finish};
  std::atomic<int> abort_polls{0};   // abort answers in_progress for this many polls
  std::atomic<int> launch_polls{0};  // each launch answers in_progress for this many polls
  std::atomic<int> finalize_polls{0};
  std::atomic<bool> async_error{false};
  std::atomic<int> launch_sleep_us{0};  // each launch takes this long (two issuers overlap if unserialised)
  // What happened.
  std::atomic<int> launches{0}, aborts{0}, abort_polls_seen{0}, finalizes{0}, destroys{0};
  std::atomic<int> misuse{0};  // a call on an aborted or destroyed communicator
  std::atomic<int> inside_at_abort{0}, overlapping_issues{0};
  std::atomic<bool> abort_finished{false};
  std::atomic<int> events_live{0};

  Status deviceCount(int* n) override {
    *n = 4;
    return {};
  }
  Status currentDevice(int* d) override {
    *d = t_device;
    return {};
  }
  Status setDevice(int d) override {
    t_device = d;
    return {};
  }
  Status createStream(Handle* s) override {
    *s = &comm_stream_;
    return {};
  }
  Status destroyStream(Handle) override { return {}; }
  Status createEvent(Handle* e) override {
    *e = new Event;
    ++events_live;
    return {};
  }
  Status recordEvent(Handle e, Handle stream) override {
    auto* ev = static_cast<Event*>(e);
    if (stream != &comm_stream_) {
      ev->state = kFired;  // the caller's stream: nothing queued on it in these tests
      return {};
    }
    std::lock_guard<std::mutex> g(mu_);
    ev->state = ops == Ops::finish ? kFired : ops == Ops::gpu_error ? kError : kPending;
    if (ev->state == kPending) hung_.insert(ev);
    return {};
  }
  Status queryEvent(Handle e) override {
    int s = static_cast<Event*>(e)->state.load();
    if (s == kFired) return {};
    if (s == kError) return Status::failure("CUDA error 700 (cudaErrorIllegalAddress: an illegal memory access was encountered)");
    return {Status::not_ready, ""};
  }
  Status destroyEvent(Handle e) override {
    auto* ev = static_cast<Event*>(e);
    {
      std::lock_guard<std::mutex> g(mu_);
      hung_.erase(ev);
    }
    delete ev;
    --events_live;
    return {};
  }
  Status streamWaitEvent(Handle, Handle) override { return {}; }
  Status uniqueId(comm::nccl::UniqueId* id) override {
    id->bytes[0] = 42;
    return {};
  }
  Status initComm(Handle* c, int, const comm::nccl::UniqueId& id, int) override {
    EXPECT_EQ(id.bytes[0], 42) << "rank 0's id did not reach this rank";
    *c = &comm_;
    comm_.state = kLive;
    return {};
  }
  Status asyncError(Handle c) override {
    Inside in(*this, c);
    if (comm_.state == kAborting) {
      ++abort_polls_seen;
      if (abort_polls.fetch_sub(1) > 1) return {Status::in_progress, ""};
      comm_.state = kGone;
      abort_finished = true;
      return {};
    }
    if (comm_.state == kFinalizing) {
      if (finalize_polls.fetch_sub(1) > 1) return {Status::in_progress, ""};
      comm_.state = kFinalized;
      return {};
    }
    if (pending_launch_polls_ > 0) {
      --pending_launch_polls_;
      return {Status::in_progress, ""};
    }
    if (async_error) return Status::failure("NCCL error 6 (remote process exited or there was a network error): "
                                            "socket closed by rank 1");
    return {};
  }
  Status launch(Handle c, Handle, const comm::nccl::Launch& call) override {
    Inside in(*this, c);
    {
      std::lock_guard<std::mutex> g(mu_);
      launched_.push_back(call);
    }
    if (issuing_.exchange(true)) ++overlapping_issues;
    if (launch_sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(launch_sleep_us.load()));
    issuing_ = false;
    ++launches;
    pending_launch_polls_ = launch_polls.load();
    return pending_launch_polls_ > 0 ? Status{Status::in_progress, ""} : Status{};
  }
  Status abort(Handle c) override {
    if (inside_ > 0) ++inside_at_abort;
    if (comm_.state == kGone) ++misuse;
    ++aborts;
    if (abort_polls > 0) {
      comm_.state = kAborting;
      return {Status::in_progress, ""};
    }
    comm_.state = kGone;
    abort_finished = true;
    return {};
  }
  Status finalize(Handle c) override {
    Inside in(*this, c);
    ++finalizes;
    if (finalize_polls > 0) {
      comm_.state = kFinalizing;
      return {Status::in_progress, ""};
    }
    comm_.state = kFinalized;
    return {};
  }
  Status destroy(Handle c) override {
    if (c != &comm_ || comm_.state == kGone) ++misuse;
    comm_.state = kGone;
    ++destroys;
    return {};
  }

  // What was launched, in order.
  std::vector<comm::nccl::Launch> launched() {
    std::lock_guard<std::mutex> g(mu_);
    return launched_;
  }

  // Fires the end events of the ops that hang.
  void fireAll() {
    std::lock_guard<std::mutex> g(mu_);
    for (Event* e : hung_) e->state = kFired;
    hung_.clear();
  }

 private:
  enum { kPending, kFired, kError };
  enum { kLive, kAborting, kFinalizing, kFinalized, kGone };
  struct Event {
    std::atomic<int> state{kPending};
  };
  struct Comm {
    std::atomic<int> state{kLive};
  };
  // Counts the threads inside a call on the communicator; flags a call on one that is gone.
  struct Inside {
    Inside(FakeApi& f, Handle c) : f_(f) {
      ++f_.inside_;
      if (c != &f_.comm_ || f_.comm_.state == kGone) ++f_.misuse;
    }
    ~Inside() { --f_.inside_; }
    FakeApi& f_;
  };
  int comm_stream_ = 0;
  Comm comm_;
  std::atomic<int> inside_{0};
  std::atomic<bool> issuing_{false};
  std::atomic<int> pending_launch_polls_{0};
  std::mutex mu_;
  std::set<Event*> hung_;
  std::vector<comm::nccl::Launch> launched_;
};

GroupOptions options(std::chrono::milliseconds timeout, bool check = false) {
  GroupOptions o;
  o.timeout = timeout;
  o.check_fingerprints = check;
  o.name = "world";
  return o;
}

// Waits (bounded) until `n` reaches `target`: a Work's callbacks run on the completing thread just after
// wait() may have returned.
bool reaches(const std::atomic<int>& n, int target) {
  const auto until = Clock::now() + scaled(std::chrono::seconds(10));
  while (n.load() < target) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

std::string errorOf(const comm::WorkPtr& w) {
  try {
    w->wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// After a failure and the communicator's destruction: aborted exactly once, never used afterwards, nobody
// inside NCCL during the abort, no event left.
void expectOneCleanAbort(const FakeApi& api) {
  EXPECT_EQ(api.aborts.load(), 1) << "aborts";
  EXPECT_EQ(api.misuse.load(), 0) << "a call on the communicator after its abort";
  EXPECT_EQ(api.inside_at_abort.load(), 0) << "a thread was inside NCCL while it was aborted";
  EXPECT_EQ(api.events_live.load(), 0) << "events leaked";
}

struct OneRank {
  explicit OneRank(std::chrono::milliseconds timeout) : pg(ProcessGroup::create(server.client(), 0, 1, options(timeout))) {}
  StoreServer server;
  std::shared_ptr<ProcessGroup> pg;
  std::vector<float> buf = std::vector<float>(16, 1.0f);
};

TEST(NcclFake, OpsCompleteInOrderAndTheCallersDeviceIsKept) {
  OneRank w(5s);
  auto api = std::make_shared<FakeApi>();
  t_device = 3;  // the caller works on cuda:3; the communicator is on cuda:1
  {
    auto nccl = comm::nccl::createComm(*w.pg, 1, api);
    EXPECT_EQ(t_device, 3) << "creating the communicator changed the caller's device";
    for (int i = 0; i < 20; ++i) {
      auto work = nccl->allreduce(w.buf.data(), w.buf.data(), w.buf.size(), DType::f32, ReduceOp::sum, nullptr);
      EXPECT_EQ(t_device, 3) << "op " << i << " changed the caller's device";
      EXPECT_EQ(errorOf(work), "");
    }
  }
  EXPECT_EQ(api->launches.load(), 20);
  EXPECT_EQ(api->aborts.load(), 0);
  EXPECT_EQ(api->finalizes.load(), 1) << "an intact communicator is finalized, then destroyed";
  EXPECT_EQ(api->destroys.load(), 1);
  EXPECT_EQ(api->misuse.load(), 0);
  EXPECT_EQ(api->events_live.load(), 0) << "events leaked";
  t_device = 0;
}

// What each call hands NCCL is what it was asked: the collective, the buffers, the count, the dtype, every
// reduce op and the root.
TEST(NcclFake, EachCallLaunchesWhatItWasAsked) {
  OneRank w(5s);
  auto api = std::make_shared<FakeApi>();
  auto nccl = comm::nccl::createComm(*w.pg, 0, api);
  std::vector<double> in(12, 1.0), out(12);
  using comm::nccl::Call;
  auto expectLast = [&](Call call, const void* i, void* o, size_t count, DType t, ReduceOp op,
                        const std::string& what) {
    const auto all = api->launched();
    ASSERT_FALSE(all.empty()) << what;
    const comm::nccl::Launch& l = all.back();
    EXPECT_EQ(l.call, call) << what;
    EXPECT_EQ(l.in, i) << what;
    EXPECT_EQ(l.out, o) << what;
    EXPECT_EQ(l.count, count) << what;
    EXPECT_EQ(l.dtype, t) << what;
    if (call == Call::allreduce || call == Call::reduce_scatter) {
      EXPECT_EQ(l.op, op) << what;
    }
  };
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::prod}) {
    const std::string name = comm::reduceOpName(op);
    EXPECT_EQ(errorOf(nccl->allreduce(in.data(), out.data(), 12, DType::f64, op, nullptr)), "");
    expectLast(Call::allreduce, in.data(), out.data(), 12, DType::f64, op, "allreduce " + name);
    EXPECT_EQ(errorOf(nccl->reduceScatter(in.data(), out.data(), 12, DType::f32, op, nullptr)), "");
    expectLast(Call::reduce_scatter, in.data(), out.data(), 12, DType::f32, op, "reduceScatter " + name);
  }
  EXPECT_EQ(errorOf(nccl->allgather(in.data(), out.data(), 5, DType::i32, nullptr)), "");
  expectLast(Call::allgather, in.data(), out.data(), 5, DType::i32, ReduceOp::sum, "allgather");
  EXPECT_EQ(errorOf(nccl->broadcast(out.data(), 7, DType::bf16, 0, nullptr)), "");
  expectLast(Call::broadcast, out.data(), out.data(), 7, DType::bf16, ReduceOp::sum, "broadcast");
  EXPECT_EQ(api->launched().back().root, 0);
  EXPECT_EQ(api->launches.load(), 12);
}

// A broadcast's root must be a rank of the group: refused before anything is launched, naming it, and the
// communicator stays usable. So must the device: cuda:N of N visible does not exist.
TEST(NcclFake, ARootOrADeviceOutsideTheRangeIsRefused) {
  OneRank w(5s);
  auto api = std::make_shared<FakeApi>();
  auto nccl = comm::nccl::createComm(*w.pg, 0, api);
  std::vector<float> buf(4);
  for (int root : {1, -1}) {
    const std::string e = test::errorOf([&] { nccl->broadcast(buf.data(), 4, DType::f32, root, nullptr); });
    EXPECT_NE(e.find(fmt::format("nccl broadcast: root {} outside the group of 1", root)), std::string::npos) << e;
  }
  EXPECT_EQ(api->launches.load(), 0);
  EXPECT_EQ(errorOf(nccl->broadcast(buf.data(), 4, DType::f32, 0, nullptr)), "");
  auto other = std::make_shared<FakeApi>();
  const std::string e = test::errorOf([&] { comm::nccl::createComm(*w.pg, 4, other); });
  EXPECT_NE(e.find("cuda:4 does not exist (4 visible)"), std::string::npos) << e;
  EXPECT_EQ(other->aborts.load() + other->launches.load(), 0);
}

// An op whose end never comes: the deadline error names the op, its sequence number, the GPU and the
// group; the communicator is aborted before the op fails, and later ops fail at once with the same error.
TEST(NcclFake, AnEventThatNeverFiresIsATimeoutNamingTheOp) {
  OneRank w(300ms);
  auto api = std::make_shared<FakeApi>();
  api->abort_polls = 5;  // the abort stays in progress for 5 polls
  auto nccl = comm::nccl::createComm(*w.pg, 0, api);
  nccl->allreduce(w.buf.data(), w.buf.data(), 16, DType::f32, ReduceOp::sum, nullptr)->wait();
  api->ops = FakeApi::Ops::hang;
  auto work = nccl->allreduce(w.buf.data(), w.buf.data(), 16, DType::f32, ReduceOp::sum, nullptr);
  std::atomic<int> called{0}, aborted_first{0};
  work->onComplete([&] {
    aborted_first = api->abort_finished.load() ? 1 : 0;
    ++called;
  });
  const auto t0 = Clock::now();
  std::string err;
  try {
    work->wait();
  } catch (const TimeoutError& e) {
    err = e.what();
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_NE(err.find("nccl allreduce seq=1 f32 x 16 sum timed out after 0.3 s"), std::string::npos) << err;
  EXPECT_NE(err.find("[rank 0] on cuda:0"), std::string::npos) << err;
  EXPECT_NE(err.find("group 'world' of 1 ranks"), std::string::npos) << err;
  EXPECT_NE(err.find("the communicator was aborted"), std::string::npos) << err;
  EXPECT_LT(secs, 5 * timeScale()) << "the deadline was 0.3 s";
  ASSERT_TRUE(reaches(called, 1)) << "the Work's callback never ran";
  EXPECT_EQ(aborted_first.load(), 1) << "the op failed before the abort had finished";
  EXPECT_EQ(api->aborts.load(), 1);
  EXPECT_GE(api->abort_polls_seen.load(), 5) << "the abort's in-progress answer was not polled";
  api->ops = FakeApi::Ops::finish;
  auto later = nccl->allgather(w.buf.data(), w.buf.data(), 16, DType::f32, nullptr);
  EXPECT_EQ(errorOf(later), err) << "an op after the failure must fail with the first error";
  EXPECT_EQ(api->launches.load(), 2) << "nothing may be launched on an aborted communicator";
  nccl.reset();
  expectOneCleanAbort(*api);
  EXPECT_EQ(api->finalizes.load(), 0) << "an aborted communicator was finalized";
  EXPECT_EQ(api->destroys.load(), 0) << "an aborted communicator was destroyed";
}

// NCCL reports an asynchronous error (a peer's socket closed): every pending op fails with NCCL's words,
// after the abort.
TEST(NcclFake, AnAsyncErrorFailsEveryPendingOpAfterTheAbort) {
  OneRank w(30s);
  auto api = std::make_shared<FakeApi>();
  auto nccl = comm::nccl::createComm(*w.pg, 0, api);
  api->ops = FakeApi::Ops::hang;
  std::vector<comm::WorkPtr> works;
  std::atomic<int> failed_before_abort{0}, called{0};
  for (int i = 0; i < 3; ++i) {
    works.push_back(nccl->broadcast(w.buf.data(), 16, DType::f32, 0, nullptr));
    works.back()->onComplete([&] {
      if (!api->abort_finished) ++failed_before_abort;
      ++called;
    });
  }
  api->async_error = true;
  for (auto& wk : works) {
    const std::string e = errorOf(wk);
    EXPECT_NE(e.find("NCCL's asynchronous error: NCCL error 6 (remote process exited or there was a network error)"),
              std::string::npos) << e;
    EXPECT_NE(e.find("nccl broadcast seq=0 f32 x 16 root 0"), std::string::npos) << "names the op it saw fail: " << e;
  }
  ASSERT_TRUE(reaches(called, 3)) << "the Works' callbacks did not all run";
  EXPECT_EQ(failed_before_abort.load(), 0);
  nccl.reset();
  expectOneCleanAbort(*api);
}

TEST(NcclFake, AGpuErrorFailsTheOpNamingCudasError) {
  OneRank w(30s);
  auto api = std::make_shared<FakeApi>();
  auto nccl = comm::nccl::createComm(*w.pg, 0, api);
  api->ops = FakeApi::Ops::gpu_error;
  const std::string e = errorOf(nccl->reduceScatter(w.buf.data(), w.buf.data(), 16, DType::f32, ReduceOp::max, nullptr));
  EXPECT_NE(e.find("nccl reduce_scatter seq=0 f32 x 16 max failed on the GPU: CUDA error 700 (cudaErrorIllegalAddress"),
            std::string::npos) << e;
  EXPECT_EQ(api->aborts.load(), 1);
}

// The launch itself stays in progress (NCCL's non-blocking mode) while an earlier op times out and the
// watchdog aborts: the launch stops polling the aborted communicator and fails with the first error.
TEST(NcclFake, AnAbortDuringALaunchEndsTheLaunch) {
  OneRank w(300ms);
  auto api = std::make_shared<FakeApi>();
  auto nccl = comm::nccl::createComm(*w.pg, 0, api);
  api->ops = FakeApi::Ops::hang;
  auto first = nccl->allreduce(w.buf.data(), w.buf.data(), 16, DType::f32, ReduceOp::sum, nullptr);
  api->launch_polls = 1 << 30;  // the next launch never settles by itself
  auto second = nccl->allreduce(w.buf.data(), w.buf.data(), 8, DType::f32, ReduceOp::sum, nullptr);
  // Either op may reach its deadline first (their deadlines are microseconds apart): both fail with it.
  const std::string e1 = errorOf(first), e2 = errorOf(second);
  EXPECT_NE(e1.find("timed out after 0.3 s"), std::string::npos) << e1;
  EXPECT_EQ(e2, e1);
  nccl.reset();
  expectOneCleanAbort(*api);
}

// Destroying the communicator with ops in flight: it waits for them (they finish), then finalizes;
// with ops that never finish, it returns after their deadline, having aborted.
TEST(NcclFake, DestructionWithOpsPendingIsBounded) {
  OneRank w(400ms);
  {
    auto api = std::make_shared<FakeApi>();
    api->finalize_polls = 3;
    auto nccl = comm::nccl::createComm(*w.pg, 0, api);
    api->ops = FakeApi::Ops::hang;
    auto work = nccl->allreduce(w.buf.data(), w.buf.data(), 16, DType::f32, ReduceOp::sum, nullptr);
    std::thread later([&] {
      std::this_thread::sleep_for(50ms);
      api->fireAll();
    });
    nccl.reset();
    later.join();
    EXPECT_EQ(errorOf(work), "");
    EXPECT_EQ(api->finalizes.load(), 1);
    EXPECT_EQ(api->destroys.load(), 1);
    EXPECT_EQ(api->aborts.load(), 0);
  }
  {
    auto api = std::make_shared<FakeApi>();
    auto nccl = comm::nccl::createComm(*w.pg, 0, api);
    api->ops = FakeApi::Ops::hang;
    auto work = nccl->allreduce(w.buf.data(), w.buf.data(), 16, DType::f32, ReduceOp::sum, nullptr);
    const auto t0 = Clock::now();
    nccl.reset();
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10 * timeScale());
    EXPECT_NE(errorOf(work).find("timed out"), std::string::npos);
    expectOneCleanAbort(*api);
    EXPECT_EQ(api->destroys.load(), 0);
  }
}

// Two threads on each of two ranks issue the same ops on one communicator, with the fingerprint check on:
// each op is issued whole (sequence number, check, launch), so the ranks' checks pair the same ops and
// all of them pass; no two launches overlap.
TEST(NcclFake, TwoThreadsIssuingAreSerialised) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 2, options(20s, /*check=*/true));
    auto api = std::make_shared<FakeApi>();
    api->launch_sleep_us = 100;
    auto nccl = comm::nccl::createComm(*pg, rank, api);
    std::vector<float> a(16), b(16);
    auto issue = [&](std::vector<float>* buf) {
      for (int i = 0; i < 40; ++i) {
        const std::string e = errorOf(nccl->allreduce(buf->data(), buf->data(), 16, DType::f32, ReduceOp::sum, nullptr));
        if (!e.empty()) {
          ADD_FAILURE() << "rank " << rank << " op " << i << ": " << e;
          return;
        }
      }
    };
    std::thread t1(issue, &a), t2(issue, &b);
    t1.join();
    t2.join();
    EXPECT_EQ(api->launches.load(), 80);
    EXPECT_EQ(api->overlapping_issues.load(), 0) << "two threads were launching at once";
  }, 60s);
  expectAllOk(results);
}

// With the fingerprint check (DTRAIN_DEBUG=detail) on two ranks: a mismatch fails both ranks naming both
// calls, and a peer that died is named by the host group; either way the communicator is aborted.
TEST(NcclFake, AMismatchAndADeadPeerAreNamedWithTheCheckOn) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 2, options(5s, /*check=*/true));
    auto api = std::make_shared<FakeApi>();
    auto nccl = comm::nccl::createComm(*pg, rank, api);
    std::vector<float> buf(32, 1.0f);
    nccl->allreduce(buf.data(), buf.data(), 16, DType::f32, ReduceOp::sum, nullptr)->wait();
    const size_t n = rank == 0 ? 16 : 32;  // the second op disagrees
    const std::string e = errorOf(nccl->allreduce(buf.data(), buf.data(), n, DType::f32, ReduceOp::sum, nullptr));
    EXPECT_NE(e.find("collective mismatch on the NCCL communicator"), std::string::npos) << e;
    EXPECT_NE(e.find("nccl allreduce seq=1 f32 x 16 sum"), std::string::npos) << e;
    EXPECT_NE(e.find("nccl allreduce seq=1 f32 x 32 sum"), std::string::npos) << e;
    EXPECT_EQ(api->aborts.load(), 1);
    EXPECT_EQ(api->launches.load(), 1) << "the mismatched op was launched";
  });
  expectAllOk(results);

  StoreServer server2;
  results = runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(server2.client(), rank, 2, options(5s, /*check=*/true));
    auto api = std::make_shared<FakeApi>();
    auto nccl = comm::nccl::createComm(*pg, rank, api);
    std::vector<float> buf(16, 1.0f);
    nccl->allreduce(buf.data(), buf.data(), 16, DType::f32, ReduceOp::sum, nullptr)->wait();
    if (rank == 1) _exit(0);  // dies between two ops
    const std::string e = errorOf(nccl->allreduce(buf.data(), buf.data(), 16, DType::f32, ReduceOp::sum, nullptr));
    EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
    EXPECT_EQ(api->aborts.load(), 1);
    EXPECT_EQ(api->launches.load(), 1);
  });
  expectAllOk(results);
}

// Rank 1 cannot use its GPU (it asks for cuda:7 of 4): both ranks fail at creation, and nobody waits for
// rank 1 in the id's broadcast.
TEST(NcclFake, ARankThatCannotTakePartFailsEveryRankAtCreation) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 2, options(5s));
    auto api = std::make_shared<FakeApi>();
    try {
      comm::nccl::createComm(*pg, rank == 1 ? 7 : 0, api);
      ADD_FAILURE() << "rank " << rank << ": created a communicator";
    } catch (const Error& e) {
      const std::string m = e.what();
      if (rank == 1) EXPECT_NE(m.find("cuda:7 does not exist (4 visible)"), std::string::npos) << m;
      else EXPECT_NE(m.find("rank(s) 1 could not set up CUDA or NCCL"), std::string::npos) << m;
    }
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
