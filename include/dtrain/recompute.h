/// @file
/// Activation recomputation (gradient checkpointing): run a stretch of the forward pass keeping only
/// its inputs, and run it again inside backward to get the activations back. Memory for activations
/// drops to the segments' inputs plus one segment's activations at a time, for one more forward of the
/// recomputed parts (torch.utils.checkpoint).
///
/// \code
///   // A Sequential in 4 segments: all but the last are recomputed (checkpoint_sequential's rule).
///   auto y = dtrain::recomputeSequential(seq, 4, x);
///   // One submodule:
///   auto h = dtrain::recompute([&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{
///                                  block->forward(in[0])}; }, {x}, block->parameters())[0];
/// \endcode
///
/// The recomputed stretch's parameter gradients come out of this call's own backward node, in the outer
/// backward pass, like any other gradient: DDP's hooks, ZeRO and the pipeline see them at the usual time
/// (the recomputation itself runs torch::autograd::grad, which accumulates nothing). The default CPU
/// generator's state is put back for the recomputation, so dropout draws the same masks; buffers updated
/// in forward (BatchNorm's running statistics) are updated again by the recomputation, as in PyTorch.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <vector>

namespace dtrain {

/// A stretch of the forward pass, inputs to outputs, as recompute() runs it (again in backward).
using SegmentFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// fn(inputs), recomputed in backward. `params`: what fn uses besides its inputs that needs gradients
/// (a module's parameters()); those that do not require grad are ignored.
std::vector<at::Tensor> recompute(const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& params);

/// seq's children in `segments` consecutive runs of (nearly) equal length; every run but the last is
/// recomputed. InvalidArgument when segments < 1 or exceeds the number of children.
at::Tensor recomputeSequential(torch::nn::Sequential& seq, int segments, const at::Tensor& x);

}  // namespace dtrain
