/// @file
/// Top-k sparsification with error feedback, in the manner of Deep Gradient Compression (Lin et al.,
/// ICLR 2018, arXiv 1712.01887), as a DDP communication hook: each rank sends only the k largest
/// entries (by magnitude) of what it has accumulated, and keeps the rest for later steps.
///
/// \code
///   dtrain::TopKOptions o;
///   o.ratio = 0.01;                  // send 1% of each bucket
///   o.momentum = 0.9;                // momentum correction: use plain SGD (no momentum) as the optimizer
///   ddp.registerCommHook(dtrain::topKHook(o));
/// \endcode
///
/// Per bucket and rank, every step (DGC's algorithm 1 and its official code, per bucket):
/// \verbatim
///   g  = the bucket's gradient (clipped first to clip_norm / sqrt(world) when clip_norm > 0);
///   u  = momentum * u + g;  v += u          (momentum correction; nesterov: u = (u + g) * momentum,
///                                            v += u + g; momentum 0: v += g, plain error feedback)
///   the k = ceil(ratio_t * numel) entries of v largest in magnitude are sent as (index, value) pairs
///   and zeroed in v and in u (momentum-factor masking);
///   the bucket's gradient becomes the sum of every rank's pairs, divided by the world size.
/// \endverbatim
/// ratio_t warms up as DGC's does: during warm-up stage e (0-based, steps_per_stage steps each) it is
/// max(c^(e+1), ratio) with c = ratio^(1/(warmup_stages+1)); then ratio. The pairs travel by one
/// allgather of values and one of indices (k is the same on every rank). Buckets smaller than
/// min_compress_numel are averaged as they are.
///
/// The residual and momentum are kept per bucket: when DDP's bucket layout changes (it rebuilds its
/// buckets once, after the first step, unless DDPOptions::rebuild_buckets is false), the changed
/// buckets start again from zero. Bytes on the wire per bucket and rank: about k * (8 + element size)
/// * (world - 1), against 2 * numel * element size * (world - 1) / world for the ring allreduce.
#pragma once
#include <cstdint>
#include <memory>

#include "dtrain/ddp.h"

namespace dtrain {

/// Options of topKHook().
struct TopKOptions {
  double ratio = 0.01;                 ///< fraction of each bucket sent once warmed up, in (0, 1]
  double momentum = 0;                 ///< momentum correction factor, in [0, 1)
  bool nesterov = false;               ///< Nesterov momentum correction instead of the plain one
  double clip_norm = 0;                ///< local clipping threshold before sqrt(world) scaling; 0: none
  int warmup_stages = 0;               ///< DGC's sparsity warm-up (e.g. 4: 75%, 93.75%, ... sent less each stage)
  int64_t steps_per_stage = 1;         ///< steps per warm-up stage (DGC: an epoch)
  int64_t min_compress_numel = 1024;   ///< smaller buckets are averaged as they are
};

/// Throws InvalidArgument naming the option when one is out of range.
std::shared_ptr<CommHook> topKHook(TopKOptions options = {});

/// The fraction sent at a bucket's step `step` (0-based) under `o` (exposed for tests and logs).
double topKRatioAt(const TopKOptions& o, int64_t step);

}  // namespace dtrain
