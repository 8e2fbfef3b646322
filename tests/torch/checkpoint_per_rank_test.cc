// The per-rank checkpoint layout (a file per rank plus a manifest written last): pipeline stages and
// parameter-server workers resume bit for bit in a fresh process group; a rank killed mid-save and a
// failed write leave the previous checkpoint the newest; incomplete, damaged and other-world-size
// checkpoints when loading; and Python reads the files.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/compat.h"
#include "dtrain/pipeline.h"
#include "dtrain/ps.h"
#include "dtrain/ps_module.h"
#include "harness.h"
#include "ps_test_util.h"

namespace dtrain::test {
namespace {
namespace fs = std::filesystem;

std::shared_ptr<comm::ProcessGroup> group(std::shared_ptr<comm::Store> store, int rank, int world) {
  comm::GroupOptions o;
  o.timeout = std::chrono::seconds(15);
  return comm::ProcessGroup::create(std::move(store), rank, world, o);
}

// The optimizer's per-parameter state tensors in parameter order (Adam's moments and step, SGD's
// momentum buffers): what "identical optimizer state" compares.
std::vector<at::Tensor> optimizerState(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) {
      auto it = opt.state().find(dtrain::compat::optimizerStateKey(p));
      if (it == opt.state().end()) continue;
      if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get())) {
        out.push_back(a->exp_avg());
        out.push_back(a->exp_avg_sq());
        out.push_back(torch::tensor(a->step()));
      } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) {
        out.push_back(s->momentum_buffer());
      }
    }
  }
  return out;
}

std::vector<at::Tensor> loadTensors(const std::string& path) {
  std::vector<at::Tensor> ts;
  torch::load(ts, path);
  return ts;
}

void expectIdentical(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(torch::equal(got[i], want[i])) << what << " tensor " << i << "\ngot " << got[i] << "\nwant " << want[i];
}

// ---------------------------------------------------------------- pipeline
torch::nn::Sequential pipeModel(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(),
                          torch::nn::Linear(16, 3));
  m->to(torch::kDouble);
  return m;
}

std::pair<at::Tensor, at::Tensor> pipeBatch(int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(300 + step);
  return {at::randn({12, 6}, g, torch::kDouble), at::randint(0, 3, {12}, g, torch::kLong)};
}

// 3 stages, 1F1B, Adam per stage. Trains steps [from, to); without restore it starts from seed 11 and
// saves after step save_at - 1; with restore it starts from another seed and loads the newest checkpoint.
// Each rank writes its stage's parameters and Adam state to <out>-<rank>.pt.
void pipelinePhase(const std::string& dir, int from, int to, bool restore, int save_at, const std::string& out) {
  constexpr int kWorld = 3;
  StoreServer server;  // a fresh process group every phase
  auto results = runRanks(kWorld, [&](int rank) {
    auto pg = group(server.client(), rank, kWorld);
    auto model = pipeModel(restore ? 99 : 11);
    auto stage = pipelineStage(model, rank, kWorld);
    Pipeline pipe(stage, pg, PipelineOptions{4, PipelineSchedule::one_f_one_b});
    torch::optim::Adam opt(stage->parameters(), torch::optim::AdamOptions(0.01));
    Checkpointer ckpt(dir, pg, 2);
    EXPECT_TRUE(ckpt.writes());
    int start = from;
    if (restore) {
      auto s = ckpt.loadLatest();
      ASSERT_TRUE(s.has_value());
      s->restoreModel(*stage);
      s->restoreOptimizer(opt);
      start = static_cast<int>(s->step);
      ASSERT_EQ(start, save_at);
    }
    for (int step = start; step < to; ++step) {
      auto [x, y] = pipeBatch(step);
      opt.zero_grad();
      pipe.step(rank == 0 ? x : at::Tensor(), rank == kWorld - 1 ? y : at::Tensor(),
                [](const at::Tensor& o, const at::Tensor& t) { return torch::nn::functional::cross_entropy(o, t); });
      opt.step();
      if (!restore && step + 1 == save_at) {
        CheckpointState s;
        s.captureModel(*stage);
        s.captureOptimizer(opt);
        s.step = save_at;
        const std::string path = ckpt.save(s);
        EXPECT_EQ(path, dir + "/" + Checkpointer::dirName(0, save_at) + "/" + Checkpointer::rankFileName(rank, kWorld));
      }
    }
    std::vector<at::Tensor> ts;
    for (auto& p : stage->parameters()) ts.push_back(p.detach());
    for (auto& t : optimizerState(opt)) ts.push_back(t);
    torch::save(ts, out + "-" + std::to_string(rank) + ".pt");
  });
  expectAllOk(results);
}

TEST(CheckpointPerRank, PipelineStagesResumeBitForBit) {
  TempDir dir, res;
  // A: 5 steps in one go, saving after step 3. B: a new process group loads that checkpoint, runs 3 and 4.
  pipelinePhase(dir.path(), 0, 5, false, 3, res.path() + "/a");
  pipelinePhase(dir.path(), 3, 5, true, 3, res.path() + "/b");
  for (int r = 0; r < 3; ++r) {
    auto a = loadTensors(res.path() + "/a-" + std::to_string(r) + ".pt");
    auto b = loadTensors(res.path() + "/b-" + std::to_string(r) + ".pt");
    EXPECT_GT(a.size(), 2u);
    expectIdentical(b, a, "stage " + std::to_string(r) + " (parameters, then Adam's exp_avg, exp_avg_sq, step)");
  }
  // Every stage's state is on disk, not only rank 0's: each file holds its own stage's parameters.
  const std::string cdir = dir.path() + "/" + Checkpointer::dirName(0, 3);
  std::set<std::string> seen;
  for (int r = 0; r < 3; ++r) {
    auto s = Checkpointer::load(cdir + "/" + Checkpointer::rankFileName(r, 3));
    EXPECT_FALSE(s.model.empty()) << "rank " << r;
    EXPECT_FALSE(s.optimizer.empty()) << "rank " << r;
    for (const auto& [name, t] : s.model) EXPECT_TRUE(seen.insert(name).second) << name << " in two stages' files";
  }
  EXPECT_EQ(seen.size(), pipeModel(1)->parameters().size());
  // Python reads the manifest and the rank files.
  const std::string out = runPython(std::string(kPythonDtrainLoad) + "m = dtrain_load('" + cdir + "/manifest.pt')\n"
                                    "print(m['format'], m['epoch'], m['step'], m['world_size'], m['files'], "
                                    "m['parameter_server'], len(m['bytes']))\n"
                                    "d = dtrain_load('" + cdir + "/rank-00002-of-00003.pt')\n"
                                    "print(d['format'], d['rank'], d['world_size'], d['step'], sorted(d['model']))\n");
  EXPECT_NE(out.find("dtrain-checkpoint-manifest-v1 0 3 3 ['rank-00000-of-00003.pt', 'rank-00001-of-00003.pt', "
                     "'rank-00002-of-00003.pt'] 0 3"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("dtrain-checkpoint-v1 2 3 3 ['4.bias', '4.weight']"), std::string::npos) << out;
  // Loading needs the world size it was written with (resharding is for later).
  Checkpointer one(dir.path(), comm::ProcessGroup::create(nullptr, 0, 1));
  EXPECT_NE(errorOf([&] { one.loadLatest(); }).find("checkpoint " + cdir + " was written by 3 ranks, this group has 1"),
            std::string::npos);
}

// ---------------------------------------------------------------- a save that does not complete
CheckpointState stateOf(int rank, int64_t step) {
  CheckpointState s;
  s.step = step;
  s.model["w"] = torch::full({3}, static_cast<float>(rank * 100 + step));
  return s;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Rank 2 is killed after ranks 0 and 1 wrote their files of step 2, before it wrote its own: no
// manifest, the survivors' save() fails, and a restarted job loads step 1, then saves step 2 again.
TEST(CheckpointPerRank, RankKilledMidSaveLeavesThePreviousNewest) {
  TempDir dir;
  const std::string step2 = dir.path() + "/" + Checkpointer::dirName(0, 2);
  {
    StoreServer server;
    auto results = runRanks(
        3,
        [&](int rank) {
          auto pg = group(server.client(), rank, 3);
          Checkpointer ckpt(dir.path(), pg, 3);
          ckpt.save(stateOf(rank, 1));
          if (rank == 2) {
            const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
            while (!(fs::exists(step2 + "/" + Checkpointer::rankFileName(0, 3)) &&
                     fs::exists(step2 + "/" + Checkpointer::rankFileName(1, 3)))) {
              ASSERT_LT(std::chrono::steady_clock::now(), until) << "ranks 0 and 1 never wrote their files";
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            }
            raise(SIGKILL);
          }
          const std::string msg = errorOf([&] { ckpt.save(stateOf(rank, 2)); });
          printf("rank %d: %s\n", rank, msg.c_str());
          EXPECT_NE(msg.find(fmt::format("[rank {}] checkpoint {} not saved (the previous one stays the newest): ",
                                         rank, step2)),
                    std::string::npos)
              << msg;
        },
        std::chrono::seconds(60));
    EXPECT_TRUE(results[0].ok()) << results[0].describe();
    EXPECT_TRUE(results[1].ok()) << results[1].describe();
    EXPECT_EQ(results[2].signal, SIGKILL) << results[2].describe();
  }
  EXPECT_EQ(entries(step2), (std::vector<std::string>{"rank-00000-of-00003.pt", "rank-00001-of-00003.pt"}));
  // The restarted job: a new process group.
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto pg = group(server.client(), rank, 3);
    Checkpointer ckpt(dir.path(), pg, 3);
    auto s = ckpt.loadLatest();
    ASSERT_TRUE(s.has_value());
    EXPECT_EQ(s->step, 1);
    EXPECT_TRUE(torch::equal(s->model.at("w"), stateOf(rank, 1).model.at("w"))) << s->model.at("w");
    ckpt.save(stateOf(rank, 2));
    auto t = ckpt.loadLatest();
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->step, 2);
    EXPECT_TRUE(torch::equal(t->model.at("w"), stateOf(rank, 2).model.at("w")));
  });
  expectAllOk(results);
  EXPECT_EQ(entries(step2), (std::vector<std::string>{"manifest.pt", "rank-00000-of-00003.pt", "rank-00001-of-00003.pt",
                                                      "rank-00002-of-00003.pt"}));
}

// A write that fails on one rank, ranks that disagree on the step, and PS state on a rank other than 0:
// every rank throws the same error naming the culprit, and nothing is committed.
TEST(CheckpointPerRank, FailedSaveOnOneRankFailsEveryRankNamingIt) {
  TempDir dir;
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto pg = group(server.client(), rank, 3);
    Checkpointer ckpt(dir.path(), pg, 2);
    ckpt.save(stateOf(rank, 1));
    const std::string blocked = dir.path() + "/" + Checkpointer::dirName(0, 2) + "/" + Checkpointer::rankFileName(1, 3);
    if (rank == 1) fs::create_directories(blocked + "/in-the-way");  // rank 1's rename fails
    pg->barrier()->wait();
    std::string msg = errorOf([&] { ckpt.save(stateOf(rank, 2)); });
    EXPECT_NE(msg.find(fmt::format("[rank {}] checkpoint {}/{} not saved (the previous one stays the newest): rank 1 "
                                   "failed: checkpoint: cannot rename into {}",
                                   rank, dir.path(), Checkpointer::dirName(0, 2), blocked)),
              std::string::npos)
        << msg;
    msg = errorOf([&] { ckpt.save(stateOf(rank, rank == 2 ? 5 : 3)); });
    EXPECT_NE(msg.find("the ranks disagree on (epoch, step): rank 0: (0, 3), rank 1: (0, 3), rank 2: (0, 5)"),
              std::string::npos)
        << msg;
    auto s4 = stateOf(rank, 4);
    if (rank == 1) s4.parameter_server["v"] = torch::zeros({1});
    msg = errorOf([&] { ckpt.save(s4); });
    EXPECT_NE(msg.find("rank 1 failed: parameter_server is the job's state: rank 0 saves it"), std::string::npos) << msg;
    auto s = ckpt.loadLatest();
    ASSERT_TRUE(s.has_value());
    EXPECT_EQ(s->step, 1);
    EXPECT_TRUE(torch::equal(s->model.at("w"), stateOf(rank, 1).model.at("w")));
    // The next good save commits and removes the leftovers of the failed ones.
    pg->barrier()->wait();
    if (rank == 1) fs::remove_all(blocked);
    ckpt.save(stateOf(rank, 6));
    EXPECT_EQ(ckpt.loadLatest()->step, 6);
  });
  expectAllOk(results);
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{Checkpointer::dirName(0, 1), Checkpointer::dirName(0, 6)}));
}

// One process (a group of one): a newest checkpoint with a missing or short file is skipped, a damaged
// manifest is an error naming it, and a replaced checkpoint never mixes old and new files.
TEST(CheckpointPerRank, IncompleteAndDamagedCheckpoints) {
  TempDir dir;
  auto pg = comm::ProcessGroup::create(nullptr, 0, 1);
  Checkpointer ckpt(dir.path(), pg, 0);
  EXPECT_FALSE(ckpt.loadLatest().has_value());
  for (int64_t step : {1, 2, 3}) ckpt.save(stateOf(0, step));
  auto file = [&](int64_t step) { return dir.path() + "/" + Checkpointer::dirName(0, step) + "/rank-00000-of-00001.pt"; };
  fs::remove(file(3));
  {
    auto bytes = fs::file_size(file(2));
    fs::resize_file(file(2), bytes - 1);
  }
  auto s = ckpt.loadLatest();  // 3 lacks its file, 2 is short: 1
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->step, 1);
  ASSERT_EQ(ckpt.list().size(), 1u);
  EXPECT_EQ(ckpt.list()[0].path, dir.path() + "/" + Checkpointer::dirName(0, 1));
  const std::string manifest = dir.path() + "/" + Checkpointer::dirName(0, 4) + "/manifest.pt";
  fs::create_directories(fs::path(manifest).parent_path());
  std::ofstream(manifest) << "garbage";
  const std::string msg = errorOf([&] { ckpt.loadLatest(); });
  EXPECT_NE(msg.find(manifest + " is not a dtrain checkpoint: not a zip archive"), std::string::npos) << msg;
  fs::remove_all(fs::path(manifest).parent_path());
  // Saving step 1 again replaces it.
  auto again = stateOf(0, 1);
  again.model["w"].fill_(-7);
  ckpt.save(again);
  EXPECT_TRUE(torch::equal(ckpt.loadLatest()->model.at("w"), again.model.at("w")));
}

// ---------------------------------------------------------------- parameter server
struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

// Two workers and two servers, BSP with server-side Adam on a module and a sparse table; each worker also
// has state of its own: a local head with SGD momentum and its data stream (the default RNG). Without
// restore: steps [0, to), saving after save_at - 1; with restore: a new job loads the checkpoint and
// runs [save_at, to). Each worker writes its parameters, head, head optimizer state and the rows (worker
// 0 also the servers' state) to <out>-<worker>.pt.
void psPhase(const std::string& dir, int to, bool restore, int save_at, const std::string& out) {
  ps::PSOptions o;
  o.consistency = ps::Consistency::bsp;
  o.update = ps::PSOptions::Update::adam;
  o.lr = 0.01;
  o.partition_bytes = 48;
  o.timeout = std::chrono::seconds(20);
  const int W = 2, S = 2;
  runJob(W, S, W, o, [&](const std::shared_ptr<comm::Store>& store, int p) {
    ps::Worker wk(store, p, W, S, o);
    auto workers = group(std::make_shared<comm::PrefixStore>("workers", store), p, W);
    torch::manual_seed(restore ? 99 : 21);
    Net net;
    torch::nn::Linear head(3, 1);
    ps::ModuleOptions mo;
    mo.bucket_bytes = 64;
    ps::DistributedModule psm(net.ptr(), wk, mo);
    wk.declareRows("emb", 10, 4);
    torch::optim::SGD head_opt(head->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::manual_seed(100 + p);  // this worker's data
    Checkpointer ckpt(dir, workers, 3);
    int start = 0;
    if (restore) {
      auto s = ckpt.loadLatest();
      ASSERT_TRUE(s.has_value());
      ASSERT_FALSE(s->parameter_server.empty()) << "worker " << p << " needs the servers' state too";
      wk.loadState(s->parameter_server);
      psm.refresh();
      s->restoreModel(*head);
      s->restoreOptimizer(head_opt);
      s->restoreRng();
      start = static_cast<int>(s->step);
      ASSERT_EQ(start, save_at);
    }
    for (int step = start; step < to; ++step) {
      psm.beforeForward();
      net->zero_grad();
      head_opt.zero_grad();
      auto x = torch::randn({4, 6}), y = torch::randn({4, 1});
      torch::mse_loss(head->forward(net->forward(x)), y).backward();
      wk.pushRows("emb", torch::tensor({int64_t{p * 5 + step % 3}, int64_t{p * 5 + 4}}, torch::kLong),
                  torch::full({2, 4}, static_cast<float>(step + p + 1)));
      psm.step();
      head_opt.step();
      if (!restore && step + 1 == save_at) {
        CheckpointState s;
        if (p == 0) s.parameter_server = wk.saveState();
        s.captureModel(*head);
        s.captureOptimizer(head_opt);
        s.captureRng();
        s.step = save_at;
        ckpt.save(s);
      }
    }
    psm.beforeForward();
    std::vector<at::Tensor> ts;
    for (auto& t : net->parameters()) ts.push_back(t.detach().clone());
    for (auto& t : head->parameters()) ts.push_back(t.detach().clone());
    for (auto& t : optimizerState(head_opt)) ts.push_back(t);
    ts.push_back(wk.pullRows("emb", torch::arange(10, torch::kLong)));
    if (p == 0)
      for (auto& [k, v] : wk.saveState()) ts.push_back(v);  // the servers' values, Adam moments, steps, clocks
    torch::save(ts, out + "-" + std::to_string(p) + ".pt");
    wk.finish();
  });
}

TEST(CheckpointPerRank, ParameterServerWorkersResumeBitForBit) {
  TempDir dir, res;
  psPhase(dir.path(), 5, false, 3, res.path() + "/a");
  psPhase(dir.path(), 5, true, 3, res.path() + "/b");
  for (int w = 0; w < 2; ++w) {
    auto a = loadTensors(res.path() + "/a-" + std::to_string(w) + ".pt");
    auto b = loadTensors(res.path() + "/b-" + std::to_string(w) + ".pt");
    expectIdentical(b, a, "worker " + std::to_string(w));
  }
  // Worker 1's own file holds its head, not the servers' state (that is in worker 0's, once).
  const std::string cdir = dir.path() + "/" + Checkpointer::dirName(0, 3);
  auto w0 = Checkpointer::load(cdir + "/rank-00000-of-00002.pt"), w1 = Checkpointer::load(cdir + "/rank-00001-of-00002.pt");
  EXPECT_FALSE(w0.parameter_server.empty());
  EXPECT_TRUE(w1.parameter_server.empty());
  EXPECT_FALSE(torch::equal(w0.model.at("weight"), w1.model.at("weight"))) << "each worker's head is its own";
}

}  // namespace
}  // namespace dtrain::test
