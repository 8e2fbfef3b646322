// DDP with BatchNorm following the README's loop (model->forward, no beforeForward()): every rank's
// buffers at the start of every forward are what PyTorch's DDP would have there, on 2 and 3 ranks,
// with noSync accumulation and eval forwards in between, with broadcast_buffers on and off.
//
// The reference is an emulation of PyTorch 1.13's DistributedDataParallel.forward in one process:
// each rank r has buffers B[r]; a forward first copies B[0] into every B[r] when the previous forward
// was a synced one in grad mode (require_forward_param_sync, initially true) and broadcast_buffers is
// set; then rank r's forward updates B[r] from rank r's batch. The gradients come from the same
// emulation (the sum of every rank's micro-batch losses / world), so parameters are checked too.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/ddp.h"
#include "ddp_test_util.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using Buffers = std::vector<torch::Tensor>;

Buffers snapshot(torch::nn::Module& m) {
  Buffers out;
  for (auto& b : m.buffers()) out.push_back(b.clone());
  return out;
}
void install(torch::nn::Module& m, const Buffers& bs) {
  torch::NoGradGuard g;
  auto dst = m.buffers();
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(bs[i]);
}
double maxDiff(const Buffers& a, const Buffers& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i)
    d = std::max(d, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  return d;
}

// Steps alternate between one micro-batch and three (the first two under noSync); after every step an
// eval forward (no_grad) on a fixed batch.
int microBatches(int step) { return step % 2 == 0 ? 1 : 3; }

void readmeLoopWithBatchNorm(int world, bool broadcast_buffers) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    Net model = makeNet(/*bn=*/true), ref = makeNet(/*bn=*/true);
    if (rank != 0) {  // DDP starts every rank from rank 0's weights and buffers
      torch::NoGradGuard g;
      for (auto& p : model->parameters()) p.add_(0.5 * rank);
      for (auto& b : model->buffers()) b.add_(rank);
    }
    DDPOptions o;
    o.bucket_bytes = o.first_bucket_bytes = 256;
    o.broadcast_buffers = broadcast_buffers;
    DistributedDataParallel ddp(model.ptr(), pg, o);
    auto opt = makeOpt("sgd", *model), ref_opt = makeOpt("sgd", *ref);

    std::vector<Buffers> B(world, snapshot(*ref));  // what PyTorch's rank r holds
    bool param_sync = true;                         // PyTorch's require_forward_param_sync
    auto pytorchForwardStart = [&] {
      if (param_sync && broadcast_buffers)
        for (int r = 1; r < world; ++r) B[r] = B[0];
    };
    auto checkBuffers = [&](const std::string& where) {
      double d = maxDiff(snapshot(*model), B[rank]);
      EXPECT_LE(d, 1e-9) << "rank " << rank << " " << where << ": buffers differ from PyTorch DDP's by " << d;
    };
    auto [xe, ye] = batch(999, 1);
    int forwards = 0;
    for (int step = 0; step < 6; ++step) {
      const int K = microBatches(step);
      opt->zero_grad();
      ref_opt->zero_grad();
      for (int k = 0; k < K; ++k) {
        auto [x, y] = batch(step * 10 + k, world);
        const bool synced = k + 1 == K;
        pytorchForwardStart();
        checkBuffers(fmt::format("before training forward {} (step {}, micro {})", forwards++, step, k));
        for (int r = 0; r < world; ++r) {  // the reference: every rank's forward on its own buffers
          install(*ref, B[r]);
          auto l = torch::nn::functional::cross_entropy(ref->forward(x.narrow(0, r * kPerRank, kPerRank)),
                                                        y.narrow(0, r * kPerRank, kPerRank));
          (l / world).backward();
          B[r] = snapshot(*ref);
        }
        param_sync = synced;  // grad mode, and require_backward_grad_sync unless under no_sync
        // The README's loop, on this rank's slice.
        auto loss = torch::nn::functional::cross_entropy(model->forward(x.narrow(0, rank * kPerRank, kPerRank)),
                                                         y.narrow(0, rank * kPerRank, kPerRank));
        if (synced) {
          loss.backward();
        } else {
          auto guard = ddp.noSync();
          loss.backward();
        }
      }
      opt->step();
      ref_opt->step();
      // Evaluation: BatchNorm uses the running statistics, so the output shows whose they are.
      pytorchForwardStart();
      checkBuffers(fmt::format("before the eval forward after step {}", step));
      model->eval();
      ref->eval();
      torch::NoGradGuard no_grad;
      install(*ref, B[rank]);
      auto want = ref->forward(xe), got = model->forward(xe);
      EXPECT_LE((want - got).abs().max().item<double>(), 1e-6) << "rank " << rank << " eval after step " << step;
      param_sync = false;  // a no_grad forward
      model->train();
      ref->train();
    }
    install(*ref, B[rank]);
    expectClose(*model, *ref, 1e-6, fmt::format("rank {} of {}", rank, world));
    // The point of the exercise: with broadcast_buffers each rank's statistics are rank 0's, which
    // evolved from rank 0's batches only; without it each rank keeps its own.
    if (rank > 0) {
      double d0 = maxDiff(snapshot(*model), B[0]);
      if (broadcast_buffers) EXPECT_LE(d0, 1e-9);
      else EXPECT_GT(d0, 1e-3) << "ranks' buffers should have drifted apart";
    }
  });
  expectAllOk(results);
}

class DDPBuffers : public ::testing::TestWithParam<int> {};

TEST_P(DDPBuffers, ReadmeLoopKeepsRankZerosBatchNormStatistics) { readmeLoopWithBatchNorm(GetParam(), true); }
TEST_P(DDPBuffers, BroadcastBuffersOffKeepsEachRanksOwn) { readmeLoopWithBatchNorm(GetParam(), false); }

INSTANTIATE_TEST_SUITE_P(World, DDPBuffers, ::testing::Values(2, 3), [](const auto& p) {
  return "world" + std::to_string(p.param);
});

}  // namespace
}  // namespace dtrain::test
