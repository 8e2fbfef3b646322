// ZeroRedundancyOptimizer (dtrain/zero.h, stage 1): the partition against PyTorch's (the torch of pythonPath(): the wheel's 2.x or Debian's 1.13);
// 2, 3 and 4 ranks with DDP against one process on the global batch (SGD-momentum and Adam, a model with an
// unused parameter, a tied weight and uneven sizes, with and without clipping); the consolidated state
// loaded by PyTorch's Adam, whose next step equals dtrain's; resharding: saved at 4 ranks, continued at
// 2 and 3, equal to the 4-rank run's continuation; memory: the state is split, not copied.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "ddp_test_util.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/zero.h"
#include "harness.h"
#include "torch/pickle_save.h"

namespace dtrain::test {
namespace {

// Uneven sizes, a weight used twice (registered under two names), a parameter no forward uses.
struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl() {
    enc = register_module("enc", torch::nn::Linear(6, 16));
    mid = register_module("mid", torch::nn::Linear(16, 37));
    back = register_module("back", torch::nn::Linear(37, 16));
    tied = register_parameter("tied", enc->weight);  // the same tensor as enc.weight
    spare = register_parameter("spare", torch::randn({5}));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(enc->forward(x));
    h = torch::tanh(back->forward(torch::relu(mid->forward(h))));
    return torch::nn::functional::linear(h, tied.t());  // 6 outputs through the shared weight
  }
  torch::nn::Linear enc{nullptr}, mid{nullptr}, back{nullptr};
  torch::Tensor tied, spare;
};
TORCH_MODULE(TiedNet);

TiedNet makeTied() {
  torch::manual_seed(11);
  TiedNet n;
  n->to(torch::kDouble);
  return n;
}

constexpr int kGlobal = 12;  // rows of a step's global batch: divisible by 2, 3 and 4

std::pair<torch::Tensor, torch::Tensor> globalBatch(int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randn({kGlobal, 6}, g, torch::kDouble), at::randint(0, 6, {kGlobal}, g, torch::kLong)};
}

std::vector<at::Tensor> unique(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : uniqueParameters(m)) out.push_back(t);
  return out;
}

std::unique_ptr<torch::optim::Optimizer> make(const std::string& kind, std::vector<torch::optim::OptimizerParamGroup> g) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(std::move(g), torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.05).momentum(0.9));
}

ZeroRedundancyOptimizer::MakeOptimizer maker(const std::string& kind) {
  return [kind](std::vector<torch::optim::OptimizerParamGroup> g) { return make(kind, std::move(g)); };
}

// One DDP + ZeRO training step on this rank's rows of the global batch.
void zeroStep(DistributedDataParallel& ddp, TiedNet& model, ZeroRedundancyOptimizer& opt, int step, int rank,
              int world, double clip) {
  opt.zeroGrad();
  auto [x, y] = globalBatch(step);
  const int rows = kGlobal / world;
  auto xs = x.narrow(0, rank * rows, rows), ys = y.narrow(0, rank * rows, rows);
  torch::nn::functional::cross_entropy(ddp.forward(model, xs), ys).backward();
  if (clip > 0) opt.clipGradNorm(clip);
  opt.step();
}

void refStep(TiedNet& ref, torch::optim::Optimizer& opt, int step, double clip) {
  opt.zero_grad();
  auto [x, y] = globalBatch(step);
  torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
  if (clip > 0) torch::nn::utils::clip_grad_norm_(unique(*ref), clip);
  opt.step();
}

DDPOptions ddpOptions() {
  DDPOptions d;
  d.bucket_bytes = d.first_bucket_bytes = 512;
  d.find_unused_parameters = true;  // `spare`
  return d;
}

void stage1EqualsOneProcess(int world, const std::string& kind, double clip) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    TiedNet model = makeTied(), ref = makeTied();
    DistributedDataParallel ddp(model.ptr(), pg, ddpOptions());
    ZeroRedundancyOptimizer opt(unique(*model), maker(kind), pg);
    auto ref_opt = make(kind, {torch::optim::OptimizerParamGroup(unique(*ref))});
    ASSERT_EQ(opt.parameters().size(), 7u) << "the tied weight counts once";
    for (int s = 0; s < 5; ++s) {
      zeroStep(ddp, model, opt, s, rank, world, clip);
      refStep(ref, *ref_opt, s, clip);
    }
    expectClose(*model, *ref, 1e-5, fmt::format("{} clip {} rank {} of {}", kind, clip, rank, world));
    // The state is split: the ranks' state bytes add up to one process's.
    int64_t bytes = opt.memory().optimizer_state;
    pg->allreduce(&bytes, 1, comm::DType::i64)->wait();
    int64_t ref_bytes = 0;
    for (const auto& [key, st] : ref_opt->state()) {
      if (kind == "adam") {
        const auto& a = static_cast<const torch::optim::AdamParamState&>(*st);
        ref_bytes += static_cast<int64_t>(a.exp_avg().nbytes() + a.exp_avg_sq().nbytes() + 4);
      } else {
        ref_bytes += static_cast<int64_t>(static_cast<const torch::optim::SGDParamState&>(*st).momentum_buffer().nbytes());
      }
    }
    // The unused parameter (5 doubles) has no gradient on any rank: DDP leaves it undefined, so neither
    // side has state for it (before, DDP gave it a zero gradient and the sharded side 2 x 40 + 4 bytes more).
    EXPECT_EQ(bytes, ref_bytes);
    EXPECT_LT(opt.memory().optimizer_state, ref_bytes) << "rank " << rank << " holds the whole state";
  });
  expectAllOk(results);
}

void writeTensors(const std::string& path, const std::vector<at::Tensor>& ts) {
  c10::List<at::Tensor> list;
  for (const auto& t : ts) list.push_back(t.detach().clone());
  auto bytes = dtrain::detail::torchSave(list);  // what dtrain writes: torch.load reads it by default
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<at::Tensor> readTensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), {});
  std::vector<at::Tensor> out;
  for (const auto& v : torch::pickle_load(bytes).toList()) out.push_back(v.get().toTensor());
  return out;
}

TEST(Zero, PartitionIsPyTorchsOnItsExample) {
  // zero_redundancy_optimizer.py's rule on numels [100, 10, 60, 50, 5], 2 ranks: {0, 1, 4} and {2, 3}.
  EXPECT_EQ(zeroPartition({{100, 10, 60, 50, 5}}, 2), (std::vector<int>{0, 0, 1, 1, 0}));
  EXPECT_EQ(zeroPartition({{4, 4, 4}, {4}}, 2), (std::vector<int>{0, 1, 0, 1})) << "ties: the lowest rank, loads carried";
  EXPECT_THROW(zeroPartition({{1}}, 0), InvalidArgument);
}

TEST(Zero, PartitionEqualsPyTorchs) {
  std::mt19937 rng(3);
  nlohmann::json cases = nlohmann::json::array();
  for (int k = 0; k < 30; ++k) {
    nlohmann::json groups = nlohmann::json::array();
    const int ngroups = 1 + static_cast<int>(rng() % 3);
    for (int g = 0; g < ngroups; ++g) {
      std::vector<int64_t> numels;
      const int n = 1 + static_cast<int>(rng() % 12);
      for (int i = 0; i < n; ++i) numels.push_back(1 + static_cast<int64_t>(rng() % (k % 2 ? 4 : 500)));  // ties too
      groups.push_back(numels);
    }
    cases.push_back({{"world", 2 + k % 3}, {"groups", groups}});
  }
  TempDir tmp;
  std::ofstream(tmp.path() + "/cases.json") << cases.dump();
  std::ofstream(tmp.path() + "/ref.py") <<
      "import json, sys, torch, torch.distributed as dist\n"
      "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
      "dist.init_process_group('gloo', init_method='file://' + sys.argv[2], rank=0, world_size=1)\n"
      "out = []\n"
      "for c in json.load(open(sys.argv[1])):\n"
      "    groups = [[torch.nn.Parameter(torch.zeros(n)) for n in g] for g in c['groups']]\n"
      "    z = ZeroRedundancyOptimizer([{'params': g} for g in groups], torch.optim.SGD, lr=0.1)\n"
      "    z.world_size = c['world']\n"
      "    z._partition_parameters_cache = []\n"
      "    owner = {}\n"
      "    for r, pgs in enumerate(z._partition_parameters()):\n"
      "        for pg in pgs:\n"
      "            for p in pg['params']: owner[id(p)] = r\n"
      "    out.append([owner[id(p)] for g in groups for p in g])\n"
      "print(json.dumps(out))\n";
  auto [status, out] = runCommand("env OMP_NUM_THREADS=1 " + pythonPath() + " " + tmp.path() + "/ref.py " + tmp.path() +
                                      "/cases.json " + tmp.path() + "/pg",
                                  120);
  ASSERT_EQ(status, 0) << out;
  auto ref = nlohmann::json::parse(out.substr(out.rfind("\n[") == std::string::npos ? out.find('[') : out.rfind("\n[") + 1));
  ASSERT_EQ(ref.size(), cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    auto groups = cases[k]["groups"].get<std::vector<std::vector<int64_t>>>();
    EXPECT_EQ(zeroPartition(groups, cases[k]["world"].get<int>()), ref[k].get<std::vector<int>>()) << cases[k].dump();
  }
}

TEST(Zero, Stage1SgdOnTwoRanksEqualsOneProcess) { stage1EqualsOneProcess(2, "sgd", 0); }
TEST(Zero, Stage1SgdOnThreeRanksEqualsOneProcess) { stage1EqualsOneProcess(3, "sgd", 0); }
TEST(Zero, Stage1SgdOnFourRanksEqualsOneProcess) { stage1EqualsOneProcess(4, "sgd", 0); }
TEST(Zero, Stage1AdamOnTwoRanksEqualsOneProcess) { stage1EqualsOneProcess(2, "adam", 0); }
TEST(Zero, Stage1AdamOnThreeRanksEqualsOneProcess) { stage1EqualsOneProcess(3, "adam", 0); }
TEST(Zero, Stage1AdamOnFourRanksEqualsOneProcess) { stage1EqualsOneProcess(4, "adam", 0); }
TEST(Zero, ClippingAcrossShardsEqualsOneProcess) {
  stage1EqualsOneProcess(3, "adam", 0.05);
  stage1EqualsOneProcess(2, "sgd", 0.05);
}

// The consolidated file, loaded by PyTorch's own Adam (python3-torch): the next step with the same
// gradients gives the same parameters as dtrain's sharded Adam.
TEST(Zero, ConsolidatedStateLoadsIntoPyTorchsAdam) {
  TempDir tmp;
  const std::string dir = tmp.path();
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    TiedNet model = makeTied();
    DistributedDataParallel ddp(model.ptr(), pg, ddpOptions());
    ZeroRedundancyOptimizer opt(unique(*model), maker("adam"), pg);
    for (int s = 0; s < 3; ++s) zeroStep(ddp, model, opt, s, rank, 2, 0);
    opt.saveConsolidated(dir + "/adam.pt");
    auto params = opt.parameters();
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < params.size(); ++i) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(90 + i);
      grads.push_back(at::randn(params[i].sizes(), g, torch::kDouble));
      params[i].mutable_grad() = grads.back().clone();
    }
    if (rank == 0) {
      writeTensors(dir + "/before.pt", params);
      writeTensors(dir + "/grads.pt", grads);
    }
    opt.step();
    if (rank == 0) writeTensors(dir + "/after.pt", params);
    pg->barrier()->wait();
  });
  expectAllOk(results);
  std::ofstream(dir + "/ref.py") << kPythonDtrainLoad <<
      "import sys, torch\n"
      "d = sys.argv[1]\n"
      "ps = [torch.nn.Parameter(t) for t in dtrain_load(d + '/before.pt')]\n"
      "sd = dtrain_load(d + '/adam.pt')\n"
      "opt = torch.optim.Adam(ps, lr=0.5)\n"
      "opt.load_state_dict(sd)\n"
      "assert opt.param_groups[0]['lr'] == 0.01, opt.param_groups[0]\n"
      // `spare` (index 1) never had a gradient: no state, as in one process (PyTorch's Adam makes it at
      // the step below, and so does dtrain's)
      "assert sorted(sd['state'].keys()) == [i for i in range(len(ps)) if i != 1], sorted(sd['state'].keys())\n"
      "for p, g in zip(ps, dtrain_load(d + '/grads.pt')): p.grad = g\n"
      "opt.step()\n"
      "diff = max((p - a).abs().max().item() for p, a in zip(ps, dtrain_load(d + '/after.pt')))\n"
      "print('steps', int(opt.state[ps[0]]['step'].item()), 'max difference', diff)\n"
      "sys.exit(0 if diff < 1e-10 else 1)\n";
  auto [status, out] = runCommand("env OMP_NUM_THREADS=1 " + pythonPath() + " " + dir + "/ref.py " + dir, 120);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("steps 4 max difference"), std::string::npos) << out;
}

// Saved at 4 ranks after 3 steps, loaded at 2 and at 3 (other owners), 3 more steps: equal to the
// 4-rank run's own continuation.
TEST(Zero, ReshardsFromFourRanksToTwoAndThree) {
  TempDir tmp;
  const std::string dir = tmp.path();
  {
    StoreServer server;
    auto results = runRanks(4, [&](int rank) {
      auto pg = group(server, rank, 4);
      TiedNet model = makeTied();
      DistributedDataParallel ddp(model.ptr(), pg, ddpOptions());
      ZeroRedundancyOptimizer opt(unique(*model), maker("adam"), pg);
      for (int s = 0; s < 3; ++s) zeroStep(ddp, model, opt, s, rank, 4, 0);
      opt.saveConsolidated(dir + "/adam.pt");
      if (rank == 0) writeTensors(dir + "/model.pt", opt.parameters());
      for (int s = 3; s < 6; ++s) zeroStep(ddp, model, opt, s, rank, 4, 0);
      if (rank == 0) writeTensors(dir + "/final4.pt", opt.parameters());
    });
    expectAllOk(results);
  }
  for (int world : {2, 3}) {
    StoreServer server;
    auto results = runRanks(world, [&](int rank) {
      auto pg = group(server, rank, world);
      TiedNet model = makeTied();
      {
        torch::NoGradGuard no_grad;
        auto saved = readTensors(dir + "/model.pt");
        auto params = unique(*model);
        ASSERT_EQ(saved.size(), params.size());
        for (size_t i = 0; i < params.size(); ++i) params[i].copy_(saved[i]);
      }
      DistributedDataParallel ddp(model.ptr(), pg, ddpOptions());
      ZeroRedundancyOptimizer opt(unique(*model), maker("adam"), pg);
      opt.loadConsolidated(dir + "/adam.pt");
      for (int s = 3; s < 6; ++s) zeroStep(ddp, model, opt, s, rank, world, 0);
      auto want = readTensors(dir + "/final4.pt");
      const auto& got = opt.parameters();
      for (size_t i = 0; i < got.size(); ++i) {
        const double diff = (got[i] - want[i]).abs().max().item<double>();
        EXPECT_LE(diff / std::max(1.0, want[i].abs().max().item<double>()), 1e-5)
            << "parameter " << i << " at world " << world << " rank " << rank;
      }
    });
    expectAllOk(results);
  }
}

// Per-rank checkpoint files (a Checkpointer over the group, each rank writing its part): saved at 4
// ranks, restored at 2 and 3 and continued as the 4-rank run; at 4 ranks bit for bit.
TEST(Zero, PerRankCheckpointsReshard) {
  TempDir tmp;
  const std::string dir = tmp.path(), saved = dir + "/" + Checkpointer::dirName(0, 3);
  {
    StoreServer server;
    auto results = runRanks(4, [&](int rank) {
      auto pg = group(server, rank, 4);
      TiedNet model = makeTied();
      DistributedDataParallel ddp(model.ptr(), pg, ddpOptions());
      ZeroRedundancyOptimizer opt(unique(*model), maker("adam"), pg);
      for (int s = 0; s < 3; ++s) zeroStep(ddp, model, opt, s, rank, 4, 0);
      CheckpointState st;
      st.step = 3;
      st.captureModel(*model);
      opt.captureSharded(st);
      Checkpointer(dir, pg).save(st);
      for (int s = 3; s < 6; ++s) zeroStep(ddp, model, opt, s, rank, 4, 0);
      if (rank == 0) writeTensors(dir + "/final4.pt", opt.parameters());
    });
    expectAllOk(results);
  }
  for (int world : {2, 3, 4}) {
    StoreServer server;
    auto results = runRanks(world, [&](int rank) {
      auto pg = group(server, rank, world);
      TiedNet model = makeTied();
      Checkpointer::load(saved + "/" + Checkpointer::rankFileName(0, 4)).restoreModel(*model);
      DistributedDataParallel ddp(model.ptr(), pg, ddpOptions());
      ZeroRedundancyOptimizer opt(unique(*model), maker("adam"), pg);
      opt.restoreSharded(saved);
      for (int s = 3; s < 6; ++s) zeroStep(ddp, model, opt, s, rank, world, 0);
      auto want = readTensors(dir + "/final4.pt");
      for (size_t i = 0; i < want.size(); ++i) {
        if (world == 4) {
          EXPECT_TRUE(torch::equal(opt.parameters()[i], want[i])) << "parameter " << i << ": not bit for bit";
        } else {
          const double diff = (opt.parameters()[i] - want[i]).abs().max().item<double>();
          EXPECT_LE(diff / std::max(1.0, want[i].abs().max().item<double>()), 1e-5) << i << " at world " << world;
        }
      }
    });
    expectAllOk(results);
  }
  StoreServer server;
  auto results = runRanks(1, [&](int rank) {
    auto pg = group(server, rank, 1);
    TiedNet model = makeTied();
    ZeroRedundancyOptimizer opt(unique(*model), maker("adam"), pg);
    std::filesystem::remove(saved + "/" + Checkpointer::rankFileName(2, 4));
    try {
      opt.restoreSharded(saved);
      ADD_FAILURE() << "restored from a checkpoint without rank 2's file";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2's file rank-00002-of-00004.pt is missing"), std::string::npos) << e.what();
    }
  });
  expectAllOk(results);
}

TEST(Zero, LoadingAnotherOptimizersStateIsAnError) {
  TempDir tmp;
  StoreServer server;
  auto results = runRanks(1, [&](int rank) {
    auto pg = group(server, rank, 1);
    TiedNet model = makeTied();
    ZeroRedundancyOptimizer sgd(unique(*model), maker("sgd"), pg), adam(unique(*model), maker("adam"), pg);
    sgd.saveConsolidated(tmp.path() + "/sgd.pt");
    try {
      adam.loadConsolidated(tmp.path() + "/sgd.pt");
      ADD_FAILURE() << "loaded SGD's state into Adam";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("holds the state of SGD, this optimizer is Adam"), std::string::npos) << e.what();
    }
    std::ofstream(tmp.path() + "/junk.pt") << "junk";
    EXPECT_THROW(adam.loadConsolidated(tmp.path() + "/junk.pt"), InvalidArgument);
    TiedNet other = makeTied();
    auto fewer = unique(*other);
    fewer.pop_back();
    ZeroRedundancyOptimizer small(fewer, maker("sgd"), pg);
    try {
      small.loadConsolidated(tmp.path() + "/sgd.pt");
      ADD_FAILURE() << "loaded 7 parameters' state into 6";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("has 7 parameter(s), this optimizer's 6"), std::string::npos) << e.what();
    }
  });
  expectAllOk(results);
}

TEST(Zero, RanksWithOtherParametersAllFail) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2, 10);
    TiedNet model = makeTied();
    auto params = unique(*model);
    if (rank == 1) params.pop_back();
    try {
      ZeroRedundancyOptimizer opt(params, maker("sgd"), pg);
      ADD_FAILURE() << "rank " << rank << " accepted other parameters";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("was given other parameters than rank"), std::string::npos) << e.what();
    }
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
