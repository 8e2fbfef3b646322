// dtrain::Join: DDP with a different number of batches on each rank finishes, and the gradients,
// parameters and BatchNorm buffers follow PyTorch's Join with DDP, checked against one process that
// computes every step from every rank's data: a rank that has joined contributes zeros and the sum is
// divided by the initial world size (or by the ranks still training); buffers come from the highest
// rank still training; at the end every rank has the model of the last rank to join. Also: noSync
// accumulation inside the join scope, a rank with no batch at all, throw_on_early_termination, and the
// errors for collectives a joined rank cannot shadow.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "dtrain/autograd.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/join.h"
#include "ddp_test_util.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using Tensors = std::vector<torch::Tensor>;

Tensors cloneAll(const Tensors& ts) {
  Tensors out;
  for (auto& t : ts) out.push_back(t.clone());
  return out;
}
Tensors grads(torch::nn::Module& m) {
  Tensors out;
  for (auto& p : m.parameters()) out.push_back(p.grad().clone());
  return out;
}
void install(torch::nn::Module& m, const Tensors& bs) {
  torch::NoGradGuard g;
  auto dst = m.buffers();
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(bs[i]);
}

struct JoinCase {
  std::vector<int> batches;  // per rank
  bool divide_by_initial_world_size = true;
  int micro = 1;  // micro-batches per step, all but the last under noSync
};

void joinAndCompare(const JoinCase& c) {
  const int W = static_cast<int>(c.batches.size());
  const int steps = *std::max_element(c.batches.begin(), c.batches.end());
  StoreServer server;
  auto results = runRanks(W, [&](int rank) {
    auto pg = group(server, rank, W);
    Net model = makeNet(/*bn=*/true), ref = makeNet(/*bn=*/true);
    if (rank != 0) {
      torch::NoGradGuard g;
      for (auto& p : model->parameters()) p.add_(0.5 * rank);
    }
    DDPOptions o;
    o.bucket_bytes = o.first_bucket_bytes = 256;  // several buckets
    DistributedDataParallel ddp(model.ptr(), pg, o);
    auto opt = makeOpt("sgd", *model);
    std::vector<Tensors> seen;  // the averaged gradients of each of this rank's steps
    {
      JoinOptions jo;
      jo.divide_by_initial_world_size = c.divide_by_initial_world_size;
      Join join(ddp, jo);
      for (int s = 0; s < c.batches[rank]; ++s) {
        opt->zero_grad();
        for (int k = 0; k < c.micro; ++k) {
          auto [x, y] = batch(s * 10 + k, W);
          auto loss = torch::nn::functional::cross_entropy(model->forward(x.narrow(0, rank * kPerRank, kPerRank)),
                                                           y.narrow(0, rank * kPerRank, kPerRank));
          if (k + 1 < c.micro) {
            auto guard = ddp.noSync();
            loss.backward();
          } else {
            loss.backward();
          }
        }
        seen.push_back(grads(*model));
        opt->step();
      }
      join.finish();
    }

    // One process: step s sums the losses of the ranks that still have a batch s.
    auto ref_opt = makeOpt("sgd", *ref);
    std::vector<Tensors> B(W, cloneAll(ref->buffers()));
    for (int s = 0; s < steps; ++s) {
      std::vector<int> running;
      for (int r = 0; r < W; ++r)
        if (c.batches[r] > s) running.push_back(r);
      const double divisor = c.divide_by_initial_world_size ? W : static_cast<double>(running.size());
      ref_opt->zero_grad();
      for (int k = 0; k < c.micro; ++k) {
        auto [x, y] = batch(s * 10 + k, W);
        for (int r : running) {
          install(*ref, B[r]);
          auto l = torch::nn::functional::cross_entropy(ref->forward(x.narrow(0, r * kPerRank, kPerRank)),
                                                        y.narrow(0, r * kPerRank, kPerRank));
          (l / divisor).backward();
          B[r] = cloneAll(ref->buffers());
        }
      }
      // The end of the synced pass: everyone gets the highest training rank's buffers.
      for (int r = 0; r < W; ++r)
        if (r != running.back()) B[r] = B[running.back()];
      if (s < c.batches[rank]) {
        auto want = grads(*ref);
        for (size_t i = 0; i < want.size(); ++i) {
          double d = (want[i] - seen[s][i]).abs().max().item<double>();
          EXPECT_LE(d, 1e-9) << "rank " << rank << " step " << s << ": gradient " << i << " differs by " << d;
        }
      }
      ref_opt->step();
    }
    install(*ref, B[rank]);
    expectClose(*model, *ref, 1e-9, fmt::format("rank {} after the join", rank));
  });
  expectAllOk(results);
}

TEST(Join, FiveSevenNineBatchesOnThreeRanks) { joinAndCompare({{5, 7, 9}}); }
TEST(Join, DivideByRanksStillTraining) { joinAndCompare({{5, 7, 9}, /*divide_by_initial_world_size=*/false}); }
// The highest rank joins first (buffers then come from a lower rank), with noSync accumulation.
TEST(Join, HighestRankJoinsFirstWithNoSyncMicroBatches) { joinAndCompare({{3, 1, 2}, true, /*micro=*/2}); }
// Rank 0 never trains: it shadows even the first pass (and its bucket rebuild).
TEST(Join, RankWithoutBatches) { joinAndCompare({{0, 3, 2}}); }
TEST(Join, TwoRanks) { joinAndCompare({{4, 1}}); }

// With throw_on_early_termination every rank throws in the first synced pass after rank 0 joined,
// naming it, and the group stays usable (the pass's collectives were all matched).
TEST(Join, ThrowOnEarlyTerminationStopsEveryRank) {
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto pg = group(server, rank, 3);
    Net model = makeNet();
    DistributedDataParallel ddp(model.ptr(), pg);
    const int mine = rank == 0 ? 2 : 4;
    int done = 0;
    try {
      JoinOptions jo;
      jo.throw_on_early_termination = true;
      Join join(ddp, jo);
      for (; done < mine; ++done) {
        auto [x, y] = batch(done, 3);
        torch::nn::functional::cross_entropy(model->forward(x), y).backward();
      }
      join.finish();
      ADD_FAILURE() << "rank " << rank << ": no error";
    } catch (const Error& e) {
      std::string m = e.what();
      printf("rank %d: %s\n", rank, m.c_str());
      EXPECT_NE(m.find("rank(s) 0 ran out of inputs"), std::string::npos) << m;
      EXPECT_NE(m.find("throw_on_early_termination"), std::string::npos) << m;
    }
    EXPECT_EQ(done, 2) << "rank " << rank << " should stop in its third step";
    int32_t v = 1;
    pg->allreduce(&v, 1, comm::DType::i32, comm::ReduceOp::sum)->wait();
    EXPECT_EQ(v, 3);
  });
  expectAllOk(results);
}

// An allGather (as in MIL-NCE's loss) on the ranks still training, after rank 0 joined: every rank
// fails promptly; rank 0's error says it had joined and what a joined rank shadows, and names the
// allgather the others issued (the comm layer's fingerprint check), on both transports.
class JoinErrors : public ::testing::TestWithParam<std::string> {};
TEST_P(JoinErrors, AllGatherAfterJoiningIsAnErrorNamingIt) {
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto pg = group(server, rank, 3, /*timeout_s=*/10, GetParam());
    Net model = makeNet();
    DistributedDataParallel ddp(model.ptr(), pg);
    const int mine = rank == 0 ? 1 : 3;
    auto t0 = std::chrono::steady_clock::now();
    try {
      Join join(ddp);
      for (int s = 0; s < mine; ++s) {
        auto [x, y] = batch(s, 3);
        auto out = dtrain::allGather(model->forward(x.narrow(0, rank * kPerRank, kPerRank)), *pg);
        torch::nn::functional::cross_entropy(out, y).backward();
      }
      join.finish();
      ADD_FAILURE() << "rank " << rank << ": no error";
    } catch (const Error& e) {
      std::string m = e.what();
      printf("rank %d: %s\n", rank, m.c_str());
      EXPECT_NE(m.find("allgather"), std::string::npos) << m;
      if (rank == 0) {
        EXPECT_NE(m.find("had joined"), std::string::npos) << m;
        EXPECT_NE(m.find("DDP gradient allreduces and buffer broadcasts"), std::string::npos) << m;
      }
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 8.0)
        << "rank " << rank << " should fail before the 10 s timeout";
  });
  expectAllOk(results);
}

INSTANTIATE_TEST_SUITE_P(Transport, JoinErrors, ::testing::Values("shm", "tcp"), [](const auto& p) { return p.param; });

// Without Join, uneven batches are an error on the rank still training that points to Join (here
// rank 0 ran out and went on to a barrier; rank 1's next gradient allreduce meets it).
TEST(JoinScope, UnevenBatchesWithoutJoinPointToIt) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2, /*timeout_s=*/10);
    Net model = makeNet();
    DistributedDataParallel ddp(model.ptr(), pg);
    try {
      for (int s = 0; s < (rank == 0 ? 1 : 2); ++s) {
        auto [x, y] = batch(s, 2);
        torch::nn::functional::cross_entropy(model->forward(x), y).backward();
      }
      pg->barrier()->wait();
      ADD_FAILURE() << "rank " << rank << ": no error";
    } catch (const Error& e) {
      std::string m = e.what();
      printf("rank %d: %s\n", rank, m.c_str());
      EXPECT_NE(m.find(rank == 0 ? "barrier" : "dtrain::Join scope"), std::string::npos) << m;
    }
  });
  expectAllOk(results);
}

// beforeForward() (or ddp.forward) is a broadcast a joined rank would not shadow: refused at once.
TEST(JoinScope, BeforeForwardInsideAJoinScopeIsRefused) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    Net model = makeNet(/*bn=*/true);
    DistributedDataParallel ddp(model.ptr(), pg);
    Join join(ddp);
    try {
      ddp.beforeForward();
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("dtrain::Join scope"), std::string::npos) << e.what();
    }
  });  // join's destructor joins: nobody trained, so it finishes at once
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
