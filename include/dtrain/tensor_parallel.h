// Tensor parallelism (Megatron-LM style): layers whose weight matrices are split across the ranks of
// a group, which compute one layer together on the same (replicated) input.
//
// \code
//   auto tp = mesh.tensor();                                 // or dist.world(): T ranks
//   torch::manual_seed(0);                                   // the same seed on every rank
//   dtrain::ParallelMLP mlp(/*hidden=*/1024, /*ffn=*/4096, tp);  // each rank holds 1/T of both matrices
//   at::Tensor y = mlp->forward(x);                          // x and y replicated: [.., 1024]
//   loss(y).backward();                                      // one allreduce forward, one backward
//   // exact slices of an existing model: dtrain::ColumnParallelLinear(full_linear, tp)
// \endcode
//
// The operators (every rank of the group calls them in the same order, forward and backward):
//   f  copyToTensorParallel      forward identity,                 backward allreduce(sum)
//   g  reduceFromTensorParallel  forward allreduce(sum),           backward identity
//      gatherFromTensorParallel  forward allgather along last dim, backward this rank's slice
//      scatterToTensorParallel   forward this rank's slice,        backward allgather along last dim
// f and g are conjugate: a replicated input enters a parallel region through f (each rank's
// gradient is a partial sum, so backward adds them up) and partial outputs leave through g.
// Unlike dtrain::allReduce (autograd.h), whose backward sums the gradients because each rank has its
// own loss, g assumes what tensor parallelism has: one loss, computed identically on every rank.
//
// Splits: a dimension of n is cut into T contiguous parts with rank r holding
// [r*n/T, (r+1)*n/T) (sizes differ by at most one, so n need not be divisible by T).
// Constructors without a full layer initialise an unsplit torch::nn::Linear / Embedding from the
// current RNG and keep this rank's slice: with the same seed, the model is the same whatever T is
// (at the price of materialising each full layer once while constructing).
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <utility>

#include "dtrain/comm/process_group.h"

namespace dtrain {

at::Tensor copyToTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg);
at::Tensor reduceFromTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg);
at::Tensor gatherFromTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg);
at::Tensor scatterToTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg);

// [begin, end) of part `index` when n is cut into `parts` contiguous, balanced parts.
std::pair<int64_t, int64_t> partitionRange(int64_t n, int parts, int index);

struct ColumnParallelLinearOptions {
  bool bias = true;
  // Allgather the output (full out_features on every rank) instead of leaving this rank's columns.
  bool gather_output = false;
};

// y = x A^T + b with A's rows (the output features) split: rank r computes output features
// partitionRange(out, T, r). Input replicated (enters through f).
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, std::shared_ptr<comm::ProcessGroup> pg,
                           ColumnParallelLinearOptions options = {});
  // This rank's rows of full->weight and full->bias (options.bias must match whether full has one).
  ColumnParallelLinearImpl(const torch::nn::Linear& full, std::shared_ptr<comm::ProcessGroup> pg,
                           ColumnParallelLinearOptions options = {});
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;  // [out_end - out_begin, in_features]
  at::Tensor bias;    // [out_end - out_begin] or undefined
  int64_t in_features, out_features, out_begin, out_end;

 private:
  void init(const at::Tensor& full_weight, const at::Tensor& full_bias);
  std::shared_ptr<comm::ProcessGroup> pg_;
  ColumnParallelLinearOptions options_;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  bool bias = true;
  // The input is already split along its last dim (the output of a ColumnParallelLinear); when
  // false, each rank takes its slice of a replicated input.
  bool input_is_parallel = true;
};

// y = x A^T + b with A's columns (the input features) split: rank r multiplies its input slice
// partitionRange(in, T, r) and g sums the partial products; the bias (replicated) is added after.
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, std::shared_ptr<comm::ProcessGroup> pg,
                        RowParallelLinearOptions options = {});
  RowParallelLinearImpl(const torch::nn::Linear& full, std::shared_ptr<comm::ProcessGroup> pg,
                        RowParallelLinearOptions options = {});
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;  // [out_features, in_end - in_begin]
  at::Tensor bias;    // [out_features] (whole, the same on every rank) or undefined
  int64_t in_features, out_features, in_begin, in_end;

 private:
  void init(const at::Tensor& full_weight, const at::Tensor& full_bias);
  std::shared_ptr<comm::ProcessGroup> pg_;
  RowParallelLinearOptions options_;
};
TORCH_MODULE(RowParallelLinear);

// The transformer MLP block: fc2(gelu(fc1(x))) with fc1 column-parallel and fc2 row-parallel, so the
// ffn-wide activation never leaves its rank: one allreduce forward (g) and one backward (f).
class ParallelMLPImpl : public torch::nn::Module {
 public:
  ParallelMLPImpl(int64_t hidden, int64_t ffn_hidden, std::shared_ptr<comm::ProcessGroup> pg);
  // Slices of an unsplit fc1 [ffn, hidden] and fc2 [hidden, ffn].
  ParallelMLPImpl(const torch::nn::Linear& fc1, const torch::nn::Linear& fc2, std::shared_ptr<comm::ProcessGroup> pg);
  at::Tensor forward(const at::Tensor& x);

  ColumnParallelLinear fc1{nullptr};
  RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(ParallelMLP);

// An embedding table whose rows (the vocabulary) are split: rank r looks up the ids in its range
// partitionRange(num_embeddings, T, r), writes zeros for the others, and g sums the ranks' results.
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, std::shared_ptr<comm::ProcessGroup> pg);
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, std::shared_ptr<comm::ProcessGroup> pg);
  // ids: integer tensor of any shape, replicated; values in [0, num_embeddings) (else InvalidArgument).
  at::Tensor forward(const at::Tensor& ids);

  at::Tensor weight;  // [vocab_end - vocab_begin, embedding_dim]
  int64_t num_embeddings, embedding_dim, vocab_begin, vocab_end;

 private:
  void init(const at::Tensor& full_weight);
  std::shared_ptr<comm::ProcessGroup> pg_;
};
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace dtrain
