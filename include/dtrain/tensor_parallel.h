/// @file
/// Tensor parallelism (Megatron-LM style): layers whose weight matrices are split across the ranks of
/// a group, which compute one layer together on the same (replicated) input.
///
/// \code
///   auto tp = mesh.tensor();                                 // or dist.world(): T ranks
///   torch::manual_seed(0);                                   // the same seed on every rank
///   dtrain::ParallelMLP mlp(/*hidden=*/1024, /*ffn=*/4096, tp);  // each rank holds 1/T of both matrices
///   at::Tensor y = mlp->forward(x);                          // x and y replicated: [.., 1024]
///   loss(y).backward();                                      // one allreduce forward, one backward
///   // exact slices of an existing model: dtrain::ColumnParallelLinear(full_linear, tp)
/// \endcode
///
/// The operators (every rank of the group calls them in the same order, forward and backward):
/// \verbatim
///   f  copyToTensorParallel      forward identity,                 backward allreduce(sum)
///   g  reduceFromTensorParallel  forward allreduce(sum),           backward identity
///      gatherFromTensorParallel  forward allgather along last dim, backward this rank's slice
///      scatterToTensorParallel   forward this rank's slice,        backward allgather along last dim
/// \endverbatim
/// f and g are conjugate: a replicated input enters a parallel region through f (each rank's
/// gradient is a partial sum, so backward adds them up) and partial outputs leave through g.
/// Unlike dtrain::allReduce (autograd.h), whose backward sums the gradients because each rank has its
/// own loss, g assumes what tensor parallelism has: one loss, computed identically on every rank.
///
/// Splits: a dimension of n is cut into T contiguous parts with rank r holding
/// [r*n/T, (r+1)*n/T) (sizes differ by at most one, so n need not be divisible by T).
/// Constructors without a full layer initialise an unsplit torch::nn::Linear / Embedding from the
/// current RNG and keep this rank's slice: with the same seed, the model is the same whatever T is
/// (at the price of materialising each full layer once while constructing).
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <utility>

#include "dtrain/comm/process_group.h"

namespace dtrain {

/// f: identity forward, allreduce (sum) of the gradient backward; where a replicated input enters.
at::Tensor copyToTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg);
/// g: allreduce (sum) forward, identity backward; where partial outputs leave.
at::Tensor reduceFromTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg);
/// Allgather along the last dim forward; this rank's slice of the gradient backward.
at::Tensor gatherFromTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg);
/// This rank's slice along the last dim forward; allgather of the gradient backward.
at::Tensor scatterToTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg);

/// [begin, end) of part `index` when n is cut into `parts` contiguous, balanced parts.
std::pair<int64_t, int64_t> partitionRange(int64_t n, int parts, int index);

/// Options of a ColumnParallelLinear.
struct ColumnParallelLinearOptions {
  bool bias = true;  ///< with a bias (split like the output features)
  /// Allgather the output (full out_features on every rank) instead of leaving this rank's columns.
  bool gather_output = false;
};

/// y = x A^T + b with A's rows (the output features) split: rank r computes output features
/// partitionRange(out, T, r). Input replicated (enters through f).
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  /// A new layer: an unsplit Linear initialised from the current RNG, of which this rank keeps its rows.
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, std::shared_ptr<comm::ProcessGroup> pg,
                           ColumnParallelLinearOptions options = {});
  /// This rank's rows of full->weight and full->bias (options.bias must match whether full has one).
  ColumnParallelLinearImpl(const torch::nn::Linear& full, std::shared_ptr<comm::ProcessGroup> pg,
                           ColumnParallelLinearOptions options = {});
  /// x: [.., in_features], replicated; returns this rank's output features, or all of them with gather_output.
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;  ///< [out_end - out_begin, in_features]
  at::Tensor bias;    ///< [out_end - out_begin] or undefined
  ///@{
  /// The full layer's sizes, and this rank's output features [out_begin, out_end).
  int64_t in_features, out_features, out_begin, out_end;
  ///@}

 private:
  void init(const at::Tensor& full_weight, const at::Tensor& full_bias);
  std::shared_ptr<comm::ProcessGroup> pg_;
  ColumnParallelLinearOptions options_;
};
/// dtrain::ColumnParallelLinear, the module holder of ColumnParallelLinearImpl.
TORCH_MODULE(ColumnParallelLinear);

/// Options of a RowParallelLinear.
struct RowParallelLinearOptions {
  bool bias = true;  ///< with a bias (whole on every rank, added after the sum)
  /// The input is already split along its last dim (the output of a ColumnParallelLinear); when
  /// false, each rank takes its slice of a replicated input.
  bool input_is_parallel = true;
};

/// y = x A^T + b with A's columns (the input features) split: rank r multiplies its input slice
/// partitionRange(in, T, r) and g sums the partial products; the bias (replicated) is added after.
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  /// A new layer: an unsplit Linear initialised from the current RNG, of which this rank keeps its columns.
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, std::shared_ptr<comm::ProcessGroup> pg,
                        RowParallelLinearOptions options = {});
  /// This rank's columns of full->weight, and full->bias whole (options.bias must match whether full has one).
  RowParallelLinearImpl(const torch::nn::Linear& full, std::shared_ptr<comm::ProcessGroup> pg,
                        RowParallelLinearOptions options = {});
  /// x: this rank's slice of the input (or the whole input without input_is_parallel); returns the full,
  /// replicated output [.., out_features].
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;  ///< [out_features, in_end - in_begin]
  at::Tensor bias;    ///< [out_features] (whole, the same on every rank) or undefined
  ///@{
  /// The full layer's sizes, and this rank's input features [in_begin, in_end).
  int64_t in_features, out_features, in_begin, in_end;
  ///@}

 private:
  void init(const at::Tensor& full_weight, const at::Tensor& full_bias);
  std::shared_ptr<comm::ProcessGroup> pg_;
  RowParallelLinearOptions options_;
};
/// dtrain::RowParallelLinear, the module holder of RowParallelLinearImpl.
TORCH_MODULE(RowParallelLinear);

/// The transformer MLP block: fc2(gelu(fc1(x))) with fc1 column-parallel and fc2 row-parallel, so the
/// ffn-wide activation never leaves its rank: one allreduce forward (g) and one backward (f).
class ParallelMLPImpl : public torch::nn::Module {
 public:
  /// A new block: fc1 hidden -> ffn_hidden, fc2 ffn_hidden -> hidden, initialised as unsplit layers.
  ParallelMLPImpl(int64_t hidden, int64_t ffn_hidden, std::shared_ptr<comm::ProcessGroup> pg);
  /// Slices of an unsplit fc1 [ffn, hidden] and fc2 [hidden, ffn].
  ParallelMLPImpl(const torch::nn::Linear& fc1, const torch::nn::Linear& fc2, std::shared_ptr<comm::ProcessGroup> pg);
  /// fc2(gelu(fc1(x))); x and the result replicated, [.., hidden].
  at::Tensor forward(const at::Tensor& x);

  ColumnParallelLinear fc1{nullptr};  ///< hidden -> ffn_hidden, column-parallel
  RowParallelLinear fc2{nullptr};  ///< ffn_hidden -> hidden, row-parallel
};
/// dtrain::ParallelMLP, the module holder of ParallelMLPImpl.
TORCH_MODULE(ParallelMLP);

/// An embedding table whose rows (the vocabulary) are split: rank r looks up the ids in its range
/// partitionRange(num_embeddings, T, r), writes zeros for the others, and g sums the ranks' results.
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  /// A new table: an unsplit Embedding initialised from the current RNG, of which this rank keeps its rows.
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, std::shared_ptr<comm::ProcessGroup> pg);
  /// This rank's rows of full->weight.
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, std::shared_ptr<comm::ProcessGroup> pg);
  /// ids: integer tensor of any shape, replicated; values in [0, num_embeddings) (else InvalidArgument).
  at::Tensor forward(const at::Tensor& ids);

  at::Tensor weight;  ///< [vocab_end - vocab_begin, embedding_dim]
  ///@{
  /// The full table's sizes, and this rank's rows (ids) [vocab_begin, vocab_end).
  int64_t num_embeddings, embedding_dim, vocab_begin, vocab_end;
  ///@}

 private:
  void init(const at::Tensor& full_weight);
  std::shared_ptr<comm::ProcessGroup> pg_;
};
/// dtrain::VocabParallelEmbedding, the module holder of VocabParallelEmbeddingImpl.
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace dtrain
