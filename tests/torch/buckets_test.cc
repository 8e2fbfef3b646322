// Bucketing: the one rule (detail::assignBuckets) that DistributedDataParallel and
// ps::DistributedModule both use, and a check that both really get their layouts from it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/ddp.h"
#include "dtrain/ps.h"
#include "dtrain/ps_module.h"
#include "harness.h"
#include "ps_test_util.h"
#include "torch/buckets.h"

namespace dtrain::test {
namespace {

using Layout = std::vector<std::vector<size_t>>;

std::vector<at::Tensor> tensors(const std::vector<std::pair<int64_t, c10::ScalarType>>& spec) {
  std::vector<at::Tensor> out;
  for (auto [n, t] : spec) out.push_back(at::zeros({n}, at::TensorOptions().dtype(t)));
  return out;
}

TEST(AssignBuckets, ReverseOrderFirstBucketSmallThenFull) {
  // Six float parameters of 4 elements (16 bytes each).
  std::vector<at::Tensor> ps;
  for (int i = 0; i < 6; ++i) ps.push_back(at::zeros({4}, at::kFloat));
  detail::BucketSizes s{/*bucket_bytes=*/48, /*first_bucket_bytes=*/16};
  EXPECT_EQ(detail::reverseOrder(6), (std::vector<size_t>{5, 4, 3, 2, 1, 0}));
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(6), s), (Layout{{5}, {4, 3, 2}, {1, 0}}));
  // The first bucket's cap applies to bucket 0 only; the given order is kept.
  s.first_bucket_bytes = 32;
  EXPECT_EQ(detail::assignBuckets(ps, {0, 2, 4, 1, 3, 5}, s), (Layout{{0, 2}, {4, 1, 3}, {5}}));
}

TEST(AssignBuckets, DtypeChangeStartsABucket) {
  auto ps = tensors({{2, at::kFloat}, {2, at::kDouble}, {2, at::kDouble}, {2, at::kFloat}, {2, at::kFloat}});
  detail::BucketSizes s{1 << 20, 1 << 20};
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(5), s), (Layout{{4, 3}, {2, 1}, {0}}));
}

TEST(AssignBuckets, LargeParameterGetsABucketOfItsOwn) {
  auto ps = tensors({{2, at::kFloat}, {100, at::kFloat}, {2, at::kFloat}});
  detail::BucketSizes s{/*bucket_bytes=*/16, /*first_bucket_bytes=*/16};
  EXPECT_EQ(detail::assignBuckets(ps, {0, 1, 2}, s), (Layout{{0}, {1}, {2}}));
  EXPECT_EQ(detail::assignBuckets(ps, {}, s), Layout{});
}

struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(5, 4));
    c = register_module("c", torch::nn::Linear(4, 3));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Model);

// The same model and sizes give DistributedDataParallel and ps::DistributedModule the same layout,
// and it is assignBuckets' (reverse order, small first bucket).
TEST(SharedBuckets, DDPAndPSModuleGetTheSameLayout) {
  ps::PSOptions o;
  o.timeout = std::chrono::seconds(20);
  runJob(1, 1, 1, o, [&](const std::shared_ptr<comm::Store>& store, int p) {
    ps::Worker wk(store, p, 1, 1, o);
    torch::manual_seed(3);
    Model model;
    std::vector<at::Tensor> params = model->parameters();
    detail::BucketSizes sizes{/*bucket_bytes=*/100, /*first_bucket_bytes=*/40};
    Layout want = detail::assignBuckets(params, detail::reverseOrder(params.size()), sizes);
    ASSERT_GE(want.size(), 3u);
    ASSERT_EQ(want.front(), (std::vector<size_t>{5})) << "c.bias (12 bytes) alone fills the 40-byte first bucket";

    DDPOptions d;
    d.bucket_bytes = sizes.bucket_bytes;
    d.first_bucket_bytes = sizes.first_bucket_bytes;
    DistributedDataParallel ddp(model.ptr(), comm::ProcessGroup::create(nullptr, 0, 1), d);
    EXPECT_EQ(ddp.bucketLayout(), want);

    ps::ModuleOptions m;
    m.bucket_bytes = sizes.bucket_bytes;
    m.first_bucket_bytes = sizes.first_bucket_bytes;
    ps::DistributedModule psm(model.ptr(), wk, m);
    EXPECT_EQ(psm.bucketLayout(), want);
    ASSERT_EQ(psm.numBuckets(), want.size());
    for (size_t k = 0; k < want.size(); ++k) EXPECT_EQ(psm.bucketParams(k), want[k]);
  });
}

}  // namespace
}  // namespace dtrain::test
