// ZeroRedundancyOptimizer's state (internal to zero.cc and zero_state.cc).
#pragma once
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "dtrain/zero.h"

namespace dtrain {

struct ZeroRedundancyOptimizer::Impl {
  std::shared_ptr<comm::ProcessGroup> pg;
  ZeroOptions opts;
  std::vector<torch::optim::OptimizerParamGroup> groups;  // every parameter, the caller's options
  std::vector<at::Tensor> params;                         // groups concatenated, each tensor once
  std::vector<size_t> group_of;                           // per parameter
  std::vector<int> owner;                                 // per parameter
  std::vector<std::vector<size_t>> owned_by;              // per rank, in order
  std::unique_ptr<torch::optim::Optimizer> local;         // the owned parameters, one group per group
  at::Tensor staging;                                     // broadcast_bucket_bytes, for packed broadcasts

  // Broadcasts the parameters `batch` (indices, `bytes` in all) from `root`: in place when alone, else
  // packed through `staging`.
  void broadcastFrom(int root, const std::vector<size_t>& batch, size_t bytes);
  // Every parameter from its owner.
  void broadcastOwned();
};

// The tensors of an optimizer's per-parameter state (momentum buffers, moments), for memory reports.
std::vector<at::Tensor> optimizerStateTensors(const torch::optim::Optimizer& opt);

}  // namespace dtrain
