// The reference MLP of benches/peers/torch_ddp.py (784-2048-2048-1024-10, 7.9M parameters, SGD momentum 0.9
// on a fixed batch per rank) and what the training benchmarks need to verify what they print: the
// same training in one process with plain libtorch, and a comparison of the parameters.
//
// \code
//   auto [x, y] = rankBatch(/*rank=*/0, /*rows=*/64);
//   auto ref = trainReference(x, y, /*steps=*/33);          // no dtrain involved
//   ParamCheck c = compareParams(net, ref, /*tol=*/0.02);    // c.wrong of c.tensors, c.max_rel
// \endcode
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain::bench {

// The models a benchmark can train: the reference MLP, or a small convolutional net on 3x32x32 images
// (conv 3-64-128-256-256-512, 3x3, ReLU, stride 2 at 128, 256 and 512; average pool; linear 512-1000;
// 2.8M parameters): compute-heavy for its size, where the MLP is parameter-heavy.
enum class BenchModel { mlp, conv };
// "mlp" or "conv"; InvalidArgument otherwise.
BenchModel parseBenchModel(const std::string& name);

// Seeded: every call returns the same initial weights.
torch::nn::Sequential referenceMlp();
torch::nn::Sequential benchModel(BenchModel m);

// Rank r's fixed batch (inputs [rows, 784] or [rows, 3, 32, 32], labels [rows]) from a generator
// seeded with r.
std::pair<at::Tensor, at::Tensor> rankBatch(int rank, int rows, BenchModel m = BenchModel::mlp);

// The ranks' batches 0..world-1 concatenated: the global batch a data-parallel step sees.
std::pair<at::Tensor, at::Tensor> globalBatch(int world, int rows_per_rank, BenchModel m = BenchModel::mlp);

// One SGD step (lr 0.01, momentum 0.9) on the mean cross entropy of (x, y); the benchmarks' step.
void sgdStep(torch::nn::Sequential& net, torch::optim::SGD& opt, const at::Tensor& x, const at::Tensor& y);
torch::optim::SGD makeSgd(torch::nn::Sequential& net);

// benchModel(m) after `steps` SGD steps on (x, y), in this process with plain libtorch.
torch::nn::Sequential trainReference(const at::Tensor& x, const at::Tensor& y, int steps, BenchModel m = BenchModel::mlp);

struct ParamCheck {
  int64_t wrong = 0;    // parameter tensors beyond the tolerance
  int64_t tensors = 0;  // parameter tensors compared
  double max_rel = 0;   // the largest relative error seen
};

// Compares net's parameters with ref's, tensor by tensor: the error of a tensor is
// ||net - ref|| / ||ref - init|| (init = referenceMlp()), its distance from the reference measured
// against how far training moved it. Element-wise or tighter checks cannot work: a mathematically
// equal computation in another summation order flips a few ReLUs within steps and drifts to
// relative errors of about 1e-3 after 30 steps, while not averaging, or averaging only some
// buckets, is off by order 1.
ParamCheck compareParams(torch::nn::Sequential& net, torch::nn::Sequential& ref, double tol,
                         BenchModel m = BenchModel::mlp);

// Data parallelism's invariant: every rank of pg holds the same parameters. Each of `params`' sums is
// compared across ranks (min against max, collective); wrong counts those that differ, max_rel is the
// largest relative spread.
ParamCheck ranksAgree(comm::ProcessGroup& pg, const std::vector<at::Tensor>& params);

int64_t countParams(torch::nn::Sequential& net);

}  // namespace dtrain::bench
