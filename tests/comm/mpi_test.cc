// The MPI transport (DTRAIN_TRANSPORT=mpi), under mpirun: every rank a process of the job, none forked.
// Each test here relaunches a test binary under mpirun (--oversubscribe: more ranks than cores) with
// DTRAIN_TEST_MPI_DIR set, which makes the harness run ranks in place (harness.h, mpiRunner) and share
// stores through files; the relaunched test bodies check each rank's result, and the parent checks
// that every process passed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <thread>

#include "comm/transport/transport.h"
#include "comm_test_util.h"
#include "dtrain/comm/error.h"

namespace dtrain::test {
namespace {

using comm::GroupOptions;
using comm::ProcessGroup;

std::string selfExe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Runs `exe args` on `np` processes under mpirun; returns its exit status and output.
std::pair<int, std::string> mpirun(int np, const std::string& exe, const std::string& args, int timeout_s,
                                   const std::string& env = "") {
  TempDir dir;
  const std::string script = dir.path() + "/run.sh";
  std::ofstream(script) << fmt::format(
      "cd {0} && GTEST_COLOR=no DTRAIN_TEST_MPI_DIR={0} {1} exec mpirun --allow-run-as-root --oversubscribe --bind-to none "
      "-x DTRAIN_TEST_MPI_DIR -x GTEST_COLOR -x OMP_NUM_THREADS=1 -np {2} {3} {4} 2>&1\n",
      dir.path(), env, np, exe, args);
  return runCommand("bash " + script, timeout_s);
}

// In the parent: relaunches this test alone under mpirun on np processes and expects every one to pass.
void relaunch(int np) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  auto [rc, out] = mpirun(np, selfExe(), fmt::format("--gtest_filter={}.{}", info->test_suite_name(), info->name()),
                          120);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(count(out, "[  PASSED  ] 1 test."), np) << out;
}

GroupOptions mpiOptions(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  GroupOptions o;
  o.transport = "mpi";
  o.timeout = timeout;
  o.segment_bytes = 4096;
  return o;
}

// Runs the `mpi_*` cases of a parameterised suite of test binary `exe` under mpirun on as many processes
// as its largest world (each process must take part in some test: MPI is initialised by the first group)
// and expects every process to pass at least `at_least` of them, the largest world included.
void passesUnderMpirun(const std::string& exe, const std::string& filter, int at_least, int largest) {
  auto [rc, out] = mpirun(largest, DTRAIN_BIN_DIR "/" + exe, "--gtest_filter='" + filter + "'", 280);
  EXPECT_EQ(rc, 0) << out;
  // Each process prints its own summary; nothing failed.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(\[  PASSED  \] (\d+) tests)"))) << out;
  EXPECT_GE(std::stoi(m[1]), at_least) << out;
  EXPECT_EQ(count(out, "[  PASSED  ] " + m[1].str() + " tests."), largest) << out;
  EXPECT_EQ(count(out, "[  FAILED  ]"), 0) << out;
  EXPECT_GT(count(out, fmt::format("mpi_world{} (", largest)), 0) << out;
}

// Every test of the collectives sweep (every collective x dtype x count x world 1..5) on the mpi transport.
TEST(Mpi, TheCollectivesSweepPasses) {
  passesUnderMpirun("collectives_test", "Sweep/Collectives.*/mpi_*", 45, 5);
}

// The mismatch sweep (mismatch_test: every collective and algorithm with one rank's call different) at 3,
// 4 and 5 ranks: every rank fails naming both calls, and nothing crashes. Many failed groups in one job
// used to crash a process inside OpenMPI (a failed run's send read after the caller freed its buffer)
// or break the next group's matching (a late message into a freed communicator's reused id).
TEST(Mpi, TheMismatchSweepPassesAt3To5Ranks) {
  for (int w = 3; w <= 5; ++w) {
    auto [rc, out] = mpirun(w, DTRAIN_BIN_DIR "/mismatch_test",
                            fmt::format("--gtest_filter='Transports/Mismatch.*/mpi_world{}'", w), 120);
    EXPECT_EQ(rc, 0) << "world " << w << ":\n" << out;
    EXPECT_EQ(count(out, "[  PASSED  ] 1 test."), w) << "world " << w << ":\n" << out;
    EXPECT_EQ(count(out, "[  FAILED  ]"), 0) << "world " << w << ":\n" << out;
  }
}

// A rank that never calls the collective: the others get a TimeoutError after the group's timeout,
// naming it, not a hang. Rank 1 waits for rank 0, which waits for rank 2; rank 0 enters 300 ms late, so
// rank 1 times out first and must still learn from rank 0 that rank 2 is the stuck one (CI once saw rank
// 1 name rank 0: rank 0 had said its last word to rank 1, "closed", on rank 1's timeout, before its own).
TEST(Mpi, AStuckPeerIsATimeoutErrorNamingIt) {
  if (!mpiRunner()) return relaunch(3);
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 3, mpiOptions(std::chrono::seconds(2)));
    if (rank == 2) {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      return;
    }
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::vector<float> v(1000, 1.0f);
    std::string err = errorOf([&] { pg->allreduce(v.data(), v.size(), DType::f32)->wait(); });
    EXPECT_NE(err.find("timed out"), std::string::npos) << err;
    EXPECT_NE(err.find("rank 2 (MPI rank 2 on "), std::string::npos) << err;
  });
  expectAllOk(results);
}

// Two ranks that call different collectives both fail with the mismatch, naming both calls.
TEST(Mpi, MismatchedCallsFailOnEveryRank) {
  if (!mpiRunner()) return relaunch(2);
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 2, mpiOptions(std::chrono::seconds(20)));
    std::vector<float> v(rank == 0 ? 10 : 12, 1.0f);
    std::string err = errorOf([&] { pg->allreduce(v.data(), v.size(), DType::f32)->wait(); });
    EXPECT_NE(err.find("collective mismatch"), std::string::npos) << err;
    EXPECT_NE(err.find("allreduce(f32 x 10"), std::string::npos) << err;
    EXPECT_NE(err.find("allreduce(f32 x 12"), std::string::npos) << err;
    // The group is broken from here on, with the first failure as the reason.
    std::string again = errorOf([&] { pg->allreduce(v.data(), v.size(), DType::f32)->wait(); });
    EXPECT_NE(again.find("collective mismatch"), std::string::npos) << again;
  });
  expectAllOk(results);
}

// A rank that fails on its own (a bad argument on rank 1 only) is named by the others, who were waiting.
TEST(Mpi, AFailedRankIsNamedByTheOthers) {
  if (!mpiRunner()) return relaunch(3);
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto pg = ProcessGroup::create(server.client(), rank, 3, mpiOptions(std::chrono::seconds(30)));
    int64_t x = 1;
    if (rank == 1) {
      EXPECT_NE(errorOf([&] { pg->abort("rank 1 gave up on purpose")->wait(); }).find("gave up"), std::string::npos);
      return;
    }
    std::string err = errorOf([&] { pg->allreduce(&x, 1, DType::i64)->wait(); });
    EXPECT_NE(err.find("rank 1 gave up on purpose"), std::string::npos) << err;
  });
  expectAllOk(results);
}

// The transport itself after a failure (the group above it keeps its first error and never calls it
// again, so only a direct use shows this): a failed run marks it broken, and the next run fails at once,
// saying so, before it posts anything (a peer still settling the failed run must not match the new run's
// messages). The failure is an op to a peer outside the group, on both ranks.
TEST(Mpi, ATransportThatFailedRefusesTheNextRunAtOnce) {
  if (!mpiRunner()) return relaunch(2);
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    using namespace comm::transport;
    auto store = server.client();
    TransportOptions o;
    o.timeout = std::chrono::seconds(20);
    auto t = createTransport("mpi", *store, rank, 2, o);
    std::vector<char> buf(64, static_cast<char>(rank));
    Label label;
    label.what = "bad op";
    label.timeout = std::chrono::seconds(20);
    std::vector<Op> bad{sendOp(5, 0, buf.data(), buf.size())};
    const std::string first = errorOf([&] { t->run(bad, Clock::now() + scaled(std::chrono::seconds(20)), label); });
    EXPECT_NE(first.find("bad op: op to peer 5 in a group of 2"), std::string::npos) << first;
    label.what = "next op";
    std::vector<Op> next{rank == 0 ? sendOp(1, 0, buf.data(), buf.size()) : recvOp(0, 0, buf.data(), buf.size())};
    const auto t0 = Clock::now();
    std::string again = "no IoError";
    try {
      t->run(next, t0 + scaled(std::chrono::seconds(5)), label);
    } catch (const IoError& e) {
      again = e.what();
    } catch (const std::exception& e) {
      again = std::string("not an IoError: ") + e.what();
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_NE(again.find(fmt::format("[rank {}] next op: the mpi transport failed earlier and cannot be used again",
                                     rank)),
              std::string::npos) << again;
    EXPECT_LT(secs, 1.0 * timeScale()) << "the second run waited";
    EXPECT_EQ(buf[0], static_cast<char>(rank)) << "the second run received";
  });
  expectAllOk(results);
}

// Ranks forked without mpirun are each an MPI job of one: the group refuses with what to do instead.
TEST(Mpi, RanksNotStartedByMpirunFailClearly) {
  if (mpiRunner()) GTEST_FAIL() << "runs without mpirun";
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    std::string err = errorOf([&] { ProcessGroup::create(server.client(), rank, 2, mpiOptions()); });
    EXPECT_NE(err.find("not distinct processes of one MPI job"), std::string::npos) << err;
    EXPECT_NE(err.find("mpirun"), std::string::npos) << err;
  });
  expectAllOk(results);
}

// A program that uses initWorld: DTRAIN_TRANSPORT=mpi under mpirun, nothing else set.
TEST(Mpi, TheAllreduceExampleRunsUnderMpirun) {
  auto [rc, out] = mpirun(3, DTRAIN_BIN_DIR "/example-allreduce", "", 120, "DTRAIN_TRANSPORT=mpi");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(count(out, "sum = 3 (expected 3)"), 3) << out;
}

}  // namespace
}  // namespace dtrain::test
