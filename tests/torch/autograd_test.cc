// Differentiable allGather / allReduce on 1, 2 and 3 real processes. Every rank rebuilds all ranks'
// inputs and losses locally (they are deterministic), so each distributed gradient is checked
// against a single-process autograd reference of the same total loss, built with cat / sum.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/autograd.h"
#include "dtrain/comm/error.h"
#include "harness.h"

namespace dtrain::test {
namespace {

constexpr int64_t kCols = 3;

// Uneven dim-0 sizes, with an empty rank from world 2 on: [2], [2, 0], [2, 0, 4].
int64_t rowsOf(int rank) { return rank == 1 ? 0 : rank + 2; }

// Rank j's input: distinct values per rank, row and column.
at::Tensor inputOf(int j) {
  auto x = at::arange(rowsOf(j) * kCols, torch::kDouble).reshape({rowsOf(j), kCols});
  return (x * 0.1 + j).sin();
}

// Rank j's loss weights over a tensor of the given shape: rank-specific, so sum and local differ.
at::Tensor weightsOf(int j, at::IntArrayRef shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return (at::arange(n, torch::kDouble).reshape(shape) * (0.3 + j) + j).cos();
}

// Rank j's loss of the collective's output: nonlinear so the gradient depends on the values.
at::Tensor lossOf(int j, const at::Tensor& y) { return (weightsOf(j, y.sizes()) * y.tanh()).sum(); }

std::shared_ptr<comm::ProcessGroup> group(const StoreServer& s, int rank, int world) {
  comm::GroupOptions o;
  o.timeout = std::chrono::seconds(30);
  return comm::ProcessGroup::create(s.client(), rank, world, o);
}

void expectNear(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  if (want.numel() == 0) return;
  double diff = (got - want).abs().max().item<double>();
  EXPECT_LE(diff, 1e-12) << what << "\ngot\n" << got << "\nwant\n" << want;
}

class Autograd : public ::testing::TestWithParam<int> {
 protected:
  void runGroup(const std::function<void(comm::ProcessGroup&)>& fn) {
    StoreServer server;
    const int world = GetParam();
    expectAllOk(runRanks(world, [&](int rank) {
      auto pg = group(server, rank, world);
      fn(*pg);
    }));
  }
};

TEST_P(Autograd, AllGatherForwardConcatenatesUnevenRows) {
  runGroup([](comm::ProcessGroup& pg) {
    const int w = pg.size(), r = pg.rank();
    std::vector<at::Tensor> all;
    for (int j = 0; j < w; ++j) all.push_back(inputOf(j));
    at::Tensor x = inputOf(r);
    at::Tensor before = x.clone();
    expectNear(allGather(x, pg), at::cat(all), "gathered rows");
    expectNear(x, before, "input unchanged");

    // 1-d, integer (forward only), and every rank empty.
    at::Tensor ints = at::arange(r + 1, torch::kLong) + 10 * r;
    std::vector<at::Tensor> all_ints;
    for (int j = 0; j < w; ++j) all_ints.push_back(at::arange(j + 1, torch::kLong) + 10 * j);
    EXPECT_TRUE(allGather(ints, pg).equal(at::cat(all_ints)));
    EXPECT_EQ(allGather(at::zeros({0, 5}), pg).sizes(), (std::vector<int64_t>{0, 5}));
  });
}

// d(sum_j L_j)/dx_r, the reference of mode sum; d L_r / dx_r, the reference of mode local.
at::Tensor referenceGatherGrad(int r, int w, bool own_loss_only) {
  std::vector<at::Tensor> xs;
  for (int j = 0; j < w; ++j) xs.push_back(inputOf(j).requires_grad_());
  at::Tensor y = at::cat(xs);
  at::Tensor total = at::zeros({}, torch::kDouble);
  for (int j = 0; j < w; ++j)
    if (!own_loss_only || j == r) total = total + lossOf(j, y);
  return torch::autograd::grad({total}, {xs[r]}, {}, false, false, /*allow_unused=*/true)[0];
}

TEST_P(Autograd, AllGatherSumGradientIsTheGradientOfAllRanksLosses) {
  runGroup([](comm::ProcessGroup& pg) {
    const int w = pg.size(), r = pg.rank();
    at::Tensor x = inputOf(r).requires_grad_();
    lossOf(r, allGather(x, pg, AllGatherGrad::sum)).backward();
    at::Tensor want = referenceGatherGrad(r, w, false);
    expectNear(x.grad().defined() ? x.grad() : at::zeros_like(x), want.defined() ? want : at::zeros_like(x),
               "sum-mode gradient");
  });
}

TEST_P(Autograd, AllGatherLocalGradientIsOwnSlice) {
  runGroup([](comm::ProcessGroup& pg) {
    const int w = pg.size(), r = pg.rank();
    at::Tensor x = inputOf(r).requires_grad_();
    lossOf(r, allGather(x, pg, AllGatherGrad::local)).backward();
    at::Tensor want = referenceGatherGrad(r, w, true);
    expectNear(x.grad().defined() ? x.grad() : at::zeros_like(x), want.defined() ? want : at::zeros_like(x),
               "local-mode gradient");
  });
}

// The MIL-NCE situation: every rank computes the same global loss. Then sum = world x local.
TEST_P(Autograd, SameGlobalLossOnEveryRankSumIsWorldTimesLocal) {
  runGroup([](comm::ProcessGroup& pg) {
    const int w = pg.size(), r = pg.rank();
    at::Tensor grads[2];
    for (auto mode : {AllGatherGrad::sum, AllGatherGrad::local}) {
      at::Tensor x = inputOf(r).requires_grad_();
      lossOf(0, allGather(x, pg, mode)).backward();  // loss 0 everywhere
      grads[mode == AllGatherGrad::sum ? 0 : 1] = x.grad().defined() ? x.grad() : at::zeros_like(x);
    }
    expectNear(grads[0], grads[1] * w, "sum vs world * local");
  });
}

TEST_P(Autograd, AllGatherOfStridedInputAndReusedOutput) {
  runGroup([](comm::ProcessGroup& pg) {
    const int w = pg.size(), r = pg.rank();
    // A transposed (non-contiguous) leaf whose gathered output feeds two terms of the loss.
    at::Tensor base = inputOf(r).t().contiguous().requires_grad_();  // [kCols, rows]
    at::Tensor y = allGather(base.t(), pg);
    at::Tensor loss = lossOf(r, y) + 0.5 * lossOf(r, y * y);
    loss.backward();

    std::vector<at::Tensor> xs;
    for (int j = 0; j < w; ++j) xs.push_back(inputOf(j).requires_grad_());
    at::Tensor ry = at::cat(xs);
    at::Tensor total = at::zeros({}, torch::kDouble);
    for (int j = 0; j < w; ++j) total = total + lossOf(j, ry) + 0.5 * lossOf(j, ry * ry);
    auto want = torch::autograd::grad({total}, {xs[r]}, {}, false, false, true)[0];
    if (!want.defined()) want = at::zeros_like(xs[r]);
    expectNear(base.grad().t(), want, "gradient through a transpose");
  });
}

// Mismatches need at least two ranks: its own suite, instantiated for 2 and 3.
class AutogradMultiRank : public Autograd {};

TEST_P(AutogradMultiRank, AllGatherRejectsMismatchedShapesOnEveryRank) {
  runGroup([](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    try {
      allGather(at::zeros({2, r == 1 ? 4 : 3}), pg);
      ADD_FAILURE() << "mismatched trailing dims accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1: Float [2, 4]"), std::string::npos) << e.what();
    }
    try {
      allGather(at::zeros({2, 3}, r == 1 ? torch::kDouble : torch::kFloat), pg);
      ADD_FAILURE() << "mismatched dtypes accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1: Double"), std::string::npos) << e.what();
    }
    // The group is still usable: the failed calls left the ranks in step.
    EXPECT_EQ(allGather(at::ones({1, 2}), pg).size(0), pg.size());
  });
}

TEST(AutogradLocal, RejectsScalarsAndUnsupportedDtypes) {
  StoreServer server;
  expectAllOk(runRanks(1, [&](int rank) {
    auto pg = group(server, rank, 1);
    EXPECT_THROW(allGather(at::ones({}), *pg), InvalidArgument);
    EXPECT_THROW(allGather(at::ones({2}, torch::kBool), *pg), InvalidArgument);
    EXPECT_THROW(allReduce(at::ones({2}, torch::kComplexFloat), *pg), InvalidArgument);
  }));
}

TEST_P(Autograd, AllReduceForwardIsOutOfPlace) {
  runGroup([](comm::ProcessGroup& pg) {
    const int w = pg.size(), r = pg.rank();
    at::Tensor x = at::arange(6, torch::kDouble).reshape({2, 3}) + r;
    at::Tensor before = x.clone();
    at::Tensor base = at::arange(6, torch::kDouble).reshape({2, 3});
    double rank_sum = w * (w - 1) / 2.0;
    expectNear(allReduce(x, pg), base * w + rank_sum, "sum");
    expectNear(allReduce(x, pg, comm::ReduceOp::avg), base + rank_sum / w, "avg");
    expectNear(allReduce(x, pg, comm::ReduceOp::max), base + (w - 1), "max");
    expectNear(x, before, "input unchanged");
  });
}

TEST_P(Autograd, AllReduceGradients) {
  runGroup([](comm::ProcessGroup& pg) {
    const int w = pg.size(), r = pg.rank();
    for (auto op : {comm::ReduceOp::sum, comm::ReduceOp::avg}) {
      auto input = [](int j) { return (at::arange(8, torch::kDouble).reshape({2, 4}) * 0.2 - j).cos(); };
      at::Tensor x = input(r).requires_grad_();
      lossOf(r, allReduce(x, pg, op)).backward();

      std::vector<at::Tensor> xs;
      for (int j = 0; j < w; ++j) xs.push_back(input(j).requires_grad_());
      at::Tensor y = at::stack(xs).sum(0);
      if (op == comm::ReduceOp::avg) y = y / w;
      at::Tensor total = at::zeros({}, torch::kDouble);
      for (int j = 0; j < w; ++j) total = total + lossOf(j, y);
      auto want = torch::autograd::grad({total}, {xs[r]})[0];
      expectNear(x.grad(), want, std::string("allReduce ") + comm::reduceOpName(op));
    }
  });
}

TEST_P(Autograd, AllReduceMaxIsNotDifferentiable) {
  runGroup([](comm::ProcessGroup& pg) {
    at::Tensor x = at::ones({3}, torch::kDouble).requires_grad_();
    at::Tensor y = allReduce(x, pg, comm::ReduceOp::max);
    try {
      y.sum().backward();
      ADD_FAILURE() << "backward through allReduce(max) succeeded";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("allReduce(max) is not differentiable"), std::string::npos) << e.what();
    }
    // Forward without autograd is fine.
    EXPECT_EQ(allReduce(at::ones({3}), pg, comm::ReduceOp::max).sum().item<float>(), 3.0f);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Autograd, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& p) { return "world" + std::to_string(p.param); });
INSTANTIATE_TEST_SUITE_P(MultiRank, AutogradMultiRank, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& p) { return "world" + std::to_string(p.param); });

}  // namespace
}  // namespace dtrain::test
