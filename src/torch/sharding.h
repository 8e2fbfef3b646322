// What ZeroRedundancyOptimizer (zero.cc), FullyShardedDataParallel (fsdp.cc) and recomputation
// (recompute.cc) share (internal).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <vector>

#include "dtrain/recompute.h"

namespace dtrain {
namespace comm {
class ProcessGroup;
}

// torch.nn.utils.clip_grad_norm_ across the ranks of pg: the total 2-norm of the gradients of `counted`
// (each gradient counted on exactly one rank), then, when it is above max_norm, every gradient of
// `scaled` times max_norm / (norm + 1e-6). Returns the total norm; InvalidArgument naming `who` for a
// max_norm that is not positive and finite. Collective.
double clipGradNormAcross(comm::ProcessGroup& pg, const std::vector<at::Tensor>& counted,
                          const std::vector<at::Tensor>& scaled, double max_norm, const char* who);

// seq's children [from, to) run in order on the single input.
SegmentFn childrenOf(torch::nn::Sequential seq, int from, int to);

}  // namespace dtrain
