// DistributedDataParallel for libtorch: add it to a single-process training loop and the loop trains
// on many processes, each on its share of the batch, with gradients averaged as backward runs.
//
// \code
//   auto dist = dtrain::init();
//   auto model = std::make_shared<Net>();
//   dtrain::DistributedDataParallel ddp(model, dist.world());   // broadcasts rank 0's weights
//   torch::optim::SGD opt(model->parameters(), 0.1);
//   for (auto& batch : loader) {
//     opt.zero_grad();
//     auto loss = loss_fn(model->forward(batch.data), batch.target);
//     loss.backward();          // buckets of gradients are averaged across ranks while backward runs
//     opt.step();               // sees the averaged gradients
//   }
//   // gradient accumulation: { auto guard = ddp.noSync(); loss.backward(); } ... then a synced backward
// \endcode
//
// How: every parameter's gradient lives in a flat bucket (param.grad() is a view into it, so nothing
// is copied). Buckets hold parameters in reverse order (about 1 MB for the first, 25 MB for the rest)
// because backward produces gradients roughly last layer first. A hook on each parameter's gradient
// accumulator marks it ready; when a bucket is complete its allreduce starts at once, while backward
// goes on with earlier layers. Buckets are launched in index order on every rank, so all ranks issue
// the same collectives in the same order. At the end of backward (an autograd engine callback) the
// step waits for every bucket. After the first iteration the buckets are rebuilt in the order the
// gradients actually arrived (rank 0's order, broadcast), so later buckets fill and launch earlier.
#pragma once
#include <torch/nn/module.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain {

struct DDPOptions {
  // Bucket sizes in bytes (PyTorch's defaults).
  size_t bucket_bytes = 25u << 20;
  size_t first_bucket_bytes = 1u << 20;
  // Parameters that get no gradient in a backward pass are allowed (their gradients are averaged as
  // they are, usually zero). When false, such a pass is an error naming them.
  bool find_unused_parameters = false;
  // Broadcast buffers (e.g. BatchNorm running statistics) from rank 0 in beforeForward().
  bool broadcast_buffers = true;
  // Rebuild buckets after the first iteration in gradient arrival order.
  bool rebuild_buckets = true;
};

// One bucket of gradients, as a communication hook sees it.
struct GradBucket {
  int index = 0;
  at::Tensor flat;                 // the gradients, contiguous (param.grad() are views into it)
  std::vector<size_t> params;      // indices into DistributedDataParallel::parameters()
  at::Tensor scratch;              // free for the hook's use (e.g. the compressed copy)
};

// Decides how a bucket travels. run() starts the communication and returns its Work; finish() runs
// after that Work completed and must leave the averaged gradient in bucket.flat.
class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual std::string name() const = 0;
  virtual comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& bucket) = 0;
  virtual void finish(GradBucket& bucket) {}
};
// Averages in float16 / bfloat16: half the bytes on the wire, gradients rounded to 16 bits.
std::shared_ptr<CommHook> fp16CompressHook();
std::shared_ptr<CommHook> bf16CompressHook();

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<comm::ProcessGroup> pg,
                          DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Call before each forward when the model has buffers that rank 0 owns (broadcast_buffers).
  void beforeForward();
  // forward with beforeForward() first: ddp.forward(model, x) == model->forward(x) plus buffer sync.
  template <typename M, typename... Args>
  auto forward(M& model, Args&&... args) {
    beforeForward();
    return model->forward(std::forward<Args>(args)...);
  }

  // While the returned guard lives, backward passes only accumulate gradients locally.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel* d) : d_(d) { d_->setSync(false); }
    ~NoSync() { d_->setSync(true); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel* d_;
  };
  [[nodiscard]] NoSync noSync() { return NoSync(this); }

  void registerCommHook(std::shared_ptr<CommHook> hook);

  const std::vector<at::Tensor>& parameters() const;
  const std::vector<std::string>& parameterNames() const;
  // Current bucket layout: parameter indices per bucket (for tests and logs).
  std::vector<std::vector<size_t>> bucketLayout() const;
  comm::ProcessGroup& processGroup() const;

  // Communication of the last synced backward pass.
  struct Stats {
    double comm_ms = 0;     // first bucket launched -> last bucket done
    double exposed_ms = 0;  // end of backward -> last bucket done (what backward did not hide)
    double hidden_fraction() const { return comm_ms > 0 ? std::max(0.0, 1.0 - exposed_ms / comm_ms) : 0.0; }
  };
  Stats lastStats() const;

  struct Impl;

 private:
  void setSync(bool on);
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<std::atomic<Impl*>> owner_;  // shared with the gradient hooks
};

}  // namespace dtrain
