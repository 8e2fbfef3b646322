// Hierarchical allreduce (src/comm/collectives/hierarchical.cc) on one machine: each forked rank sets
// the DTRAIN_HOST_ID test hook, so ranks with different ids look like ranks of different hosts. The
// group's mesh is then tcp and each "host" with several ranks gets its own shm transport, as across real
// hosts. Results must equal the flat ring's (exactly for integers, within rounding for floats) and the
// locally computed value, on layouts 2x2, 2x1, 3x1, 2+1 and 2+1 with the hosts' ranks interleaved, for
// every dtype and reduce op, counts 0, 1, a prime and a multi-segment size; every rank must end
// bit-identical; broadcast and allgather (hierarchical too). A rank killed mid-op must fail every other rank, naming it, within the deadline.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <fmt/format.h>

#include <random>
#include <thread>

#include "comm/collectives/collectives.h"
#include "comm_test_util.h"
#include "dtrain/comm/error.h"

namespace dtrain::test {
namespace {

using comm::AllreduceAlgorithm;
using comm::GroupOptions;
using comm::ProcessGroup;
using Clock = std::chrono::steady_clock;

constexpr size_t kCounts[] = {0, 1, 13, 12007};

// The fake host of each rank.
struct Layout {
  std::string name;
  std::vector<std::string> hosts;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

std::string layoutName(const ::testing::TestParamInfo<Layout>& p) { return p.param.name; }

GroupOptions options(std::chrono::milliseconds timeout) {
  GroupOptions o;
  o.timeout = timeout;
  o.segment_bytes = 4096;  // tiny rings: large counts wrap many times
  return o;
}

// Runs fn(pg) on every rank of a group whose rank r pretends to be on host layout.hosts[r].
void runLayout(const Layout& layout, const std::function<void(ProcessGroup&)>& fn,
               std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  StoreServer server;
  const int world = static_cast<int>(layout.hosts.size());
  auto results = runRanks(world, [&](int rank) {
    setenv("DTRAIN_HOST_ID", layout.hosts[static_cast<size_t>(rank)].c_str(), 1);
    auto pg = ProcessGroup::create(server.client(), rank, world, options(timeout));
    ASSERT_EQ(pg->transportName(), "tcp");
    fn(*pg);
  });
  expectAllOk(results);
}

class Hierarchical : public ::testing::TestWithParam<Layout> {};

// Hierarchical against the flat ring and the expected value; in place and out of place.
TEST_P(Hierarchical, EqualsFlat) {
  runLayout(GetParam(), [](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (DType t : comm::kAllDTypes)
      for (size_t count : kCounts)
        for (ReduceOp op : comm::kAllReduceOps) {
          Buf in(t, count), hier(t, count), flat(t, count);
          for (size_t i = 0; i < count; ++i) in.set(i, inputValue(r, i, op));
          pg.allreduce(in.data(), hier.data(), count, t, op, AllreduceAlgorithm::hierarchical)->wait();
          pg.allreduce(in.data(), flat.data(), count, t, op, AllreduceAlgorithm::ring)->wait();
          Buf inplace = in;
          pg.allreduce(inplace.data(), inplace.data(), count, t, op, AllreduceAlgorithm::hierarchical)->wait();
          const std::string what = fmt::format("{} {} x {} world {} rank {}", comm::reduceOpName(op),
                                               comm::dtypeName(t), count, n, r);
          for (size_t i = 0; i < count; ++i) {
            const double want = expectedReduce(n, i, op, t);
            ASSERT_TRUE(close(hier.at(i), want, t)) << what << ": element " << i << " is " << hier.at(i)
                                                    << ", expected " << want;
            ASSERT_TRUE(close(hier.at(i), flat.at(i), t)) << what << ": element " << i << " is " << hier.at(i)
                                                          << ", the ring gave " << flat.at(i);
            if (!comm::isFloating(t)) {
              ASSERT_EQ(hier.at(i), flat.at(i)) << what << ": element " << i;
            }
            ASSERT_EQ(inplace.at(i), hier.at(i)) << what << ": in place differs at element " << i;
          }
          ASSERT_EQ(hier.bytes.back(), 0xEE) << what << ": wrote past the end";
          ASSERT_EQ(inplace.bytes.back(), 0xEE) << what << ": wrote past the end (in place)";
        }
  });
}

// Broadcast goes hierarchical where some host has several ranks (to one rank per host over tcp, then
// within each host over shm): every root, every dtype, every count, including a root that is not its
// host's lowest rank.
TEST_P(Hierarchical, BroadcastFromEveryRoot) {
  runLayout(GetParam(), [](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (DType t : comm::kAllDTypes)
      for (size_t count : kCounts)
        for (int root = 0; root < n; ++root) {
          Buf buf(t, count);
          for (size_t i = 0; i < count; ++i) buf.set(i, r == root ? inputValue(root, i, ReduceOp::sum) : 0);
          pg.broadcast(buf.data(), count, t, root)->wait();
          for (size_t i = 0; i < count; ++i)
            ASSERT_EQ(buf.at(i), inputValue(root, i, ReduceOp::sum))
                << comm::dtypeName(t) << " x " << count << " root " << root << " rank " << r << ": element " << i;
          ASSERT_EQ(buf.bytes.back(), 0xEE) << "wrote past the end";
        }
  });
}

// Allgather goes hierarchical too (blocks to the host's lowest rank, bundles across hosts, broadcast
// within hosts): even and uneven blocks (empty ones included), every dtype, out of place and in place.
TEST_P(Hierarchical, AllgatherEqualsExpected) {
  runLayout(GetParam(), [](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (DType t : comm::kAllDTypes)
      for (size_t count : kCounts)
        for (bool uneven : {false, true}) {
          std::vector<size_t> counts(static_cast<size_t>(n), count);
          if (uneven)
            for (int q = 0; q < n; ++q) counts[static_cast<size_t>(q)] = q % 2 ? count / 2 : count + q;
          std::vector<size_t> off(1, 0);
          for (size_t k : counts) off.push_back(off.back() + k);
          const size_t mine = counts[static_cast<size_t>(r)];
          Buf in(t, mine), out(t, off.back()), inplace(t, off.back());
          for (size_t i = 0; i < mine; ++i) in.set(i, inputValue(r, i, ReduceOp::sum));
          for (size_t i = 0; i < mine; ++i) inplace.set(off[static_cast<size_t>(r)] + i, inputValue(r, i, ReduceOp::sum));
          pg.allgatherv(in.data(), out.data(), counts, t)->wait();
          void* at = static_cast<char*>(inplace.data()) + off[static_cast<size_t>(r)] * comm::dtypeSize(t);
          pg.allgatherv(at, inplace.data(), counts, t)->wait();
          for (int q = 0; q < n; ++q)
            for (size_t i = 0; i < counts[static_cast<size_t>(q)]; ++i) {
              const size_t j = off[static_cast<size_t>(q)] + i;
              ASSERT_EQ(out.at(j), inputValue(q, i, ReduceOp::sum))
                  << comm::dtypeName(t) << " x " << count << (uneven ? " uneven" : "") << ": rank " << r
                  << " has a wrong element " << i << " of rank " << q << "'s block";
              ASSERT_EQ(inplace.at(j), out.at(j)) << "in place differs at " << j;
            }
          ASSERT_EQ(out.bytes.back(), 0xEE) << "wrote past the end";
        }
  });
}

// Irregular floats: every rank must end with the same bits (each shard is reduced by one set of owners
// and handed out as bytes), checked by allgathering every rank's result.
TEST_P(Hierarchical, EveryRankBitIdentical) {
  runLayout(GetParam(), [](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16})
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg})
        for (size_t count : {size_t(37), size_t(12007)}) {
          Buf buf(t, count);
          std::mt19937_64 rng(static_cast<uint64_t>(r) * 7919 + count);
          std::uniform_real_distribution<double> value(-1000.0, 1000.0);
          for (size_t i = 0; i < count; ++i) buf.set(i, value(rng));
          pg.allreduce(buf.data(), buf.data(), count, t, op, AllreduceAlgorithm::hierarchical)->wait();
          const size_t bytes = count * comm::dtypeSize(t);
          std::vector<uint8_t> all(bytes * static_cast<size_t>(n));
          pg.allgather(buf.data(), all.data(), bytes, DType::u8)->wait();
          for (int q = 0; q < n; ++q)
            ASSERT_EQ(0, std::memcmp(all.data() + bytes * static_cast<size_t>(q), all.data(), bytes))
                << comm::dtypeName(t) << " " << comm::reduceOpName(op) << " x " << count << ": rank " << q
                << " differs from rank 0";
        }
  });
}

// Ops of different algorithms interleave on one group (shm stages, tcp mesh, flat ops on the mesh), and
// automatic (hierarchical where a host has several ranks) agrees with the expected value.
TEST_P(Hierarchical, InterleavedWithOtherOps) {
  runLayout(GetParam(), [](ProcessGroup& pg) {
    const int n = pg.size();
    for (int k = 0; k < 50; ++k) {
      std::vector<int64_t> a(1000 + k, pg.rank() + 1);
      pg.allreduce(a.data(), a.size(), DType::i64)->wait();
      ASSERT_EQ(a.back(), n * (n + 1) / 2) << "iteration " << k;
      std::vector<int32_t> b(7, k);
      pg.broadcast(b.data(), b.size(), DType::i32, k % n)->wait();
      pg.allreduce(b.data(), b.data(), b.size(), DType::i32, ReduceOp::max, AllreduceAlgorithm::recursive_doubling)
          ->wait();
      ASSERT_EQ(b[3], k);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, Hierarchical,
                         ::testing::Values(Layout{"hosts2x2", {"a", "a", "b", "b"}}, Layout{"hosts2x1", {"a", "b"}},
                                           Layout{"hosts3x1", {"a", "b", "c"}},
                                           Layout{"hosts2plus1", {"a", "a", "b"}},
                                           Layout{"hosts2plus1_interleaved", {"a", "b", "a"}},
                                           Layout{"hosts3plus1plus2", {"a", "b", "a", "c", "c", "a"}}),
                         layoutName);

// The automatic choice (select.cc): hierarchical when the group spans hosts and some host has several
// ranks; never on one host; forcing it on one host falls back to the flat choice.
TEST(HierarchicalChoice, AutomaticWhereAHostHasSeveralRanks) {
  std::vector<uint8_t> scratch;
  comm::algo::Context c{nullptr, 0, 4, {}, {}, scratch};
  EXPECT_NE(comm::algo::chooseAllreduce(c, 1000, DType::f32, AllreduceAlgorithm::hierarchical),
            AllreduceAlgorithm::hierarchical);
  comm::algo::Hierarchy h;
  h.hosts = {{0, 1}, {2, 3}};
  h.shards = 2;
  c.hier = &h;
  for (size_t count : {size_t(1), size_t(1) << 20})
    EXPECT_EQ(comm::algo::chooseAllreduce(c, count, DType::f32, AllreduceAlgorithm::automatic),
              AllreduceAlgorithm::hierarchical);
  EXPECT_EQ(comm::algo::chooseAllreduce(c, 1000, DType::f32, AllreduceAlgorithm::ring), AllreduceAlgorithm::ring);
  h.hosts = {{0}, {1}};
  h.shards = 1;
  EXPECT_EQ(comm::algo::chooseAllreduce(c, 1000, DType::f32, AllreduceAlgorithm::automatic),
            AllreduceAlgorithm::recursive_doubling);
  EXPECT_EQ(comm::algo::chooseAllreduce(c, 1000, DType::f32, AllreduceAlgorithm::hierarchical),
            AllreduceAlgorithm::hierarchical);
}

TEST(HierarchicalChoice, DtrainAlgoNames) {
  using comm::algo::parseAllreduceAlgorithm;
  EXPECT_EQ(parseAllreduceAlgorithm("hierarchical"), AllreduceAlgorithm::hierarchical);
  EXPECT_EQ(parseAllreduceAlgorithm("ring"), AllreduceAlgorithm::ring);
  EXPECT_EQ(parseAllreduceAlgorithm("recursive_doubling"), AllreduceAlgorithm::recursive_doubling);
  EXPECT_EQ(parseAllreduceAlgorithm("rd"), AllreduceAlgorithm::recursive_doubling);
  EXPECT_EQ(parseAllreduceAlgorithm("auto"), AllreduceAlgorithm::automatic);
  try {
    parseAllreduceAlgorithm("tree");
    ADD_FAILURE() << "DTRAIN_ALGO=tree accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_ALGO='tree'"), std::string::npos) << e.what();
  }
}

// DTRAIN_ALGO reaches the group, and ranks that force different algorithms (which would wait for each
// other in different algorithms until the deadline) fail together when the group is created.
TEST(HierarchicalChoice, DtrainAlgoMustAgree) {
  StoreServer server;
  auto results = runRanks(4, [&](int rank) {
    setenv("DTRAIN_HOST_ID", rank < 2 ? "a" : "b", 1);
    setenv("DTRAIN_ALGO", "hierarchical", 1);
    auto pg = ProcessGroup::create(server.client(), rank, 4, options(std::chrono::seconds(10)));
    EXPECT_EQ(pg->options().allreduce_algorithm, AllreduceAlgorithm::hierarchical);
    std::vector<int32_t> x(100, rank);
    pg->allreduce(x.data(), x.size(), DType::i32)->wait();
    EXPECT_EQ(x[99], 6);
  });
  expectAllOk(results);
  StoreServer server2;
  results = runRanks(4, [&](int rank) {
    setenv("DTRAIN_HOST_ID", rank < 2 ? "a" : "b", 1);
    setenv("DTRAIN_ALGO", rank == 3 ? "ring" : "hierarchical", 1);
    try {
      ProcessGroup::create(server2.client(), rank, 4, options(std::chrono::seconds(10)));
      ADD_FAILURE() << "rank " << rank << ": a group whose ranks force different algorithms was created";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 hierarchical, rank 3 ring"), std::string::npos) << e.what();
    }
  });
  expectAllOk(results);
}

// Calls that differ in their arguments are still caught through the stages: rank 3 allreduces one element
// fewer than the others, at the same point. Every rank fails with a ProtocolError naming the mismatched
// calls, long before the deadline (shm compares the calls of a host's ranks, tcp every frame's).
TEST(HierarchicalMismatch, DifferentCountsFailEveryRank) {
  StoreServer server;
  auto results = runRanks(4, [&](int rank) {
    setenv("DTRAIN_HOST_ID", rank < 2 ? "a" : "b", 1);
    auto pg = ProcessGroup::create(server.client(), rank, 4, options(std::chrono::seconds(20)));
    std::vector<float> x(1000, 1.0f);
    pg->allreduce(x.data(), x.size(), DType::f32)->wait();
    const auto t0 = Clock::now();
    try {
      pg->allreduce(x.data(), rank == 3 ? 999 : 1000, DType::f32)->wait();
      ADD_FAILURE() << "rank " << rank << ": mismatched allreduce succeeded";
    } catch (const ProtocolError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("f32 x 999"), std::string::npos) << msg;
      EXPECT_NE(msg.find("f32 x 1000"), std::string::npos) << msg;
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0) << msg;
    }
  });
  expectAllOk(results);
}

// A rank is SIGKILLed during a stream of large hierarchical allreduces. Every survivor raises IoError or
// TimeoutError naming it, within 2x the timeout, whichever stage it was in (the shm stage on the
// victim's host, the tcp stage, or the shm stage of another host behind them).
struct Victim {
  std::string name;
  std::vector<std::string> hosts;
  int rank;
};
void PrintTo(const Victim& v, std::ostream* os) { *os << v.name; }

class HierarchicalFaults : public ::testing::TestWithParam<Victim> {};

TEST_P(HierarchicalFaults, KilledRankIsNamedByEveryone) {
  StoreServer server;
  const auto timeout = std::chrono::seconds(5);
  const Victim v = GetParam();
  const int world = static_cast<int>(v.hosts.size());
  auto results = runRanks(world, [&](int rank) {
    setenv("DTRAIN_HOST_ID", v.hosts[static_cast<size_t>(rank)].c_str(), 1);
    auto pg = ProcessGroup::create(server.client(), rank, world, options(timeout));
    std::vector<float> buf(1 << 20, 1.0f);
    pg->allreduce(buf.data(), buf.size(), DType::f32)->wait();
    if (rank == v.rank) {
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        kill(getpid(), SIGKILL);
      }).detach();
    }
    const auto t0 = Clock::now();
    try {
      for (int i = 0; i < 100000; ++i) pg->allreduce(buf.data(), buf.size(), DType::f32)->wait();
      ADD_FAILURE() << "rank " << rank << ": allreduce kept succeeding after rank " << v.rank << " was killed";
    } catch (const Error& e) {
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      const std::string msg = e.what();
      EXPECT_TRUE(dynamic_cast<const IoError*>(&e) || dynamic_cast<const TimeoutError*>(&e)) << msg;
      EXPECT_EQ(msg.rfind(fmt::format("[rank {}]", rank), 0), 0u) << msg;
      EXPECT_NE(msg.find(fmt::format("rank {} (", v.rank)), std::string::npos) << msg;
      EXPECT_NE(msg.find("allreduce seq="), std::string::npos) << msg;
      EXPECT_NE(msg.find("hierarchical"), std::string::npos) << msg;
      EXPECT_LT(secs, 2.0 * 5) << msg;
    }
  }, std::chrono::seconds(60));
  for (const auto& c : results) {
    if (c.rank == v.rank) {
      EXPECT_EQ(c.signal, SIGKILL) << c.describe();
    } else {
      EXPECT_TRUE(c.ok()) << c.describe();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Victims, HierarchicalFaults,
                         ::testing::Values(Victim{"hosts2x2_rank3", {"a", "a", "b", "b"}, 3},
                                           Victim{"hosts2x2_rank0", {"a", "a", "b", "b"}, 0},
                                           Victim{"hosts2plus1_alone", {"a", "a", "b"}, 2},
                                           Victim{"hosts2plus1_shared", {"a", "a", "b"}, 1}),
                         [](const ::testing::TestParamInfo<Victim>& p) { return p.param.name; });

}  // namespace
}  // namespace dtrain::test
