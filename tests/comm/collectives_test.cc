// Every collective x dtype x world size 1..5 x counts {0, 1, a prime, a multi-segment size}, on the
// tcp and shm transports, each result checked against a value computed locally (exact for integers).
// Ranks are real forked processes (under mpirun, for the mpi transport: the job's processes, see
// mpi_test.cc); the transport's segment size is tiny so large counts cross many
// ring wrap-arounds and staging refills.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <numeric>
#include <thread>

#include "comm_test_util.h"

namespace dtrain::test {
namespace {

using comm::AllreduceAlgorithm;
using comm::GroupOptions;
using comm::ProcessGroup;

constexpr size_t kCounts[] = {0, 1, 13, 12007};

struct Param {
  std::string transport;
  int world;
};

// Readable names in CTest's output instead of gtest's byte dump.
void PrintTo(const Param& p, std::ostream* os) { *os << p.transport << " x " << p.world; }

std::string paramName(const ::testing::TestParamInfo<Param>& p) {
  return p.param.transport + "_world" + std::to_string(p.param.world);
}

class Collectives : public ::testing::TestWithParam<Param> {
 protected:
  GroupOptions options() const {
    GroupOptions o;
    o.timeout = std::chrono::seconds(60);
    o.transport = GetParam().transport;
    o.segment_bytes = 4096;
    return o;
  }
  // Runs fn(pg) on every rank of a fresh group in forked children.
  void runGroup(const std::function<void(ProcessGroup&)>& fn) {
    StoreServer server;
    int world = GetParam().world;
    auto opts = options();
    auto results = runRanks(world, [&](int rank) {
      auto pg = ProcessGroup::create(server.client(), rank, world, opts);
      ASSERT_EQ(pg->transportName(), world == 1 ? "local" : opts.transport);
      fn(*pg);
    });
    expectAllOk(results);
  }
};

// Reports the first mismatch of a result buffer, with enough context to reproduce it.
#define EXPECT_BUF(cond_i, got_i, want_i, n, what)                                                   \
  do {                                                                                               \
    for (size_t i = 0; i < (n); ++i) {                                                               \
      if (!(cond_i)) {                                                                               \
        ADD_FAILURE() << (what) << ": element " << i << " is " << (got_i) << ", expected " << (want_i); \
        break;                                                                                       \
      }                                                                                              \
    }                                                                                                \
  } while (0)

TEST_P(Collectives, Allreduce) {
  runGroup([](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (DType t : comm::kAllDTypes)
      for (size_t count : kCounts)
        for (ReduceOp op : comm::kAllReduceOps)
          for (auto algo : {AllreduceAlgorithm::automatic, AllreduceAlgorithm::ring,
                            AllreduceAlgorithm::recursive_doubling, AllreduceAlgorithm::direct}) {
            Buf in(t, count), out(t, count);
            for (size_t i = 0; i < count; ++i) in.set(i, inputValue(r, i, op));
            bool inplace = algo == AllreduceAlgorithm::ring;  // in place for one algorithm, out of place for the others
            pg.allreduce(in.data(), inplace ? in.data() : out.data(), count, t, op, algo)->wait();
            Buf& res = inplace ? in : out;
            std::string what = fmt::format("allreduce {} {} x {} algo {} world {}", comm::reduceOpName(op),
                                           comm::dtypeName(t), count, static_cast<int>(algo), n);
            EXPECT_BUF(close(res.at(i), expectedReduce(n, i, op, t), t), res.at(i), expectedReduce(n, i, op, t),
                       count, what);
            EXPECT_EQ(res.bytes.back(), 0xEE) << what << ": wrote past the end";
          }
  });
}

// Floating-point sums depend on the order of the terms; every algorithm must still leave every rank with
// the same bits (one reducer per block, or both sides of an exchange computing the same expression),
// avg included (divided once per block). Inputs are irregular floats, so a rank that summed in its own
// order would differ in the last bits; each rank's result is allgathered and compared byte for byte.
// Ops issued and not waited for run on the group's thread: after a loop in which the issuing thread
// ran every op itself (wait() helps), and then issued from a thread that never waits for them. Polls
// isCompleted() (bounded by the group's 60 s timeout) instead of waiting.
TEST_P(Collectives, OpsNobodyWaitsForStillComplete) {
  runGroup([&](ProcessGroup& pg) {
    auto completes = [](const comm::WorkPtr& w) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!w->isCompleted() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      return w->isCompleted();
    };
    std::vector<int32_t> x(64, 1);
    for (int i = 0; i < 300; ++i) pg.allreduce(x.data(), x.size(), comm::DType::i32)->wait();
    std::vector<int32_t> a(64, 1), b(64, 2);
    auto wa = pg.allreduce(a.data(), a.size(), comm::DType::i32);
    auto wb = pg.allreduce(b.data(), b.size(), comm::DType::i32);
    EXPECT_TRUE(completes(wa));
    EXPECT_TRUE(completes(wb));
    comm::WorkPtr wc;
    std::vector<int32_t> c(64, 3);
    std::thread([&] { wc = pg.allreduce(c.data(), c.size(), comm::DType::i32); }).join();
    EXPECT_TRUE(completes(wc));
    const int n = pg.size();
    EXPECT_EQ(a[0], n);
    EXPECT_EQ(b[63], 2 * n);
    EXPECT_EQ(c[5], 3 * n);
  });
}

TEST_P(Collectives, AllreduceLeavesEveryRankBitIdentical) {
  runGroup([](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16})
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg})
        for (auto algo : {AllreduceAlgorithm::automatic, AllreduceAlgorithm::ring,
                          AllreduceAlgorithm::recursive_doubling, AllreduceAlgorithm::direct})
          for (size_t count : {size_t(37), size_t(12007)}) {
            Buf buf(t, count);
            uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(r + 1);
            for (size_t i = 0; i < count; ++i) {
              x ^= x << 13, x ^= x >> 7, x ^= x << 17;
              buf.set(i, (static_cast<double>(x % 2000001) - 1000000.0) / 999983.0 * (1 + i % 7));
            }
            pg.allreduce(buf.data(), buf.data(), count, t, op, algo)->wait();
            const size_t bytes = count * comm::dtypeSize(t);
            std::vector<uint8_t> all(bytes * n);
            pg.allgather(buf.data(), all.data(), bytes, DType::u8)->wait();
            for (int q = 0; q < n; ++q) {
              EXPECT_EQ(std::memcmp(all.data() + q * bytes, all.data(), bytes), 0)
                  << fmt::format("allreduce {} {} x {} algo {} world {}: rank {} ended with other bits than rank 0",
                                 comm::reduceOpName(op), comm::dtypeName(t), count, static_cast<int>(algo), n, q);
            }
          }
  });
}

TEST_P(Collectives, BroadcastAndReduce) {
  runGroup([](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (DType t : comm::kAllDTypes)
      for (size_t count : kCounts)
        for (int root : {0, n - 1}) {
          Buf b(t, count);
          for (size_t i = 0; i < count; ++i) b.set(i, r == root ? inputValue(root, i, ReduceOp::sum) : 0);
          pg.broadcast(b.data(), count, t, root)->wait();
          std::string what = fmt::format("broadcast {} x {} root {} world {}", comm::dtypeName(t), count, root, n);
          EXPECT_BUF(b.at(i) == inputValue(root, i, ReduceOp::sum), b.at(i), inputValue(root, i, ReduceOp::sum),
                     count, what);
          for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg}) {
            Buf in(t, count), out(t, count);
            for (size_t i = 0; i < count; ++i) in.set(i, inputValue(r, i, op));
            pg.reduce(in.data(), r == root ? out.data() : nullptr, count, t, op, root)->wait();
            if (r != root) continue;
            std::string w2 = fmt::format("reduce {} {} x {} root {} world {}", comm::reduceOpName(op),
                                         comm::dtypeName(t), count, root, n);
            EXPECT_BUF(close(out.at(i), expectedReduce(n, i, op, t), t), out.at(i), expectedReduce(n, i, op, t),
                       count, w2);
            // The input is const: reduce must not have touched it.
            EXPECT_BUF(in.at(i) == inputValue(r, i, op), in.at(i), inputValue(r, i, op), count, w2 + " (input)");
          }
        }
  });
}

TEST_P(Collectives, AllgatherAndReduceScatter) {
  runGroup([](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (DType t : comm::kAllDTypes)
      for (size_t count : kCounts) {
        // Equal blocks, then uneven ones (some empty).
        std::vector<size_t> equal(n, count), uneven(n);
        for (int q = 0; q < n; ++q) uneven[q] = (count * (q + 1) + q) % (count + 3);
        for (const auto& counts : {equal, uneven}) {
          size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
          std::vector<size_t> off(n + 1, 0);
          for (int q = 0; q < n; ++q) off[q + 1] = off[q] + counts[q];
          Buf in(t, counts[r]), out(t, total);
          for (size_t i = 0; i < counts[r]; ++i) in.set(i, inputValue(r, i, ReduceOp::sum));
          pg.allgatherv(in.data(), out.data(), counts, t)->wait();
          std::string what = fmt::format("allgather {} total {} world {}", comm::dtypeName(t), total, n);
          for (int q = 0; q < n; ++q)
            EXPECT_BUF(out.at(off[q] + i) == inputValue(q, i, ReduceOp::sum), out.at(off[q] + i),
                       inputValue(q, i, ReduceOp::sum), counts[q], what + fmt::format(" block {}", q));
          for (ReduceOp op : {ReduceOp::sum, ReduceOp::min, ReduceOp::avg}) {
            // Rank q contributes inputValue(q, global index) to every element.
            Buf rin(t, total), rout(t, counts[r]);
            for (size_t i = 0; i < total; ++i) rin.set(i, inputValue(r, i, op));
            pg.reduceScatterv(rin.data(), rout.data(), counts, t, op)->wait();
            std::string w2 = fmt::format("reduce_scatter {} {} total {} world {}", comm::reduceOpName(op),
                                         comm::dtypeName(t), total, n);
            EXPECT_BUF(close(rout.at(i), expectedReduce(n, off[r] + i, op, t), t), rout.at(i),
                       expectedReduce(n, off[r] + i, op, t), counts[r], w2);
            EXPECT_BUF(rin.at(i) == inputValue(r, i, op), rin.at(i), inputValue(r, i, op), total, w2 + " (input)");
            // In place: the output is this rank's own block of the input.
            char* mine = static_cast<char*>(rin.data()) + off[r] * comm::dtypeSize(t);
            pg.reduceScatterv(rin.data(), mine, counts, t, op)->wait();
            EXPECT_BUF(close(rin.at(off[r] + i), expectedReduce(n, off[r] + i, op, t), t), rin.at(off[r] + i),
                       expectedReduce(n, off[r] + i, op, t), counts[r], w2 + " (in place)");
          }
        }
      }
  });
}

TEST_P(Collectives, AlltoallGatherScatter) {
  runGroup([](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    // Element i of block b sent by rank q: q * 10 + b + i % 3 (distinct per sender and block).
    auto val = [](int q, int b, size_t i) { return static_cast<double>(q * 10 + b + i % 3); };
    for (DType t : comm::kAllDTypes)
      for (size_t count : kCounts) {
        Buf in(t, count * n), out(t, count * n);
        for (int b = 0; b < n; ++b)
          for (size_t i = 0; i < count; ++i) in.set(b * count + i, val(r, b, i));
        pg.alltoall(in.data(), out.data(), count, t)->wait();
        std::string what = fmt::format("alltoall {} x {} world {}", comm::dtypeName(t), count, n);
        for (int q = 0; q < n; ++q)
          EXPECT_BUF(out.at(q * count + i) == val(q, r, i), out.at(q * count + i), val(q, r, i), count,
                     what + fmt::format(" from {}", q));
        // In place.
        pg.alltoall(in.data(), in.data(), count, t)->wait();
        for (int q = 0; q < n; ++q)
          EXPECT_BUF(in.at(q * count + i) == val(q, r, i), in.at(q * count + i), val(q, r, i), count,
                     what + fmt::format(" in place from {}", q));

        int root = n > 1 ? 1 : 0;
        Buf mine(t, count), all(t, count * n);
        for (size_t i = 0; i < count; ++i) mine.set(i, val(r, 0, i));
        pg.gather(mine.data(), r == root ? all.data() : nullptr, count, t, root)->wait();
        if (r == root)
          for (int q = 0; q < n; ++q)
            EXPECT_BUF(all.at(q * count + i) == val(q, 0, i), all.at(q * count + i), val(q, 0, i), count,
                       fmt::format("gather {} x {} from {}", comm::dtypeName(t), count, q));
        Buf src(t, count * n), part(t, count);
        if (r == root)
          for (int b = 0; b < n; ++b)
            for (size_t i = 0; i < count; ++i) src.set(b * count + i, val(root, b, i));
        pg.scatter(r == root ? src.data() : nullptr, part.data(), count, t, root)->wait();
        EXPECT_BUF(part.at(i) == val(root, r, i), part.at(i), val(root, r, i), count,
                   fmt::format("scatter {} x {}", comm::dtypeName(t), count));
      }
    pg.barrier()->wait();
  });
}

TEST_P(Collectives, SendRecv) {
  runGroup([](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    if (n == 1) return;
    for (size_t count : kCounts) {
      // A ring exchange in one batch: send right, receive from the left, at the same time.
      std::vector<int64_t> out(count), in(count, -1);
      std::iota(out.begin(), out.end(), r * 1000000);
      pg.sendRecv({{comm::P2POp::kSend, out.data(), count, DType::i64, (r + 1) % n, 7},
                   {comm::P2POp::kRecv, in.data(), count, DType::i64, (r - 1 + n) % n, 7}})
          ->wait();
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(in[i], static_cast<int64_t>((r - 1 + n) % n * 1000000 + i));
    }
    // Plain send/recv with tags, in order, between ranks 0 and 1.
    if (r < 2) {
      double a = 3.5, b = 0;
      int peer = 1 - r;
      for (uint32_t tag = 0; tag < 3; ++tag) {
        if (r == 0) {
          pg.send(&a, 1, DType::f64, peer, tag)->wait();
          pg.recv(&b, 1, DType::f64, peer, tag + 100)->wait();
          EXPECT_EQ(b, a + tag);
        } else {
          pg.recv(&b, 1, DType::f64, peer, tag)->wait();
          b += tag;
          pg.send(&b, 1, DType::f64, peer, tag + 100)->wait();
        }
      }
    }
    pg.barrier()->wait();
  });
}

// Many ops issued before any is waited on: they run in issue order and all complete correctly.
TEST_P(Collectives, ManyInFlight) {
  runGroup([](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    constexpr int kOps = 64;
    std::vector<std::vector<float>> bufs(kOps);
    std::vector<comm::WorkPtr> works;
    for (int k = 0; k < kOps; ++k) {
      bufs[k].assign(257 + 1001 * (k % 5), static_cast<float>(r + k));
      works.push_back(k % 3 == 2 ? pg.broadcast(bufs[k].data(), bufs[k].size(), DType::f32, k % n)
                                 : pg.allreduce(bufs[k].data(), bufs[k].size(), DType::f32));
    }
    for (auto& w : works) w->wait();
    for (int k = 0; k < kOps; ++k) {
      float want = k % 3 == 2 ? static_cast<float>(k % n + k) : static_cast<float>(n * (n - 1) / 2 + n * k);
      for (float v : bufs[k]) ASSERT_EQ(v, want) << "op " << k;
    }
  });
}

TEST_P(Collectives, SubGroups) {
  runGroup([](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    std::vector<int> evens, odds;
    for (int q = 0; q < n; ++q) (q % 2 ? odds : evens).push_back(q);
    auto ge = pg.newGroup(evens);
    auto go = odds.empty() ? nullptr : pg.newGroup(odds);
    auto& mine = r % 2 ? go : ge;
    ASSERT_NE(mine, nullptr);
    EXPECT_EQ((r % 2 ? ge : go), nullptr);
    const auto& members = r % 2 ? odds : evens;
    EXPECT_EQ(mine->size(), static_cast<int>(members.size()));
    EXPECT_EQ(mine->rank(), r / 2);
    int64_t v = r, want = 0;
    for (int q : members) want += q;
    // The sub-group and the world group used at the same time.
    int64_t w = 1;
    auto a = mine->allreduce(&v, 1, DType::i64);
    auto b = pg.allreduce(&w, 1, DType::i64);
    a->wait();
    b->wait();
    EXPECT_EQ(v, want);
    EXPECT_EQ(w, n);
    // A group of a group (reversed order renumbers the ranks).
    std::vector<int> rev(members.size());
    for (size_t i = 0; i < rev.size(); ++i) rev[i] = static_cast<int>(rev.size() - 1 - i);
    auto sub = mine->newGroup(rev);
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->rank(), static_cast<int>(rev.size()) - 1 - mine->rank());
    int32_t x = sub->rank() == 0 ? 42 : 0;
    sub->broadcast(&x, 1, DType::i32, 0)->wait();
    EXPECT_EQ(x, 42);
  });
}

std::vector<Param> params() {
  std::vector<Param> ps;
  for (std::string t : {"tcp", "shm"})
    for (int w = 1; w <= 5; ++w) ps.push_back({t, w});
  // Under mpirun (mpi_test relaunches this binary so): the same tests on the MPI transport, no fork.
  if (mpiRunner())
    for (int w = 1; w <= 5; ++w) ps.push_back({"mpi", w});
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Sweep, Collectives, ::testing::ValuesIn(params()), paramName);

}  // namespace
}  // namespace dtrain::test
