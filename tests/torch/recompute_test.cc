// Activation recomputation (dtrain/recompute.h): a Sequential with dropout recomputed in 1-4 segments
// gives the same output and gradients as running it whole; a single recomputed segment; with DDP on 2
// ranks and with ZeRO stage 1 on 3 ranks, training with recomputation equals one process without it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/recompute.h"
#include "dtrain/zero.h"
#include "harness.h"

namespace dtrain::test {
namespace {

torch::nn::Sequential makeSeq(bool dropout) {
  torch::manual_seed(5);
  torch::nn::Sequential s(torch::nn::Linear(6, 24), torch::nn::ReLU(), torch::nn::Dropout(dropout ? 0.3 : 0.0),
                          torch::nn::Linear(24, 24), torch::nn::Tanh(), torch::nn::Linear(24, 11),
                          torch::nn::ReLU(), torch::nn::Linear(11, 3));
  s->to(torch::kDouble);
  return s;
}

struct SeqNetImpl : torch::nn::Module {
  explicit SeqNetImpl(int segments) : segments(segments) { seq = register_module("seq", makeSeq(false)); }
  torch::Tensor forward(torch::Tensor x) { return segments > 0 ? recomputeSequential(seq, segments, x) : seq->forward(x); }
  torch::nn::Sequential seq{nullptr};
  int segments;
};
TORCH_MODULE(SeqNet);

TEST(Recompute, SequentialEqualsRunningItWhole) {
  auto x0 = torch::randn({5, 6}, torch::kDouble);
  for (int segments = 1; segments <= 4; ++segments) {
    auto plain = makeSeq(true), again = makeSeq(true);
    auto x1 = x0.clone().requires_grad_(true), x2 = x0.clone().requires_grad_(true);
    torch::manual_seed(99);
    auto y1 = plain->forward(x1);
    torch::manual_seed(99);
    auto y2 = recomputeSequential(again, segments, x2);
    ASSERT_TRUE(torch::equal(y1, y2)) << segments << " segments";
    (y1 * y1).sum().backward();
    (y2 * y2).sum().backward();
    EXPECT_TRUE(torch::allclose(x1.grad(), x2.grad(), 1e-12, 1e-12)) << segments << " segments: input gradient";
    auto p1 = plain->parameters(), p2 = again->parameters();
    for (size_t i = 0; i < p1.size(); ++i)
      EXPECT_TRUE(torch::allclose(p1[i].grad(), p2[i].grad(), 1e-12, 1e-12)) << segments << " segments: parameter " << i;
  }
  auto s = makeSeq(false);
  EXPECT_THROW(recomputeSequential(s, 0, x0), InvalidArgument);
  EXPECT_THROW(recomputeSequential(s, 9, x0), InvalidArgument);
}

TEST(Recompute, OneSegmentKeepsNoActivationsButGivesTheSameGradients) {
  auto block = makeSeq(true);
  auto x = torch::randn({4, 6}, torch::kDouble).requires_grad_(true);
  torch::manual_seed(3);
  auto y = recompute([&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{block->forward(in[0])}; },
                     {x}, block->parameters())[0];
  EXPECT_TRUE(y.requires_grad());
  EXPECT_NE(y.grad_fn()->name().find("RecomputeFunction"), std::string::npos)
      << y.grad_fn()->name() << ": the output's node is not the recomputation's (the segment's graph was kept)";
  y.sum().backward();
  auto ref = makeSeq(true);
  auto xr = x.detach().clone().requires_grad_(true);
  torch::manual_seed(3);
  ref->forward(xr).sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), xr.grad(), 1e-12, 1e-12));
  for (size_t i = 0; i < ref->parameters().size(); ++i)
    EXPECT_TRUE(torch::allclose(block->parameters()[i].grad(), ref->parameters()[i].grad(), 1e-12, 1e-12)) << i;
}

std::pair<torch::Tensor, torch::Tensor> step12(int s) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(700 + s);
  return {at::randn({12, 6}, g, torch::kDouble), at::randint(0, 3, {12}, g, torch::kLong)};
}

// world ranks, DDP, recomputation in 2 segments, optionally ZeRO stage 1 (Adam), against one process
// running the model whole with the plain optimizer.
void recomputedTrainingEqualsOneProcess(int world, bool zero) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    SeqNet model(2), ref(0);
    DDPOptions d;
    d.bucket_bytes = d.first_bucket_bytes = 1024;
    DistributedDataParallel ddp(model.ptr(), pg, d);
    auto make = [](std::vector<torch::optim::OptimizerParamGroup> g) {
      return std::make_unique<torch::optim::Adam>(std::move(g), torch::optim::AdamOptions(0.01));
    };
    std::unique_ptr<ZeroRedundancyOptimizer> zopt;
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (zero) zopt = std::make_unique<ZeroRedundancyOptimizer>(model->parameters(), make, pg);
    else opt = make({torch::optim::OptimizerParamGroup(model->parameters())});
    auto ref_opt = make({torch::optim::OptimizerParamGroup(ref->parameters())});
    const int rows = 12 / world;
    for (int s = 0; s < 5; ++s) {
      auto [x, y] = step12(s);
      if (zero) zopt->zeroGrad();
      else opt->zero_grad();
      auto out = ddp.forward(model, x.narrow(0, rank * rows, rows));
      torch::nn::functional::cross_entropy(out, y.narrow(0, rank * rows, rows)).backward();
      if (zero) zopt->step();
      else opt->step();
      ref_opt->zero_grad();
      torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
      ref_opt->step();
    }
    expectClose(*model, *ref, 1e-5, fmt::format("recomputed, {} rank {} of {}", zero ? "ZeRO-1" : "DDP", rank, world));
  });
  expectAllOk(results);
}

TEST(Recompute, WithDdpOnTwoRanksEqualsOneProcess) { recomputedTrainingEqualsOneProcess(2, false); }
TEST(Recompute, WithZeroStage1OnThreeRanksEqualsOneProcess) { recomputedTrainingEqualsOneProcess(3, true); }

}  // namespace
}  // namespace dtrain::test
