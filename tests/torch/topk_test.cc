// The top-k hook (dtrain/topk.h) on 1 and 3 real processes against a reference written here: one
// process simulates every rank's residual, momentum and selection (by sorting, not torch::topk) on the
// same buckets, sums the selected pairs and steps plain SGD. After several steps both must agree.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <numeric>

#include "ddp_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/topk.h"
#include "harness.h"

namespace dtrain::test {
namespace {

constexpr double kLr = 0.1;
constexpr int kSteps = 6;

// The k entries of v largest in magnitude (ties: the lower index first), by a full sort.
std::vector<int64_t> largest(const at::Tensor& v, int64_t k) {
  std::vector<int64_t> order(static_cast<size_t>(v.numel()));
  std::iota(order.begin(), order.end(), 0);
  auto a = v.accessor<double, 1>();
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return std::abs(a[x]) > std::abs(a[y]); });
  order.resize(static_cast<size_t>(k));
  return order;
}

// One bucket of the reference: every rank's residual and momentum.
struct RefBucket {
  std::vector<size_t> params;
  std::vector<at::Tensor> u, v;
};

// The reference's averaged gradient of one bucket for this step, from every rank's local gradient.
at::Tensor referenceBucket(const TopKOptions& o, RefBucket& rb, const std::vector<at::Tensor>& local, int64_t step) {
  const int world = static_cast<int>(local.size());
  const int64_t n = local[0].numel();
  if (n < o.min_compress_numel) return torch::stack(local).mean(0);
  const double ratio = step / o.steps_per_stage < o.warmup_stages
                           ? std::max(std::pow(std::pow(o.ratio, 1.0 / (o.warmup_stages + 1)),
                                               static_cast<double>(step / o.steps_per_stage + 1)),
                                      o.ratio)
                           : o.ratio;
  const auto k = std::min<int64_t>(n, static_cast<int64_t>(std::ceil(ratio * static_cast<double>(n))));
  at::Tensor sum = torch::zeros({n}, torch::kDouble);
  for (int r = 0; r < world; ++r) {
    at::Tensor g = local[r].clone();
    if (o.clip_norm > 0) {
      const double max_norm = o.clip_norm / std::sqrt(static_cast<double>(world));
      const double norm = std::sqrt(g.pow(2).sum().item<double>());
      if (max_norm / (norm + 1e-6) < 1) g = g * (max_norm / (norm + 1e-6));
    }
    if (o.momentum == 0) {
      rb.v[r] = rb.v[r] + g;
    } else if (o.nesterov) {
      rb.u[r] = (rb.u[r] + g) * o.momentum;
      rb.v[r] = rb.v[r] + rb.u[r] + g;
    } else {
      rb.u[r] = rb.u[r] * o.momentum + g;
      rb.v[r] = rb.v[r] + rb.u[r];
    }
    auto v = rb.v[r].accessor<double, 1>();
    auto u = rb.u[r].accessor<double, 1>();
    auto s = sum.accessor<double, 1>();
    for (int64_t i : largest(rb.v[r], k)) {
      s[i] += v[i];
      v[i] = 0;
      u[i] = 0;
    }
  }
  return sum / world;
}

// Each rank trains with DDP and the hook; alongside, the reference simulates all ranks on the same
// bucket layout (no rebuild) and steps plain SGD with the averaged sparse gradient.
void trainAndCompare(int world, const TopKOptions& o) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    Net model = makeNet(), ref = makeNet();
    DDPOptions d;
    d.bucket_bytes = d.first_bucket_bytes = 1200;  // several buckets: fc3's small ones are averaged as they are
    d.rebuild_buckets = false;
    DistributedDataParallel ddp(model.ptr(), pg, d);
    ddp.registerCommHook(topKHook(o));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
    auto ref_params = ref->parameters();
    std::vector<RefBucket> buckets;
    for (const auto& ps : ddp.bucketLayout()) {
      int64_t n = 0;
      for (size_t p : ps) n += ref_params[p].numel();
      buckets.push_back({ps, std::vector<at::Tensor>(world, torch::zeros({n}, torch::kDouble)),
                         std::vector<at::Tensor>(world, torch::zeros({n}, torch::kDouble))});
    }
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, world);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(x.narrow(0, rank * kPerRank, kPerRank)),
                                           y.narrow(0, rank * kPerRank, kPerRank))
          .backward();
      opt.step();
      // The reference: each rank's local gradient, flattened per bucket in DDP's parameter order.
      std::vector<std::vector<at::Tensor>> local(buckets.size());
      for (int r = 0; r < world; ++r) {
        ref->zero_grad();
        torch::nn::functional::cross_entropy(ref->forward(x.narrow(0, r * kPerRank, kPerRank)),
                                             y.narrow(0, r * kPerRank, kPerRank))
            .backward();
        for (size_t b = 0; b < buckets.size(); ++b) {
          std::vector<at::Tensor> parts;
          for (size_t p : buckets[b].params) parts.push_back(ref_params[p].grad().reshape(-1));
          local[b].push_back(torch::cat(parts));
        }
      }
      torch::NoGradGuard g;
      for (size_t b = 0; b < buckets.size(); ++b) {
        at::Tensor avg = referenceBucket(o, buckets[b], local[b], step);
        int64_t off = 0;
        for (size_t p : buckets[b].params) {
          auto& w = ref_params[p];
          w.sub_(kLr * avg.narrow(0, off, w.numel()).view_as(w));
          off += w.numel();
        }
      }
    }
    expectClose(*model, *ref, 1e-6, fmt::format("rank {} world {} topk", rank, world));
  });
  expectAllOk(results);
}

class TopK : public ::testing::TestWithParam<int> {};

TEST_P(TopK, ErrorFeedbackEqualsTheReference) {
  TopKOptions o;
  o.ratio = 0.05;
  o.min_compress_numel = 64;
  trainAndCompare(GetParam(), o);
}

TEST_P(TopK, MomentumCorrectionClippingAndWarmUpEqualTheReference) {
  TopKOptions o;
  o.ratio = 0.02;
  o.momentum = 0.9;
  o.clip_norm = 0.5;
  o.warmup_stages = 2;
  o.steps_per_stage = 2;
  o.min_compress_numel = 64;
  trainAndCompare(GetParam(), o);
}

TEST_P(TopK, NesterovEqualsTheReference) {
  TopKOptions o;
  o.ratio = 0.1;
  o.momentum = 0.5;
  o.nesterov = true;
  o.min_compress_numel = 64;
  trainAndCompare(GetParam(), o);
}

INSTANTIATE_TEST_SUITE_P(World, TopK, ::testing::Values(1, 3), [](const auto& p) {
  return "world" + std::to_string(p.param);
});

// With DDP's bucket rebuild on (the default; the hook restarts a changed bucket's residual), every rank
// applies the same update: the replicas stay identical.
TEST(TopKRebuild, ReplicasStayIdenticalWithRebuildOn) {
  StoreServer server;
  const int world = 3;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    Net model = makeNet();
    DDPOptions d;
    d.bucket_bytes = d.first_bucket_bytes = 1200;
    DistributedDataParallel ddp(model.ptr(), pg, d);
    TopKOptions o;
    o.ratio = 0.05;
    o.momentum = 0.9;
    o.min_compress_numel = 64;
    ddp.registerCommHook(topKHook(o));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = batch(step, world);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(x.narrow(0, rank * kPerRank, kPerRank)),
                                           y.narrow(0, rank * kPerRank, kPerRank))
          .backward();
      opt.step();
    }
    double sum = 0;
    for (auto& p : model->parameters()) sum += (p * p).sum().item<double>() + p.sum().item<double>();
    std::vector<double> all(world);
    pg->allgather(&sum, all.data(), 1, comm::DType::f64)->wait();
    for (int r = 0; r < world; ++r) EXPECT_EQ(all[r], all[0]) << "rank " << r << " diverged";
  });
  expectAllOk(results);
}

TEST(TopKOptions, WarmUpFollowsDgcAndBadOptionsAreNamed) {
  TopKOptions o;
  o.ratio = 0.001;
  o.warmup_stages = 4;
  o.steps_per_stage = 10;
  // DGC's example: 75%, 93.75%, 98.4375%, 99.6%, then 99.9% sparsity (0.001^(1/5) = 0.2512).
  EXPECT_NEAR(topKRatioAt(o, 0), 0.2512, 1e-4);
  EXPECT_NEAR(topKRatioAt(o, 19), 0.0631, 1e-4);
  EXPECT_NEAR(topKRatioAt(o, 25), 0.01585, 1e-4);
  EXPECT_NEAR(topKRatioAt(o, 39), 0.00398, 1e-5);
  EXPECT_DOUBLE_EQ(topKRatioAt(o, 40), 0.001);
  o.ratio = 0;
  EXPECT_NE(errorOf([&] { topKHook(o); }).find("ratio 0 is not in (0, 1]"), std::string::npos);
  o.ratio = 0.1;
  o.momentum = 1;
  EXPECT_NE(errorOf([&] { topKHook(o); }).find("momentum 1 is not in [0, 1)"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::test
