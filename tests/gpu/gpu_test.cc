// Tests that need a GPU: built in every build, run where a GPU is (scripts/gpu_check.sh on a GPU machine),
// reported by CTest as skipped ("did not run") elsewhere, with the reason: never counted as passed.
//
// Every distributed result is compared with one process: DDP on the reference-style MLP and on the MIL-NCE
// model, 2 ranks sharing one GPU (the staged path) and NCCL at world 1 (NCCL up to 2.29 refuses two
// ranks on one GPU) and at world 2 where 2 GPUs exist; FSDP stage 3, PowerSGD and SyncBatchNorm on CUDA
// tensors against the same on the CPU; a peer killed mid-collective on the staged path; a checkpoint
// saved from CUDA tensors loaded on the CPU and restored onto CUDA; the staged path at 64 MiB (many
// chunks) and the order after a slow producer on a side stream, checked by value; Adam under DDP against
// Adam in one process on the same GPU; a group of CPU and CUDA ranks refused on every rank; NCCL with two
// ranks on one GPU where the NCCL loaded accepts that (2.30+), with its failure paths.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/data_parallel.h"
#include "dtrain/ddp.h"
#include "dtrain/device.h"
#include "dtrain/distributed.h"
#include "dtrain/fsdp.h"
#include "dtrain/powersgd.h"
#include "dtrain/sync_batch_norm.h"
#include "dtrain/zero.h"
#include "harness.h"
#include "milnce/train.h"
#include "torch/device/tensor_comm.h"

#ifdef DTRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtrain {
namespace {

using namespace std::chrono_literals;

struct Gpus {
  int count = 0;
  std::string why;
};

// Counted in a child: a process that has initialised CUDA cannot fork ranks that use it.
const Gpus& gpus() {
  static const Gpus g = [] {
    Gpus out;
    auto r = test::runRanks(1, [](int) {
      std::printf("gpus=%d\nwhy=%s\n", cudaDeviceCount(), cudaUnavailableReason().c_str());
    }, 60s);
    const std::string& text = r.at(0).output;
    const auto at = text.find("gpus="), why = text.find("why=");
    if (at == std::string::npos || why == std::string::npos) {
      out.why = "the probe failed: " + r.at(0).describe();
      return out;
    }
    out.count = std::stoi(text.substr(at + 5));
    out.why = text.substr(why + 4, text.find('\n', why) - why - 4);
    return out;
  }();
  return g;
}

#define DTRAIN_NEEDS_GPUS(n)                                                                             \
  do {                                                                                                   \
    if (gpus().count < (n))                                                                              \
      GTEST_SKIP() << "not run: needs " << (n) << " GPU(s), " << gpus().count << " here: " << gpus().why; \
  } while (0)

std::shared_ptr<comm::ProcessGroup> group(test::StoreServer& server, int rank, int world, const std::string& path = "auto",
                                          std::chrono::seconds timeout = 60s) {
  comm::GroupOptions o;
  o.timeout = timeout;
  o.cuda_path = path;
  return comm::ProcessGroup::create(world > 1 ? server.client() : nullptr, rank, world, o);
}

torch::nn::Sequential mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::ReLU(), torch::nn::Linear(64, 4));
}

std::pair<at::Tensor, at::Tensor> globalBatch() {
  torch::manual_seed(1);
  return {torch::randn({16, 32}), torch::randint(0, 4, {16})};
}

// The module's parameters, copied to the CPU.
std::vector<at::Tensor> cpuParams(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().cpu());
  return out;
}

enum class Optim { sgd, adam };

// `steps` steps of mlp() on `device` on this rank's share of the global batch (SGD with momentum, or
// Adam), with DDP over pg when given (else plain libtorch on the whole batch); the parameters on the CPU.
std::vector<at::Tensor> train(const std::shared_ptr<comm::ProcessGroup>& pg, const c10::Device& device, int steps,
                              std::shared_ptr<CommHook> hook = nullptr, Optim optim = Optim::sgd) {
  auto net = mlp();
  net->to(device);
  auto [x, y] = globalBatch();
  if (pg && pg->size() > 1) {
    const int64_t rows = x.size(0) / pg->size();
    x = x.narrow(0, pg->rank() * rows, rows);
    y = y.narrow(0, pg->rank() * rows, rows);
  }
  x = x.to(device);
  y = y.to(device);
  std::unique_ptr<DistributedDataParallel> ddp;
  if (pg) ddp = std::make_unique<DistributedDataParallel>(net.ptr(), pg);
  if (ddp && hook) ddp->registerCommHook(hook);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (optim == Optim::adam) opt = std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-3));
  else opt = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int i = 0; i < steps; ++i) {
    opt->zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    opt->step();
  }
  return cpuParams(*net);
}

void expectClose(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), tol) << "tensor " << i;
}

TEST(GpuDdp, TwoRanksSharingOneGpuStagedEqualOneProcess) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    const c10::Device gpu(c10::kCUDA, 0);
    EXPECT_EQ(device::pathFor(*pg, torch::zeros({1}, gpu)), device::Path::staged);  // one GPU, two ranks
    expectClose(train(pg, gpu, 5), train(nullptr, gpu, 5), 1e-5);
  });
  test::expectAllOk(results);
}

TEST(GpuDdp, NcclAtWorldOneEqualsOneProcess) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server;
  auto results = test::runRanks(1, [&](int) {
    auto pg = group(server, 0, 1);
    const c10::Device gpu(c10::kCUDA, 0);
    EXPECT_EQ(device::pathFor(*pg, torch::zeros({1}, gpu)), device::Path::nccl);
    // The communicator itself: every collective on CUDA tensors, checked by value.
    auto x = torch::arange(12, torch::TensorOptions().dtype(torch::kFloat).device(gpu));
    auto y = torch::empty({12}, x.options());
    device::allreduce(*pg, x, y, comm::ReduceOp::avg)->wait();
    EXPECT_TRUE(torch::equal(y.cpu(), torch::arange(12, torch::kFloat)));
    // At world 1 an all-gather and a reduce-scatter copy the input: checked by value, after a reset.
    y.fill_(-1);
    device::allgather(*pg, x, y)->wait();
    EXPECT_TRUE(torch::equal(y.cpu(), torch::arange(12, torch::kFloat))) << "allgather at world 1";
    y.fill_(-1);
    device::reduceScatter(*pg, x, y, comm::ReduceOp::sum)->wait();
    EXPECT_TRUE(torch::equal(y.cpu(), torch::arange(12, torch::kFloat))) << "reduce_scatter at world 1";
    device::broadcast(*pg, y, 0)->wait();
    EXPECT_TRUE(torch::equal(y.cpu(), torch::arange(12, torch::kFloat)));
    expectClose(train(pg, gpu, 5), train(nullptr, gpu, 5), 1e-5);
  });
  test::expectAllOk(results);
}

// Adam on DDP's averaged gradients against Adam in one process on the same GPU (same kernels): at world 1
// (NCCL) the gradients are the one process's, so the parameters match to rounding; at world 2 sharing the
// GPU (staged) each rank's half-batch gradients are averaged, and Adam's update (m / sqrt(v)) keeps their
// relative rounding.
TEST(GpuDdp, AdamEqualsOneProcessOnTheSameGpu) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server;
  const c10::Device gpu(c10::kCUDA, 0);
  auto results = test::runRanks(1, [&](int) {
    auto pg = group(server, 0, 1);
    EXPECT_EQ(device::pathFor(*pg, torch::zeros({1}, gpu)), device::Path::nccl);
    expectClose(train(pg, gpu, 4, nullptr, Optim::adam), train(nullptr, gpu, 4, nullptr, Optim::adam), 1e-6);
  });
  test::expectAllOk(results);
  results = test::runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    EXPECT_EQ(device::pathFor(*pg, torch::zeros({1}, gpu)), device::Path::staged);
    expectClose(train(pg, gpu, 4, nullptr, Optim::adam), train(nullptr, gpu, 4, nullptr, Optim::adam), 1e-4);
  });
  test::expectAllOk(results);
}

// A group where one rank passes CPU tensors and the other CUDA tensors fails on both, saying so (the
// ranks exchange their places once, on the group's first tensor collective: tensor_comm.h, pathFor).
TEST(GpuDevicePaths, CpuAndCudaRanksInOneGroupFailOnEveryRank) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2, "auto", 20s);
    auto t = rank == 0 ? torch::ones({8}) : torch::ones({8}, c10::Device(c10::kCUDA, 0));
    const std::string err = test::errorOf([&] { device::allreduce(*pg, t, comm::ReduceOp::sum)->wait(); });
    EXPECT_NE(err.find("the ranks pass tensors of different kinds (rank 0 on cpu, rank 1 on cuda:0)"), std::string::npos)
        << err;
  }, 60s);
  test::expectAllOk(results);
}

// NCCL with two ranks on the one GPU, where the NCCL loaded accepts it (2.30 or later with
// NCCL_MULTI_RANK_GPU_ENABLE=1, experimental): values, DDP against one process, and the failure paths a
// one-GPU machine otherwise cannot reach (a fingerprint mismatch, a peer that never calls, a peer killed).
// Not run, with the reason, where NCCL is older or a first two-rank allreduce does not complete.
std::shared_ptr<comm::ProcessGroup> sharedNcclGroup(test::StoreServer& server, int rank, std::chrono::seconds timeout,
                                                    bool fingerprints) {
  ::setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
  comm::GroupOptions o;
  o.timeout = timeout;
  o.cuda_path = "nccl";
  o.check_fingerprints = fingerprints;
  return comm::ProcessGroup::create(server.client(), rank, 2, o);
}

TEST(GpuNcclSharedGpu, TwoRanksOnOneGpuWhereNcclAcceptsIt) {
  DTRAIN_NEEDS_GPUS(1);
  const std::string version = comm::ncclVersionText();
  int major = 0, minor = 0;
  if (std::sscanf(version.c_str(), "%d.%d", &major, &minor) != 2 || major < 2 || (major == 2 && minor < 30))
    GTEST_SKIP() << "not run: NCCL " << version << " is loaded; two ranks on one GPU need NCCL 2.30 or later "
                 << "(NCCL_MULTI_RANK_GPU_ENABLE=1)";
  const c10::Device gpu(c10::kCUDA, 0);
  test::StoreServer probe_server;
  auto probe = test::runRanks(2, [&](int rank) {
    auto pg = sharedNcclGroup(probe_server, rank, 30s, false);
    auto t = torch::full({1024}, static_cast<float>(rank + 1), gpu);
    device::allreduce(*pg, t, comm::ReduceOp::sum)->wait();
    if (!torch::equal(t.cpu(), torch::full({1024}, 3.0f))) throw Error("wrong sum");
  }, 90s);
  for (const auto& r : probe)
    if (!r.ok()) GTEST_SKIP() << "not run: NCCL " << version << " with NCCL_MULTI_RANK_GPU_ENABLE=1 did not complete a "
                              << "two-rank allreduce on one GPU (MPS may be needed): " << r.describe();
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = sharedNcclGroup(server, rank, 30s, true);
    EXPECT_EQ(device::pathFor(*pg, torch::zeros({1}, gpu)), device::Path::nccl);
    expectClose(train(pg, gpu, 3), train(nullptr, gpu, 3), 1e-5);
    // A mismatch (16 against 32 elements) fails both ranks, naming both calls.
    auto t = torch::ones({rank == 0 ? 16 : 32}, gpu);
    const std::string e = test::errorOf([&] { device::allreduce(*pg, t, comm::ReduceOp::sum)->wait(); });
    EXPECT_NE(e.find("collective mismatch on the NCCL communicator"), std::string::npos) << e;
  }, 120s);
  test::expectAllOk(results);
  // A peer that never calls (it leaves): the op fails by the deadline, naming it.
  test::StoreServer server2;
  results = test::runRanks(2, [&](int rank) {
    auto pg = sharedNcclGroup(server2, rank, 5s, false);
    auto t = torch::ones({16}, gpu);
    device::allreduce(*pg, t, comm::ReduceOp::sum)->wait();
    if (rank == 1) return;
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = test::errorOf([&] { device::allreduce(*pg, t, comm::ReduceOp::sum)->wait(); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s) << e;
    EXPECT_NE(e.find("nccl allreduce seq=1 f32 x 16 sum"), std::string::npos) << e;  // timed out, or NCCL saw the exit
  }, 120s);
  test::expectAllOk(results);
  // A peer killed: with the fingerprint check the survivor's next op names it within the deadline.
  test::StoreServer server3;
  results = test::runRanks(2, [&](int rank) {
    auto pg = sharedNcclGroup(server3, rank, 10s, true);
    auto t = torch::ones({16}, gpu);
    device::allreduce(*pg, t, comm::ReduceOp::sum)->wait();
    if (rank == 1) std::raise(SIGKILL);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = test::errorOf([&] { device::allreduce(*pg, t, comm::ReduceOp::sum)->wait(); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s) << e;
    EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
  }, 120s);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].ok()) << results[0].describe();
  EXPECT_EQ(results[1].signal, SIGKILL) << results[1].describe();
}

TEST(GpuDdp, NcclOnTwoGpusEqualsOneProcess) {
  DTRAIN_NEEDS_GPUS(2);
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2, "nccl");
    const c10::Device gpu(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
    EXPECT_EQ(device::pathFor(*pg, torch::zeros({1}, gpu)), device::Path::nccl);
    expectClose(train(pg, gpu, 5), train(nullptr, gpu, 5), 1e-5);
  });
  test::expectAllOk(results);
}

// MIL-NCE: world 2 on one GPU (staged; embeddings all-gathered, DDP) gives the loss and gradients of one
// process on the global batch; and world 1 on the GPU (NCCL) those of the CPU.
milnce::TrainOptions smallModel(const std::string& data, const std::string& device) {
  milnce::TrainOptions o;
  o.data = data;
  o.model.hidden = 64;
  o.model.embed = 32;
  o.device = device;
  return o;
}

std::map<std::string, at::Tensor> grads(milnce::Trainer& t) {
  std::map<std::string, at::Tensor> g;
  for (const auto& item : t.model()->named_parameters())
    if (item.value().requires_grad()) g[item.key()] = item.value().grad().cpu();
  return g;
}

void expectSameGrads(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  for (const auto& [name, g] : a) {
    const double scale = std::max(1e-3, g.abs().max().item<double>());
    EXPECT_LT((g - b.at(name)).abs().max().item<double>() / scale, 1e-5) << name;
  }
}

TEST(GpuMilNce, TwoRanksStagedAndNcclAtWorldOneEqualOneProcess) {
  DTRAIN_NEEDS_GPUS(1);
  test::TempDir dir;
  milnce::GenOptions g;
  g.out = dir.path();
  g.videos = 60;
  g.eval_videos = 10;
  milnce::generateData(g);
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    milnce::Dataset data = milnce::Dataset::load(dir.path());
    std::mt19937_64 rng(42);
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < 16; ++i) rows.push_back(i);
    milnce::Batch global = milnce::makeBatch(data, rows, smallModel(dir.path(), "cpu").loader, rng);
    milnce::Batch local{global.video.narrow(0, rank * 8, 8), global.text.narrow(0, rank * 8, 8)};
    auto pg = group(server, rank, 2);
    Distributed two(pg, pg, comm::WorldInfo{rank, 2, rank, 2, "explicit", 0, 1, "", {{0, 1}}});
    milnce::Trainer staged(two, data, smallModel(dir.path(), "cuda:0"));
    const double loss2 = staged.lossAndBackward(local);
    auto one_pg = group(server, 0, 1);
    Distributed one(one_pg, one_pg, comm::WorldInfo{});
    milnce::Trainer gpu1(one, data, smallModel(dir.path(), "cuda:0"));
    const double loss_gpu = gpu1.lossAndBackward(global);
    milnce::Trainer cpu1(one, data, smallModel(dir.path(), "cpu"));
    const double loss_cpu = cpu1.lossAndBackward(global);
    EXPECT_NEAR(loss2, loss_gpu, 1e-5 * std::abs(loss_gpu));
    EXPECT_NEAR(loss_gpu, loss_cpu, 1e-5 * std::abs(loss_cpu));
    expectSameGrads(grads(staged), grads(gpu1));
    expectSameGrads(grads(gpu1), grads(cpu1));
  });
  test::expectAllOk(results);
}

// FSDP stage 3 on 2 ranks: the same training on CUDA tensors (staged, one GPU) and on the CPU.
std::map<std::string, at::Tensor> fsdpTrain(const std::shared_ptr<comm::ProcessGroup>& pg, const c10::Device& device) {
  auto net = mlp();
  net->to(device);
  FsdpOptions o;
  o.stage = 3;
  FullyShardedDataParallel fsdp(net, pg, o);
  auto [x, y] = globalBatch();
  x = x.narrow(0, pg->rank() * 8, 8).to(device);
  y = y.narrow(0, pg->rank() * 8, 8).to(device);
  torch::optim::Adam opt(fsdp.shards(), torch::optim::AdamOptions(1e-2));
  for (int i = 0; i < 4; ++i) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(fsdp.forward(x), y).backward();
    opt.step();
  }
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : fsdp.fullState()) out[name] = t.cpu();
  return out;
}

TEST(GpuFsdp, StageThreeOnCudaEqualsCpu) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server_gpu, server_cpu;
  auto results = test::runRanks(2, [&](int rank) {
    auto gpu = fsdpTrain(group(server_gpu, rank, 2), c10::Device(c10::kCUDA, 0));
    auto cpu = fsdpTrain(group(server_cpu, rank, 2), c10::Device(c10::kCPU));
    ASSERT_EQ(gpu.size(), cpu.size());
    for (const auto& [name, t] : cpu) EXPECT_LT((t - gpu.at(name)).abs().max().item<double>(), 1e-5) << name;
  });
  test::expectAllOk(results);
}

// DataParallel with replicas on GPUs (two on one GPU here; one per GPU where there are more) equals one
// model on the CPU.
TEST(GpuDataParallel, ReplicasOnGpusEqualOneModel) {
  DTRAIN_NEEDS_GPUS(1);
  auto results = test::runRanks(1, [&](int) {
    const int gpus = cudaDeviceCount();
    std::vector<c10::Device> devices{c10::Device(c10::kCUDA, 0),
                                     c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(gpus > 1 ? 1 : 0))};
    auto ref = mlp(), net = mlp();
    DataParallel dp(net, devices);
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05)), opt(net->parameters(), torch::optim::SGDOptions(0.05));
    auto [x, y] = globalBatch();
    auto loss_fn = [](torch::nn::Module& r, const at::Tensor& xs, const at::Tensor& ys) {
      return torch::nn::functional::cross_entropy(r.as<torch::nn::Sequential>()->forward(xs), ys);
    };
    for (int i = 0; i < 4; ++i) {
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
      ref_opt.step();
      opt.zero_grad();
      dp.step(x, y, loss_fn);
      opt.step();
    }
    expectClose(cpuParams(*net), cpuParams(*ref), 1e-5);
  });
  test::expectAllOk(results);
}

// ZeRO stage 1: DDP with the Adam state sharded, owners broadcasting their parameters (small ones packed).
TEST(GpuZero, StageOneOnCudaEqualsCpu) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server_gpu, server_cpu;
  auto results = test::runRanks(2, [&](int rank) {
    auto run = [&](test::StoreServer& s, const c10::Device& device) {
      auto pg = group(s, rank, 2);
      auto net = mlp();
      net->to(device);
      DistributedDataParallel ddp(net.ptr(), pg);
      ZeroRedundancyOptimizer opt(net->parameters(), [](std::vector<torch::optim::OptimizerParamGroup> g) {
        return std::make_unique<torch::optim::Adam>(std::move(g), torch::optim::AdamOptions(1e-2));
      }, pg);
      auto [x, y] = globalBatch();
      x = x.narrow(0, rank * 8, 8).to(device);
      y = y.narrow(0, rank * 8, 8).to(device);
      for (int i = 0; i < 4; ++i) {
        opt.zeroGrad();
        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
        opt.step();
      }
      return cpuParams(*net);
    };
    expectClose(run(server_gpu, c10::Device(c10::kCUDA, 0)), run(server_cpu, c10::Device(c10::kCPU)), 1e-5);
  });
  test::expectAllOk(results);
}

TEST(GpuPowerSgd, OnCudaEqualsCpu) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server_gpu, server_cpu;
  auto results = test::runRanks(2, [&](int rank) {
    PowerSGDOptions o;
    o.matrix_approximation_rank = 2;
    o.start_powerSGD_iter = 2;
    auto gpu = train(group(server_gpu, rank, 2), c10::Device(c10::kCUDA, 0), 6, powerSGDHook(o));
    auto cpu = train(group(server_cpu, rank, 2), c10::Device(c10::kCPU), 6, powerSGDHook(o));
    expectClose(gpu, cpu, 1e-5);
  });
  test::expectAllOk(results);
}

TEST(GpuSyncBatchNorm, OnCudaEqualsCpu) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server_gpu, server_cpu;
  auto results = test::runRanks(2, [&](int rank) {
    auto run = [&](test::StoreServer& s, const c10::Device& device) {
      torch::manual_seed(3);
      auto x = (torch::randn({6, 5, 4}) * 3 + 1).narrow(0, rank * 3, 3).to(device).requires_grad_(true);
      SyncBatchNorm bn(torch::nn::BatchNormOptions(5), group(s, rank, 2));
      bn->to(device);
      auto out = bn->forward(x);
      (out * out.detach().cos()).sum().backward();
      return std::vector<at::Tensor>{out.detach().cpu(), x.grad().cpu(), bn->running_mean.cpu(), bn->running_var.cpu()};
    };
    expectClose(run(server_gpu, c10::Device(c10::kCUDA, 0)), run(server_cpu, c10::Device(c10::kCPU)), 1e-5);
  });
  test::expectAllOk(results);
}

// A peer killed between two collectives on the staged path: the survivor's CUDA allreduce fails within the
// deadline, naming the peer.
TEST(GpuStaged, PeerKilledMidCollectiveFailsNamingIt) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2, "staged", 10s);
    auto t = torch::ones({1 << 22}, c10::Device(c10::kCUDA, 0));
    device::allreduce(*pg, t, comm::ReduceOp::sum)->wait();
    if (rank == 1) std::raise(SIGKILL);
    const auto t0 = std::chrono::steady_clock::now();
    std::string err = test::errorOf([&] { device::allreduce(*pg, t, comm::ReduceOp::sum)->wait(); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s) << err;
    EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
  }, 90s);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].ok()) << results[0].describe();
  EXPECT_EQ(results[1].signal, SIGKILL) << results[1].describe();
}

#ifdef DTRAIN_WITH_CUDA
// Values through the device paths that the training tests do not reach: the staged path's many chunks (a
// 64 MiB tensor: 16 chunks of 4 MiB), and the order after the caller's stream: a slow producer on a side
// stream (made current) whose last kernel writes the input, then the collective, checked by value. Also
// that no op changes the caller's current device.
void checkStreamOrderAndChunks(comm::ProcessGroup& pg, int rank, int world) {
  const c10::Device gpu(c10::kCUDA, 0);
  const int device_before = c10::cuda::current_device();
  auto big = torch::full({16 << 20}, static_cast<float>(rank + 1), gpu);  // 64 MiB
  device::allreduce(pg, big, comm::ReduceOp::sum)->wait();
  const float sum = static_cast<float>(world * (world + 1) / 2);
  EXPECT_TRUE(torch::equal(big.cpu(), torch::full({16 << 20}, sum))) << "64 MiB allreduce: wrong values";
  auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  auto t = torch::zeros({1 << 20}, gpu);
  {
    c10::cuda::CUDAStreamGuard g(side);
    auto m = torch::randn({2048, 2048}, gpu);
    for (int i = 0; i < 20; ++i) m = torch::matmul(m, m).clamp(-1, 1);  // slow, on the side stream
    t.add_(m.sum() * 0).fill_(static_cast<float>(rank + 1));            // the input is written last
    device::allreduce(pg, t, comm::ReduceOp::sum)->wait();
  }
  EXPECT_TRUE(torch::equal(t.cpu(), torch::full({1 << 20}, sum))) << "the collective did not wait for the producer";
  EXPECT_EQ(c10::cuda::current_device(), device_before) << "an op changed the current device";
}

TEST(GpuDevicePaths, StagedChunksAndStreamOrderByValue) {
  DTRAIN_NEEDS_GPUS(1);
  test::StoreServer server;
  auto results = test::runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2, "staged");
    checkStreamOrderAndChunks(*pg, rank, 2);
  }, 120s);
  test::expectAllOk(results);
  results = test::runRanks(1, [&](int) {
    auto pg = group(server, 0, 1);
    EXPECT_EQ(device::pathFor(*pg, torch::zeros({1}, c10::Device(c10::kCUDA, 0))), device::Path::nccl);
    checkStreamOrderAndChunks(*pg, 0, 1);
  }, 120s);
  test::expectAllOk(results);
}
#endif

TEST(GpuCheckpoint, SavedFromCudaTensorsLoadsOnTheCpu) {
  DTRAIN_NEEDS_GPUS(1);
  test::TempDir dir;
  auto results = test::runRanks(1, [&](int) {
    auto net = mlp();
    net->to(c10::Device(c10::kCUDA, 0));
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
    auto [x, y] = globalBatch();
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x.cuda()), y.cuda()).backward();
    opt.step();
    CheckpointState s;
    s.captureModel(*net);
    s.captureOptimizer(opt);
    const std::string path = Checkpointer(dir.path()).save(s);
    CheckpointState back = Checkpointer::load(path);
    auto cpu_net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                         torch::nn::ReLU(), torch::nn::Linear(64, 4));
    back.restoreModel(*cpu_net);
    torch::optim::Adam cpu_opt(cpu_net->parameters(), torch::optim::AdamOptions(1e-2));
    back.restoreOptimizer(cpu_opt);
    auto a = net->parameters(), b = cpu_net->parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].cpu(), b[i])) << i;
    // And back onto CUDA: the model and Adam's state, then one more step equal on both devices.
    auto gpu_net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                         torch::nn::ReLU(), torch::nn::Linear(64, 4));
    gpu_net->to(c10::Device(c10::kCUDA, 0));
    back.restoreModel(*gpu_net);
    torch::optim::Adam gpu_opt(gpu_net->parameters(), torch::optim::AdamOptions(1e-2));
    back.restoreOptimizer(gpu_opt);
    for (auto* pair : {&opt, &gpu_opt}) {
      auto& model = pair == &opt ? net : gpu_net;
      pair->zero_grad();
      torch::nn::functional::cross_entropy(model->forward(x.cuda()), y.cuda()).backward();
      pair->step();
    }
    auto c = gpu_net->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(c[i].is_cuda()) << i;
      EXPECT_LT((a[i] - c[i]).abs().max().item<float>(), 1e-6) << "parameter " << i << " after a step on CUDA";
    }
  });
  test::expectAllOk(results);
}

}  // namespace
}  // namespace dtrain
