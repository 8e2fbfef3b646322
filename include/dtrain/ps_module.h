/// @file
/// Training a torch::nn::Module through the parameter server with the loop a DDP user writes.
///
/// \code
///   dtrain::ps::Worker worker(store, rank, world, num_servers, opts);   // opts.update = sgd or adam
///   dtrain::ps::DistributedModule psm(model, worker);    // declares the buckets; every worker starts from
///                                                         // worker 0's values
///   for (auto& batch : loader) {
///     psm.beforeForward();                               // installs the values the last step pulled
///     model->zero_grad();
///     auto loss = loss_fn(model->forward(batch.data), batch.target);
///     loss.backward();                                   // each bucket is pushed as soon as its gradients are in
///     psm.step();                                        // ends the step; starts pulling the new values
///   }
///   // sum_only servers (the workers run the optimizer): psm.step() leaves the mean gradient in each
///   // param.grad(), then call your optimizer's step() as after DDP's backward.
/// \endcode
///
/// Parameters are grouped into buckets by DistributedDataParallel's rule: reverse registration order
/// (backward produces the last layers' gradients first), about first_bucket_bytes for the first bucket
/// and bucket_bytes for the others. Each bucket is one PS tensor "<prefix>bucket<i>", cut into
/// partitions over the servers. A hook on every parameter's gradient accumulator copies its gradient into
/// its bucket; when a bucket is complete its push starts (asynchronously, on the Worker's thread) while
/// backward goes on.
/// step() pushes the buckets that are still incomplete (parameters without a gradient in this pass
/// contribute zeros: an unused branch is fine), waits for the pushes, ends the step (clock) and starts
/// the pulls; beforeForward() waits for them and copies the values into the parameters. Unused
/// parameters are treated as one process treats a parameter whose gradient is undefined: every push says
/// which elements carry a gradient (Worker::pushAsync with `used`), and a parameter that no worker used in
/// a step is not updated by the servers, nor its optimizer state (momentum, Adam's moments and its own
/// step count); one that some workers used is averaged with zeros from the others. A parameter counts as
/// used on a worker when backward gave it a gradient or its .grad() is defined (zeroed in place by
/// zero_grad(false), or by 1.13's zero_grad(): one process steps it with a zero gradient too). With sum_only servers
/// the workers also push how many of them used each parameter (PS tensor "<prefix>used", one float per
/// parameter), and step() leaves the .grad() of a parameter no worker used as it was (undefined after
/// zero_grad() on libtorch 2.x, so the local optimizer skips it). A backward that
/// starts before beforeForward() installed the pending values is an error (it would train on stale
/// parameters), as is a second gradient for a parameter whose bucket was already pushed.
#pragma once
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "dtrain/ps.h"

namespace dtrain::ps {

/// Options of a DistributedModule.
struct ModuleOptions {
  size_t bucket_bytes = 4u << 20;  ///< target size of each bucket after the first, in bytes
  /// The first bucket's size (a small one starts pushing earlier); 0: bucket_bytes.
  size_t first_bucket_bytes = 0;
  std::string prefix = "";  ///< PS names: "<prefix>bucket<i>" (several modules on one Worker need distinct prefixes)
  /// sum_only: gradients are divided by this; 0 means worker.numProcesses().
  int average_over = 0;
};

/// Trains a torch::nn::Module's parameters through the parameter server, bucket by bucket, with the loop
/// a DDP user writes (see the file's description).
class DistributedModule {
 public:
  /// Declares the buckets of the module's trainable parameters (float32 on the CPU) on `worker` and starts
  /// from worker 0's values.
  DistributedModule(std::shared_ptr<torch::nn::Module> module, Worker& worker, ModuleOptions options = {});
  /// Removes the gradient hooks and waits for the pushes and pulls in flight.
  ~DistributedModule();
  DistributedModule(const DistributedModule&) = delete;
  DistributedModule& operator=(const DistributedModule&) = delete;

  /// Waits for the pulls that step() started and copies the values into the parameters; call before forward.
  void beforeForward();
  /// Pushes the buckets still incomplete, waits for the pushes, ends the step and starts pulling the new values.
  void step();
  /// Pulls the current values (installed by the next beforeForward()): after Worker::loadState().
  void refresh();

  /// The number of buckets.
  size_t numBuckets() const;
  /// Parameter indices (into module->parameters()) of bucket b, in bucket order.
  const std::vector<size_t>& bucketParams(size_t b) const;
  /// Parameter indices per bucket (as DistributedDataParallel::bucketLayout(); same rule, same layout).
  std::vector<std::vector<size_t>> bucketLayout() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::ps
