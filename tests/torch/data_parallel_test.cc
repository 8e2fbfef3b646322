// DataParallel with 1..4 replica threads against one model on the whole batch: SGD with momentum and
// Adam for 5 steps, uneven and tiny batches, gradient accumulation, buffer and train/eval sync, and
// errors from the loss function.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/comm/error.h"
#include "dtrain/data_parallel.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using torch::nn::Sequential;

// A BatchNorm-free MLP in double precision, the same weights on every call.
Sequential makeMlp() {
  torch::manual_seed(11);
  Sequential net(torch::nn::Linear(5, 16), torch::nn::Tanh(), torch::nn::Linear(16, 8), torch::nn::ReLU(),
                 torch::nn::Linear(8, 2));
  net->to(torch::kDouble);
  return net;
}

std::pair<at::Tensor, at::Tensor> batch(int step, int64_t rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randn({rows, 5}, g, torch::kDouble), at::randn({rows, 2}, g, torch::kDouble)};
}

at::Tensor mseOf(torch::nn::Module& replica, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(replica.as<Sequential>()->forward(x), y);
}

std::unique_ptr<torch::optim::Optimizer> makeOpt(const std::string& kind, Sequential& net) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

double relDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1.0, b.abs().max().item<double>());
}

void expectSameParameters(Sequential& a, Sequential& b, double rel, const std::string& what) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& item : pa)
    EXPECT_LE(relDiff(item.value(), pb[item.key()]), rel) << what << ": parameter " << item.key();
  auto ba = a->named_buffers(), bb = b->named_buffers();
  for (const auto& item : ba) EXPECT_LE(relDiff(item.value(), bb[item.key()]), rel) << what << ": buffer " << item.key();
}

TEST(DataParallel, SplitSizesAreAsEvenAsPossible) {
  EXPECT_EQ(DataParallel::splitSizes(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(DataParallel::splitSizes(6, 4), (std::vector<int64_t>{2, 2, 1, 1}));  // torch.chunk: 2, 2, 2, -
  EXPECT_EQ(DataParallel::splitSizes(2, 3), (std::vector<int64_t>{1, 1, 0}));
  EXPECT_EQ(DataParallel::splitSizes(9, 3), (std::vector<int64_t>{3, 3, 3}));
  EXPECT_THROW(DataParallel::splitSizes(4, 0), InvalidArgument);
}

struct Case {
  int replicas;
  int64_t rows;
  std::string optimizer;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.replicas << " replicas, " << c.rows << " rows, " << c.optimizer; }

class MatchesOneReplica : public ::testing::TestWithParam<Case> {};

// 5 optimizer steps through DataParallel equal 5 steps of one model on the whole batch.
// Five steps of `optimizer` on net through dp and on one model, batches of `rows`: the same losses and
// parameters.
void expectFiveStepsMatchOneModel(DataParallel& dp, Sequential& net, const std::string& optimizer, int64_t rows) {
  Sequential ref = makeMlp();
  auto ref_opt = makeOpt(optimizer, ref);
  auto opt = makeOpt(optimizer, net);
  for (int s = 0; s < 5; ++s) {
    auto [x, y] = batch(s, rows);
    ref_opt->zero_grad();
    at::Tensor ref_loss = torch::mse_loss(ref->forward(x), y);
    ref_loss.backward();
    ref_opt->step();

    opt->zero_grad();
    at::Tensor loss = dp.step(x, y, mseOf);
    opt->step();

    EXPECT_FALSE(loss.requires_grad());
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-12) << "step " << s;
  }
  expectSameParameters(net, ref, 1e-10, "after 5 steps");
}

TEST_P(MatchesOneReplica, AfterFiveSteps) {
  const Case c = GetParam();
  Sequential net = makeMlp();
  DataParallel dp(net, c.replicas);
  ASSERT_EQ(dp.numReplicas(), c.replicas);
  expectFiveStepsMatchOneModel(dp, net, c.optimizer, c.rows);

  // The replicas catch up with the optimizer's last update.
  dp.syncReplicas();
  auto main_params = net->parameters();
  for (int k = 1; k < dp.numReplicas(); ++k) {
    auto rp = dp.replica(k).parameters();
    for (size_t j = 0; j < rp.size(); ++j) EXPECT_TRUE(rp[j].equal(main_params[j])) << "replica " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(
    DataParallel, MatchesOneReplica,
    ::testing::Values(Case{1, 12, "sgd"}, Case{2, 12, "sgd"}, Case{3, 12, "sgd"}, Case{2, 12, "adam"},
                      Case{3, 12, "adam"}, Case{3, 10, "sgd"}, Case{4, 10, "adam"}, Case{3, 2, "sgd"}),
    [](const ::testing::TestParamInfo<Case>& p) {
      return std::to_string(p.param.replicas) + "replicas_" + std::to_string(p.param.rows) + "rows_" +
             p.param.optimizer;
    });

// Replicas on given devices (here all the CPU: the GPU case is tests/gpu): the path that moves slices and
// sums gradients across devices gives the same training as one model.
TEST(DataParallel, OnListedDevicesMatchesOneReplica) {
  Sequential net = makeMlp();
  DataParallel dp(net, std::vector<c10::Device>(3, c10::Device(c10::kCPU)));
  ASSERT_EQ(dp.numReplicas(), 3);
  expectFiveStepsMatchOneModel(dp, net, "sgd", 10);
  EXPECT_NE(dtrain::test::errorOf([&] { DataParallel(makeMlp().ptr(), std::vector<c10::Device>{}); }).find("no devices"),
            std::string::npos);
}

TEST(DataParallel, AccumulatesIntoExistingGradients) {
  Sequential ref = makeMlp(), net = makeMlp();
  DataParallel dp(net, 3);
  for (int s = 0; s < 2; ++s) {  // two backward passes without zero_grad in between
    auto [x, y] = batch(s, 9);
    torch::mse_loss(ref->forward(x), y).backward();
    dp.step(x, y, mseOf);
  }
  auto pr = ref->parameters(), pn = net->parameters();
  for (size_t j = 0; j < pr.size(); ++j) EXPECT_LE(relDiff(pn[j].grad(), pr[j].grad()), 1e-12) << "parameter " << j;
}

// Buffers and the train/eval mode changed on the main module after construction reach the replicas.
TEST(DataParallel, SyncsBuffersAndMode) {
  auto make = [] {
    torch::manual_seed(3);
    Sequential net(torch::nn::Linear(5, 6), torch::nn::BatchNorm1d(6), torch::nn::Linear(6, 2));
    net->to(torch::kDouble);
    return net;
  };
  Sequential ref = make(), net = make();
  DataParallel dp(net, 3);
  for (Sequential* m : {&ref, &net}) {
    (*m)->eval();  // BatchNorm normalizes with its running statistics, not the slice's
    for (auto& b : (*m)->named_buffers())
      if (b.key().find("running_mean") != std::string::npos) b.value().fill_(0.25);
  }
  auto [x, y] = batch(0, 9);
  at::Tensor ref_loss = torch::mse_loss(ref->forward(x), y);
  ref_loss.backward();
  EXPECT_NEAR(dp.step(x, y, mseOf).item<double>(), ref_loss.item<double>(), 1e-12);
  for (int k = 0; k < 3; ++k) EXPECT_FALSE(dp.replica(k).is_training()) << "replica " << k;
  auto pr = ref->parameters(), pn = net->parameters();
  for (size_t j = 0; j < pr.size(); ++j) EXPECT_LE(relDiff(pn[j].grad(), pr[j].grad()), 1e-12) << "parameter " << j;
}

TEST(DataParallel, LossFunctionErrorsPropagateWithTheirMessage) {
  Sequential net = makeMlp();
  DataParallel dp(net, 3);
  auto [x, y] = batch(0, 6);
  torch::nn::Module* bad = &dp.replica(2);
  try {
    dp.step(x, y, [bad](torch::nn::Module& m, const at::Tensor& xs, const at::Tensor& ys) {
      if (&m == bad) throw std::runtime_error("no labels for this slice");
      return mseOf(m, xs, ys);
    });
    ADD_FAILURE() << "step did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "no labels for this slice");
  }

  // Not a scalar: InvalidArgument naming the shape.
  try {
    dp.step(x, y, [](torch::nn::Module& m, const at::Tensor& xs, const at::Tensor& ys) {
      return (m.as<Sequential>()->forward(xs) - ys).pow(2);
    });
    ADD_FAILURE() << "non-scalar loss accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("must return a scalar"), std::string::npos) << e.what();
  }

  // The pool survives failed steps and a clean step after them matches the reference.
  Sequential ref = makeMlp();
  for (auto& p : net->parameters()) p.mutable_grad().reset();
  torch::mse_loss(ref->forward(x), y).backward();
  dp.step(x, y, mseOf);
  auto pr = ref->parameters(), pn = net->parameters();
  for (size_t j = 0; j < pr.size(); ++j) EXPECT_LE(relDiff(pn[j].grad(), pr[j].grad()), 1e-12) << "parameter " << j;
}

TEST(DataParallel, RejectsBadArguments) {
  Sequential net = makeMlp();
  EXPECT_THROW(DataParallel(net, 0), InvalidArgument);
  DataParallel dp(net, 2);
  auto [x, y] = batch(0, 4);
  EXPECT_THROW(dp.step(x, y.narrow(0, 0, 3), mseOf), InvalidArgument);
  EXPECT_THROW(dp.step(x.narrow(0, 0, 0), y.narrow(0, 0, 0), mseOf), InvalidArgument);
  EXPECT_THROW(dp.replica(2), InvalidArgument);
}

}  // namespace
}  // namespace dtrain::test
