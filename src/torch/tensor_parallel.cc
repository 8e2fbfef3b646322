// Tensor-parallel layers (see tensor_parallel.h). The collectives are dtrain's own autograd ops
// (autograd.h) where their gradient is the one tensor parallelism needs (allGather's `local` mode
// is exactly the backward of a gather whose consumers all compute the same loss); f, g and scatter
// need a different backward and are small custom Functions around the same calls.
#include "dtrain/tensor_parallel.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "dtrain/autograd.h"
#include "dtrain/comm/error.h"
#include "dtrain/tensor.h"
#include "torch/saved_group.h"

namespace dtrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using detail::savedGroup;  // the layers hold their group by shared_ptr (saved_group.h)

// The sum over the group, without a graph: dtrain::allReduce's forward.
at::Tensor sumOverGroup(const at::Tensor& x, comm::ProcessGroup& pg) {
  torch::NoGradGuard no_grad;
  return allReduce(x, pg, comm::ReduceOp::sum);
}

// Concatenation of every rank's x along the last dim (ranks may hold different widths).
at::Tensor gatherLastDim(const at::Tensor& x, comm::ProcessGroup& pg, AllGatherGrad mode) {
  DTRAIN_CHECK(x.dim() >= 1, InvalidArgument, "[rank {}] tensor parallel gather: a 0-dim tensor", pg.rank());
  return allGather(x.movedim(-1, 0), pg, mode).movedim(0, -1);
}

struct CopyToFn : torch::autograd::Function<CopyToFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::ProcessGroup* pg) {
    detail::saveGroup(ctx, *pg);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {sumOverGroup(grads[0], savedGroup(ctx)), at::Tensor()};
  }
};

struct ReduceFromFn : torch::autograd::Function<ReduceFromFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::ProcessGroup* pg) {
    return sumOverGroup(x, *pg);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct ScatterToFn : torch::autograd::Function<ScatterToFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::ProcessGroup* pg) {
    detail::saveGroup(ctx, *pg);
    auto [begin, end] = partitionRange(x.size(-1), pg->size(), pg->rank());
    return x.narrow(-1, begin, end - begin).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::NoGradGuard no_grad;
    return {gatherLastDim(grads[0], savedGroup(ctx), AllGatherGrad::local), at::Tensor()};
  }
};

// Every rank must hold at least one row / column: an empty shard has nothing to compute.
void checkShard(int64_t n, const comm::ProcessGroup& pg, const char* layer, const char* dim) {
  DTRAIN_CHECK(n >= pg.size(), InvalidArgument, "[rank {}] {}: {} {} cannot be split over {} ranks", pg.rank(), layer,
               n, dim, pg.size());
}

at::Tensor maybeBias(bool on, const at::Tensor& full_bias, const char* layer, int rank) {
  DTRAIN_CHECK(on == full_bias.defined(), InvalidArgument,
               "[rank {}] {}: options.bias is {} but the full layer {} a bias", rank, layer, on, on ? "has no" : "has");
  return full_bias;
}

}  // namespace

std::pair<int64_t, int64_t> partitionRange(int64_t n, int parts, int index) {
  DTRAIN_CHECK(parts >= 1 && index >= 0 && index < parts, InvalidArgument, "partitionRange: part {} of {}", index,
               parts);
  return {n * index / parts, n * (index + 1) / parts};
}

at::Tensor copyToTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg) { return CopyToFn::apply(x, &pg); }
at::Tensor reduceFromTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg) {
  return ReduceFromFn::apply(x, &pg);
}
at::Tensor gatherFromTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg) {
  return gatherLastDim(x, pg, AllGatherGrad::local);
}
at::Tensor scatterToTensorParallel(const at::Tensor& x, comm::ProcessGroup& pg) {
  DTRAIN_CHECK(x.dim() >= 1, InvalidArgument, "[rank {}] scatterToTensorParallel: a 0-dim tensor", pg.rank());
  return ScatterToFn::apply(x, &pg);
}

// ---- ColumnParallelLinear ----

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, std::shared_ptr<comm::ProcessGroup> pg,
                                                   ColumnParallelLinearOptions options)
    : ColumnParallelLinearImpl(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(options.bias)), std::move(pg),
                               options) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& full, std::shared_ptr<comm::ProcessGroup> pg,
                                                   ColumnParallelLinearOptions options)
    : pg_(std::move(pg)), options_(options) {
  DTRAIN_CHECK(pg_ != nullptr, InvalidArgument, "ColumnParallelLinear: null process group");
  init(full->weight, maybeBias(options.bias, full->bias, "ColumnParallelLinear", pg_->rank()));
}

void ColumnParallelLinearImpl::init(const at::Tensor& full_weight, const at::Tensor& full_bias) {
  torch::NoGradGuard no_grad;
  out_features = full_weight.size(0);
  in_features = full_weight.size(1);
  checkShard(out_features, *pg_, "ColumnParallelLinear", "output features");
  std::tie(out_begin, out_end) = partitionRange(out_features, pg_->size(), pg_->rank());
  weight = register_parameter("weight", full_weight.narrow(0, out_begin, out_end - out_begin).clone());
  if (full_bias.defined()) bias = register_parameter("bias", full_bias.narrow(0, out_begin, out_end - out_begin).clone());
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = torch::nn::functional::linear(copyToTensorParallel(x, *pg_), weight, bias);
  return options_.gather_output ? gatherFromTensorParallel(y, *pg_) : y;
}

// ---- RowParallelLinear ----

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, std::shared_ptr<comm::ProcessGroup> pg,
                                             RowParallelLinearOptions options)
    : RowParallelLinearImpl(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(options.bias)), std::move(pg),
                            options) {}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& full, std::shared_ptr<comm::ProcessGroup> pg,
                                             RowParallelLinearOptions options)
    : pg_(std::move(pg)), options_(options) {
  DTRAIN_CHECK(pg_ != nullptr, InvalidArgument, "RowParallelLinear: null process group");
  init(full->weight, maybeBias(options.bias, full->bias, "RowParallelLinear", pg_->rank()));
}

void RowParallelLinearImpl::init(const at::Tensor& full_weight, const at::Tensor& full_bias) {
  torch::NoGradGuard no_grad;
  out_features = full_weight.size(0);
  in_features = full_weight.size(1);
  checkShard(in_features, *pg_, "RowParallelLinear", "input features");
  std::tie(in_begin, in_end) = partitionRange(in_features, pg_->size(), pg_->rank());
  weight = register_parameter("weight", full_weight.narrow(1, in_begin, in_end - in_begin).clone());
  if (full_bias.defined()) bias = register_parameter("bias", full_bias.clone());
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor xs = options_.input_is_parallel ? x : scatterToTensorParallel(x, *pg_);
  DTRAIN_CHECK(xs.size(-1) == in_end - in_begin, InvalidArgument,
               "[rank {}] RowParallelLinear: this rank's input slice has {} features, expected {} (input features "
               "[{}, {}) of {})",
               pg_->rank(), xs.size(-1), in_end - in_begin, in_begin, in_end, in_features);
  at::Tensor y = reduceFromTensorParallel(torch::nn::functional::linear(xs, weight), *pg_);
  return bias.defined() ? y + bias : y;
}

// ---- ParallelMLP ----

ParallelMLPImpl::ParallelMLPImpl(int64_t hidden, int64_t ffn_hidden, std::shared_ptr<comm::ProcessGroup> pg) {
  fc1 = register_module("fc1", ColumnParallelLinear(hidden, ffn_hidden, pg));
  fc2 = register_module("fc2", RowParallelLinear(ffn_hidden, hidden, pg));
}

ParallelMLPImpl::ParallelMLPImpl(const torch::nn::Linear& full_fc1, const torch::nn::Linear& full_fc2,
                                 std::shared_ptr<comm::ProcessGroup> pg) {
  fc1 = register_module("fc1", ColumnParallelLinear(full_fc1, pg));
  fc2 = register_module("fc2", RowParallelLinear(full_fc2, pg));
}

at::Tensor ParallelMLPImpl::forward(const at::Tensor& x) { return fc2->forward(torch::gelu(fc1->forward(x))); }

// ---- VocabParallelEmbedding ----

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t num, int64_t dim, std::shared_ptr<comm::ProcessGroup> pg)
    : VocabParallelEmbeddingImpl(torch::nn::Embedding(num, dim), std::move(pg)) {}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::Embedding& full,
                                                       std::shared_ptr<comm::ProcessGroup> pg)
    : pg_(std::move(pg)) {
  DTRAIN_CHECK(pg_ != nullptr, InvalidArgument, "VocabParallelEmbedding: null process group");
  init(full->weight);
}

void VocabParallelEmbeddingImpl::init(const at::Tensor& full_weight) {
  torch::NoGradGuard no_grad;
  num_embeddings = full_weight.size(0);
  embedding_dim = full_weight.size(1);
  checkShard(num_embeddings, *pg_, "VocabParallelEmbedding", "embeddings");
  std::tie(vocab_begin, vocab_end) = partitionRange(num_embeddings, pg_->size(), pg_->rank());
  weight = register_parameter("weight", full_weight.narrow(0, vocab_begin, vocab_end - vocab_begin).clone());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  DTRAIN_CHECK(ids.defined() && !at::isFloatingType(ids.scalar_type()), InvalidArgument,
               "[rank {}] VocabParallelEmbedding: ids must be an integer tensor", pg_->rank());
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    DTRAIN_CHECK(lo >= 0 && hi < num_embeddings, InvalidArgument,
                 "[rank {}] VocabParallelEmbedding: ids range over [{}, {}], the vocabulary is [0, {})", pg_->rank(),
                 lo, hi, num_embeddings);
  }
  // Ids of other ranks look up row 0 of this shard and are zeroed: every id is found on one rank.
  at::Tensor outside = (ids < vocab_begin).logical_or(ids >= vocab_end);
  at::Tensor local = (ids - vocab_begin).masked_fill(outside, 0);
  at::Tensor rows = torch::embedding(weight, local);
  rows = rows.masked_fill(outside.unsqueeze(-1), 0);
  return reduceFromTensorParallel(rows, *pg_);
}

}  // namespace dtrain
