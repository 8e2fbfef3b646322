// Mismatched collectives: one rank calls a collective with another count, dtype of the same byte size,
// reduce op, root, count vector or algorithm than the others. The always-on fingerprint check must make
// every rank fail with a ProtocolError naming both calls, on every transport, world size 2..4 and
// algorithm; on shared memory no output (nor in-place input) may have been modified.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <functional>

#include "comm/transport/transport.h"
#include "comm_test_util.h"
#include "dtrain/comm/error.h"

namespace dtrain::test {
namespace {

using comm::AllreduceAlgorithm;
using comm::GroupOptions;
using comm::ProcessGroup;
using comm::PrefixStore;

// One mismatch: `issue` runs the collective on every rank (the deviant passes other arguments), on
// buffers `in` and `out` of kBufBytes; `mine` and `theirs` are how the two calls are named.
struct Case {
  std::string name;
  std::function<void(ProcessGroup&, bool deviant, void* in, void* out)> issue;
  std::string normal_call;   // what the other ranks called, as the error names it
  std::string deviant_call;  // what the deviant rank called
};

constexpr size_t kBufBytes = 8 * 40000;

std::vector<size_t> unevenCounts(int world, bool reversed) {
  std::vector<size_t> c;
  for (int r = 0; r < world; ++r) c.push_back(10 + 3 * static_cast<size_t>(reversed ? world - 1 - r : r));
  return c;
}

std::string vcall(const char* op, int world, bool reversed, const char* rop) {
  auto counts = unevenCounts(world, reversed);
  size_t total = 0;
  for (size_t c : counts) total += c;
  comm::transport::Fingerprint fp;
  fp.op = static_cast<uint16_t>(std::string(op) == "allgather" ? comm::transport::OpCode::allgather
                                                              : comm::transport::OpCode::reduce_scatter);
  fp.dtype = static_cast<uint8_t>(DType::f32);
  fp.count = total;
  fp.counts_hash = comm::transport::hashCounts(counts);
  std::string s = fmt::format("{}(f32 x {}, counts #{:08x}", op, total,
                              static_cast<uint32_t>(fp.counts_hash ^ (fp.counts_hash >> 32)));
  if (rop) s += fmt::format(", {}", rop);
  return s + ") seq=0";
}

std::vector<Case> cases(int world) {
  const int last = world - 1;
  std::vector<Case> v;
  struct Algo {
    AllreduceAlgorithm a;
    const char* suffix;
  };
  for (Algo al : {Algo{AllreduceAlgorithm::automatic, ""}, Algo{AllreduceAlgorithm::ring, ", algorithm ring"},
                  Algo{AllreduceAlgorithm::recursive_doubling, ", algorithm rd"},
                  Algo{AllreduceAlgorithm::direct, ", algorithm direct"}}) {
    std::string sfx = al.suffix;
    v.push_back({"allreduce count" + sfx,
                 [=](ProcessGroup& pg, bool d, void* in, void* out) {
                   pg.allreduce(in, in, d ? 500 : 1000, DType::f32, ReduceOp::sum, al.a)->wait();
                 },
                 "allreduce(f32 x 1000, sum" + sfx + ") seq=0", "allreduce(f32 x 500, sum" + sfx + ") seq=0"});
    v.push_back({"allreduce large count" + sfx,
                 [=](ProcessGroup& pg, bool d, void* in, void* out) {
                   pg.allreduce(in, out, d ? 30000 : 40000, DType::f32, ReduceOp::sum, al.a)->wait();
                 },
                 "allreduce(f32 x 40000, sum" + sfx + ") seq=0", "allreduce(f32 x 30000, sum" + sfx + ") seq=0"});
    v.push_back({"allreduce reduce op" + sfx,
                 [=](ProcessGroup& pg, bool d, void* in, void* out) {
                   pg.allreduce(in, in, 1000, DType::f32, d ? ReduceOp::max : ReduceOp::sum, al.a)->wait();
                 },
                 "allreduce(f32 x 1000, sum" + sfx + ") seq=0", "allreduce(f32 x 1000, max" + sfx + ") seq=0"});
  }
  v.push_back({"allreduce dtype of equal size",
               [](ProcessGroup& pg, bool d, void* in, void* out) {
                 pg.allreduce(in, in, d ? 4 : 8, d ? DType::f64 : DType::f32)->wait();
               },
               "allreduce(f32 x 8, sum) seq=0", "allreduce(f64 x 4, sum) seq=0"});
  v.push_back({"allreduce algorithm",
               [](ProcessGroup& pg, bool d, void* in, void* out) {
                 pg.allreduce(in, in, 64, DType::f32, ReduceOp::sum,
                              d ? AllreduceAlgorithm::ring : AllreduceAlgorithm::automatic)->wait();
               },
               "allreduce(f32 x 64, sum) seq=0", "allreduce(f32 x 64, sum, algorithm ring) seq=0"});
  for (size_t n : {size_t(100), size_t(40000)}) {
    v.push_back({fmt::format("broadcast root x {}", n),
                 [=](ProcessGroup& pg, bool d, void* in, void* out) { pg.broadcast(in, n, DType::f32, d ? 1 : 0)->wait(); },
                 fmt::format("broadcast(f32 x {}, root 0) seq=0", n), fmt::format("broadcast(f32 x {}, root 1) seq=0", n)});
    v.push_back({fmt::format("broadcast count x {}", n),
                 [=](ProcessGroup& pg, bool d, void* in, void* out) { pg.broadcast(in, d ? n / 2 : n, DType::f32, 0)->wait(); },
                 fmt::format("broadcast(f32 x {}, root 0) seq=0", n),
                 fmt::format("broadcast(f32 x {}, root 0) seq=0", n / 2)});
    v.push_back({fmt::format("reduce root x {}", n),
                 [=](ProcessGroup& pg, bool d, void* in, void* out) {
                   pg.reduce(in, out, n, DType::i32, ReduceOp::sum, d ? 1 : 0)->wait();
                 },
                 fmt::format("reduce(i32 x {}, sum, root 0) seq=0", n),
                 fmt::format("reduce(i32 x {}, sum, root 1) seq=0", n)});
  }
  v.push_back({"reduce op",
               [](ProcessGroup& pg, bool d, void* in, void* out) {
                 pg.reduce(in, out, 40000, DType::f32, d ? ReduceOp::min : ReduceOp::prod, 0)->wait();
               },
               "reduce(f32 x 40000, prod, root 0) seq=0", "reduce(f32 x 40000, min, root 0) seq=0"});
  v.push_back({"allgather count",
               [](ProcessGroup& pg, bool d, void* in, void* out) { pg.allgather(in, out, d ? 5 : 7, DType::i64)->wait(); },
               fmt::format("allgather(i64 x {}) seq=0", 7 * world), fmt::format("allgather(i64 x {}) seq=0", 5 * world)});
  v.push_back({"allgatherv counts",
               [=](ProcessGroup& pg, bool d, void* in, void* out) {
                 pg.allgatherv(in, out, unevenCounts(world, d), DType::f32)->wait();
               },
               vcall("allgather", world, false, nullptr), vcall("allgather", world, true, nullptr)});
  v.push_back({"reduce_scatterv counts",
               [=](ProcessGroup& pg, bool d, void* in, void* out) {
                 pg.reduceScatterv(in, out, unevenCounts(world, d), DType::f32, ReduceOp::sum)->wait();
               },
               vcall("reduce_scatter", world, false, "sum"), vcall("reduce_scatter", world, true, "sum")});
  v.push_back({"reduce_scatter op",
               [](ProcessGroup& pg, bool d, void* in, void* out) {
                 pg.reduceScatter(in, out, 100, DType::f32, d ? ReduceOp::avg : ReduceOp::sum)->wait();
               },
               fmt::format("reduce_scatter(f32 x {}, sum) seq=0", 100 * world),
               fmt::format("reduce_scatter(f32 x {}, avg) seq=0", 100 * world)});
  v.push_back({"gather root",
               [=](ProcessGroup& pg, bool d, void* in, void* out) { pg.gather(in, out, 50, DType::u8, d ? last : 0)->wait(); },
               "gather(u8 x 50, root 0) seq=0", fmt::format("gather(u8 x 50, root {}) seq=0", last)});
  v.push_back({"scatter count",
               [](ProcessGroup& pg, bool d, void* in, void* out) { pg.scatter(in, out, d ? 40 : 50, DType::u8, 0)->wait(); },
               "scatter(u8 x 50, root 0) seq=0", "scatter(u8 x 40, root 0) seq=0"});
  v.push_back({"alltoall dtype",
               [](ProcessGroup& pg, bool d, void* in, void* out) {
                 pg.alltoall(in, out, d ? 20 : 10, d ? DType::f16 : DType::f32)->wait();
               },
               "alltoall(f32 x 10) seq=0", "alltoall(f16 x 20) seq=0"});
  v.push_back({"different ops",
               [](ProcessGroup& pg, bool d, void* in, void* out) {
                 if (d) pg.barrier()->wait();
                 else pg.allreduce(in, in, 2, DType::f64)->wait();
               },
               "allreduce(f64 x 2, sum) seq=0", "barrier() seq=0"});
  return v;
}

struct Param {
  std::string transport;
  int world;
};
void PrintTo(const Param& p, std::ostream* os) { *os << p.transport << " x " << p.world; }

class Mismatch : public ::testing::TestWithParam<Param> {};

TEST_P(Mismatch, EveryRankFailsNamingBothCalls) {
  // Named copies, not a structured binding: C++17 lambdas cannot capture bindings (clang refuses).
  const std::string transport = GetParam().transport;
  const int world = GetParam().world;
  StoreServer server;
  GroupOptions o;
  o.transport = transport;
  o.timeout = std::chrono::seconds(20);  // errors must come at once; a timeout would fail the text checks
  const auto all = cases(world);
  auto results = runRanks(world, [&](int rank) {
    auto store = server.client();
    const bool deviant = rank == world - 1;
    for (size_t k = 0; k < all.size(); ++k) {
      const Case& c = all[k];
      auto pg = ProcessGroup::create(std::make_shared<PrefixStore>(fmt::format("case{}", k), store), rank, world, o);
      std::vector<uint8_t> in(kBufBytes), out(kBufBytes, 0xEE);
      for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>((i * 7 + rank * 13) % 120);
      const std::vector<uint8_t> in0 = in, out0 = out;
      try {
        c.issue(*pg, deviant, in.data(), out.data());
        ADD_FAILURE() << "rank " << rank << ", " << c.name << ": mismatch not detected";
      } catch (const ProtocolError& e) {
        std::string m = e.what();
        EXPECT_NE(m.find("collective mismatch"), std::string::npos) << c.name << ": " << m;
        EXPECT_NE(m.find(c.normal_call), std::string::npos) << c.name << ": rank " << rank << ": " << m;
        EXPECT_NE(m.find(c.deviant_call), std::string::npos) << c.name << ": rank " << rank << ": " << m;
        if (transport == "shm") {
          EXPECT_NE(m.find("no output buffer was modified"), std::string::npos) << c.name << ": " << m;
          EXPECT_TRUE(in == in0) << c.name << ": rank " << rank << ": the input/in-place buffer was modified";
          EXPECT_TRUE(out == out0) << c.name << ": rank " << rank << ": the output buffer was modified";
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << c.name << ": rank " << rank << ": expected a ProtocolError, got: " << e.what();
      }
    }
  }, std::chrono::seconds(240));
  expectAllOk(results);
}

std::vector<Param> mismatchParams() {
  std::vector<Param> ps{{"tcp", 2}, {"tcp", 3}, {"tcp", 4}, {"shm", 2}, {"shm", 3}, {"shm", 4}};
  // Under mpirun (mpi_test relaunches this binary so): the MPI transport at 3, 4 and 5 ranks, no fork.
  if (mpiRunner())
    for (int w = 3; w <= 5; ++w) ps.push_back({"mpi", w});
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Transports, Mismatch, ::testing::ValuesIn(mismatchParams()),
                         [](const auto& p) { return p.param.transport + "_world" + std::to_string(p.param.world); });

// The case of the issue: with ranks taking different numbers of steps, one rank's small allreduce met
// another's large one and both "succeeded". Now both fail, and a later call fails with the first error.
TEST(Mismatch, GroupStaysBrokenAfterAMismatch) {
  for (const char* transport : {"tcp", "shm"}) {
    StoreServer server;
    GroupOptions o;
    o.transport = transport;
    o.timeout = std::chrono::seconds(20);
    auto results = runRanks(2, [&](int rank) {
      auto pg = ProcessGroup::create(server.client(), rank, 2, o);
      std::vector<double> small(2, 1.0);
      std::vector<float> big(15770, 1.0f);
      pg->allreduce(big.data(), big.size(), DType::f32)->wait();  // a step both ranks take
      try {
        if (rank == 1) pg->allreduce(small.data(), small.size(), DType::f64)->wait();
        else pg->allreduce(big.data(), big.size(), DType::f32)->wait();
        ADD_FAILURE() << "mismatch not detected";
      } catch (const ProtocolError& e) {
        std::string m = e.what();
        EXPECT_NE(m.find("allreduce(f64 x 2, sum) seq=1"), std::string::npos) << m;
        EXPECT_NE(m.find("allreduce(f32 x 15770, sum) seq=1"), std::string::npos) << m;
      }
      try {
        pg->barrier()->wait();
        ADD_FAILURE() << "a broken group ran a barrier";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("collective mismatch"), std::string::npos) << e.what();
      }
    });
    expectAllOk(results);
  }
}

}  // namespace
}  // namespace dtrain::test
