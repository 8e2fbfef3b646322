/// @file
/// PowerSGD gradient compression as a DistributedDataParallel comm hook, with PyTorch 1.13's
/// semantics (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook; Vogels et al., 2019):
/// each gradient matrix M (a weight viewed as shape[0] x rest) travels as two thin matrices P = M·Q
/// (n x r) and Q = Mᵀ·P (m x r) instead of n x m numbers, and arrives as P·Qᵀ.
///
/// \code
///   dtrain::DistributedDataParallel ddp(model, dist.world());
///   dtrain::PowerSGDOptions o;
///   o.matrix_approximation_rank = 4;   // bytes per matrix: (n + m)·r instead of n·m
///   o.start_powerSGD_iter = 100;       // plain allreduce for the first 100 steps
///   auto hook = dtrain::powerSGDHook(o);
///   ddp.registerCommHook(hook);        // every rank, same options
///   ... train ...
///   auto s = hook->compressionStats(); // elements per step before / after compression
///   ddp.lastStats().bytes_sent;        // what the last step sent
/// \endcode
///
/// Per bucket and step, past start_powerSGD_iter (before it: the plain average):
///  - with error feedback the bucket first gets back what compression lost at its last step;
///  - each gradient viewed as (n, m) with r = min(n, m, rank) is compressed iff
///    (n + m)·r·min_compression_rate < n·m; the others (biases, small matrices) are averaged as they
///    are, in one flat allreduce;
///  - the compressed ones, grouped by shape in order of first appearance: Q drawn at random (first
///    step, or every step without warm start) or last step's Q (warm start), orthogonalised; P = M·Q,
///    allreduced (sum), orthogonalised; Q = Mᵀ·P, allreduced and divided by the world size; M = P·Qᵀ.
/// Orthogonalisation is Gram-Schmidt at every rank (PyTorch: QR above rank 2, which agrees up to
/// column signs; they cancel in P·Qᵀ). Random Q: numpy's RandomState(random_seed).randint(10^9) seeds
/// a CPU generator as torch::manual_seed would (PyTorch reseeds the global one inside fork_rng; the
/// hook leaves the global generator alone), one seed per bucket initialisation in bucket order, then
/// torch::randn per matrix: the same seed gives PyTorch's Q. Every rank must use the same options.
///
/// batchedPowerSGDHook: the whole bucket zero-padded to side² (side = ⌈√numel⌉) and compressed as one
/// side x side matrix (PyTorch's batched_powerSGD_hook): less work per step, usually much less accuracy
/// unless the rank is 1. Same options, min_compression_rate unused.
#pragma once
#include <cstdint>
#include <memory>

#include "dtrain/ddp.h"

namespace dtrain {

/// Options of powerSGDHook() and batchedPowerSGDHook(), named as PyTorch's PowerSGDState.
struct PowerSGDOptions {
  int matrix_approximation_rank = 1;  ///< r: each matrix travels as P (n x r) and Q (m x r)
  /// Steps (synced backward passes) of plain allreduce before compression starts. With error feedback
  /// or warm start at least 2: DDP rebuilds its buckets after the first step.
  int64_t start_powerSGD_iter = 1000;
  double min_compression_rate = 2;  ///< a matrix is compressed iff (n + m)·r·min_compression_rate < n·m
  bool use_error_feedback = true;  ///< add back what compression lost at the bucket's last step
  bool warm_start = true;  ///< start from the last step's Q instead of a new random one every step
  /// Added to each column norm in orthogonalisation; 0 (PyTorch's default) divides a zero column by
  /// zero (NaN); 1e-8 avoids that.
  double orthogonalization_epsilon = 0;
  uint32_t random_seed = 0;  ///< seeds the random Q as PyTorch's hook does (same seed, same Q)
};

/// A PowerSGD comm hook (from powerSGDHook() or batchedPowerSGDHook()), with its statistics.
class PowerSGDHook : public CommHook {
 public:
  /// Elements of the last compressed step, all buckets (PyTorch's compression_stats()).
  struct Compression {
    int64_t before = 0;  ///< gradient elements
    int64_t after = 0;   ///< elements allreduced (P, Q and the uncompressed ones)
    /// before / after, or 0 before any compressed step.
    double rate() const { return after > 0 ? double(before) / double(after) : 0.0; }
  };
  /// The elements of the last compressed step, before and after compression.
  virtual Compression compressionStats() const = 0;
  /// Synced backward passes seen (PyTorch's state.iter).
  virtual int64_t iteration() const = 0;
};

/// The PowerSGD hook: register it with DistributedDataParallel::registerCommHook(). InvalidArgument for a
/// rank < 1, a negative rate or epsilon, or start_powerSGD_iter < 2 with error feedback or warm start.
std::shared_ptr<PowerSGDHook> powerSGDHook(const PowerSGDOptions& options = {});
/// The batched variant: the whole bucket zero-padded to a square matrix and compressed as one (see the
/// file's description). Same options and errors as powerSGDHook().
std::shared_ptr<PowerSGDHook> batchedPowerSGDHook(const PowerSGDOptions& options = {});

}  // namespace dtrain
