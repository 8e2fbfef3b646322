// Parameters without a gradient, against one process on the global batch: a head that every rank uses at
// some steps, no rank at others, and some ranks only at others (also only in a noSync micro-batch), with
// Adam (momentum, weight decay) and SGD with momentum and weight decay, after zero_grad() that sets the
// gradients to none (libtorch 2.x's default) and after zero_grad(false), on 2 and 3 ranks, through DDP,
// ZeRO-1 (DDP + ZeroRedundancyOptimizer), FSDP stage 3 and the parameter server's DistributedModule. In
// one process the optimizer skips a parameter whose gradient is undefined: no momentum, no weight decay.
// Also: the comm hooks and dtrain::Join keep such a gradient as it was, and the model averagers agree on
// which parameters to average when one rank skipped a branch.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp_test_util.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/compat.h"
#include "dtrain/data_parallel.h"
#include "dtrain/ddp.h"
#include "dtrain/fsdp.h"
#include "dtrain/join.h"
#include "dtrain/local_sgd.h"
#include "dtrain/powersgd.h"
#include "dtrain/ps_module.h"
#include "dtrain/recompute.h"
#include "dtrain/topk.h"
#include "dtrain/zero.h"
#include "harness.h"
#include "ps_test_util.h"

namespace dtrain::test {
namespace {

// x + tanh(lin(x)) when on, x when off: a branch whose parameters get no gradient when it is skipped.
struct GateImpl : torch::nn::Module {
  explicit GateImpl(int64_t n) { lin = register_module("lin", torch::nn::Linear(n, n)); }
  torch::Tensor forward(torch::Tensor x) { return on ? x + torch::tanh(lin->forward(x)) : x; }
  torch::nn::Linear lin{nullptr};
  bool on = true;
};
TORCH_MODULE(Gate);

struct Model {
  torch::nn::Sequential seq{nullptr};
  Gate gate{nullptr};
};

// Children: Linear, Tanh, Gate, Linear (FSDP units {2, 1, 1}: the gate is a unit of its own).
Model makeModel(torch::Dtype dtype) {
  torch::manual_seed(11);
  Model m;
  m.gate = Gate(16);
  m.seq = torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), m.gate, torch::nn::Linear(16, 3));
  m.seq->to(dtype);
  return m;
}

constexpr int kSteps = 6;
constexpr int kRows = 4;  // per rank

// Whether rank r uses the gate in micro-batch k of step s: everywhere, nowhere, rank 0 only (in the first
// micro-batch only: a noSync one when there are two), nowhere, the last rank only, nowhere.
bool uses(int s, int k, int r, int world) {
  switch (s % 6) {
    case 0: return true;
    case 2: return r == 0 && k == 0;
    case 4: return r == world - 1;
    default: return false;
  }
}

std::pair<torch::Tensor, torch::Tensor> rows(int s, int k, int world, torch::Dtype dtype) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(900 + 10 * s + k);
  return {at::randn({world * kRows, 6}, g, torch::TensorOptions(dtype)), at::randint(0, 3, {world * kRows}, g, torch::kLong)};
}

// Rank `rank`'s loss on its rows of micro-batch k of step s, the gate on or off; through `fwd` when given
// (FSDP's forward), else the model's.
torch::Tensor rankLoss(Model& m, int s, int k, int rank, int world, torch::Dtype dtype, bool gate,
                       const std::function<at::Tensor(const at::Tensor&)>& fwd = {}) {
  auto [x, y] = rows(s, k, world, dtype);
  m.gate->on = gate;
  auto xs = x.narrow(0, rank * kRows, kRows);
  return torch::nn::functional::cross_entropy(fwd ? fwd(xs) : m.seq->forward(xs), y.narrow(0, rank * kRows, kRows));
}

struct Variant {
  std::string opt = "adam";
  bool none = true;  // zero_grad(): set to none (2.x's default) or zero in place
  int micro = 1;     // micro-batches per step, all but the last under noSync
  // The forward through dtrain::recompute: its backward node hands the accumulators of the parameters the
  // segment did not use an undefined gradient (the hooks run, with nothing).
  bool recomputed = false;
  std::string describe(int rank, int world) const {
    return fmt::format("{} zero_grad({}) micro {}{} rank {} of {}", opt, none ? "set_to_none" : "false", micro,
                       recomputed ? " recomputed" : "", rank, world);
  }
};

// The model's forward, through dtrain::recompute when v.recomputed.
std::function<at::Tensor(const at::Tensor&)> forwardOf(const Model& m, const Variant& v) {
  if (!v.recomputed) return {};
  return [seq = m.seq, params = m.seq->parameters()](const at::Tensor& x) {
    return recompute([seq](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{seq.ptr()->forward(in[0])}; },
                     {x}, params)[0];
  };
}

std::vector<torch::optim::OptimizerParamGroup> groupOf(std::vector<at::Tensor> params) {
  return {torch::optim::OptimizerParamGroup(std::move(params))};
}

// Adam with momentum and weight decay, or SGD with momentum and weight decay: both move a parameter whose
// gradient is a defined zero, and skip one whose gradient is undefined.
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const std::string& kind,
                                                       std::vector<torch::optim::OptimizerParamGroup> groups) {
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(0.01).weight_decay(0.1));
  return std::make_unique<torch::optim::SGD>(std::move(groups),
                                             torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.05));
}

using MakeOpt = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;

// The model one process trains on the whole global batch, step after step, with the same gate schedule:
// rank r's rows go through the gate when uses(s, k, r), and the loss is the mean of the ranks' losses.
Model reference(const Variant& v, int world, torch::Dtype dtype, const MakeOpt& make_opt = {}) {
  Model ref = makeModel(dtype);
  auto groups = groupOf(ref.seq->parameters());
  auto opt = make_opt ? make_opt(std::move(groups)) : makeOptimizer(v.opt, std::move(groups));
  for (int s = 0; s < kSteps; ++s) {
    compat::zeroGrad(*opt, v.none);
    for (int k = 0; k < v.micro; ++k) {
      for (int r = 0; r < world; ++r) (rankLoss(ref, s, k, r, world, dtype, uses(s, k, r, world)) / world).backward();
    }
    opt->step();
  }
  return ref;
}

// Every parameter of `got` (by name) within rel of the reference's.
void expectSame(const std::map<std::string, at::Tensor>& got, const Model& ref, double rel, const std::string& what) {
  size_t n = 0;
  for (const auto& item : ref.seq->named_parameters()) {
    auto it = got.find(item.key());
    ASSERT_NE(it, got.end()) << what << ": no parameter " << item.key();
    const auto want = item.value().detach().to(torch::kDouble);
    const double diff = (it->second.detach().to(torch::kDouble) - want).abs().max().item<double>();
    EXPECT_LE(diff / std::max(1.0, want.abs().max().item<double>()), rel)
        << what << ": parameter " << item.key() << " differs by " << diff;
    ++n;
  }
  EXPECT_EQ(n, got.size()) << what;
}

std::map<std::string, at::Tensor> paramsOf(const Model& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.seq->named_parameters()) out[item.key()] = item.value();
  return out;
}

std::vector<Variant> everyVariant() {
  std::vector<Variant> out;
  for (const char* opt : {"adam", "sgd"})
    for (bool none : {true, false})
      for (int micro : {1, 2}) out.push_back({opt, none, micro});
  for (int micro : {1, 2}) out.push_back({"adam", true, micro, /*recomputed=*/true});
  return out;
}

using RankFn = std::function<void(int rank, const std::shared_ptr<comm::ProcessGroup>& pg)>;

// fn on `world` ranks, each with the world's group.
void onRanks(int world, const RankFn& fn) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) { fn(rank, group(server, rank, world)); });
  expectAllOk(results);
}

void everyVariantOn(int world, const std::function<void(int, const std::shared_ptr<comm::ProcessGroup>&, const Variant&)>& fn) {
  onRanks(world, [&](int rank, const std::shared_ptr<comm::ProcessGroup>& pg) {
    for (const auto& v : everyVariant()) fn(rank, pg, v);
  });
}

DDPOptions findUnused(size_t bucket_bytes) {
  DDPOptions o;
  o.find_unused_parameters = true;
  o.bucket_bytes = o.first_bucket_bytes = bucket_bytes;
  return o;
}

// DDP (find_unused_parameters), optionally with ZeRO-1 over it.
void trainDdp(int rank, int world, const std::shared_ptr<comm::ProcessGroup>& pg, const Variant& v, bool zero) {
  Model model = makeModel(torch::kDouble);
  DistributedDataParallel ddp(model.seq.ptr(), pg, findUnused(512));  // several buckets: the gate's not the last
  std::unique_ptr<torch::optim::Optimizer> plain;
  std::unique_ptr<ZeroRedundancyOptimizer> sharded;
  if (zero) {
    sharded = std::make_unique<ZeroRedundancyOptimizer>(
        model.seq->parameters(), [&](auto groups) { return makeOptimizer(v.opt, std::move(groups)); }, pg);
  } else {
    plain = makeOptimizer(v.opt, groupOf(model.seq->parameters()));
  }
  for (int s = 0; s < kSteps; ++s) {
    if (zero) sharded->zeroGrad(v.none);
    else compat::zeroGrad(*plain, v.none);
    for (int k = 0; k < v.micro; ++k) {
      ddp.beforeForward();
      auto loss = rankLoss(model, s, k, rank, world, torch::kDouble, uses(s, k, rank, world), forwardOf(model, v));
      if (k + 1 < v.micro) {
        auto guard = ddp.noSync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    // No rank used the gate in this step's window: its gradient is what it was before (undefined after
    // a zero_grad that sets to none).
    const bool anyone = [&] {
      for (int k = 0; k < v.micro; ++k)
        for (int r = 0; r < world; ++r)
          if (uses(s, k, r, world)) return true;
      return false;
    }();
    if (!anyone && v.none) {
      EXPECT_FALSE(model.gate->lin->weight.grad().defined()) << v.describe(rank, world) << " step " << s;
    }
    if (zero) sharded->step();
    else plain->step();
  }
  expectSame(paramsOf(model), reference(v, world, torch::kDouble), 1e-7,
             fmt::format("{}{}", zero ? "ZeRO-1 " : "DDP ", v.describe(rank, world)));
}

void trainFsdp(int rank, int world, const std::shared_ptr<comm::ProcessGroup>& pg, const Variant& v) {
  Model model = makeModel(torch::kDouble);
  FsdpOptions o;
  o.stage = 3;
  o.units = {2, 1, 1};
  FullyShardedDataParallel fsdp(model.seq, pg, o);
  auto opt = makeOptimizer(v.opt, groupOf(fsdp.shards()));
  for (int s = 0; s < kSteps; ++s) {
    compat::zeroGrad(*opt, v.none);
    for (int k = 0; k < v.micro; ++k) {
      auto loss = rankLoss(model, s, k, rank, world, torch::kDouble, uses(s, k, rank, world),
                           [&](const at::Tensor& x) { return fsdp.forward(x); });
      if (k + 1 < v.micro) {
        auto guard = fsdp.noSync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    opt->step();
  }
  expectSame(fsdp.fullState(), reference(v, world, torch::kDouble), 1e-7, "FSDP stage 3 " + v.describe(rank, world));
}

// Clears the gradients of `params` as zero_grad() does (set to none, or zeroed in place).
void clearGrads(const std::vector<at::Tensor>& params, bool none) {
  for (auto p : params) {
    if (!p.grad().defined()) continue;
    if (none) {
      p.mutable_grad().reset();
    } else {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

// The parameter server's module on W workers and 2 servers (bsp): servers that update (sgd with momentum,
// adam: no weight decay on the servers), or sum_only servers with the optimizer on the workers. One
// module per variant, one after the other on the same workers (PS names apart by prefix).
// bsp servers with this update; partitions of 100 floats: buckets cut into partitions over both servers.
ps::PSOptions bspOptions(ps::PSOptions::Update update) {
  ps::PSOptions o;
  o.consistency = ps::Consistency::bsp;
  o.update = update;
  o.lr = update == ps::PSOptions::Update::adam ? 0.01 : 0.05;
  o.momentum = 0.9;
  o.partition_bytes = 400;
  o.timeout = std::chrono::seconds(20);
  return o;
}

void psEqualsOneProcess(int world, ps::PSOptions::Update update) {
  const ps::PSOptions o = bspOptions(update);
  std::vector<Variant> variants;
  for (const char* opt : {"adam", "sgd"}) {
    for (bool none : {true, false}) {
      if (update == ps::PSOptions::Update::sum_only) variants.push_back({opt, none, 1});
      else if (std::string(opt) == "adam") variants.push_back({update == ps::PSOptions::Update::adam ? "server adam" : "server sgd+momentum", none, 1});
      if (none && std::string(opt) == "adam") variants.push_back({variants.back().opt, none, 1, /*recomputed=*/true});
    }
  }
  // The servers' optimizer, as torch::optim configures it.
  MakeOpt server_opt = [&](std::vector<torch::optim::OptimizerParamGroup> g) -> std::unique_ptr<torch::optim::Optimizer> {
    if (update == ps::PSOptions::Update::adam)
      return std::make_unique<torch::optim::Adam>(std::move(g), torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps));
    return std::make_unique<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(o.lr).momentum(o.momentum));
  };
  runJob(world, 2, world, o, [&](const std::shared_ptr<comm::Store>& store, int rank) {
    ps::Worker wk(store, rank, world, 2, o);
    for (size_t n = 0; n < variants.size(); ++n) {
      const Variant& v = variants[n];
      Model model = makeModel(torch::kFloat);
      ps::ModuleOptions mo;
      mo.bucket_bytes = 256;  // several buckets
      mo.prefix = fmt::format("m{}.", n);
      ps::DistributedModule psm(model.seq.ptr(), wk, mo);
      std::unique_ptr<torch::optim::Optimizer> local;
      if (update == ps::PSOptions::Update::sum_only) local = makeOptimizer(v.opt, groupOf(model.seq->parameters()));
      for (int s = 0; s < kSteps; ++s) {
        psm.beforeForward();
        clearGrads(model.seq->parameters(), v.none);
        rankLoss(model, s, 0, rank, world, torch::kFloat, uses(s, 0, rank, world), forwardOf(model, v)).backward();
        psm.step();
        if (local) local->step();
      }
      psm.beforeForward();
      const bool sum_only = update == ps::PSOptions::Update::sum_only;
      expectSame(paramsOf(model), reference(v, world, torch::kFloat, sum_only ? MakeOpt() : server_opt), 2e-6,
                 fmt::format("ps::DistributedModule ({} servers) {}", sum_only ? "sum_only" : "updating",
                             v.describe(rank, world)));
    }
    wk.finish();
  });
}

// The servers' per-element update counts survive a checkpoint: saved after 3 steps (the gate's elements
// updated twice, the others three times), 3 more steps, then the saved state loaded back and the same 3
// steps again give the same parameters, bit for bit.
TEST(UnusedGradPs, PerElementStepsSurviveACheckpoint) {
  const ps::PSOptions o = bspOptions(ps::PSOptions::Update::adam);
  runJob(2, 2, 2, o, [&](const std::shared_ptr<comm::Store>& store, int rank) {
    ps::Worker wk(store, rank, 2, 2, o);
    Model model = makeModel(torch::kFloat);
    ps::ModuleOptions mo;
    mo.bucket_bytes = 256;
    ps::DistributedModule psm(model.seq.ptr(), wk, mo);
    auto train = [&](int from, int to) {
      for (int s = from; s < to; ++s) {
        psm.beforeForward();
        clearGrads(model.seq->parameters(), true);
        rankLoss(model, s, 0, rank, 2, torch::kFloat, uses(s, 0, rank, 2)).backward();
        psm.step();
      }
      psm.beforeForward();
      std::vector<at::Tensor> out;
      for (const auto& p : model.seq->parameters()) out.push_back(p.detach().clone());
      return out;
    };
    train(0, 3);
    const auto state = wk.saveState();
    size_t with_counts = 0;
    for (const auto& [name, t] : state) with_counts += name.find("#elem_steps") != std::string::npos;
    EXPECT_GT(with_counts, 0u) << "no tensor kept per-element update counts";
    const auto first = train(3, 6);
    // Every worker's last pulls are answered before worker 0 puts the servers back at step 3: a pull of
    // step 6 that reached a server after the restore would wait for a step that no longer comes.
    store->set(fmt::format("pulled{}", rank), {1});
    store->wait({"pulled0", "pulled1"}, std::chrono::seconds(30));
    wk.loadState(state);
    psm.refresh();
    const auto again = train(3, 6);
    for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(first[i].equal(again[i])) << "parameter " << i;
    wk.finish();
  });
}

class UnusedGrad : public ::testing::TestWithParam<int> {};


TEST_P(UnusedGrad, DdpEqualsOneProcess) {
  const int world = GetParam();
  everyVariantOn(world, [&](int rank, auto& pg, const Variant& v) { trainDdp(rank, world, pg, v, /*zero=*/false); });
}

TEST_P(UnusedGrad, ZeroStage1EqualsOneProcess) {
  const int world = GetParam();
  everyVariantOn(world, [&](int rank, auto& pg, const Variant& v) { trainDdp(rank, world, pg, v, /*zero=*/true); });
}

TEST_P(UnusedGrad, FsdpStage3EqualsOneProcess) {
  const int world = GetParam();
  everyVariantOn(world, [&](int rank, auto& pg, const Variant& v) { trainFsdp(rank, world, pg, v); });
}

TEST_P(UnusedGrad, PsModuleAdamServersEqualOneProcess) { psEqualsOneProcess(GetParam(), ps::PSOptions::Update::adam); }
TEST_P(UnusedGrad, PsModuleMomentumServersEqualOneProcess) {
  psEqualsOneProcess(GetParam(), ps::PSOptions::Update::sgd);
}
TEST_P(UnusedGrad, PsModuleSumOnlyServersEqualOneProcess) {
  psEqualsOneProcess(GetParam(), ps::PSOptions::Update::sum_only);
}

// The comm hooks write into every slot of a bucket (error feedback, residuals): a gradient that no rank
// produced in a pass is still what it was before it, bit for bit, or undefined.
TEST(UnusedGradHooks, EveryHookKeepsAGradientNoRankProduced) {
  struct Named {
    const char* name;
    std::function<std::shared_ptr<CommHook>()> make;
  };
  const std::vector<Named> hooks = {
      {"fp16", [] { return fp16CompressHook(/*always=*/true); }},
      {"bf16", [] { return bf16CompressHook(/*always=*/true); }},
      {"powerSGD",
       [] {
         PowerSGDOptions o;
         o.start_powerSGD_iter = 2;
         o.min_compression_rate = 0;
         return std::static_pointer_cast<CommHook>(powerSGDHook(o));
       }},
      {"topK",
       [] {
         TopKOptions o;
         o.ratio = 0.3;
         o.min_compress_numel = 16;
         return topKHook(o);
       }},
  };
  onRanks(2, [&](int rank, const std::shared_ptr<comm::ProcessGroup>& pg) {
    for (const auto& hook : hooks) {
      Model model = makeModel(torch::kDouble);
      DistributedDataParallel ddp(model.seq.ptr(), pg, findUnused(4096));
      ddp.registerCommHook(hook.make());
      auto pass = [&](int s, bool gate) { rankLoss(model, s, 0, rank, 2, torch::kDouble, gate).backward(); };
      const auto& w = model.gate->lin->weight;
      for (int s = 0; s < 4; ++s) {  // (PowerSGD compresses from the third pass on)
        clearGrads(model.seq->parameters(), true);
        pass(s, true);
      }
      const at::Tensor before = w.grad().clone();
      pass(4, false);  // accumulates into the others; the gate's gradient must stay as it was
      ASSERT_TRUE(w.grad().defined()) << hook.name;
      EXPECT_TRUE(w.grad().equal(before)) << hook.name << ": the gate's gradient changed by "
                                          << (w.grad() - before).abs().max().item<double>();
      EXPECT_GT(model.seq[0]->as<torch::nn::Linear>()->weight.grad().abs().sum().item<double>(), 0)
          << hook.name;  // (not a vacuous pass: the trunk got gradients)
      clearGrads(model.seq->parameters(), true);
      pass(5, false);
      EXPECT_FALSE(w.grad().defined()) << hook.name << ": a gradient appeared for a parameter no rank used";
      clearGrads(model.seq->parameters(), true);
      pass(6, rank == 0);
      EXPECT_TRUE(w.grad().defined()) << hook.name << ": a parameter rank 0 used has no gradient on rank " << rank;
    }
  });
}

// dtrain::Join: a rank that ran out of inputs shadows the others' exchange of who used what.
TEST(UnusedGradJoin, AJoinedRankShadowsTheExchange) {
  onRanks(2, [&](int rank, const std::shared_ptr<comm::ProcessGroup>& pg) {
    Model model = makeModel(torch::kDouble);
    DistributedDataParallel ddp(model.seq.ptr(), pg, findUnused(DDPOptions().bucket_bytes));
    const int batches = rank == 0 ? 3 : 1;
    {
      Join join(ddp);
      for (int s = 0; s < batches; ++s) {
        clearGrads(model.seq->parameters(), true);
        rankLoss(model, s, 0, rank, 2, torch::kDouble, s == 0).backward();
        EXPECT_EQ(model.gate->lin->weight.grad().defined(), s == 0) << "rank " << rank << " pass " << s;
        EXPECT_TRUE(model.seq[3]->as<torch::nn::Linear>()->weight.grad().defined()) << "rank " << rank << " pass " << s;
      }
    }
  });
}

// The model averagers: rank 0 has a gradient for the gate, rank 1 none (it skipped the branch after a
// zero_grad() that sets to none). Both must average the same parameters: those with a gradient somewhere.
TEST(UnusedGradLocalSgd, AveragersAgreeOnWhatToAverage) {
  onRanks(2, [&](int rank, const std::shared_ptr<comm::ProcessGroup>& pg) {
    Model model = makeModel(torch::kDouble);
    auto params = model.seq->parameters();
    {
      torch::NoGradGuard g;
      for (auto& p : params) p.add_(rank);  // replicas apart by 1
    }
    model.seq[3]->as<torch::nn::Linear>()->weight.set_requires_grad(false);  // no rank has a gradient for it
    rankLoss(model, 0, 0, rank, 2, torch::kDouble, rank == 0).backward();
    ASSERT_EQ(model.gate->lin->weight.grad().defined(), rank == 0);
    PeriodicModelAverager avg(pg, /*period=*/1);
    ASSERT_TRUE(avg.averageParameters(params));
    Model start = makeModel(torch::kDouble);
    auto expect = start.seq->named_parameters();
    for (const auto& item : model.seq->named_parameters()) {
      const double shift = item.key() == "3.weight" ? rank : 0.5;  // own value, or the mean of +0 and +1
      const double diff = (item.value() - (expect[item.key()] + shift)).abs().max().item<double>();
      EXPECT_LE(diff, 1e-12) << "rank " << rank << ": " << item.key();
    }
  });
}

// DataParallel (threads, one process): replicas of 3-row slices use a branch, those of 2 rows do not. The
// main module's gradients, step by step, are one process's on the whole batch: undefined where no slice
// used the branch, so Adam with weight decay leaves it alone.
struct SliceGatedImpl : torch::nn::Cloneable<SliceGatedImpl> {
  SliceGatedImpl() { reset(); }
  void reset() override {
    trunk = register_module("trunk", torch::nn::Linear(6, 8));
    branch = register_module("branch", torch::nn::Linear(8, 8));
    out = register_module("out", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(trunk(x));
    if (x.size(0) == 3) h = h + branch(h);
    return out(h);
  }
  torch::nn::Linear trunk{nullptr}, branch{nullptr}, out{nullptr};
};
TORCH_MODULE(SliceGated);

TEST(UnusedGradDataParallel, MainGradientsAreOneProcesss) {
  at::set_num_threads(1);
  auto loss_fn = [](torch::nn::Module& replica, const at::Tensor& x, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(replica.as<SliceGatedImpl>()->forward(x), y);
  };
  for (bool none : {true, false}) {
    torch::manual_seed(3);
    SliceGated net;
    net->to(torch::kDouble);
    SliceGated ref(std::dynamic_pointer_cast<SliceGatedImpl>(net->clone()));
    DataParallel dp(net, /*num_replicas=*/4);
    auto opts = torch::optim::AdamOptions(0.01).weight_decay(0.1);
    torch::optim::Adam opt(net->parameters(), opts), ref_opt(ref->parameters(), opts);
    for (int s = 0; s < 6; ++s) {
      const int64_t batch = s % 2 == 0 ? 10 : 8;  // slices 3, 3, 2, 2 (the branch used) or 2, 2, 2, 2 (not)
      auto g = at::make_generator<at::CPUGeneratorImpl>(40 + s);
      auto x = at::randn({batch, 6}, g, torch::kDouble);
      auto y = at::randint(0, 3, {batch}, g, torch::kLong);
      compat::zeroGrad(opt, none);
      compat::zeroGrad(ref_opt, none);
      dp.step(x, y, loss_fn);
      int64_t row = 0;
      for (int64_t n : DataParallel::splitSizes(batch, 4)) {  // the same slices, one after the other
        (torch::nn::functional::cross_entropy(ref->forward(x.narrow(0, row, n)), y.narrow(0, row, n)) * n / batch)
            .backward();
        row += n;
      }
      if (none) {
        EXPECT_EQ(net->branch->weight.grad().defined(), batch == 10) << "step " << s;
      }
      opt.step();
      ref_opt.step();
    }
    auto want = ref->named_parameters();
    for (const auto& item : net->named_parameters()) {
      const double diff = (item.value() - want[item.key()]).abs().max().item<double>();
      EXPECT_LE(diff, 1e-10) << item.key() << (none ? " (set to none)" : " (zeroed)");
    }
  }
}

// Restoring optimizer state into a live optimizer: a parameter with no state in the checkpoint (never
// stepped, its gradient always undefined) has none afterwards, as in the run that wrote it.
TEST(UnusedGradCheckpoint, ARestoredParameterWithoutStateHasNone) {
  Model model = makeModel(torch::kDouble);
  auto opt = makeOptimizer("adam", groupOf(model.seq->parameters()));
  auto step = [&](bool gate) {
    compat::zeroGrad(*opt, true);
    rankLoss(model, 0, 0, 0, 1, torch::kDouble, gate).backward();
    opt->step();
  };
  const auto key = compat::optimizerStateKey(model.gate->lin->weight);
  step(false);
  ASSERT_EQ(opt->state().count(key), 0u);
  CheckpointState s;
  s.captureOptimizer(*opt);
  step(true);
  ASSERT_EQ(opt->state().count(key), 1u);
  s.restoreOptimizer(*opt);
  EXPECT_EQ(opt->state().count(key), 0u) << "the gate kept the state of a step after the checkpoint";
}

// FSDP consolidated files across unit layouts: saved with the gate a unit of its own (never used: no state),
// loaded with the gate and the last layer in one unit (the gate's part of the shard's state: zeros). Where
// the unit's parameters were stepped different numbers of times, the error says so (one step per shard).
TEST(UnusedGradCheckpoint, FsdpLoadsAUnitWhoseParametersHaveStateAndNot) {
  TempDir tmp;
  for (bool gate_once : {false, true}) {
    const std::string file = tmp.path() + (gate_once ? "/once.pt" : "/never.pt");
    onRanks(2, [&](int rank, const std::shared_ptr<comm::ProcessGroup>& pg) {
      std::map<std::string, at::Tensor> saved;
      {
        Model model = makeModel(torch::kDouble);
        FsdpOptions o;
        o.units = {2, 1, 1};
        FullyShardedDataParallel fsdp(model.seq, pg, o);
        auto opt = makeOptimizer("adam", groupOf(fsdp.shards()));
        for (int s = 0; s < 3; ++s) {
          compat::zeroGrad(*opt, true);
          rankLoss(model, s, 0, rank, 2, torch::kDouble, gate_once && s == 0, [&](const at::Tensor& x) {
            return fsdp.forward(x);
          }).backward();
          opt->step();
        }
        fsdp.saveConsolidated(file, *opt);
        saved = fsdp.fullState();
      }
      Model model = makeModel(torch::kDouble);
      FsdpOptions o;
      o.units = {2, 2};
      FullyShardedDataParallel fsdp(model.seq, pg, o);
      auto opt = makeOptimizer("adam", groupOf(fsdp.shards()));
      if (gate_once) {
        try {
          fsdp.loadConsolidated(file, *opt);
          ADD_FAILURE() << "parameters stepped 1 and 3 times loaded into one shard";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("stepped 1 and 3 times"), std::string::npos) << e.what();
        }
        return;
      }
      fsdp.loadConsolidated(file, *opt);
      for (const auto& [name, t] : fsdp.fullState()) EXPECT_TRUE(t.equal(saved.at(name))) << name;
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, UnusedGrad, ::testing::Values(2, 3), [](const auto& info) {
  return "world" + std::to_string(info.param);
});

}  // namespace
}  // namespace dtrain::test
