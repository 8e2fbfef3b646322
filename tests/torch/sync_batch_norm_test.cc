// SyncBatchNorm on 1 and 3 real processes against torch::nn::BatchNorm on the global batch in one
// process (double precision, within 1e-6): outputs, input gradients, summed weight/bias gradients and
// running statistics over several steps, with even, uneven and empty per-rank batches; the eval path;
// the error for a single value per channel; the converter; and DDP training a converted model.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>
#include <optional>

#include "ddp_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/sync_batch_norm.h"
#include "harness.h"

namespace dtrain::test {
namespace {

constexpr int64_t kChannels = 3;
constexpr double kTol = 1e-6;

double maxDiff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return a.numel() ? (a - b).abs().max().item<double>() : 0.0;
}

struct Case {
  std::vector<int64_t> rows;            // per-rank batch sizes; the world is rows.size()
  bool spatial = true;                  // (N, C, 2, 2) with BatchNorm2d, else (N, C) with BatchNorm1d
  c10::optional<double> momentum = 0.3;  // nullopt: cumulative moving average
  bool affine = true;
};

torch::nn::BatchNormOptions options(const Case& c) {
  return torch::nn::BatchNormOptions(kChannels).momentum(c.momentum).affine(c.affine).eps(1e-3);
}

// The reference: one process, the whole batch, torch::nn::BatchNorm1d/2d.
std::shared_ptr<torch::nn::Module> referenceBn(const Case& c) {
  if (c.spatial) return torch::nn::BatchNorm2d(options(c)).ptr();
  return torch::nn::BatchNorm1d(options(c)).ptr();
}
at::Tensor referenceForward(torch::nn::Module& m, const at::Tensor& x) {
  if (auto* b = dynamic_cast<torch::nn::BatchNorm2dImpl*>(&m)) return b->forward(x);
  return dynamic_cast<torch::nn::BatchNorm1dImpl&>(m).forward(x);
}

// Parameters start away from (1, 0) so that weight's role in the backward is exercised.
void initAffine(torch::nn::Module& m) {
  torch::NoGradGuard g;
  for (auto& p : m.parameters()) p.copy_(at::linspace(0.5, 1.5, kChannels, p.options()) + p.numel() * 0.0);
}

void runCase(const Case& c) {
  const int world = static_cast<int>(c.rows.size());
  const int64_t total = std::accumulate(c.rows.begin(), c.rows.end(), int64_t{0});
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    SyncBatchNorm sbn(options(c), pg);
    auto ref = referenceBn(c);
    sbn->to(torch::kDouble);
    ref->to(torch::kDouble);
    initAffine(*sbn);
    initAffine(*ref);
    const int64_t offset = std::accumulate(c.rows.begin(), c.rows.begin() + rank, int64_t{0});
    for (int step = 0; step < 4; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
      std::vector<int64_t> shape{total, kChannels};
      if (c.spatial) shape.insert(shape.end(), {2, 2});
      at::Tensor x = at::randn(shape, gen, torch::kDouble) * (step + 1) + step;
      at::Tensor r = at::randn(shape, gen, torch::kDouble);  // the loss is sum(y * r)
      std::string what = fmt::format("rank {} step {}", rank, step);

      at::Tensor xr = x.narrow(0, offset, c.rows[rank]).clone().requires_grad_(true);
      at::Tensor y = sbn->forward(xr);
      (y * r.narrow(0, offset, c.rows[rank])).sum().backward();

      at::Tensor xg = x.clone().requires_grad_(true);
      at::Tensor ref_y = referenceForward(*ref, xg);
      (ref_y * r).sum().backward();

      EXPECT_LE(maxDiff(y, ref_y.narrow(0, offset, c.rows[rank])), kTol) << what << ": output";
      EXPECT_LE(maxDiff(xr.grad(), xg.grad().narrow(0, offset, c.rows[rank])), kTol) << what << ": input grad";
      auto bufs = sbn->named_buffers(), ref_bufs = ref->named_buffers();
      for (const auto& b : ref_bufs)
        EXPECT_LE(maxDiff(bufs[b.key()].to(torch::kDouble), b.value().to(torch::kDouble)), kTol)
            << what << ": " << b.key();
      // Weight/bias gradients are this rank's part: their sum over the ranks is the global one. Then
      // both take the same SGD step, so later steps start from moved parameters.
      torch::NoGradGuard g;
      auto params = sbn->named_parameters(), ref_params = ref->named_parameters();
      for (const auto& p : ref_params) {
        at::Tensor sum = params[p.key()].grad().clone();
        pg->allreduce(sum.data_ptr(), sum.numel(), comm::DType::f64)->wait();
        EXPECT_LE(maxDiff(sum, p.value().grad()), kTol) << what << ": grad of " << p.key();
        params[p.key()].sub_(0.1 * sum);
        p.value().sub_(0.1 * p.value().grad());
        params[p.key()].grad().zero_();
        p.value().grad().zero_();
      }
    }
    // Eval: running statistics, no communication (rank 0 alone runs it; a collective would time out).
    if (rank == 0) {
      sbn->eval();
      ref->eval();
      at::Tensor x = at::randn(c.spatial ? std::vector<int64_t>{5, kChannels, 2, 2} : std::vector<int64_t>{5, kChannels},
                               torch::kDouble);
      EXPECT_LE(maxDiff(sbn->forward(x), referenceForward(*ref, x)), kTol) << "eval";
    }
  });
  expectAllOk(results);
}

TEST(SyncBatchNorm, OneRankEqualsBatchNorm) { runCase(Case{{6}}); }
TEST(SyncBatchNorm, OneRank1dCumulativeAverage) {
  Case c{{7}};
  c.spatial = false;
  c.momentum = c10::nullopt;
  runCase(c);
}
TEST(SyncBatchNorm, ThreeRanksEvenBatches) { runCase(Case{{4, 4, 4}}); }
TEST(SyncBatchNorm, ThreeRanksUnevenBatches) { runCase(Case{{5, 1, 3}}); }
TEST(SyncBatchNorm, ThreeRanksOneEmpty) { runCase(Case{{4, 0, 3}}); }
TEST(SyncBatchNorm, ThreeRanks1dEmptyCumulativeNoAffine) {
  Case c{{0, 6, 2}};
  c.spatial = false;
  c.momentum = c10::nullopt;
  c.affine = false;
  runCase(c);
}

// The autograd function itself (the module falls back to torch::batch_norm on a group of one).
TEST(SyncBatchNorm, FunctionOnOneRankEqualsBatchNorm) {
  StoreServer server;
  auto pg = group(server, 0, 1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor x = at::randn({6, kChannels, 3}, gen, torch::kDouble), r = at::randn({6, kChannels, 3}, gen, torch::kDouble);
  at::Tensor w = at::rand({kChannels}, gen, torch::kDouble).requires_grad_(true);
  at::Tensor b = at::rand({kChannels}, gen, torch::kDouble).requires_grad_(true);
  at::Tensor rm = at::zeros({kChannels}, torch::kDouble), rv = at::ones({kChannels}, torch::kDouble);
  at::Tensor rm2 = rm.clone(), rv2 = rv.clone();
  at::Tensor x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
  at::Tensor y1 = syncBatchNorm(x1, w, b, rm, rv, 0.2, 1e-5, *pg);
  (y1 * r).sum().backward();
  auto g1 = std::vector<at::Tensor>{x1.grad(), w.grad().clone(), b.grad().clone()};
  w.grad().zero_();
  b.grad().zero_();
  at::Tensor y2 = torch::batch_norm(x2, w, b, rm2, rv2, true, 0.2, 1e-5, false);
  (y2 * r).sum().backward();
  EXPECT_LE(maxDiff(y1, y2), kTol);
  EXPECT_LE(maxDiff(g1[0], x2.grad()), kTol);
  EXPECT_LE(maxDiff(g1[1], w.grad()), kTol);
  EXPECT_LE(maxDiff(g1[2], b.grad()), kTol);
  EXPECT_LE(maxDiff(rm, rm2), kTol);
  EXPECT_LE(maxDiff(rv, rv2), kTol);
}

// One value per channel over the whole group: every rank throws (none waits for the others).
TEST(SyncBatchNorm, SingleValuePerChannelThrowsOnEveryRank) {
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto pg = group(server, rank, 3);
    SyncBatchNorm sbn(torch::nn::BatchNormOptions(2), pg);
    std::string err = errorOf([&] { sbn->forward(torch::randn({rank == 1 ? 1 : 0, 2})); });
    EXPECT_NE(err.find("expected more than 1 value per channel over the group"), std::string::npos) << err;
    EXPECT_NE(err.find("per rank: 0, 1, 0"), std::string::npos) << err;
    EXPECT_NE(errorOf([&] { sbn->forward(torch::randn({4, 3})); }).find("expected input (N, 2, *)"),
              std::string::npos);
  });
  expectAllOk(results);
}

// A model whose BatchNorm layers sit in a Sequential, a ModuleDict and directly in the registry.
struct Holder : torch::nn::Module {
  Holder() {
    register_module("seq", torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4)));
    torch::nn::ModuleDict dict;
    dict->update({{"bn3", torch::nn::BatchNorm3d(2).ptr()}});
    register_module("dict", dict);
    register_module("list", torch::nn::ModuleList(torch::nn::Linear(2, 2), torch::nn::BatchNorm1d(2)));
    register_module("bn", torch::nn::BatchNorm2d(torch::nn::BatchNormOptions(5).momentum(0.5).eps(0.01)));
  }
};

TEST(SyncBatchNorm, ConvertReplacesEveryBatchNormAndSharesTensors) {
  StoreServer server;
  auto pg = group(server, 0, 1);
  auto model = std::make_shared<Holder>();
  auto before = model->named_parameters();
  auto before_buffers = model->named_buffers();
  auto out = convertSyncBatchNorm(model, pg);
  ASSERT_EQ(out, model);  // changed in place
  int syncs = 0;
  for (const auto& m : out->modules()) {
    EXPECT_FALSE(dynamic_cast<torch::nn::BatchNorm1dImpl*>(m.get()) || dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get()) ||
                 dynamic_cast<torch::nn::BatchNorm3dImpl*>(m.get()));
    syncs += dynamic_cast<SyncBatchNormImpl*>(m.get()) != nullptr;
  }
  EXPECT_EQ(syncs, 4);
  auto after = out->named_parameters();
  ASSERT_EQ(after.keys(), before.keys());
  for (const auto& p : before) EXPECT_TRUE(after[p.key()].is_same(p.value())) << p.key();
  auto after_buffers = out->named_buffers();
  ASSERT_EQ(after_buffers.keys(), before_buffers.keys());
  for (const auto& b : before_buffers) EXPECT_TRUE(after_buffers[b.key()].is_same(b.value())) << b.key();
  auto bn = std::dynamic_pointer_cast<SyncBatchNormImpl>(out->named_children()["bn"]);
  ASSERT_TRUE(bn);
  EXPECT_EQ(*bn->options.momentum(), 0.5);
  EXPECT_EQ(bn->options.eps(), 0.01);
  // The Sequential was rebuilt: its forward reaches the SyncBatchNorm.
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(out->named_children()["seq"]);
  ASSERT_TRUE(seq);
  EXPECT_TRUE(std::dynamic_pointer_cast<SyncBatchNormImpl>(seq->ptr(1)));
  EXPECT_EQ(seq->forward(torch::randn({5, 3})).size(1), 4);
  // ModuleDict and ModuleList hand out the new layer too (their own lists, not just the registry).
  auto dict = std::dynamic_pointer_cast<torch::nn::ModuleDictImpl>(out->named_children()["dict"]);
  ASSERT_TRUE(dict);
  EXPECT_TRUE(std::dynamic_pointer_cast<SyncBatchNormImpl>((*dict)["bn3"]));
  auto list = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(out->named_children()["list"]);
  ASSERT_TRUE(list);
  EXPECT_TRUE(std::dynamic_pointer_cast<SyncBatchNormImpl>(list->ptr(1)));
  // A BatchNorm root becomes a new SyncBatchNorm; anything else is refused by the constructor.
  EXPECT_TRUE(std::dynamic_pointer_cast<SyncBatchNormImpl>(convertSyncBatchNorm(torch::nn::BatchNorm1d(2).ptr(), pg)));
  EXPECT_NE(errorOf([&] { SyncBatchNormImpl(*torch::nn::Linear(2, 2), pg); }).find("BatchNorm1d/2d/3d only"),
            std::string::npos);
}

torch::nn::Sequential convNet() {
  torch::manual_seed(11);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)), torch::nn::BatchNorm2d(4),
                            torch::nn::ReLU(), torch::nn::Flatten(), torch::nn::Linear(4 * 4 * 4, 3));
  net->to(torch::kDouble);
  return net;
}

// DDP over a converted BatchNorm2d equals one process on the global batch (which plain DDP does not:
// see DDP.BatchNormBuffersFromRankZero).
void ddpCase(int world) {
  constexpr int64_t kRows = 4;
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    auto net = torch::nn::Sequential(
        std::dynamic_pointer_cast<torch::nn::SequentialImpl>(convertSyncBatchNorm(convNet().ptr(), pg)));
    auto ref = convNet();
    DistributedDataParallel ddp(net.ptr(), pg);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 4; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(200 + step);
      at::Tensor x = at::randn({world * kRows, 2, 4, 4}, gen, torch::kDouble);
      at::Tensor y = at::randint(0, 3, {world * kRows}, gen, torch::kLong);
      opt.zero_grad();
      auto out = ddp.forward(net, x.narrow(0, rank * kRows, kRows));
      torch::nn::functional::cross_entropy(out, y.narrow(0, rank * kRows, kRows)).backward();
      opt.step();
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
      ref_opt.step();
    }
    expectClose(*net, *ref, kTol, fmt::format("rank {} world {}", rank, world));
  });
  expectAllOk(results);
}

TEST(SyncBatchNorm, DdpConvertedModelOneRank) { ddpCase(1); }
TEST(SyncBatchNorm, DdpConvertedModelThreeRanks) { ddpCase(3); }

}  // namespace
}  // namespace dtrain::test
