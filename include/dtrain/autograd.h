/// @file
/// Differentiable collectives: allGather and allReduce that autograd can run backward through, for
/// losses that look at every rank's data (contrastive losses such as MIL-NCE compare each clip with
/// every caption of the global batch).
///
/// \code
///   auto dist = dtrain::init();
///   auto& pg = *dist.world();
///   at::Tensor v = video_net->forward(clips);          // [local_batch, d], this rank's embeddings
///   at::Tensor t = text_net->forward(captions);        // [local_batch, d]
///   at::Tensor all_v = dtrain::allGather(v, pg);       // [global_batch, d], rank order
///   at::Tensor all_t = dtrain::allGather(t, pg);
///   at::Tensor loss = milnce(all_v, all_t);            // every rank computes the loss of the global batch
///   loss.backward();                                   // gradients flow back into v and t
/// \endcode
///
/// Conventions (the same as torch.distributed.nn.functional): rank r computes its own loss L_r from the
/// collective's output; the gradient each rank receives for its input x_r is d(sum_j L_j)/dx_r, i.e.
/// the gradient of the sum of all ranks' losses. Let g_j be the gradient of L_j w.r.t. the output on
/// rank j.
///
/// Rules of use:
///  - Every rank must call these ops in the same order (forward) and, for the ops whose backward
///    communicates, run backward through them in the same order too: a rank whose loss does not
///    depend on the output still has to run backward through it, or the other ranks wait until the
///    group's timeout. (Unused outputs get a zero gradient, so `loss + 0 * out.sum()` is enough.)
///  - The ProcessGroup is held by reference in the autograd graph: it must outlive every backward
///    pass through the op (keep the Distributed / shared_ptr alive for the training loop).
///  - Tensors are CPU tensors of a dtype dtrain::comm transfers (float32/64, float16, bfloat16 for
///    gradients; integers pass forward only); non-contiguous inputs are made contiguous first.
#pragma once
#include <ATen/core/Tensor.h>

#include "dtrain/comm/process_group.h"

namespace dtrain {

/// What allGather's backward returns to rank r, whose input x_r became rows [o_r, o_r + n_r) of the
/// gathered output.
enum class AllGatherGrad {
  /// sum_j g_j[o_r : o_r + n_r]: a reduce-scatter (sum) of the incoming gradients. The exact gradient
  /// of sum_j L_j when each rank computes its own loss (torch.distributed.nn.functional.all_gather).
  /// When every rank computes the *same* global loss L from the gathered tensors (g_j = g for all j),
  /// rank r gets W * dL/dx_r, and once DDP averages parameter gradients over the W ranks the update
  /// is exactly dL/dtheta: the gradient of the global-batch loss.
  sum,
  /// g_r[o_r : o_r + n_r]: this rank's slice of its own incoming gradient, no communication in
  /// backward. This is the AllGather of the MIL-NCE / HowTo100M reference code. With the same global
  /// loss L on every rank, rank r gets dL/dx_r (1/W of `sum`), so after DDP's average the update is
  /// dL/dtheta / W: with SGD that code trains at an effective learning rate of lr / W compared
  /// with the exact gradient (Adam is nearly invariant to that scale). Use `local` to reproduce its
  /// numbers, `sum` for the exact gradient. With
  /// per-rank losses that differ it drops the other ranks' terms and is not a true gradient.
  local,
};

/// Concatenation along dim 0 of every rank's x, in rank order. Ranks may have different dim-0 sizes
/// (including 0 rows); the other dims and the dtype must match on all ranks, else every rank throws
/// InvalidArgument listing each rank's shape. x must have at least one dimension. Costs one small
/// allgather of shapes (two when x has more than one dimension) before the data's allgatherv.
at::Tensor allGather(const at::Tensor& x, comm::ProcessGroup& pg, AllGatherGrad mode = AllGatherGrad::sum);

/// y = reduce_j x_j on every rank, out of place (x is unchanged). Same shape and dtype on all ranks.
/// Backward, for y = sum_j x_j:  dx_r = sum_j g_j             (an allreduce sum of the gradients);
///           for y = (1/W) sum_j x_j (avg): dx_r = (1/W) sum_j g_j  (an allreduce avg).
/// min, max and prod are forward-only: backward through them throws InvalidArgument.
at::Tensor allReduce(const at::Tensor& x, comm::ProcessGroup& pg, comm::ReduceOp op = comm::ReduceOp::sum);

}  // namespace dtrain
