// A consumer of dtrain::dtrain (the torch layer): one DDP training step on every rank, checked.
//   dtrain-run --standalone --nproc-per-node 2 consumer-ddp 2 [DEVICE]   (the expected world size; DEVICE
//   for dtrain::selectDevice, default auto: a GPU where there is one, else the CPU)
//
// Linear(4 -> 1) on a batch of 2 rows filled with rank + 1, loss = sum of the outputs: a rank's weight
// gradient is 2 * (rank + 1) in every element and its bias gradient 2, so DDP's average over the ranks is
// size + 1 and 2. Every rank starts from its own random weights: DDP must broadcast rank 0's.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "dtrain/build_info.h"
#include "dtrain/compat.h"
#include "dtrain/ddp.h"
#include "dtrain/device.h"
#include "dtrain/distributed.h"

namespace {

// Fails the check with a message naming the rank unless a and b are equal.
bool same(const char* what, int rank, const torch::Tensor& got, const torch::Tensor& want) {
  if (torch::equal(got, want)) return true;
  std::fprintf(stderr, "[rank %d] %s: got %s expected %s\n", rank, what,
               torch::str(got.flatten()).c_str(), torch::str(want.flatten()).c_str());
  return false;
}

}  // namespace

int main(int argc, char** argv) try {
  torch::set_num_threads(1);
  const int expected = argc > 1 ? std::atoi(argv[1]) : 1;
  auto dist = dtrain::init();
  const int rank = dist.rank(), size = dist.size();
  if (size != expected) {
    std::fprintf(stderr, "[rank %d] world size %d, expected %d (run it under dtrain-run)\n", rank, size, expected);
    return 1;
  }

  // The libtorch dtrain was built with and the one this program compiled against: the same MAJOR.MINOR
  // (dtrainConfig.cmake refuses another), which this prints and checks.
  const std::string built = dtrain::build_info::kTorchVersion, here = dtrain::compat::kTorchVersion;
  if (rank == 0)
    std::printf("consumer-ddp: dtrain %s built with libtorch %s; this program compiled against libtorch %s\n",
                dtrain::build_info::kVersion, built.c_str(), here.c_str());
  if (built.substr(0, built.rfind('.')) != here.substr(0, here.rfind('.'))) {
    std::fprintf(stderr, "[rank %d] dtrain was built with libtorch %s, this program with %s\n", rank, built.c_str(),
                 here.c_str());
    return 1;
  }

  const torch::Device dev = dtrain::selectDevice(argc > 2 ? argv[2] : "auto", dist.localRank());
  if (rank == 0)
    std::printf("consumer-ddp: on %s (dtrain %s CUDA)\n", dev.str().c_str(), dtrain::cudaBuilt() ? "with" : "without");
  torch::manual_seed(100 + rank);  // different weights on every rank before DDP
  torch::nn::Linear model(4, 1);
  model->to(dev);
  dtrain::DistributedDataParallel ddp(model.ptr(), dist.world());
  auto w0 = model->weight.detach().cpu().clone(), b0 = model->bias.detach().cpu().clone();

  // The same weights everywhere: the sum over the ranks is size times one's own.
  auto w_sum = w0.clone();
  dist.world()->allreduce(w_sum.data_ptr<float>(), w_sum.numel(), dtrain::comm::DType::f32,
                          dtrain::comm::ReduceOp::sum)->wait();
  bool ok = same("weights after DDP's broadcast, summed over ranks", rank, w_sum, w0 * size);

  torch::optim::SGD opt(model->parameters(), 0.5);
  opt.zero_grad();
  model->forward(torch::full({2, 4}, static_cast<float>(rank + 1), torch::TensorOptions().device(dev))).sum().backward();
  ok &= same("averaged weight gradient", rank, model->weight.grad().cpu(), torch::full({1, 4}, float(size + 1)));
  ok &= same("averaged bias gradient", rank, model->bias.grad().cpu(), torch::full({1}, 2.0f));
  opt.step();
  ok &= same("weight after the step", rank, model->weight.detach().cpu(), w0 - 0.5f * float(size + 1));
  ok &= same("bias after the step", rank, model->bias.detach().cpu(), b0 - 0.5f * 2.0f);
  if (ok) std::printf("[rank %d] consumer DDP step of %d ranks: ok\n", rank, size);
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
