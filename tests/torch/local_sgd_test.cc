// Local SGD (dtrain/local_sgd.h) against a reference written here: R replicas trained in one process
// with plain libtorch, averaged by hand. Periodic averaging (warm-up, period; on 1 and 3 ranks), a
// parameter without a gradient left alone, optimizer state not averaged; the post-local-SGD hook with
// DDP on 3 ranks of 2 faked hosts ({0, 1} and {2}: global averaging until the start step, then within
// each host); the hierarchical averager (host every 2 steps, world every 4); bad options.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <functional>

#include "ddp_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/compat.h"
#include "dtrain/ddp.h"
#include "dtrain/local_sgd.h"
#include "harness.h"

namespace dtrain::test {
namespace {

constexpr int kSteps = 9;
constexpr double kLr = 0.1, kMomentum = 0.9;

// A small net and a parameter that forward never uses (no gradient: never averaged).
struct LsNetImpl : torch::nn::Module {
  LsNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
    unused = register_parameter("unused", torch::zeros({4}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor unused;
};
TORCH_MODULE(LsNet);

// Replica r's model: the same initial weights everywhere, the unused parameter set to r (it must keep it).
LsNet makeNet(int r) {
  torch::manual_seed(7);
  LsNet net;
  torch::NoGradGuard g;
  net->unused.fill_(static_cast<double>(r));
  return net;
}

// Replica r's batch at step s.
std::pair<torch::Tensor, torch::Tensor> batch(int r, int s) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 * s + r);
  return {at::randn({5, 6}, g), at::randint(0, 3, {5}, g, at::kLong)};
}

void backward(LsNet& net, int r, int s) {
  auto [x, y] = batch(r, s);
  torch::nn::functional::cross_entropy(net->forward(x), y).backward();
}

// ---- the reference: R replicas in one process ----
struct Replicas {
  std::vector<LsNet> nets;
  std::vector<std::unique_ptr<torch::optim::SGD>> opts;
  explicit Replicas(int n) {
    for (int r = 0; r < n; ++r) {
      nets.push_back(makeNet(r));
      opts.push_back(std::make_unique<torch::optim::SGD>(nets.back()->parameters(),
                                                         torch::optim::SGDOptions(kLr).momentum(kMomentum)));
    }
  }
  // Mean over `members` of each parameter that has a gradient, written to every member.
  void average(const std::vector<int>& members) {
    torch::NoGradGuard g;
    auto names = nets[0]->named_parameters();
    for (const auto& item : names) {
      if (!nets[members[0]]->named_parameters()[item.key()].grad().defined()) continue;
      auto sum = torch::zeros_like(item.value());
      for (int m : members) sum += nets[m]->named_parameters()[item.key()];
      for (int m : members) nets[m]->named_parameters()[item.key()].copy_(sum / static_cast<double>(members.size()));
    }
  }
  // Mean over `members` of each gradient, written to every member.
  void averageGrads(const std::vector<int>& members) {
    torch::NoGradGuard g;
    for (const auto& item : nets[0]->named_parameters()) {
      if (!item.value().grad().defined()) continue;
      auto sum = torch::zeros_like(item.value());
      for (int m : members) sum += nets[m]->named_parameters()[item.key()].grad();
      for (int m : members) nets[m]->named_parameters()[item.key()].mutable_grad().copy_(sum / double(members.size()));
    }
  }
};

void expectSame(LsNet& got, LsNet& want, torch::optim::SGD& got_opt, torch::optim::SGD& want_opt, const std::string& what) {
  auto a = got->named_parameters(), b = want->named_parameters();
  for (const auto& item : a) {
    const double diff = (item.value() - b[item.key()]).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << what << ": parameter " << item.key() << " differs by " << diff;
  }
  // Momentum buffers: never averaged, so each rank's equals its own replica's.
  auto pa = got->parameters(), pb = want->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    auto ia = got_opt.state().find(dtrain::compat::optimizerStateKey(pa[i]));
    auto ib = want_opt.state().find(dtrain::compat::optimizerStateKey(pb[i]));
    ASSERT_EQ(ia == got_opt.state().end(), ib == want_opt.state().end()) << what << ": parameter " << i;
    if (ia == got_opt.state().end()) continue;
    auto& ma = static_cast<torch::optim::SGDParamState&>(*ia->second).momentum_buffer();
    auto& mb = static_cast<torch::optim::SGDParamState&>(*ib->second).momentum_buffer();
    const double diff = (ma - mb).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << what << ": momentum of parameter " << i;
  }
}

// ---- periodic averaging, no DDP: each rank steps on its own gradients ----
void periodic(int world) {
  const int period = 3, warmup = 2, steps = kSteps + 1;  // averages after steps 2, 5, 8; step 9 is local
  Replicas ref(world);
  for (int s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) {
      ref.opts[r]->zero_grad();
      backward(ref.nets[r], r, s);
      ref.opts[r]->step();
    }
    if (s >= warmup && (s - warmup) % period == 0) {
      std::vector<int> all;
      for (int r = 0; r < world; ++r) all.push_back(r);
      ref.average(all);
    }
  }
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    auto net = makeNet(rank);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum));
    PeriodicModelAverager avg(pg, period, warmup);
    int averaged = 0;
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      backward(net, rank, s);
      opt.step();
      averaged += avg.averageParameters(net->parameters());
    }
    EXPECT_EQ(averaged, 3);  // steps 2, 5, 8
    EXPECT_EQ(avg.step(), steps);
    expectSame(net, ref.nets[rank], opt, *ref.opts[rank], fmt::format("rank {} of {}", rank, world));
    EXPECT_EQ(net->unused[0].item<double>(), rank) << "a parameter without a gradient was averaged";
    // The test can fail: after the last (local) step the replicas differ, so a rank that skipped an
    // average, or averaged at the wrong step, would not match its replica.
    if (world > 1) {
      double spread = 0;
      for (const auto& item : ref.nets[0]->named_parameters())
        if (item.key() != "unused")
          spread += (item.value() - ref.nets[1]->named_parameters()[item.key()]).abs().max().item<double>();
      EXPECT_GT(spread, 1e-4) << "the replicas agree anyway: the check would not notice a missing average";
    }
  });
  expectAllOk(results);
}

TEST(LocalSgd, PeriodicAveragingOneRank) { periodic(1); }
TEST(LocalSgd, PeriodicAveragingThreeRanks) { periodic(3); }

// Ranks 0 and 1 on host "a", rank 2 on host "b"; the world and each rank's host group.
struct Groups {
  std::shared_ptr<comm::ProcessGroup> world, host;
};
Groups hostGroups(const StoreServer& server, int rank) {
  setenv("DTRAIN_HOST_ID", rank < 2 ? "a" : "b", 1);
  Groups g;
  g.world = group(server, rank, 3);
  auto a = g.world->newGroup({0, 1});
  auto b = g.world->newGroup({2});
  g.host = rank < 2 ? a : b;
  return g;
}
const std::vector<std::vector<int>> kHosts = {{0, 1}, {2}};

// DDP with the post-local hook (and, with period > 0, a PeriodicModelAverager over the world from the
// start step) on 3 ranks of 2 hosts, `steps` steps; each rank must equal its reference replica.
void postLocalRun(Replicas& ref, int steps, int start, bool gradient_allreduce, int period) {
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    Groups g = hostGroups(server, rank);
    auto net = makeNet(rank);
    net->unused.set_requires_grad(false);  // (DDP without find_unused_parameters refuses a parameter with no gradient)
    DistributedDataParallel ddp(net.ptr(), g.world);
    ddp.registerCommHook(postLocalSGDHook(g.host, start, gradient_allreduce));
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum));
    std::unique_ptr<PeriodicModelAverager> avg;
    if (period > 0) avg = std::make_unique<PeriodicModelAverager>(g.world, period, start);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      backward(net, rank, s);
      opt.step();
      if (avg) avg->averageParameters(net->parameters());
    }
    expectSame(net, ref.nets[rank], opt, *ref.opts[rank], fmt::format("rank {}", rank));
  });
  expectAllOk(results);
}

// PyTorch's post-local SGD recipe: DDP with post_localSGD_hook (start 3) and a PeriodicModelAverager
// (period 2, warm-up 3) over the world.
TEST(LocalSgd, PostLocalSgdHookAndAveragerOnTwoHosts) {
  const int start = 3, period = 2;
  Replicas ref(3);
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 0; r < 3; ++r) {
      ref.opts[r]->zero_grad();
      backward(ref.nets[r], r, s);
    }
    if (s < start) ref.averageGrads({0, 1, 2});
    else
      for (const auto& h : kHosts) ref.averageGrads(h);
    for (int r = 0; r < 3; ++r) ref.opts[r]->step();
    if (s >= start && (s - start) % period == 0) ref.average({0, 1, 2});
  }
  postLocalRun(ref, kSteps, start, true, period);
}

// Without the post-local gradient allreduce, each rank keeps its own gradients after the start.
TEST(LocalSgd, PostLocalWithoutGradientAllreduce) {
  const int start = 2;
  Replicas ref(3);
  for (int s = 0; s < 5; ++s) {
    for (int r = 0; r < 3; ++r) {
      ref.opts[r]->zero_grad();
      backward(ref.nets[r], r, s);
    }
    if (s < start) ref.averageGrads({0, 1, 2});
    for (int r = 0; r < 3; ++r) ref.opts[r]->step();
  }
  postLocalRun(ref, 5, start, false, 0);
}

// Within the host every 2 steps, across all ranks every 4, from step 1.
TEST(LocalSgd, HierarchicalAverager) {
  const int warmup = 1;
  Replicas ref(3);
  std::vector<int64_t> levels_used;
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 0; r < 3; ++r) {
      ref.opts[r]->zero_grad();
      backward(ref.nets[r], r, s);
      ref.opts[r]->step();
    }
    if (s < warmup) continue;
    if (s % 4 == 0) ref.average({0, 1, 2});
    else if (s % 2 == 0)
      for (const auto& h : kHosts) ref.average(h);
  }
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    Groups g = hostGroups(server, rank);
    auto net = makeNet(rank);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum));
    HierarchicalModelAverager avg({{2, g.host}, {4, g.world}}, warmup);
    std::vector<int64_t> used;
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      backward(net, rank, s);
      opt.step();
      used.push_back(avg.averageParameters(net->parameters()));
    }
    EXPECT_EQ(used, (std::vector<int64_t>{0, 0, 2, 0, 4, 0, 2, 0, 4}));
    expectSame(net, ref.nets[rank], opt, *ref.opts[rank], fmt::format("rank {}", rank));
  });
  expectAllOk(results);
}

TEST(LocalSgd, BadOptionsAreNamed) {
  StoreServer server;
  auto pg = group(server, 0, 1);
  EXPECT_NE(errorOf([&] { PeriodicModelAverager(pg, 0); }).find("period must be at least 1 (got 0)"), std::string::npos);
  EXPECT_NE(errorOf([&] { PeriodicModelAverager(pg, 2, -1); }).find("warmup_steps must be >= 0"), std::string::npos);
  EXPECT_NE(errorOf([&] { PeriodicModelAverager(nullptr, 2); }).find("no process group"), std::string::npos);
  EXPECT_NE(errorOf([&] { HierarchicalModelAverager({}); }).find("no levels"), std::string::npos);
  EXPECT_NE(errorOf([&] { HierarchicalModelAverager({{4, pg}, {2, pg}}); }).find("periods must increase"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { HierarchicalModelAverager({{0, pg}}); }).find("period 0"), std::string::npos);
  EXPECT_NE(errorOf([&] { postLocalSGDHook(nullptr, 10); }).find("no subgroup"), std::string::npos);
  EXPECT_NE(errorOf([&] { postLocalSGDHook(pg, -1); }).find("start_localSGD_iter must be >= 0"), std::string::npos);
}

TEST(LocalSgd, LastLevelMustBeTheWholeGroup) {
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    Groups g = hostGroups(server, rank);
    EXPECT_NE(errorOf([&] { HierarchicalModelAverager({{2, g.world}, {4, g.host}}); }).find("the last level's group"),
              std::string::npos);
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
