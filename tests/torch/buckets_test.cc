// Bucketing: the one rule (detail::assignBuckets) that DistributedDataParallel and
// ps::DistributedModule both use, and a check that both really get their layouts from it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

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

TEST(AssignBuckets, EachDtypeHasItsOwnBucket) {
  auto ps = tensors({{2, at::kFloat}, {2, at::kDouble}, {2, at::kDouble}, {2, at::kFloat}, {2, at::kFloat}});
  detail::BucketSizes s{1 << 20, 1 << 20};
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(5), s), (Layout{{4, 3, 0}, {2, 1}}));
  s = {/*bucket_bytes=*/32, /*first_bucket_bytes=*/16};  // doubles (16 bytes) close theirs one by one
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(5), s), (Layout{{4, 3}, {2}, {1}, {0}}));
}

TEST(AssignBuckets, ABucketClosesOnReachingItsCap) {
  auto ps = tensors({{2, at::kFloat}, {100, at::kFloat}, {2, at::kFloat}, {4, at::kFloat}});
  detail::BucketSizes s{/*bucket_bytes=*/16, /*first_bucket_bytes=*/16};
  // The 400-byte parameter closes the bucket it joins; 8 + 16 bytes reach 16.
  EXPECT_EQ(detail::assignBuckets(ps, {0, 1, 2, 3}, s), (Layout{{0, 1}, {2, 3}}));
  EXPECT_EQ(detail::assignBuckets(ps, {}, s), Layout{});
}

// The last-bucket rule: the bucket with the last gradient, when larger than the cap, keeps only its tail
// (from its last parameter back, up to the one that reaches the cap) as a bucket of its own.
TEST(AssignBuckets, TheLastBucketKeepsOnlyItsTail) {
  std::vector<at::Tensor> ps;
  for (int i = 0; i < 6; ++i) ps.push_back(at::zeros({4}, at::kFloat));  // 16 bytes each
  detail::BucketSizes s{/*bucket_bytes=*/1 << 20, /*first_bucket_bytes=*/16, /*last_bucket_bytes=*/32};
  // PyTorch's rule: {5}, {4, 3, 2, 1, 0}; its last 32 bytes go on their own.
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(6), s), (Layout{{5}, {4, 3, 2}, {1, 0}}));
  s.last_bucket_bytes = 20;  // the parameter that reaches the cap is in the tail
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(6), s), (Layout{{5}, {4, 3, 2}, {1, 0}}));
  s.last_bucket_bytes = 16;
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(6), s), (Layout{{5}, {4, 3, 2, 1}, {0}}));
  // No split when what would go first is smaller than the cap (here 16 bytes before a 64-byte tail).
  s.last_bucket_bytes = 64;
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(6), s), (Layout{{5}, {4, 3, 2, 1, 0}}));
  // A last bucket within the cap stays whole; 0 is PyTorch's rule.
  s.last_bucket_bytes = 80;
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(6), s), (Layout{{5}, {4, 3, 2, 1, 0}}));
  s.last_bucket_bytes = 0;
  EXPECT_EQ(detail::assignBuckets(ps, detail::reverseOrder(6), s), (Layout{{5}, {4, 3, 2, 1, 0}}));
  // The last parameter, large, goes alone; where a layer's bias comes after its weight, the weight that
  // reaches the cap goes with it. The head keeps one parameter at least.
  auto big = tensors({{1000, at::kFloat}, {2, at::kFloat}, {1000, at::kFloat}, {2, at::kFloat}, {2, at::kFloat}});
  s = {/*bucket_bytes=*/1 << 20, /*first_bucket_bytes=*/8, /*last_bucket_bytes=*/64};
  EXPECT_EQ(detail::assignBuckets(big, detail::reverseOrder(5), s), (Layout{{4}, {3, 2, 1}, {0}}));
  EXPECT_EQ(detail::assignBuckets(big, {4, 2, 0, 3, 1}, s), (Layout{{4}, {2}, {0, 3, 1}}));
  s.last_bucket_bytes = 1 << 20;  // nothing to split: the bucket is within the cap
  EXPECT_EQ(detail::assignBuckets(big, detail::reverseOrder(5), s), (Layout{{4}, {3, 2, 1, 0}}));
  // The bucket split is the one holding the last parameter of the order, not the last in the list.
  auto mixed = tensors({{4, at::kFloat}, {4, at::kFloat}, {2, at::kDouble}, {4, at::kFloat}});
  s = {/*bucket_bytes=*/1 << 20, /*first_bucket_bytes=*/1 << 20, /*last_bucket_bytes=*/16};
  EXPECT_EQ(detail::assignBuckets(mixed, {3, 2, 1, 0}, s), (Layout{{3, 1}, {0}, {2}}));
}

// The layouts of PyTorch 1.13's own rule (torch.distributed._compute_bucket_assignment_by_size, given
// the gradients' order as DDP's rebuilt buckets are) for random sizes, caps and dtypes. PyTorch leaves
// its open buckets in hash-map order at the end; with several dtypes the buckets are compared as sets.
TEST(AssignBuckets, EqualsPyTorchs) {
  struct Case {
    std::vector<int64_t> numel;
    std::vector<int> is_double;
    size_t first, cap;
  };
  std::mt19937 rng(7);
  std::vector<Case> cases;
  for (int k = 0; k < 40; ++k) {
    Case c;
    const int n = 1 + static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) {
      c.numel.push_back(1 + static_cast<int64_t>(rng() % (rng() % 4 == 0 ? 5000 : 300)));
      c.is_double.push_back(k % 3 == 0 ? static_cast<int>(rng() % 2) : 0);
    }
    c.first = 4 * (1 + rng() % 2000);
    c.cap = c.first + 4 * (rng() % 8000);
    cases.push_back(c);
  }
  nlohmann::json in = nlohmann::json::array();
  for (const auto& c : cases) in.push_back({{"numel", c.numel}, {"double", c.is_double}, {"first", c.first}, {"cap", c.cap}});
  TempDir tmp;
  std::ofstream(tmp.path() + "/cases.json") << in.dump();
  const std::string script =
      "import json, sys, torch, torch.distributed as dist\n"
      "out = []\n"
      "for c in json.load(open(sys.argv[1])):\n"
      "    n = len(c['numel'])\n"
      "    ts = [torch.zeros(c['numel'][i], dtype=torch.double if c['double'][i] else torch.float) for i in range(n)]\n"
      "    order = list(range(n - 1, -1, -1))\n"
      "    b, _ = dist._compute_bucket_assignment_by_size([ts[i] for i in order], [c['first'], c['cap']], [False] * n, order)\n"
      "    out.append(b)\n"
      "print(json.dumps(out))\n";
  std::ofstream(tmp.path() + "/ref.py") << script;
  auto [status, out] = runCommand("env OMP_NUM_THREADS=1 " + pythonPath() + " " + tmp.path() + "/ref.py " + tmp.path() + "/cases.json", 120);
  ASSERT_EQ(status, 0) << out;
  auto ref = nlohmann::json::parse(out.substr(out.find('[')));
  ASSERT_EQ(ref.size(), cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    std::vector<at::Tensor> ps;
    for (size_t i = 0; i < c.numel.size(); ++i) ps.push_back(at::zeros({c.numel[i]}, c.is_double[i] ? at::kDouble : at::kFloat));
    Layout got = detail::assignBuckets(ps, detail::reverseOrder(ps.size()), {c.cap, c.first});
    Layout want = ref[k].get<Layout>();
    const bool mixed = std::adjacent_find(c.is_double.begin(), c.is_double.end(), std::not_equal_to<>()) != c.is_double.end();
    if (mixed) {
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
    }
    EXPECT_EQ(got, want) << "case " << k;
  }
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
    ASSERT_EQ(want.front(), (std::vector<size_t>{5, 4})) << "c.bias (12 bytes) and c.weight (48) reach the 40-byte cap";

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
