// Parameter server, the layers above the core protocol: asynchronous operations, the DDP-style module
// wrapper, local aggregation of a host's workers, server state in checkpoints, tensors declared late,
// a server colocated as a thread, and ps::init's roles from the environment. Each distributed result is
// checked against one process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/ps.h"
#include "dtrain/ps_module.h"
#include "harness.h"
#include "ps_test_util.h"

namespace dtrain::test {
namespace {

using ps::Consistency;
using ps::PSOptions;

constexpr int kPerWorker = 4;

std::pair<torch::Tensor, torch::Tensor> batch(int step, int n) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(700 + step);
  return {at::randn({n * kPerWorker, 6}, g, torch::kFloat), at::randn({n * kPerWorker, 3}, g, torch::kFloat)};
}

// Two layers and a branch that gets no gradient.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(5, 3));
    unused = register_module("unused", torch::nn::Linear(2, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, unused{nullptr};
};
TORCH_MODULE(Net);

Net makeNet() {
  torch::manual_seed(21);
  return Net();
}

// One process, the global batch of `procs` x kPerWorker rows, `steps` steps: the reference.
Net reference(int procs, int steps, PSOptions::Update u, const PSOptions& o) {
  auto ref = makeNet();
  auto opt = makeOpt(u, o, ref->parameters());
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step, procs);
    opt->zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    opt->step();
  }
  return ref;
}

void expectSameParams(Net& got, Net& want, const std::string& who) {
  auto w = want->named_parameters();
  for (auto& it : got->named_parameters())
    expectClose(it.value().detach(), w[it.key()].detach(), 1e-5, who + " parameter " + it.key());
}

PSOptions bspOptions(PSOptions::Update u) {
  PSOptions o;
  o.consistency = Consistency::bsp;
  o.update = u;
  o.lr = u == PSOptions::Update::adam ? 0.01 : 0.05;
  o.momentum = 0.9;
  o.partition_bytes = 48;  // 12 floats: buckets cut into several partitions over the servers
  o.timeout = std::chrono::seconds(20);
  return o;
}

// The training loop of a DDP user, through ps::DistributedModule; 4 steps.
void trainWithModule(ps::Worker& wk, Net& model, int proc, const PSOptions& o, PSOptions::Update local_update,
                     int steps = 4) {
  ps::ModuleOptions mo;
  mo.bucket_bytes = 32;  // several buckets (three): pushes start while backward goes on
  ps::DistributedModule psm(model.ptr(), wk, mo);
  EXPECT_GT(psm.numBuckets(), 2u);
  std::unique_ptr<torch::optim::Optimizer> local;
  if (o.update == PSOptions::Update::sum_only) local = makeOpt(local_update, o, model->parameters());
  const int procs = wk.numProcesses();
  for (int step = 0; step < steps; ++step) {
    psm.beforeForward();
    model->zero_grad();
    auto [x, y] = batch(step, procs);
    torch::mse_loss(model->forward(x.narrow(0, proc * kPerWorker, kPerWorker)),
                    y.narrow(0, proc * kPerWorker, kPerWorker))
        .backward();
    psm.step();
    if (local) local->step();
  }
  psm.beforeForward();
}

void moduleEqualsOneProcess(int W, int S, PSOptions::Update server_update, PSOptions::Update local_update) {
  auto o = bspOptions(server_update == PSOptions::Update::sum_only ? local_update : server_update);
  o.update = server_update;
  runJob(W, S, W, o, [&](const std::shared_ptr<comm::Store>& store, int p) {
    ps::Worker wk(store, p, W, S, o);
    auto model = makeNet();
    if (p != 0) {  // every worker must start from worker 0's values
      torch::NoGradGuard g;
      for (auto& t : model->parameters()) t.add_(1.0);
    }
    trainWithModule(wk, model, p, o, local_update);
    auto ref = reference(W, 4, server_update == PSOptions::Update::sum_only ? local_update : server_update, o);
    expectSameParams(model, ref, fmt::format("worker {} (W={} S={})", p, W, S));
    wk.finish();
  });
}

TEST(PSModule, SgdMomentumOneServerEqualsOneProcess) {
  moduleEqualsOneProcess(2, 1, PSOptions::Update::sgd, PSOptions::Update::sgd);
}
TEST(PSModule, AdamTwoServersEqualsOneProcess) {
  moduleEqualsOneProcess(2, 2, PSOptions::Update::adam, PSOptions::Update::adam);
}
TEST(PSModule, SumOnlyWithLocalAdamEqualsOneProcess) {
  moduleEqualsOneProcess(2, 2, PSOptions::Update::sum_only, PSOptions::Update::adam);
}

TEST(PSModule, BackwardBeforeBeforeForwardIsAnError) {
  auto o = bspOptions(PSOptions::Update::sgd);
  runJob(1, 1, 1, o, [&](const std::shared_ptr<comm::Store>& store, int p) {
    ps::Worker wk(store, p, 1, 1, o);
    auto model = makeNet();
    ps::DistributedModule psm(model.ptr(), wk);
    auto [x, y] = batch(0, 1);
    torch::mse_loss(model->forward(x), y).backward();
    psm.step();
    model->zero_grad();
    try {
      torch::mse_loss(model->forward(x), y).backward();
      ADD_FAILURE() << "backward with pulls pending did not throw";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("before beforeForward()"), std::string::npos) << e.what();
    }
    psm.beforeForward();
    wk.finish();
  });
}

// ---------------------------------------------------------------- asynchronous operations
TEST(PSAsyncOps, RunInIssueOrderAndWaitTimesOutNamingTheOp) {
  auto o = bspOptions(PSOptions::Update::sgd);
  o.lr = 1.0;
  runJob(2, 1, 2, o, [&](const std::shared_ptr<comm::Store>& store, int p) {
    ps::Worker wk(store, p, 2, 1, o);
    wk.declare("t", torch::zeros({10}));
    auto out = torch::empty({10});
    if (p == 0) {
      // Worker 1 pushes only after we saw our pull block: the BSP pull of clock 1 cannot complete yet.
      auto push = wk.pushAsync("t", torch::full({10}, 2.0f));
      auto clk = wk.clockAsync();
      auto pull = wk.pullAsync("t", out);
      try {
        pull->wait(std::chrono::milliseconds(300));
        ADD_FAILURE() << "the BSP pull completed before worker 1 pushed";
      } catch (const TimeoutError& e) {
        EXPECT_NE(std::string(e.what()).find("[worker 0] pull 't'"), std::string::npos) << e.what();
      }
      EXPECT_TRUE(push->isCompleted());
      store->add("go", 1);
      pull->wait();  // waited out of order: clk is done too
      EXPECT_TRUE(clk->isCompleted());
      EXPECT_TRUE(torch::allclose(out, torch::full({10}, -3.0f))) << out;  // mean of 2 and 4
    } else {
      store->wait({"go"}, std::chrono::seconds(20));
      wk.push("t", torch::full({10}, 4.0f));
      wk.clock();
      wk.pull("t", out);
      EXPECT_TRUE(torch::allclose(out, torch::full({10}, -3.0f))) << out;
    }
    wk.finish();
  });
}

// ---------------------------------------------------------------- tensors declared after step 0
TEST(PSBspLate, TensorDeclaredAfterTrainingStartedCanBePushed) {
  auto o = bspOptions(PSOptions::Update::sgd);
  o.lr = 1.0;
  o.momentum = 0;
  runJob(2, 2, 2, o, [&](const std::shared_ptr<comm::Store>& store, int p) {
    ps::Worker wk(store, p, 2, 2, o);
    wk.declare("early", torch::zeros({4}));
    for (int s = 0; s < 3; ++s) {
      wk.push("early", torch::ones({4}));
      wk.clock();
    }
    wk.declare("late", torch::zeros({30}));  // at clock 3
    wk.push("late", torch::full({30}, static_cast<float>(p + 1)));
    wk.clock();
    auto out = torch::empty({30});
    wk.pull("late", out);
    EXPECT_TRUE(torch::allclose(out, torch::full({30}, -1.5f))) << out;
    wk.finish();
  });
}

// ---------------------------------------------------------------- colocated server
TEST(PSColocated, ServerThreadInsideWorkerZero) {
  auto o = bspOptions(PSOptions::Update::sgd);
  StoreServer server;
  auto results = runRanks(2, [&](int p) {
    auto store = server.client();
    std::unique_ptr<ps::ColocatedServer> colocated;
    if (p == 0) colocated = std::make_unique<ps::ColocatedServer>(store, 0, 1, 2, o);
    {
      ps::Worker wk(store, p, 2, 1, o);
      auto model = makeNet();
      trainWithModule(wk, model, p, o, PSOptions::Update::sgd, 3);
      auto ref = reference(2, 3, PSOptions::Update::sgd, o);
      expectSameParams(model, ref, fmt::format("worker {} with a colocated server", p));
      wk.finish();
    }
    if (colocated) colocated->join();
  });
  expectAllOk(results);
}

// ---------------------------------------------------------------- local aggregation
// 4 processes on 2 "hosts" of 2; each host is one PS worker; 2 servers count 2 workers.
TEST(PSLocalAggregation, TwoHostsOfTwoEqualOneProcess) {
  auto o = bspOptions(PSOptions::Update::sgd);
  o.local_aggregation = true;
  runJob(4, 2, /*server_workers=*/2, o, [&](const std::shared_ptr<comm::Store>& store, int p) {
    auto world = comm::ProcessGroup::create(std::make_shared<comm::PrefixStore>("world", store), p, 4);
    auto h0 = world->newGroup({0, 1}), h1 = world->newGroup({2, 3});
    ps::LocalAggregation agg{p < 2 ? h0 : h1, p / 2, 2};
    ps::Worker wk(store, agg, 2, o);
    EXPECT_EQ(wk.numProcesses(), 4);
    EXPECT_EQ(wk.connected(), p % 2 == 0);
    auto model = makeNet();
    trainWithModule(wk, model, p, o, PSOptions::Update::sgd);
    auto ref = reference(4, 4, PSOptions::Update::sgd, o);
    expectSameParams(model, ref, fmt::format("process {} (host {})", p, p / 2));
    // Sparse rows: every local worker's rows are pushed; pulls see all four processes' pushes.
    wk.declareRows("emb", 100, 3);
    auto rows = torch::tensor({int64_t{p}, int64_t{50}}, torch::kLong);
    wk.pushRows("emb", rows, torch::ones({2, 3}));
    wk.clock();
    auto got = wk.pullRows("emb", torch::tensor({0, 1, 2, 3, 50, 99}, torch::kLong));
    auto want = torch::zeros({6, 3});
    want.narrow(0, 0, 4).fill_(-0.05f);  // each of rows 0..3 pushed once (lr 0.05, sgd momentum: first step)
    // Row 50 got 4 pushes in turn with momentum 0.9: buf = 1, 1.9, 2.71, 3.439; value -= lr * buf.
    want[4].fill_(-0.05f * (1.0f + 1.9f + 2.71f + 3.439f));
    expectClose(got, want, 1e-5, fmt::format("process {} rows", p));
    if (p % 2 == 1) {
      EXPECT_EQ(wk.bytesSent(), 0);  // only local rank 0 talks to the servers
    }
    wk.finish();
  });
}

// ---------------------------------------------------------------- ps::init
void clearLauncherVariables() {
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "DTRAIN_ROLE", "DTRAIN_NUM_SERVERS", "DTRAIN_NUM_WORKERS", "DTRAIN_NUM_NODES",
                        "DTRAIN_SERVER_INDEX", "DTRAIN_USE_AGENT_STORE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "SLURM_PROCID", "SLURM_NTASKS"})
    unsetenv(v);
}

// No launcher variables: one worker with a server thread; the updates are the servers' SGD.
TEST(PSInit, AloneRunsAColocatedServer) {
  auto results = runRanks(1, [&](int) {
    clearLauncherVariables();
    PSOptions o;
    o.update = PSOptions::Update::sgd;
    o.lr = 0.5;
    o.timeout = std::chrono::seconds(10);
    auto job = ps::init(o);
    EXPECT_FALSE(job.isServer());
    EXPECT_TRUE(job.colocated());
    EXPECT_EQ(job.rank(), 0);
    EXPECT_EQ(job.numWorkers(), 1);
    EXPECT_EQ(job.numServers(), 1);
    EXPECT_EQ(job.workers()->size(), 1);
    {
      ps::Worker wk(job, o);
      wk.declare("v", torch::ones({3}));
      for (int i = 1; i <= 2; ++i) {
        wk.push("v", torch::full({3}, static_cast<float>(i)));
        wk.clock();
      }
      auto v = torch::empty({3});
      wk.pull("v", v);
      EXPECT_TRUE(v.equal(torch::full({3}, 1.0f - 0.5f * 1 - 0.5f * 2))) << v;
      wk.finish();
    }
    job.join();
  });
  expectAllOk(results);
}

// What dtrain-run --servers 1 --nproc-per-node 2 sets: two workers and a server, through ps::init.
TEST(PSInit, ReadsTheLauncherVariables) {
  StoreServer server;
  auto results = runRanks(3, [&](int p) {
    clearLauncherVariables();
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(server.port()).c_str(), 1);
    setenv("DTRAIN_USE_AGENT_STORE", "1", 1);
    setenv("DTRAIN_NUM_SERVERS", "1", 1);
    setenv("DTRAIN_NUM_WORKERS", "2", 1);
    if (p < 2) {
      setenv("DTRAIN_ROLE", "worker", 1);
      setenv("RANK", std::to_string(p).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(p).c_str(), 1);
      setenv("WORLD_SIZE", "2", 1);
      setenv("LOCAL_WORLD_SIZE", "2", 1);
    } else {
      setenv("DTRAIN_ROLE", "server", 1);
      setenv("DTRAIN_SERVER_INDEX", "0", 1);
    }
    PSOptions o;
    o.update = PSOptions::Update::sum_only;
    o.timeout = std::chrono::seconds(10);
    auto job = ps::init(o);
    if (p == 2) {
      EXPECT_TRUE(job.isServer());
      return;
    }
    EXPECT_FALSE(job.isServer());
    EXPECT_FALSE(job.colocated());
    EXPECT_EQ(job.rank(), p);
    EXPECT_EQ(job.numWorkers(), 2);
    EXPECT_EQ(job.numServers(), 1);
    ASSERT_EQ(job.workers()->size(), 2);
    ps::Worker wk(job, o);
    expectTwoWorkersSum(wk, p);
    // The workers' own group works beside the PS.
    int64_t x = p + 1;
    job.workers()->allreduce(&x, 1, comm::DType::i64)->wait();
    EXPECT_EQ(x, 3);
    wk.finish();
  });
  expectAllOk(results);
}

TEST(PSInit, WorldWithoutServersIsAnError) {
  auto results = runRanks(1, [&](int) {
    clearLauncherVariables();
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "2", 1);
    try {
      ps::init();
      ADD_FAILURE() << "no error";
    } catch (const RendezvousError& e) {
      EXPECT_NE(std::string(e.what()).find("[rank 1] ps::init: a world of 2 processes but no parameter servers "
                                           "(DTRAIN_NUM_SERVERS is not set): start them with dtrain-run --servers S"),
                std::string::npos)
          << e.what();
    }
  });
  expectAllOk(results);
}

// ---------------------------------------------------------------- server state in checkpoints
// Server-side Adam on a module and on a sparse table. Run A: 5 uninterrupted steps. Run B: 3 steps,
// worker 0 saves the servers' state in a checkpoint file, the job ends. Run C: a NEW job (fresh
// servers) restores the file and runs steps 3 and 4. C must end where A ended: Adam's moments and step
// counts, the rows and the clocks all survive the restart.
struct PhaseResult {
  std::map<std::string, torch::Tensor> params;
  torch::Tensor rows;
};

void adamPhase(const std::string& dir, int from, int to, bool restore, bool save, PhaseResult* out) {
  auto o = bspOptions(PSOptions::Update::adam);
  // Small messages: a table's 4-5 rows per server (12 floats each with Adam's moments) are restored in
  // messages of 2 rows, as a large table's would be in messages of partition_bytes.
  o.partition_bytes = 96;
  const int W = 2, S = 2;
  StoreServer server;
  auto results = runRanks(W + S, [&](int p) {
    auto store = server.client();
    if (p >= W) {
      ps::Server srv(store, p - W, S, W, o);
      srv.run();
      return;
    }
    ps::Worker wk(store, p, W, S, o);
    auto model = makeNet();
    ps::ModuleOptions mo;
    mo.bucket_bytes = 32;
    ps::DistributedModule psm(model.ptr(), wk, mo);
    wk.declareRows("emb", 10, 4);
    if (restore) {
      auto s = Checkpointer(dir, 3, /*writer=*/false).loadLatest();
      ASSERT_TRUE(s.has_value());
      ASSERT_FALSE(s->parameter_server.empty());
      wk.loadState(s->parameter_server);
      ASSERT_EQ(wk.clockValue(), from);
      psm.refresh();  // pull the restored values (bsp: waits for worker 0's restore)
    }
    for (int step = from; step < to; ++step) {
      psm.beforeForward();
      model->zero_grad();
      auto [x, y] = batch(step, W);
      torch::mse_loss(model->forward(x.narrow(0, p * kPerWorker, kPerWorker)),
                      y.narrow(0, p * kPerWorker, kPerWorker))
          .backward();
      // Disjoint rows per worker: two workers' pushes to one row are applied in arrival order, and
      // Adam's result depends on that order.
      wk.pushRows("emb", torch::tensor({int64_t{p * 5 + step % 3}, int64_t{p * 5 + 4}}, torch::kLong),
                  torch::full({2, 4}, static_cast<float>(step + p + 1)));
      psm.step();
    }
    psm.beforeForward();
    if (save && p == 0) {
      CheckpointState s;
      s.step = to;
      s.parameter_server = wk.saveState();
      Checkpointer(dir, 3, /*writer=*/true).save(s);
    }
    auto rows = wk.pullRows("emb", torch::arange(10, torch::kLong));
    if (p == 0) {
      // Hand the results to the parent through files (the workers are child processes).
      std::vector<torch::Tensor> ts;
      for (auto& it : model->named_parameters()) ts.push_back(it.value().detach());
      ts.push_back(rows);
      torch::save(ts, dir + "/result-" + std::to_string(to) + (restore ? "-restored" : "") + ".pt");
    }
    wk.finish();
  });
  expectAllOk(results);
  std::vector<torch::Tensor> ts;
  torch::load(ts, dir + "/result-" + std::to_string(to) + (restore ? "-restored" : "") + ".pt");
  auto model = makeNet();
  size_t i = 0;
  for (auto& it : model->named_parameters()) out->params[it.key()] = ts.at(i++);
  out->rows = ts.at(i);
}

TEST(PSCheckpoint, ServerStateSurvivesARestart) {
  TempDir dir;
  PhaseResult a, b, c;
  adamPhase(dir.path(), 0, 5, false, false, &a);
  adamPhase(dir.path(), 0, 3, false, true, &b);
  adamPhase(dir.path(), 3, 5, true, false, &c);
  for (auto& [name, t] : a.params) expectClose(c.params.at(name), t, 1e-6, "restarted run's " + name);
  expectClose(c.rows, a.rows, 1e-6, "restarted run's rows");
  // And the restart is not trivially equal: after 3 steps the values differ from after 5.
  EXPECT_GT((b.params.at("a.weight") - a.params.at("a.weight")).abs().max().item<double>(), 1e-4);
  EXPECT_GT((b.rows - a.rows).abs().max().item<double>(), 1e-4);
  // The file also reads in Python: the PS state is a dict of tensors next to the model's.
  auto files = Checkpointer(dir.path(), 3, false).list();
  ASSERT_FALSE(files.empty());
  auto out = runPython(std::string(kPythonDtrainLoad) + "d = dtrain_load('" + files.back().path +
                       "')\nps = d['parameter_server']\nprint(sorted(k for k in ps if k.startswith('emb')), "
                       "int(ps['#clock'][0]))\n");
  EXPECT_NE(out.find("['emb#data', 'emb#rows', 'emb#steps'] 3"), std::string::npos) << out;
}

}  // namespace
}  // namespace dtrain::test
