// FullyShardedDataParallel (dtrain/fsdp.h, ZeRO stages 2 and 3): on 2, 3 and 4 ranks, with and without
// recomputation and prefetch, SGD-momentum and Adam over the shards equal one process on the global batch
// (a model with uneven sizes, a tied weight inside one unit and a parameter no forward uses); clipping
// across shards; noSync accumulation; what a rank holds; bad options.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>

#include "ddp_test_util.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/fsdp.h"
#include "dtrain/zero.h"
#include "harness.h"
#include "torch/pickle_save.h"

namespace dtrain::test {
namespace {

// One child: a weight used twice (x·Wᵀ, then ·W back; registered as "w" and "again"), and a parameter
// no forward uses.
struct TiedPairImpl : torch::nn::Module {
  explicit TiedPairImpl(int64_t n, int64_t k) {
    w = register_parameter("w", torch::randn({k, n}) * 0.3);
    again = register_parameter("again", w);
    spare = register_parameter("spare", torch::randn({3}));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(torch::matmul(torch::relu(torch::matmul(x, w.t())), again)); }
  torch::Tensor w, again, spare;
};
TORCH_MODULE(TiedPair);

torch::nn::Sequential makeModel() {
  torch::manual_seed(21);
  torch::nn::Sequential s(torch::nn::Linear(6, 20), torch::nn::ReLU(), TiedPair(20, 7), torch::nn::Linear(20, 33),
                          torch::nn::Tanh(), torch::nn::Linear(33, 5));
  s->to(torch::kDouble);
  return s;
}

constexpr int kRows = 12;

std::pair<torch::Tensor, torch::Tensor> rows(int step, int micro) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(300 + 10 * step + micro);
  return {at::randn({kRows, 6}, g, torch::kDouble), at::randint(0, 5, {kRows}, g, torch::kLong)};
}

std::unique_ptr<torch::optim::Optimizer> makeOpt(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(0.05).momentum(0.9));
}

std::vector<at::Tensor> uniqueOf(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : uniqueParameters(m)) out.push_back(t);
  return out;
}

struct Variant {
  std::string opt = "adam";
  int stage = 3;
  bool recompute = false, prefetch = true;
  double clip = 0;
  int micro = 1;  // micro-batches per step: all but the last under noSync
};

// `steps` steps on this rank's rows with FSDP against one process on all rows; compares every parameter.
void fsdpEqualsOneProcess(comm::ProcessGroup& pg_ref, std::shared_ptr<comm::ProcessGroup> pg, const Variant& r) {
  const int world = pg->size(), rank = pg->rank(), per = kRows / world;
  auto model = makeModel(), ref = makeModel();
  FsdpOptions o;
  o.stage = r.stage;
  o.units = {2, 1, 3};
  o.recompute = r.recompute;
  o.prefetch = r.prefetch;
  FullyShardedDataParallel fsdp(model, pg, o);
  auto opt = makeOpt(r.opt, fsdp.shards());
  auto ref_opt = makeOpt(r.opt, uniqueOf(*ref));
  for (int s = 0; s < 5; ++s) {
    opt->zero_grad();
    ref_opt->zero_grad();
    for (int mb = 0; mb < r.micro; ++mb) {
      auto [x, y] = rows(s, mb);
      auto loss = [&] {
        return torch::nn::functional::cross_entropy(fsdp.forward(x.narrow(0, rank * per, per)), y.narrow(0, rank * per, per));
      };
      if (mb + 1 < r.micro) {
        auto guard = fsdp.noSync();
        loss().backward();
      } else {
        loss().backward();
      }
      torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
    }
    if (r.clip > 0) {
      fsdp.clipGradNorm(r.clip);
      torch::nn::utils::clip_grad_norm_(uniqueOf(*ref), r.clip);
    }
    opt->step();
    ref_opt->step();
  }
  auto full = fsdp.fullState();
  const std::string what = fmt::format("{} stage {} recompute {} prefetch {} clip {} micro {} rank {} of {}", r.opt, r.stage,
                                       r.recompute, r.prefetch, r.clip, r.micro, rank, world);
  size_t compared = 0;
  for (auto& [name, t] : uniqueParameters(*ref)) {
    ASSERT_TRUE(full.count(name)) << what << ": " << name << " is not in fullState()";
    const double diff = (full[name] - t).abs().max().item<double>();
    EXPECT_LE(diff / std::max(1.0, t.abs().max().item<double>()), 1e-5) << what << ": " << name << " differs by " << diff;
    ++compared;
  }
  EXPECT_EQ(compared, full.size()) << what;
  (void)pg_ref;
}

void everyVariant(int stage, int world) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    for (const char* opt : {"sgd", "adam"})
      for (bool recompute : {false, true})
        for (bool prefetch : {false, true}) {
          Variant r;
          r.opt = opt;
          r.stage = stage;
          r.recompute = recompute;
          r.prefetch = prefetch;
          fsdpEqualsOneProcess(*pg, pg, r);
        }
  });
  expectAllOk(results);
}

TEST(Fsdp, Stage2OnTwoRanksEqualsOneProcess) { everyVariant(2, 2); }
TEST(Fsdp, Stage2OnThreeRanksEqualsOneProcess) { everyVariant(2, 3); }
TEST(Fsdp, Stage2OnFourRanksEqualsOneProcess) { everyVariant(2, 4); }
TEST(Fsdp, Stage3OnTwoRanksEqualsOneProcess) { everyVariant(3, 2); }
TEST(Fsdp, Stage3OnThreeRanksEqualsOneProcess) { everyVariant(3, 3); }
TEST(Fsdp, Stage3OnFourRanksEqualsOneProcess) { everyVariant(3, 4); }

TEST(Fsdp, ClippingAndNoSyncAccumulationEqualOneProcess) {
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto pg = group(server, rank, 3);
    for (int stage : {2, 3}) {
      Variant clip;
      clip.stage = stage;
      clip.clip = 0.05;
      fsdpEqualsOneProcess(*pg, pg, clip);
      Variant acc;
      acc.stage = stage;
      acc.opt = "sgd";
      acc.micro = 3;
      fsdpEqualsOneProcess(*pg, pg, acc);
    }
  });
  expectAllOk(results);
}

// Stage 3 holds 1/W of the parameters between steps, and at most two units gathered at once; whole-unit
// buffers (gathered parameters, gradients: the pool's, and autograd's own) at most four units with
// prefetch and two without.
void holdsItsShard(bool prefetch) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    torch::manual_seed(1);
    torch::nn::Sequential seq(torch::nn::Linear(64, 64), torch::nn::Linear(64, 64), torch::nn::Linear(64, 64),
                              torch::nn::Linear(64, 64));
    int64_t total = 0;
    for (const auto& p : seq->parameters()) total += p.nbytes();
    FsdpOptions o;
    o.min_unit_params = 1;  // one child per unit
    o.prefetch = prefetch;
    FullyShardedDataParallel fsdp(seq, pg, o);
    EXPECT_EQ(fsdp.unitSizes(), (std::vector<int>{1, 1, 1, 1}));
    torch::optim::Adam opt(fsdp.shards(), torch::optim::AdamOptions(1e-3));
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      fsdp.forward(torch::randn({8, 64})).pow(2).sum().backward();
      opt.step();
    }
    auto mem = fsdp.memory();
    EXPECT_EQ(mem.shard_parameters, total / 2) << "rank " << rank;
    EXPECT_EQ(mem.shard_gradients, total / 2);
    EXPECT_EQ(mem.gathered_now, 0) << "parameters left gathered after the step";
    const int64_t unit = (64 * 64 + 64) * 4;
    EXPECT_LE(mem.gathered_peak, 2 * unit) << "more than two units gathered at once";
    EXPECT_GE(mem.gathered_peak, unit);
    EXPECT_LE(mem.transient_peak, (prefetch ? 4 : 2) * unit) << "whole-unit buffers, prefetch " << prefetch;
    EXPECT_GE(mem.transient_peak, 2 * unit);
  });
  expectAllOk(results);
}

TEST(Fsdp, Stage3HoldsItsShardAndAtMostTwoUnits) { holdsItsShard(true); }
TEST(Fsdp, Stage3WithoutPrefetchHoldsAtMostTwoWholeUnitBuffers) { holdsItsShard(false); }

// Steps [from, to) of FSDP training on this rank's rows (Adam over the shards).
void fsdpSteps(FullyShardedDataParallel& fsdp, torch::optim::Optimizer& opt, int from, int to, int rank, int world) {
  const int per = kRows / world;
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    auto [x, y] = rows(s, 0);
    torch::nn::functional::cross_entropy(fsdp.forward(x.narrow(0, rank * per, per)), y.narrow(0, rank * per, per)).backward();
    opt.step();
  }
}

// A name -> tensor map in a file (as dtrain writes files: src/torch/pickle_save.h), and back.
void saveNamed(const std::string& path, const std::map<std::string, at::Tensor>& m) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& [name, t] : m) d.insert(name, t);
  auto bytes = dtrain::detail::torchSave(d);  // what dtrain writes: torch.load reads it by default
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::map<std::string, at::Tensor> loadNamed(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), {});
  std::map<std::string, at::Tensor> out;
  for (const auto& e : torch::pickle_load(bytes).toGenericDict()) out[e.key().toStringRef()] = e.value().toTensor();
  return out;
}

// After resuming: equal to the uninterrupted run's parameters, bit for bit at its world size.
void expectResumed(FullyShardedDataParallel& fsdp, const std::map<std::string, at::Tensor>& want, int world) {
  for (auto& [name, t] : fsdp.fullState()) {
    if (world == 4) {
      EXPECT_TRUE(torch::equal(t, want.at(name))) << name << ": resumed at the same world size, not bit for bit";
    } else {
      const double diff = (t - want.at(name)).abs().max().item<double>();
      EXPECT_LE(diff / std::max(1.0, want.at(name).abs().max().item<double>()), 1e-5) << name << " at world " << world;
    }
  }
}

// Stage 3 at 4 ranks saves a consolidated file after 3 steps and goes on for 3 more. Loaded at 2 and 3
// ranks (stages 2 and 3) the 3 more steps equal that continuation; at 4 ranks they are bit for bit the
// same. Python's torch.load reads the file (the model's parameters by name, Adam's state per parameter).
TEST(Fsdp, ReshardsAndResumesFromAConsolidatedFile) {
  TempDir tmp;
  const std::string file = tmp.path() + "/fsdp.pt";
  std::map<std::string, at::Tensor> want;
  {
    StoreServer server;
    auto results = runRanks(4, [&](int rank) {
      auto pg = group(server, rank, 4);
      FsdpOptions o;
      o.units = {2, 1, 3};
      FullyShardedDataParallel fsdp(makeModel(), pg, o);
      torch::optim::Adam opt(fsdp.shards(), torch::optim::AdamOptions(0.01));
      fsdpSteps(fsdp, opt, 0, 3, rank, 4);
      fsdp.saveConsolidated(file, opt);
      fsdpSteps(fsdp, opt, 3, 6, rank, 4);
      auto full = fsdp.fullState();  // (collective)
      if (rank == 0) saveNamed(tmp.path() + "/final.pt", full);
    });
    expectAllOk(results);
  }
  want = loadNamed(tmp.path() + "/final.pt");
  ASSERT_EQ(want.size(), 8u);
  for (auto [world, stage] : {std::pair{2, 2}, {3, 3}, {4, 3}}) {
    StoreServer server;
    auto results = runRanks(world, [&, world = world, stage = stage](int rank) {
      auto pg = group(server, rank, world);
      FsdpOptions o;
      o.stage = stage;
      o.units = {2, 1, 3};
      FullyShardedDataParallel fsdp(makeModel(), pg, o);
      torch::optim::Adam opt(fsdp.shards(), torch::optim::AdamOptions(0.5));  // (the file's lr wins)
      fsdp.loadConsolidated(file, opt);
      fsdpSteps(fsdp, opt, 3, 6, rank, world);
      expectResumed(fsdp, want, world);
    });
    expectAllOk(results);
  }
  std::ofstream(tmp.path() + "/check.py") << kPythonDtrainLoad <<
      "import sys, torch\n"
      "sd = dtrain_load(sys.argv[1])\n"
      "names = sd['parameter_names']\n"
      "assert sorted(sd['model']) == sorted(names), (sorted(sd['model']), names)\n"
      "assert sorted(sd['state']) == list(range(len(names))), sorted(sd['state'])\n"
      "for i, n in enumerate(names): assert sd['state'][i]['exp_avg'].shape == sd['model'][n].shape, n\n"
      "ps = [torch.nn.Parameter(sd['model'][n]) for n in names]\n"
      "opt = torch.optim.Adam(ps)\n"
      "opt.load_state_dict({'state': sd['state'], 'param_groups': sd['param_groups']})\n"
      "print('loaded', len(names), 'parameters, lr', opt.param_groups[0]['lr'])\n";
  auto [status, out] = runCommand("env OMP_NUM_THREADS=1 " + pythonPath() + " " + tmp.path() + "/check.py " + file, 120);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("loaded 8 parameters, lr 0.01"), std::string::npos) << out;
}

// Per-rank checkpoint files: every rank writes its shards and their Adam state (a Checkpointer over the
// group); stage 3 at 4 ranks, restored at 2 (stage 2) and 3 and continued as the 4-rank run; at 4 bit for bit.
TEST(Fsdp, PerRankCheckpointsReshard) {
  TempDir tmp;
  const std::string dir = tmp.path(), saved = dir + "/" + Checkpointer::dirName(0, 3);
  {
    StoreServer server;
    auto results = runRanks(4, [&](int rank) {
      auto pg = group(server, rank, 4);
      FsdpOptions o;
      o.units = {2, 1, 3};
      FullyShardedDataParallel fsdp(makeModel(), pg, o);
      torch::optim::Adam opt(fsdp.shards(), torch::optim::AdamOptions(0.01));
      fsdpSteps(fsdp, opt, 0, 3, rank, 4);
      CheckpointState st;
      st.step = 3;
      fsdp.captureSharded(st, opt);
      Checkpointer(dir, pg).save(st);
      fsdpSteps(fsdp, opt, 3, 6, rank, 4);
      auto full = fsdp.fullState();  // (collective)
      if (rank == 0) saveNamed(dir + "/final.pt", full);
    });
    expectAllOk(results);
  }
  const auto want = loadNamed(dir + "/final.pt");
  for (auto [world, stage] : {std::pair{2, 2}, {3, 3}, {4, 3}}) {
    StoreServer server;
    auto results = runRanks(world, [&, world = world, stage = stage](int rank) {
      auto pg = group(server, rank, world);
      FsdpOptions o;
      o.stage = stage;
      o.units = {2, 1, 3};
      FullyShardedDataParallel fsdp(makeModel(), pg, o);
      torch::optim::Adam opt(fsdp.shards(), torch::optim::AdamOptions(0.5));
      fsdp.restoreSharded(saved, opt);
      fsdpSteps(fsdp, opt, 3, 6, rank, world);
      expectResumed(fsdp, want, world);
    });
    expectAllOk(results);
  }
}

TEST(Fsdp, BadOptionsAreNamed) {
  StoreServer server;
  auto results = runRanks(1, [&](int rank) {
    auto pg = group(server, rank, 1);
    auto expectError = [&](FsdpOptions o, const std::string& text) {
      try {
        FullyShardedDataParallel f(makeModel(), pg, o);
        ADD_FAILURE() << "accepted: " << text;
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
      }
    };
    FsdpOptions stage;
    stage.stage = 1;
    expectError(stage, "stage 1 (2 or 3");
    FsdpOptions units;
    units.units = {2, 2};
    expectError(units, "units cover 4 children, the Sequential has 6");
    FsdpOptions zero;
    zero.units = {0, 6};
    expectError(zero, "a unit of 0 children");
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
