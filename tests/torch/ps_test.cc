// Parameter server on real processes: processes 0..W-1 are workers, W..W+S-1 servers, a TcpStore in
// the parent. BSP (server-side SGD with momentum and Adam, and the sum_only service with a local
// optimizer) against one process on the global batch; ASP and SSP convergence on logistic regression
// with the final value checked exactly against the sum of every push; ASP/SSP update values against
// torch's optimizers with the pushes in a known order;
// the SSP staleness bound with a slowed worker; sparse rows (values and exact byte counts); a killed
// server.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/ps.h"
#include "harness.h"
#include "ps_test_util.h"

namespace dtrain::test {
namespace {

using ps::Consistency;
using ps::PSOptions;

constexpr int kPerWorker = 4;

// Runs W workers and S servers; each worker runs fn(worker, rank) then finish().
using WorkerFn = std::function<void(ps::Worker&, int, comm::Store&)>;

// Every worker waits for all W to reach `name`.
void barrier(comm::Store& store, const std::string& name, int W) {
  store.add(name, 1);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (store.add(name, 0) < W) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "barrier " << name;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void runPS(int W, int S, const PSOptions& o, const WorkerFn& fn,
           std::chrono::seconds deadline = std::chrono::seconds(90)) {
  runJob(
      W, S, W, o,
      [&](const std::shared_ptr<comm::Store>& store, int p) {
        ps::Worker wk(store, p, W, S, o);
        fn(wk, p, *store);
        wk.finish();
      },
      deadline);
}

// ---------------------------------------------------------------- BSP equals one process
torch::nn::Linear makeModel() {
  torch::manual_seed(11);
  return torch::nn::Linear(6, 3);
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, int W) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  auto x = at::randn({W * kPerWorker, 6}, g, torch::kFloat);
  auto y = at::randn({W * kPerWorker, 3}, g, torch::kFloat);
  return {x, y};
}

// 5 steps of BSP through the PS against one process on the global batch. server_update: the server
// runs SGD-with-momentum or Adam; sum_only: the workers run local_update on the pulled sum / W.
// slow_worker >= 0 sleeps 20 ms per step.
void bspEqualsOneProcess(int W, int S, PSOptions::Update server_update, PSOptions::Update local_update,
                         int slow_worker = -1) {
  PSOptions o;
  o.consistency = Consistency::bsp;
  o.update = server_update;
  o.lr = local_update == PSOptions::Update::adam ? 0.01 : 0.05;
  o.momentum = 0.9;
  o.partition_bytes = 32;  // 8 floats: the 18-float weight is cut in 3, spread over the servers
  o.timeout = std::chrono::seconds(20);
  runPS(W, S, o, [&](ps::Worker& wk, int rank, comm::Store&) {
    auto model = makeModel();
    auto ref = makeModel();
    if (rank != 0) {  // the stored values must be worker 0's
      torch::NoGradGuard g;
      for (auto& p : model->parameters()) p.add_(1.0);
    }
    auto params = model->named_parameters();
    for (auto& it : params) wk.declare(it.key(), it.value().detach());
    std::unique_ptr<torch::optim::Optimizer> local;
    if (server_update == PSOptions::Update::sum_only) {
      // The workers own the parameters: start from worker 0's values (what the server stored).
      for (auto& it : params) {
        auto d = it.value().detach();
        wk.pull(it.key(), d);
      }
      local = makeOpt(local_update, o, model->parameters());
    }
    auto ref_opt = makeOpt(local_update, o, ref->parameters());
    for (int step = 0; step < 5; ++step) {
      if (server_update != PSOptions::Update::sum_only) {
        for (auto& it : params) {
          auto d = it.value().detach();
          wk.pull(it.key(), d);
        }
      }
      if (rank == slow_worker) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto [x, y] = batch(step, W);
      model->zero_grad();
      auto loss = torch::mse_loss(model->forward(x.narrow(0, rank * kPerWorker, kPerWorker)),
                                  y.narrow(0, rank * kPerWorker, kPerWorker));
      loss.backward();
      for (auto& it : params) wk.push(it.key(), it.value().grad());
      wk.clock();
      if (server_update == PSOptions::Update::sum_only) {
        for (auto& it : params) {
          auto sum = torch::empty_like(it.value());
          wk.pull(it.key(), sum);
          it.value().mutable_grad() = sum / W;
        }
        local->step();
      }
      ref_opt->zero_grad();
      torch::mse_loss(ref->forward(x), y).backward();
      ref_opt->step();
    }
    if (server_update != PSOptions::Update::sum_only) {
      for (auto& it : params) {
        auto d = it.value().detach();
        wk.pull(it.key(), d);
      }
    }
    auto rp = ref->named_parameters();
    for (auto& it : params) {
      expectClose(it.value().detach(), rp[it.key()].detach(), 1e-5,
                  fmt::format("worker {} (W={} S={}) parameter {}", rank, W, S, it.key()));
    }
  });
}

TEST(PSBsp, SgdMomentumOneServerEqualsOneProcess) {
  bspEqualsOneProcess(2, 1, PSOptions::Update::sgd, PSOptions::Update::sgd);
}
TEST(PSBsp, SgdMomentumTwoServersEqualsOneProcess) {
  bspEqualsOneProcess(2, 2, PSOptions::Update::sgd, PSOptions::Update::sgd);
}
TEST(PSBsp, AdamTwoServersEqualsOneProcess) {
  bspEqualsOneProcess(2, 2, PSOptions::Update::adam, PSOptions::Update::adam);
}
TEST(PSBsp, SumOnlyWithLocalSgdEqualsOneProcess) {
  bspEqualsOneProcess(2, 2, PSOptions::Update::sum_only, PSOptions::Update::sgd);
}
TEST(PSBsp, SlowedWorkerStillExact) {
  bspEqualsOneProcess(2, 2, PSOptions::Update::sgd, PSOptions::Update::sgd, /*slow_worker=*/1);
}

// ---------------------------------------------------------------- ASP / SSP convergence
constexpr int kN = 512, kD = 5;

std::pair<torch::Tensor, torch::Tensor> logisticData() {
  auto g = at::make_generator<at::CPUGeneratorImpl>(77);
  auto x = at::randn({kN, kD}, g, torch::kFloat);
  auto w = at::randn({kD}, g, torch::kFloat);
  auto p = torch::sigmoid(x.matmul(w) + 0.3);
  auto y = (at::rand({kN}, g, torch::kFloat) < p).to(torch::kFloat);
  return {x, y};
}

double logisticLoss(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& wb) {
  auto logits = x.to(torch::kDouble).matmul(wb.narrow(0, 0, kD).to(torch::kDouble)) + wb[kD].to(torch::kDouble);
  return torch::binary_cross_entropy_with_logits(logits, y.to(torch::kDouble)).item<double>();
}

torch::Tensor logisticGrad(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& wb) {
  auto p = wb.detach().clone().requires_grad_(true);
  auto logits = x.matmul(p.narrow(0, 0, kD)) + p[kD];
  torch::binary_cross_entropy_with_logits(logits, y).backward();
  return p.grad();
}

// The optimum's loss by full-batch gradient descent in double (the problem is convex).
double optimumLoss() {
  auto [x, y] = logisticData();
  auto xd = x.to(torch::kDouble), yd = y.to(torch::kDouble);
  auto wb = torch::zeros({kD + 1}, torch::kDouble);
  for (int i = 0; i < 3000; ++i) wb -= 1.0 * logisticGrad(xd, yd, wb);
  return logisticLoss(x, y, wb);
}

constexpr double kConvergeTol = 3e-5;  // final loss within this of the optimum's (seen: below 3e-6 in 36 runs)

// Gradients rounded to multiples of 2^-12: every sum of them the server forms (|value| < 2^11) is exact
// in float, so the final value is the same whatever order the pushes arrived in.
torch::Tensor dyadic(const torch::Tensor& g) { return torch::round(g * 4096.0) / 4096.0; }

std::string hexDoubles(const torch::Tensor& t) {
  std::string s;
  for (int64_t i = 0; i < t.numel(); ++i) s += fmt::format("{:a} ", t[i].item<double>());
  return s;
}

torch::Tensor parseDoubles(const std::string& s, int64_t n) {
  auto out = torch::zeros({n}, torch::kDouble);
  const char* p = s.c_str();
  for (int64_t i = 0; i < n; ++i) {
    char* end = nullptr;
    out[i] = std::strtod(p, &end);
    p = end;
  }
  return out;
}

// ASP/SSP on logistic regression, two workers, two servers, plain SGD with lr 1: the server applies each
// push as it arrives, so the final value is exactly -(the sum of every push of every worker), whatever
// the interleaving. That catches a lost, doubled or scaled push, which the loss alone does not (either
// worker alone also reaches the optimum).
void convergesOnLogistic(Consistency c, int staleness) {
  const double best = optimumLoss();
  PSOptions o;
  o.consistency = c;
  o.staleness = staleness;
  o.lr = 1.0;
  o.partition_bytes = 12;  // 3 floats: the 6 parameters over both servers
  o.timeout = std::chrono::seconds(20);
  const int W = 2;
  runPS(W, 2, o, [&](ps::Worker& wk, int rank, comm::Store& store) {
    auto [x, y] = logisticData();
    auto wb = torch::zeros({kD + 1});
    wk.declare("wb", wb);
    barrier(store, "start", W);
    auto pushed = torch::zeros({kD + 1}, torch::kDouble);  // this worker's pushes, summed exactly
    for (int step = 0; step < 300; ++step) {
      wk.pull("wb", wb);
      // Worker w takes shard (step + w) % W: every worker cycles through all the data, so however
      // ASP happens to schedule the workers (one may run alone for a while), each follows the global
      // objective. A decaying step (the server's lr times this factor) lets incremental gradients settle.
      int shard = (step + rank) % W;
      auto xs = x.narrow(0, shard * kN / W, kN / W), ys = y.narrow(0, shard * kN / W, kN / W);
      auto g = dyadic(logisticGrad(xs, ys, wb) / (1.0 + step / 50.0));
      pushed += g.to(torch::kDouble);
      wk.push("wb", g);
      wk.clock();
    }
    // A push returns once it is sent; a server answers this worker's pull only after the requests this
    // worker sent before it. So once this pull returns, every push of this worker was applied, and
    // after the barrier every push of both (without it, the other worker's last push could still be in
    // flight when this worker's final pull is answered: a flake of the test, not of the server).
    wk.pull("wb", wb);
    store.set(fmt::format("pushed/{}", rank), comm::toBytes(hexDoubles(pushed)));
    // The final values, once every push is in.
    barrier(store, "trained", W);
    wk.pull("wb", wb);
    auto all = torch::zeros({kD + 1}, torch::kDouble);
    for (int w = 0; w < W; ++w) all += parseDoubles(comm::toString(store.get(fmt::format("pushed/{}", w))), kD + 1);
    EXPECT_TRUE(torch::equal(wb, (-all).to(torch::kFloat)))
        << "worker " << rank << ": the servers' value is not minus the sum of all pushes\ngot  " << wb
        << "\nwant " << -all;
    double loss = logisticLoss(x, y, wb);
    EXPECT_LE(loss, best + kConvergeTol) << "worker " << rank << " optimum " << best;
    printf("worker %d: loss %.6f optimum %.6f\n", rank, loss, best);
    EXPECT_GE(loss, best - 1e-9);
  });
}

TEST(PSAsync, AspConvergesOnLogisticRegression) { convergesOnLogistic(Consistency::asp, 0); }
TEST(PSAsync, SspConvergesOnLogisticRegression) { convergesOnLogistic(Consistency::ssp, 2); }

// ---------------------------------------------------------------- ASP / SSP update values
// The workers take turns (through the store), so the servers see the pushes in a known order: each push is
// its own optimizer step (no 1/W scaling, momentum and Adam state carried across workers' pushes), and
// after push k the value equals torch's optimizer applied to pushes 0..k in turn. The pusher pulls
// before handing over the turn, so its push has reached every partition.
void asyncUpdatesInTurn(Consistency c, PSOptions::Update u) {
  PSOptions o;
  o.consistency = c;
  o.staleness = 2;
  o.update = u;
  o.lr = u == PSOptions::Update::adam ? 0.01 : 0.1;
  o.momentum = 0.9;
  o.partition_bytes = 12;  // 3 floats: the 7 elements over both servers
  o.timeout = std::chrono::seconds(20);
  const int W = 2, kPushes = 8;
  auto init = torch::linspace(-1, 1, 7);
  auto gradOf = [](int k) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(900 + k);
    return at::randn({7}, g, torch::kFloat);
  };
  runPS(W, 2, o, [&](ps::Worker& wk, int rank, comm::Store& store) {
    wk.declare("v", init);
    auto ref = init.clone().requires_grad_(true);
    auto opt = makeOpt(u, o, {ref});
    auto v = torch::empty({7});
    for (int k = 0; k < kPushes; ++k) {
      ref.mutable_grad() = gradOf(k);
      opt->step();
      if (k % W != rank) continue;
      if (k > 0) store.wait({fmt::format("turn/{}", k - 1)}, std::chrono::seconds(20));
      wk.push("v", gradOf(k));
      wk.pull("v", v);
      if (u == PSOptions::Update::sgd) {
        EXPECT_TRUE(torch::equal(v, ref.detach())) << "worker " << rank << " after push " << k << "\ngot  " << v
                                                   << "\nwant " << ref.detach();
      } else {
        expectClose(v, ref.detach(), 1e-6, fmt::format("worker {} after push {}", rank, k));
      }
      wk.clock();
      store.set(fmt::format("turn/{}", k), comm::toBytes("1"));
    }
  });
}

TEST(PSAsync, AspAppliesEachPushInTurnSgdMomentum) { asyncUpdatesInTurn(Consistency::asp, PSOptions::Update::sgd); }
TEST(PSAsync, AspAppliesEachPushInTurnAdam) { asyncUpdatesInTurn(Consistency::asp, PSOptions::Update::adam); }
TEST(PSAsync, SspAppliesEachPushInTurnSgdMomentum) { asyncUpdatesInTurn(Consistency::ssp, PSOptions::Update::sgd); }

// ---------------------------------------------------------------- SSP bound
TEST(PSAsync, SspBoundHoldsWithSlowedWorker) {
  PSOptions o;
  o.consistency = Consistency::ssp;
  o.staleness = 2;
  o.timeout = std::chrono::seconds(20);
  StoreServer server;
  const int W = 2, S = 1, kSteps = 15;
  auto results = runRanks(W + S, [&](int p) {
    auto store = server.client();
    if (p >= W) {
      ps::Server(store, p - W, S, W, o).run();
      return;
    }
    ps::Worker wk(store, p, W, S, o);
    auto v = torch::zeros({4});
    wk.declare("v", v);
    int max_lead = 0;
    for (int step = 0; step < kSteps; ++step) {
      wk.pull("v", v);
      // The other worker's clock as it counts it itself (incremented before it tells the servers).
      int other = static_cast<int>(store->add(fmt::format("clock/{}", 1 - p), 0));
      int lead = wk.clockValue() - other;
      EXPECT_LE(lead, o.staleness) << "worker " << p << " pulled at clock " << wk.clockValue()
                                   << " while worker " << 1 - p << " was at " << other;
      max_lead = std::max(max_lead, lead);
      if (p == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      wk.push("v", torch::ones({4}));
      store->add(fmt::format("clock/{}", p), 1);
      wk.clock();
    }
    // The fast worker really ran ahead (the bound was exercised, not vacuous).
    if (p == 0) {
      EXPECT_GE(max_lead, 1);
    }
    wk.finish();
  });
  expectAllOk(results);
}

// ---------------------------------------------------------------- sparse rows
TEST(PSSparse, OnlyTouchedRowsChangeAndTravel) {
  PSOptions o;
  o.consistency = Consistency::bsp;
  o.update = PSOptions::Update::sgd;
  o.lr = 0.1;
  o.timeout = std::chrono::seconds(20);
  const int W = 2, S = 2, kRows = 1000, kDim = 8;
  const int64_t H = ps::kHeaderBytes;
  auto gradsOf = [](int rank, const torch::Tensor& rows) {
    return (rows.to(torch::kFloat).unsqueeze(1) + 1) * (rank + 1) * torch::arange(1, kDim + 1, torch::kFloat);
  };
  std::vector<torch::Tensor> touched = {torch::tensor({3, 10, 999}, torch::kLong),
                                        torch::tensor({10, 500}, torch::kLong)};
  runPS(W, S, o, [&](ps::Worker& wk, int rank, comm::Store&) {
    // Expected traffic, from the rows alone: row r lives on server r % S.
    auto perServer = [&](const torch::Tensor& rows) {
      std::vector<int64_t> n(S, 0);
      for (int64_t i = 0; i < rows.numel(); ++i) ++n[static_cast<size_t>(rows[i].item<int64_t>() % S)];
      return n;
    };
    wk.declareRows("emb", kRows, kDim);
    EXPECT_EQ(wk.bytesSent(), S * H);
    EXPECT_EQ(wk.bytesReceived(), S * H);
    int64_t sent0 = wk.bytesSent(), recv0 = wk.bytesReceived();
    auto rows = touched[static_cast<size_t>(rank)];
    wk.pushRows("emb", rows, gradsOf(rank, rows));
    int64_t expect_push = 0;
    for (int64_t n : perServer(rows))
      if (n) expect_push += H + n * 8 + n * kDim * 4;
    EXPECT_EQ(wk.bytesSent() - sent0, expect_push);
    EXPECT_EQ(wk.bytesReceived(), recv0);
    wk.clock();
    // Pull the union of the touched rows plus one untouched row.
    auto want_rows = torch::tensor({3, 10, 999, 500, 42}, torch::kLong);
    int64_t s1 = wk.bytesSent(), r1 = wk.bytesReceived();
    auto got = wk.pullRows("emb", want_rows);
    int64_t expect_sent = 0, expect_recv = 0;
    for (int64_t n : perServer(want_rows)) {
      if (!n) continue;
      expect_sent += H + n * 8;
      expect_recv += H + n * kDim * 4;
    }
    EXPECT_EQ(wk.bytesSent() - s1, expect_sent);
    EXPECT_EQ(wk.bytesReceived() - r1, expect_recv);
    // BSP: the pull at clock 1 sees both workers' pushes (sgd, each push applied: row -= lr * grad).
    auto g0 = gradsOf(0, touched[0]), g1 = gradsOf(1, touched[1]);
    auto want = torch::zeros({5, kDim});
    want[0] = -0.1 * g0[0];
    want[1] = -0.1 * g0[1] - 0.1 * g1[0];
    want[2] = -0.1 * g0[2];
    want[3] = -0.1 * g1[1];
    expectClose(got, want, 1e-6, fmt::format("worker {} pulled rows", rank));
    // Every other row of the table is untouched (zeros).
    auto all = wk.pullRows("emb", torch::arange(kRows, torch::kLong));
    auto mask = torch::ones({kRows}, torch::kBool);
    for (int64_t r : {3, 10, 999, 500}) mask[r] = false;
    EXPECT_EQ(all.index({mask}).abs().sum().item<float>(), 0.0f);
    expectClose(all.index_select(0, want_rows.narrow(0, 0, 4)), want.narrow(0, 0, 4), 1e-6, "full pull");
  });
}

// ---------------------------------------------------------------- BSP: a missing worker is named
TEST(PSFaults, BspTimeoutNamesMissingWorker) {
  PSOptions o;
  o.consistency = Consistency::bsp;
  // Long enough that a loaded machine does not trip the server's other waits (worker 1's declare waits
  // for worker 0's) before the one under test.
  o.timeout = std::chrono::seconds(3);
  StoreServer server;
  const int W = 2, S = 1;
  auto results = runRanks(
      W + S,
      [&](int p) {
        auto store = server.client();
        if (p >= W) {
          try {
            ps::Server(store, p - W, S, W, o).run();
            ADD_FAILURE() << "the server did not fail";
          } catch (const TimeoutError& e) {
            EXPECT_NE(std::string(e.what()).find("workers [1]"), std::string::npos) << e.what();
          }
          return;
        }
        ps::Worker wk(store, p, W, S, o);
        auto v = torch::zeros({4});
        wk.declare("v", v);
        if (p == 1) {  // declares, then never pushes: waits until worker 0 saw the error
          store->get("seen");
          return;
        }
        wk.push("v", torch::ones({4}));
        wk.clock();
        auto t0 = std::chrono::steady_clock::now();
        try {
          wk.pull("v", v);
          ADD_FAILURE() << "the pull did not fail";
        } catch (const Error& e) {
          std::string msg = e.what();
          printf("worker 0: %s\n", msg.c_str());
          EXPECT_NE(msg.find("server 0"), std::string::npos) << msg;
          EXPECT_NE(msg.find("misses pushes from workers [1]"), std::string::npos) << msg;
          EXPECT_LT(std::chrono::steady_clock::now() - t0, 2 * o.timeout) << msg;
        }
        store->set("seen", comm::toBytes("1"));
      },
      std::chrono::seconds(60));
  expectAllOk(results);
}

// ---------------------------------------------------------------- roles from the environment
// What dtrain-run --servers 1 sets up: the store at MASTER_ADDR:MASTER_PORT, the role variables.
TEST(PSEnv, RunServerIfRoleAndStoreFromEnv) {
  StoreServer server;
  const int W = 2;
  auto results = runRanks(W + 1, [&](int p) {
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(server.port()).c_str(), 1);
    setenv("DTRAIN_NUM_SERVERS", "1", 1);
    setenv("DTRAIN_NUM_WORKERS", std::to_string(W).c_str(), 1);
    setenv("DTRAIN_ROLE", p < W ? "worker" : "server", 1);
    if (p == W) setenv("DTRAIN_SERVER_INDEX", "0", 1);
    ps::PSOptions o;
    o.update = PSOptions::Update::sum_only;
    o.timeout = std::chrono::seconds(10);
    if (ps::runServerIfRole(o)) {
      EXPECT_EQ(p, W);
      return;
    }
    ps::Worker wk(ps::storeFromEnv(), p, W, 1, o);
    expectTwoWorkersSum(wk, p);
    wk.finish();
  });
  expectAllOk(results);
}

// ---------------------------------------------------------------- a lying peer
// A raw client (not a ps::Worker) claims a partition of 2^40 floats: the server rejects the header
// with a ProtocolError instead of allocating from the claim, and tells the client.
TEST(PSFaults, OversizedClaimIsProtocolError) {
  PSOptions o;
  o.timeout = std::chrono::seconds(5);
  StoreServer server;
  auto results = runRanks(2, [&](int p) {
    auto store = server.client();
    if (p == 1) {
      try {
        ps::Server(store, 0, 1, 1, o).run();
        ADD_FAILURE() << "the server accepted the claim";
      } catch (const ProtocolError& e) {
        EXPECT_NE(std::string(e.what()).find("limit"), std::string::npos) << e.what();
      }
      return;
    }
    auto g = comm::GroupOptions::fromEnv();  // the same transport as the server's
    g.timeout = std::chrono::seconds(5);
    auto pg = comm::ProcessGroup::create(std::make_shared<comm::PrefixStore>("ps/w0s0", store), 0, 2, g);
    // The wire header (see ps.cc): magic "PSV1", op 1 = declare, flags 1 = carries the values.
    struct {
      uint32_t magic = 0x50535631;
      uint16_t op = 1, flags = 1;
      uint32_t key = 0;
      int32_t clock = 0;
      int64_t count = int64_t{1} << 40, row_dim = 0, aux = 0;
    } h;
    static_assert(sizeof(h) == ps::kHeaderBytes, "header layout");
    pg->send(&h, sizeof(h), comm::DType::u8, 1)->wait();
    pg->recv(&h, sizeof(h), comm::DType::u8, 1)->wait();
    EXPECT_EQ(h.op, 22) << "expected an error reply";
  });
  expectAllOk(results);
}

// ---------------------------------------------------------------- a dead server
TEST(PSFaults, KilledServerIsNamedPromptly) {
  PSOptions o;
  o.consistency = Consistency::asp;
  o.partition_bytes = 16;  // the 8-float tensor over both servers
  o.timeout = std::chrono::seconds(10);
  StoreServer server;
  const int W = 2, S = 2;
  auto results = runRanks(
      W + S,
      [&](int p) {
        auto store = server.client();
        if (p >= W) {
          store->set(fmt::format("pid/{}", p - W), comm::toBytes(std::to_string(getpid())));
          ps::Server(store, p - W, S, W, o).run();
          return;
        }
        ps::Worker wk(store, p, W, S, o);
        auto v = torch::zeros({8});
        wk.declare("v", v);
        // The server dies only once both workers declared (a slow worker 1 would otherwise fail in
        // declare(), outside the loop, and never reach the barrier below).
        store->set(fmt::format("declared/{}", p), comm::toBytes("1"));
        std::string msg;
        auto t0 = std::chrono::steady_clock::now();
        try {
          for (int step = 0; step < 200; ++step) {
            if (p == 0 && step == 3) {
              store->get("declared/1");
              pid_t victim = std::stoi(comm::toString(store->get("pid/1")));
              kill(victim, SIGKILL);
              store->set("killed", comm::toBytes("1"));
              t0 = std::chrono::steady_clock::now();
            }
            if (p == 1 && step == 3) {
              store->get("killed");
              t0 = std::chrono::steady_clock::now();
            }
            wk.pull("v", v);
            wk.push("v", torch::ones({8}));
            wk.clock();
          }
        } catch (const Error& e) {
          msg = e.what();
        }
        auto waited = std::chrono::steady_clock::now() - t0;
        // Both workers saw their own error before either goes (and closes its connections).
        barrier(*store, "caught", W);
        printf("worker %d: %s\n", p, msg.c_str());
        EXPECT_NE(msg.find("server 1"), std::string::npos) << "worker " << p << ": " << msg;
        EXPECT_LT(waited, o.timeout) << msg;
      },
      std::chrono::seconds(60));
  for (int w = 0; w < W; ++w) EXPECT_TRUE(results[static_cast<size_t>(w)].ok()) << results[static_cast<size_t>(w)].describe();
  EXPECT_EQ(results[W + 1].signal, SIGKILL) << results[W + 1].describe();
  // The surviving server fails (its workers went away) but does not hang.
  EXPECT_FALSE(results[W].timed_out) << results[W].describe();
}

}  // namespace
}  // namespace dtrain::test

namespace dtrain::test {
namespace {

// pushPull of a tensor cut into several large partitions on one server: each partition's gradient and
// reply are bigger than the socket buffers, which once deadlocked worker and server. The result is the
// BSP update of the mean gradient: p1 = p0 - lr * mean_w(g_w).
TEST(PSBsp, PushPullOfLargeMultiPartitionTensor) {
  PSOptions o;
  o.consistency = ps::Consistency::bsp;
  o.update = PSOptions::Update::sgd;
  o.lr = 0.5;
  o.partition_bytes = 2u << 20;  // 3 partitions of a 6 MB tensor, all on the one server
  o.timeout = std::chrono::seconds(30);
  const int64_t n = 3 * (512 * 1024);
  runPS(2, 1, o, [&](ps::Worker& wk, int w, comm::Store&) {
    wk.declare("big", torch::ones({n}));
    auto grad = torch::full({n}, static_cast<float>(w + 1));  // mean over 2 workers: 1.5
    auto out = torch::empty({n});
    wk.pushPull("big", grad, out);
    EXPECT_TRUE(torch::allclose(out, torch::full({n}, 1.0f - 0.5f * 1.5f))) << out.slice(0, 0, 4);
    wk.clock();
  });
}

}  // namespace
}  // namespace dtrain::test
