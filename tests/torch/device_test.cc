// The device layer without a GPU: choosing a device (and the errors without one), the checks on tensors,
// the path choice, the host path of tensor collectives, and DTRAIN_CUDA_COMM. What needs a GPU is in tests/gpu/
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/device.h"
#include "harness.h"
#include "torch/device/tensor_comm.h"

namespace dtrain {
namespace {

TEST(SelectDevice, CpuAndMalformedSpecs) {
  EXPECT_TRUE(selectDevice("cpu").is_cpu());
  EXPECT_NE(test::errorOf([] { selectDevice("tpu"); }).find("device 'tpu' (expected cpu, cuda, cuda:N or auto)"),
            std::string::npos);
}

// In a child: CUDA is initialised by the probe.
TEST(SelectDevice, CudaWithoutAGpuSaysWhy) {
  auto results = test::runRanks(1, [](int) {
    if (cudaDeviceCount() > 0) {
      std::printf("dtrain-test: a GPU is here\n");
      return;
    }
    EXPECT_FALSE(cudaUnavailableReason().empty());
    EXPECT_TRUE(selectDevice("auto", 3).is_cpu());
    for (const char* spec : {"cuda", "cuda:1"}) {
      const std::string err = test::errorOf([&] { selectDevice(spec, 0); });
      EXPECT_NE(err.find(std::string("device '") + spec + "': no GPU can be used: " + cudaUnavailableReason()),
                std::string::npos) << err;
    }
    if (!cudaBuilt()) {
      EXPECT_NE(cudaUnavailableReason().find("built without CUDA"), std::string::npos);
    }
  });
  test::expectAllOk(results);
  if (results[0].output.find("dtrain-test: a GPU is here") != std::string::npos) GTEST_SKIP() << "a GPU is here";
}

TEST(DeviceTensors, ChecksNameTheProblem) {
  EXPECT_NE(test::errorOf([] { device::checkTensor(at::Tensor(), "grad"); }).find("grad: undefined tensor"),
            std::string::npos);
  auto meta = torch::empty({4}, torch::TensorOptions().device(torch::kMeta));
  const std::string err = test::errorOf([&] { device::checkTensor(meta, "DDP parameter w"); });
  EXPECT_NE(err.find("DDP parameter w: tensor is on meta"), std::string::npos) << err;
  EXPECT_NE(err.find(cudaBuilt() ? "CPU and CUDA tensors" : "built without CUDA"), std::string::npos) << err;
  EXPECT_NE(test::errorOf([] { device::checkTensor(torch::zeros({4, 4}).t(), "x"); }).find("not contiguous"),
            std::string::npos);
  EXPECT_NE(test::errorOf([] { device::checkTensor(torch::zeros({2}, torch::kBool), "mask"); }).find("cannot be communicated"),
            std::string::npos);
}

// An output of another dtype than the input would be written with the input's element size (f32 into an
// f16 buffer: past its end): every collective refuses it before anything runs.
TEST(DeviceTensors, AnOutputOfAnotherDtypeIsRefused) {
  test::StoreServer server;
  auto pg = comm::ProcessGroup::create(server.client(), 0, 1, {});
  const auto in = torch::ones({8}), half = torch::zeros({8}, torch::kHalf);
  for (const auto& [name, call] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"allreduce", [&] { device::allreduce(*pg, in, half, comm::ReduceOp::sum)->wait(); }},
           {"allgather", [&] { device::allgather(*pg, in, half)->wait(); }},
           {"reduceScatter", [&] { device::reduceScatter(*pg, in, half, comm::ReduceOp::sum)->wait(); }}}) {
    const std::string err = test::errorOf(call);
    EXPECT_NE(err.find("collective: input of dtype Float, output of dtype Half (they must be the same)"), std::string::npos)
        << name << ": " << err;
  }
  EXPECT_TRUE(torch::equal(half, torch::zeros({8}, torch::kHalf))) << "the output was written";
}

// CPU tensors go to the group as they are, in place and out of place, even and uneven.
TEST(DeviceTensors, HostPathAtWorldThree) {
  test::StoreServer server;
  auto results = test::runRanks(3, [&](int rank) {
    auto pg = comm::ProcessGroup::create(server.client(), rank, 3);
    auto t = torch::full({5}, static_cast<float>(rank + 1));
    EXPECT_EQ(device::pathFor(*pg, t), device::Path::host);
    device::allreduce(*pg, t, comm::ReduceOp::sum)->wait();
    EXPECT_TRUE(torch::equal(t, torch::full({5}, 6.0f)));
    auto out = torch::empty({5});
    device::allreduce(*pg, torch::full({5}, static_cast<float>(rank)), out, comm::ReduceOp::max)->wait();
    EXPECT_TRUE(torch::equal(out, torch::full({5}, 2.0f)));
    auto b = torch::full({3}, static_cast<double>(rank));
    device::broadcast(*pg, b, 2)->wait();
    EXPECT_TRUE(torch::equal(b, torch::full({3}, 2.0, torch::kDouble)));
    auto all = torch::empty({6}, torch::kLong);
    device::allgather(*pg, torch::full({2}, static_cast<int64_t>(rank), torch::kLong), all)->wait();
    EXPECT_TRUE(torch::equal(all, torch::tensor({0, 0, 1, 1, 2, 2}, torch::kLong)));
    auto part = torch::empty({2});
    device::reduceScatter(*pg, torch::arange(6, torch::kFloat), part, comm::ReduceOp::sum)->wait();
    EXPECT_TRUE(torch::equal(part, torch::tensor({3.0f * 2 * rank, 3.0f * (2 * rank + 1)})));
    // Uneven: rank r sends r + 1 elements.
    auto mine = torch::full({rank + 1}, static_cast<float>(rank));
    auto gathered = torch::empty({6});
    const std::vector<size_t> counts{1, 2, 3};
    device::onHost(*pg, mine, gathered, [&](const void* in, void* o) {
      return pg->allgatherv(in, o, counts, comm::DType::f32);
    })->wait();
    EXPECT_TRUE(torch::equal(gathered, torch::tensor({0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 2.0f})));
    EXPECT_NE(test::errorOf([&] { device::allgather(*pg, mine, torch::empty({5})); }).find("allgather: output elements"),
              std::string::npos);
  });
  test::expectAllOk(results);
}

// What every rank's inputs reduce to under `op`: the reference the host path is compared with.
at::Tensor reduced(const at::Tensor& stacked, comm::ReduceOp op) {
  switch (op) {
    case comm::ReduceOp::sum: return stacked.sum(0);
    case comm::ReduceOp::avg: return stacked.mean(0);
    case comm::ReduceOp::min: return stacked.amin(0);
    case comm::ReduceOp::max: return stacked.amax(0);
    case comm::ReduceOp::prod: return stacked.prod(0);
  }
  return {};
}

// "9 8": a 1-d tensor's values on one line, for the messages.
std::string valuesOf(const at::Tensor& t) {
  std::string s;
  for (int64_t i = 0; i < t.numel(); ++i) s += fmt::format("{}{:g}", i ? " " : "", t[i].item<double>());
  return s;
}

// Rank r's input of n elements: small whole numbers (products stay exact) that differ across the ranks in
// every element, so that every op gives another result.
at::Tensor inputOf(int rank, int64_t n) {
  return (torch::arange(n, torch::kDouble) * 3 + rank * 7).remainder(5) + 1;
}

// Every reduce op through every host-path collective that reduces, at world 3: allreduce in place and out
// of place (7 elements: not a multiple of the world), reduceScatter (even blocks of 2) and, through
// onHost, reduceScatterv (uneven blocks of 1, 2 and 3). Each result is compared with the op applied to
// every rank's input here.
TEST(DeviceTensors, HostPathAppliesEveryReduceOpAtWorldThree) {
  test::StoreServer server;
  constexpr int world = 3;
  auto results = test::runRanks(world, [&](int rank) {
    auto pg = comm::ProcessGroup::create(server.client(), rank, world);
    auto all = [&](int64_t n) {
      std::vector<at::Tensor> each;
      for (int r = 0; r < world; ++r) each.push_back(inputOf(r, n));
      return torch::stack(each);
    };
    for (comm::ReduceOp op : {comm::ReduceOp::sum, comm::ReduceOp::avg, comm::ReduceOp::min, comm::ReduceOp::max,
                              comm::ReduceOp::prod}) {
      const std::string name = comm::reduceOpName(op);
      const at::Tensor want7 = reduced(all(7), op), want6 = reduced(all(6), op);
      auto t = inputOf(rank, 7);
      device::allreduce(*pg, t, op)->wait();
      EXPECT_TRUE(torch::allclose(t, want7))
          << name << " allreduce in place: " << valuesOf(t) << ", expected " << valuesOf(want7);
      auto out = torch::empty({7}, torch::kDouble);
      device::allreduce(*pg, inputOf(rank, 7), out, op)->wait();
      EXPECT_TRUE(torch::allclose(out, want7))
          << name << " allreduce: " << valuesOf(out) << ", expected " << valuesOf(want7);
      auto part = torch::empty({2}, torch::kDouble);
      device::reduceScatter(*pg, inputOf(rank, 6), part, op)->wait();
      const at::Tensor mine = want6.narrow(0, 2 * rank, 2);
      EXPECT_TRUE(torch::allclose(part, mine))
          << name << " reduceScatter: " << valuesOf(part) << ", expected " << valuesOf(mine);
      // Uneven: rank r gets block r of r + 1 elements (offsets 0, 1, 3).
      const std::vector<size_t> counts{1, 2, 3};
      auto piece = torch::empty({rank + 1}, torch::kDouble);
      device::onHost(*pg, inputOf(rank, 6), piece, [&](const void* in, void* o) {
        return pg->reduceScatterv(in, o, counts, comm::DType::f64, op);
      })->wait();
      const at::Tensor block = want6.narrow(0, rank * (rank + 1) / 2, rank + 1);
      EXPECT_TRUE(torch::allclose(piece, block))
          << name << " reduceScatterv: " << valuesOf(piece) << ", expected " << valuesOf(block);
    }
  });
  test::expectAllOk(results);
}

// The path choice is a pure function of every rank's place (path.h).
TEST(PathChoice, FromEveryRanksPlace) {
  using device::Path;
  using device::Place;
  const Place cpu = Place::cpu(), g0{0, 100}, g1{1, 101}, g0b{0, 102};
  auto choose = [](std::vector<Place> p, const char* mode = "auto", bool nccl = true) {
    return device::choosePath(p, mode, nccl);
  };
  EXPECT_EQ(choose({cpu, cpu, cpu}).path, Path::host);
  EXPECT_EQ(choose({cpu}).path, Path::host);
  EXPECT_EQ(choose({g0}).path, Path::nccl);                // a world of one
  EXPECT_EQ(choose({g0, g1, g0b}).path, Path::nccl);       // a GPU of its own each (index 0 on two hosts)
  EXPECT_EQ(choose({g0, g1, g0b}, "staged").path, Path::staged);
  EXPECT_EQ(choose({g0, g1, g0b}, "nccl").path, Path::nccl);
  EXPECT_EQ(choose({g0, g1, g0b}, "auto", false).path, Path::staged);  // no NCCL in this build
  EXPECT_EQ(choose({g0, g1, g0}).path, Path::staged);      // ranks 0 and 2 share one GPU
  for (const auto& c : {choose({g0, g1, g0}), choose({g0, g1, g0}, "auto", false), choose({cpu, cpu}, "staged")})
    EXPECT_TRUE(c.error.empty()) << c.error;
  const std::string shared = choose({g0, g1, g0}, "nccl").error;
  EXPECT_NE(shared.find("ranks 0 and 2 share one GPU, and NCCL refuses two ranks on one GPU"), std::string::npos) << shared;
  EXPECT_NE(choose({g0, g1}, "nccl", false).error.find("built without NCCL"), std::string::npos);
  // NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1 on every rank: mode nccl may share a GPU; auto still stages
  // (NCCL calls it experimental: hangs possible).
  Place s0 = g0, s1 = g1;
  s0.nccl_shares_gpus = s1.nccl_shares_gpus = true;
  EXPECT_EQ(choose({s0, s1, s0}, "nccl").path, Path::nccl);
  EXPECT_EQ(choose({s0, s1, s0}).path, Path::staged);
  EXPECT_NE(choose({s0, s1, g0}, "nccl").error.find("ranks 0 and 2 share one GPU"), std::string::npos);
  EXPECT_NE(choose({cpu}, "nvlink").error.find("cuda_path 'nvlink' (expected auto, nccl or staged)"), std::string::npos);
  // CPU on some ranks, a GPU on others: refused, naming each rank's place, in every mode.
  for (const char* mode : {"auto", "nccl", "staged"}) {
    const std::string mixed = choose({cpu, g1, cpu}, mode).error;
    EXPECT_NE(mixed.find("the ranks pass tensors of different kinds (rank 0 on cpu, rank 1 on cuda:1, rank 2 on cpu)"),
              std::string::npos) << mixed;
  }
  std::vector<Place> many(10, g0);
  for (int r = 0; r < 10; ++r) many[static_cast<size_t>(r)].gpu = static_cast<uint64_t>(r + 1);
  many[9] = cpu;
  const std::string long_list = choose(many).error;
  EXPECT_NE(long_list.find("rank 7 on cuda:0 and 2 more)"), std::string::npos) << long_list;
}

TEST(PathChoice, NcclSharesGpusOnlyWhenAskedFor) {
  ::unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
  EXPECT_FALSE(device::ncclSharesGpus());
  ::setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
  if (!comm::ncclBuilt()) {
    EXPECT_FALSE(device::ncclSharesGpus());
  }
  ::unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
}

// The agreement runs over the group: a rank that passes a CUDA tensor where the others pass CPU tensors
// makes every rank fail with the same words (before, the CUDA rank's exchange met the others' data op and
// the error was the group's fingerprint mismatch, which did not say why). No GPU is needed: the place is
// given as the CUDA path would compute it.
TEST(PathChoice, AGroupOfCpuAndCudaRanksFailsOnEveryRank) {
  test::StoreServer server;
  auto results = test::runRanks(3, [&](int rank) {
    auto pg = comm::ProcessGroup::create(server.client(), rank, 3);
    const device::Place mine = rank == 1 ? device::Place{0, 42} : device::Place::cpu();
    const std::string err = test::errorOf([&] { device::agreePath(*pg, mine); });
    EXPECT_NE(err.find("[rank " + std::to_string(rank) + "] tensor collective: the ranks pass tensors of different kinds "
                       "(rank 0 on cpu, rank 1 on cuda:0, rank 2 on cpu)"), std::string::npos) << err;
    // The group is still usable, and CPU tensors everywhere agree on the host path.
    EXPECT_EQ(device::agreePath(*pg, device::Place::cpu()), device::Path::host);
    auto t = torch::full({2}, 1.0f);
    device::allreduce(*pg, t, comm::ReduceOp::sum)->wait();
    EXPECT_TRUE(torch::equal(t, torch::full({2}, 3.0f)));
  });
  test::expectAllOk(results);
}

TEST(CudaComm, FromTheEnvironment) {
  ::setenv("DTRAIN_CUDA_COMM", "staged", 1);
  EXPECT_EQ(comm::GroupOptions::fromEnv().cuda_path, "staged");
  ::setenv("DTRAIN_CUDA_COMM", "nvlink", 1);
  EXPECT_NE(test::errorOf([] { comm::GroupOptions::fromEnv(); }).find("DTRAIN_CUDA_COMM='nvlink' (expected auto, nccl or staged)"),
            std::string::npos);
  ::unsetenv("DTRAIN_CUDA_COMM");
  EXPECT_EQ(comm::GroupOptions::fromEnv().cuda_path, "auto");
}

}  // namespace
}  // namespace dtrain
