// Tensor-parallel layers on 2 and 4 real processes against the unsplit layers run by one process:
// the parallel MLP (column + row parallel), a gathered column-parallel layer feeding a row-parallel
// layer that scatters its input, and the vocabulary-parallel embedding; forward outputs, input
// gradients and every rank's slice of the weight gradients. Widths are not multiples of 4, so the
// splits are uneven.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/comm/error.h"
#include "dtrain/tensor_parallel.h"
#include "harness.h"

namespace dtrain::test {
namespace {

constexpr double kTol = 1e-10;  // double precision throughout

std::shared_ptr<comm::ProcessGroup> group(const StoreServer& s, int rank, int world) {
  comm::GroupOptions o;
  o.timeout = std::chrono::seconds(30);
  return comm::ProcessGroup::create(s.client(), rank, world, o);
}

double diff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a - b).abs().max().item<double>();
}

torch::nn::Linear linear(int64_t in, int64_t out) {
  torch::nn::Linear l(in, out);
  l->to(torch::kDouble);
  return l;
}

// The upstream gradient: loss = sum(out * w) for a fixed random w.
at::Tensor weights(c10::IntArrayRef shape) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(99);
  return at::randn(shape, g, torch::kDouble);
}

class TensorParallel : public testing::TestWithParam<int> {};

TEST_P(TensorParallel, MlpEqualsUnsplitLayers) {
  const int world = GetParam();
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    torch::manual_seed(3);
    auto fc1 = linear(8, 10), fc2 = linear(10, 8);
    ParallelMLP mlp(fc1, fc2, pg);
    auto g = at::make_generator<at::CPUGeneratorImpl>(5);
    auto x = at::randn({2, 3, 8}, g, torch::kDouble).requires_grad_(true);
    auto xr = x.detach().clone().requires_grad_(true);

    auto y = mlp->forward(x);
    (y * weights(y.sizes())).sum().backward();
    auto yr = fc2->forward(torch::gelu(fc1->forward(xr)));
    (yr * weights(yr.sizes())).sum().backward();

    EXPECT_LE(diff(y, yr), kTol) << "rank " << rank;
    EXPECT_LE(diff(x.grad(), xr.grad()), kTol) << "rank " << rank;
    auto [o0, o1] = partitionRange(10, world, rank);
    EXPECT_EQ(mlp->fc1->weight.size(0), o1 - o0);
    EXPECT_LE(diff(mlp->fc1->weight.grad(), fc1->weight.grad().narrow(0, o0, o1 - o0)), kTol);
    EXPECT_LE(diff(mlp->fc1->bias.grad(), fc1->bias.grad().narrow(0, o0, o1 - o0)), kTol);
    EXPECT_LE(diff(mlp->fc2->weight.grad(), fc2->weight.grad().narrow(1, o0, o1 - o0)), kTol);
    EXPECT_LE(diff(mlp->fc2->bias.grad(), fc2->bias.grad()), kTol);
  });
  expectAllOk(results);
}

// Column-parallel with a gathered output, then row-parallel taking its slice of a replicated input:
// exercises the gather (backward: this rank's slice) and scatter (backward: allgather) operators.
TEST_P(TensorParallel, GatherAndScatterEqualUnsplitLayers) {
  const int world = GetParam();
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    torch::manual_seed(4);
    auto a = linear(5, 7), b = linear(7, 3);
    ColumnParallelLinear col(a, pg, ColumnParallelLinearOptions{true, /*gather_output=*/true});
    RowParallelLinear row(b, pg, RowParallelLinearOptions{true, /*input_is_parallel=*/false});
    auto g = at::make_generator<at::CPUGeneratorImpl>(6);
    auto x = at::randn({4, 5}, g, torch::kDouble).requires_grad_(true);
    auto xr = x.detach().clone().requires_grad_(true);

    auto h = col->forward(x);
    auto y = row->forward(torch::tanh(h));
    (y * weights(y.sizes())).sum().backward();
    auto hr = a->forward(xr);
    auto yr = b->forward(torch::tanh(hr));
    (yr * weights(yr.sizes())).sum().backward();

    EXPECT_LE(diff(h, hr), kTol);
    EXPECT_LE(diff(y, yr), kTol);
    EXPECT_LE(diff(x.grad(), xr.grad()), kTol);
    auto [o0, o1] = partitionRange(7, world, rank);
    EXPECT_LE(diff(col->weight.grad(), a->weight.grad().narrow(0, o0, o1 - o0)), kTol);
    EXPECT_LE(diff(col->bias.grad(), a->bias.grad().narrow(0, o0, o1 - o0)), kTol);
    EXPECT_LE(diff(row->weight.grad(), b->weight.grad().narrow(1, o0, o1 - o0)), kTol);
    EXPECT_LE(diff(row->bias.grad(), b->bias.grad()), kTol);
  });
  expectAllOk(results);
}

TEST_P(TensorParallel, VocabEmbeddingEqualsUnsplitEmbedding) {
  const int world = GetParam();
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    torch::manual_seed(5);
    torch::nn::Embedding full(11, 4);
    full->to(torch::kDouble);
    VocabParallelEmbedding emb(full, pg);
    // Repeated ids, ids of every shard, and both ends of the vocabulary.
    auto ids = torch::tensor({0, 3, 10, 5, 3, 7, 9, 1, 10, 2, 6, 4}, torch::kLong).reshape({3, 4});

    auto y = emb->forward(ids);
    (y * weights(y.sizes())).sum().backward();
    auto yr = full->forward(ids);
    (yr * weights(yr.sizes())).sum().backward();

    EXPECT_LE(diff(y, yr), kTol);
    auto [v0, v1] = partitionRange(11, world, rank);
    EXPECT_EQ(emb->weight.size(0), v1 - v0);
    EXPECT_LE(diff(emb->weight.grad(), full->weight.grad().narrow(0, v0, v1 - v0)), kTol);
    EXPECT_THROW(emb->forward(torch::tensor({11}, torch::kLong)), InvalidArgument);
  });
  expectAllOk(results);
}

// Without a full layer, the same seed gives the same model whatever the number of ranks: the layer
// is the unsplit torch::nn::Linear that seed would have built.
TEST_P(TensorParallel, SeededInitIsTheUnsplitInit) {
  const int world = GetParam();
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    torch::manual_seed(8);
    ColumnParallelLinear col(6, 9, pg);
    torch::manual_seed(8);
    torch::nn::Linear ref(6, 9);
    auto [o0, o1] = partitionRange(9, world, rank);
    EXPECT_EQ(diff(col->weight, ref->weight.narrow(0, o0, o1 - o0)), 0.0);
    EXPECT_EQ(diff(col->bias, ref->bias.narrow(0, o0, o1 - o0)), 0.0);
  });
  expectAllOk(results);
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallel, testing::Values(2, 4),
                         [](const testing::TestParamInfo<int>& i) { return fmt::format("world{}", i.param); });

TEST(TensorParallelSplit, PartitionRangeCoversEveryIndexOnce) {
  for (int parts = 1; parts <= 5; ++parts) {
    int64_t next = 0;
    for (int r = 0; r < parts; ++r) {
      auto [b, e] = partitionRange(11, parts, r);
      EXPECT_EQ(b, next);
      EXPECT_GE(e - b, 11 / parts);
      EXPECT_LE(e - b, 11 / parts + 1);
      next = e;
    }
    EXPECT_EQ(next, 11);
  }
}

}  // namespace
}  // namespace dtrain::test
