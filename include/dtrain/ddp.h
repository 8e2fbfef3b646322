/// @file
/// DistributedDataParallel for libtorch: add it to a single-process training loop and the loop trains
/// on many processes, each on its share of the batch, with gradients averaged as backward runs.
///
/// \code
///   auto dist = dtrain::init();
///   auto model = std::make_shared<Net>();
///   dtrain::DistributedDataParallel ddp(model, dist.world());   // broadcasts rank 0's weights
///   torch::optim::SGD opt(model->parameters(), 0.1);
///   for (auto& batch : loader) {
///     opt.zero_grad();
///     auto loss = loss_fn(model->forward(batch.data), batch.target);
///     loss.backward();          // buckets of gradients are averaged across ranks while backward runs,
///                               // then rank 0's buffers (BatchNorm statistics) are broadcast
///     opt.step();               // sees the averaged gradients
///   }
///   // gradient accumulation: { auto guard = ddp.noSync(); loss.backward(); } ... then a synced backward
///   // ranks with different numbers of batches: dtrain::Join (join.h)
/// \endcode
///
/// How: every parameter's gradient lives in a flat bucket (param.grad() is a view into it, so nothing
/// is copied). Buckets hold parameters in reverse order (about 1 MB for the first, 25 MB for the rest)
/// because backward produces gradients roughly last layer first. A hook on each parameter's gradient
/// accumulator marks it ready; when a bucket is complete its allreduce starts at once, while backward
/// goes on with earlier layers. Buckets are launched in index order on every rank, so all ranks issue
/// the same collectives in the same order. At the end of backward (an autograd engine callback) the
/// step waits for every bucket. After the first iteration the buckets are rebuilt in the order the
/// gradients actually arrived (rank 0's order, broadcast), so later buckets fill and launch earlier.
///
/// Buffers (broadcast_buffers): PyTorch's DDP broadcasts rank 0's buffers at the start of a forward
/// that follows a synced training forward, so with BatchNorm every rank computes with rank 0's running
/// statistics, and those evolve from rank 0's batches only. libtorch modules have no forward hook, so
/// dtrain broadcasts them at the end of every synced backward instead (one broadcast per dtype, issued
/// behind the last gradient bucket): the forward that comes next starts from rank 0's buffers, as in
/// PyTorch, and the training loop needs no call of its own. noSync() passes broadcast nothing (PyTorch:
/// the forwards after a no_sync forward do not either); eval forwards change no BatchNorm buffer. The
/// difference: a forward in training mode that is not followed by a synced backward leaves its update
/// on each rank until the next synced backward (PyTorch would broadcast at the next forward); call
/// beforeForward() there if it matters.
#pragma once
#include <torch/nn/module.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/trace.h"

namespace dtrain {

/// Options of a DistributedDataParallel (PyTorch DDP's, where the names match).
struct DDPOptions {
  /// Bucket sizes in bytes; PyTorch's defaults and rule (a bucket closes once it holds at least its cap).
  size_t bucket_bytes = 25u << 20;
  size_t first_bucket_bytes = 1u << 20;  ///< the first bucket's cap (small, so that its allreduce starts early)
  /// A rule of dtrain's own, off by default (0: PyTorch's buckets exactly): the bucket that holds the
  /// last gradient of a pass, when larger than last_bucket_bytes, keeps only its tail (from the last
  /// parameter back, up to the one that reaches last_bucket_bytes, as first_bucket_bytes is applied
  /// from the front); the rest of it, when at least as large, becomes a bucket of its own, reduced while
  /// the tail's gradients are computed. PyTorch's rule leaves the whole last bucket (up to bucket_bytes,
  /// often the model's largest layers) to be reduced after backward ends: on dtrain-bench's reference MLP
  /// 23 MB, against 6.4 MB with last_bucket_bytes = 1 MiB. That pays where communication has a core (or a
  /// GPU's copy engine) of its own; on CPUs busy with every rank's compute, reducing during backward
  /// slows backward by about as much (docs/PERFORMANCE.md, "Overlap at 4 ranks": no consistent gain on
  /// 2 cores).
  size_t last_bucket_bytes = 0;
  /// Parameters that get no gradient in a backward pass are allowed. When false, such a pass is an error
  /// naming them. When true, as in one process on the global batch (and as PyTorch's DDP):
  ///   - a parameter that some rank used is averaged as usual, the ranks that did not use it adding zeros;
  ///   - a parameter that no rank used in the accumulation window (the synced pass and the noSync passes
  ///     before it) keeps the gradient it had before the window: an undefined one stays undefined (what
  ///     Optimizer::zero_grad() leaves on libtorch 2.x), so the optimizer skips it (no momentum, no weight
  ///     decay), and a defined one keeps its value. With comm hooks and under dtrain::Join too.
  /// It costs one small allreduce per synced pass (an int32 per parameter, after the last bucket).
  bool find_unused_parameters = false;
  /// Broadcast buffers (e.g. BatchNorm running statistics) from rank 0 at the end of every synced
  /// backward (see above) and in beforeForward(). false: each rank keeps its own buffers.
  bool broadcast_buffers = true;
  /// Rebuild buckets after the first iteration in gradient arrival order.
  bool rebuild_buckets = true;

  /// Bucket-size tuning (docs/PERFORMANCE.md, "Self-tuning"). When on, the synced passes after the first
  /// try the bucket caps of a fixed list (1, 2, 4, 8, 16, 25 and 64 MiB, first bucket 1 MiB, and the two
  /// sizes above; caps that give the same buckets count once; last_bucket_bytes is kept as it is), in
  /// tune_rounds rounds, one synced pass per cap per round, each timed from its first gradient to the
  /// end of its backward (backward with the buckets' allreduces beside it, and what backward did not
  /// hide).
  /// Every rank's times are combined (the slowest rank's), each cap's median is taken and the fastest
  /// cap is kept from then on. Training goes on meanwhile: every pass's gradients are averaged as
  /// always. Rank 0 appends the choice to the tuning cache (DTRAIN_TUNE_CACHE, else
  /// $XDG_CACHE_HOME/dtrain/tune.tsv, else ~/.cache/dtrain/tune.tsv), keyed by rank 0's host name,
  /// the world size, the transport, the device type and the parameters' sizes; a later run that finds
  /// its key takes the cached sizes after its first pass and times nothing.
  ///   from_env: DTRAIN_TUNE decides: on, off or refresh (unset: off). The default stays off: tuned
  ///             buckets change the order of floating-point sums, so the same command could give
  ///             different bits from run to run depending on a cache file.
  ///   on:      tune, unless the cache knows this key.    refresh: tune and replace the cached choice.
  ///   off:     keep bucket_bytes and first_bucket_bytes.
  /// Tuning stops (back to the sizes above) when a comm hook is registered or a dtrain::Join scope is
  /// active (a hook's per-bucket state, a joined rank's shadow passes); a world of one does not tune.
  /// Every rank must tune or not alike (a rank that does not would meet the others' extra collectives).
  enum class Tune {
    from_env,  ///< DTRAIN_TUNE decides: on, off or refresh (unset: off)
    off,       ///< keep bucket_bytes and first_bucket_bytes
    on,        ///< tune, unless the cache knows this key
    refresh    ///< tune and replace the cached choice
  };
  Tune tune = Tune::from_env;  ///< whether to tune (see Tune)
  int tune_rounds = 5;  ///< timed passes per candidate cap (the median is kept); >= 1
};

/// What bucket-size tuning did (DistributedDataParallel::tuning()).
struct DDPTuning {
  /// Where tuning stands.
  enum class State {
    off,      ///< not tuning: the configured sizes (why_off says why)
    probing,  ///< timing the candidates
    cached,   ///< took the sizes the tuning cache holds for this key
    tuned     ///< timed the candidates and kept the fastest
  };
  State state = State::off;  ///< where tuning stands
  /// state off: why ("tuning is off ...", "a world of one rank", "a comm hook is registered", ...)
  std::string why_off;
  ///@{
  /// The sizes in use now (the configured ones until tuning ends).
  size_t bucket_bytes = 0, first_bucket_bytes = 0;
  ///@}
  /// tuned: every candidate, in the order tried, with its median time over the rounds (the
  /// slowest rank's time of each timed pass, backward and its exposed allreduce: not a whole step);
  /// `configured` marks DDPOptions' own sizes.
  struct Candidate {
    ///@{
    /// The caps tried.
    size_t bucket_bytes = 0, first_bucket_bytes = 0;
    ///@}
    size_t buckets = 0;  ///< how many buckets these caps make
    bool configured = false;  ///< DDPOptions' own sizes
    double median_ms = 0;  ///< the median of the rounds' times (ms)
    std::vector<double> ms;  ///< each round's time (ms)
  };
  std::vector<Candidate> candidates;  ///< tuned: every candidate, in the order tried
  std::string cache_path;  ///< the tuning cache read (and, when tuned, written) by rank 0
  std::string key;         ///< this job's key in it
};

namespace detail {
struct HookLane;
}
class DistributedDataParallel;

/// One bucket of gradients, as a communication hook sees it.
struct GradBucket {
  int index = 0;  ///< the bucket's index (buckets launch in index order)
  at::Tensor flat;                 ///< the gradients, contiguous (param.grad() are views into it)
  std::vector<size_t> params;      ///< indices into DistributedDataParallel::parameters()
  std::vector<at::Tensor> grads;   ///< per parameter of `params`: its gradient, a view into flat
  bool last = false;               ///< the last bucket of a pass (PyTorch's GradBucket::is_last())
  at::Tensor scratch;              ///< free for the hook's use (e.g. the compressed copy)

  /// A dependent step of this bucket's communication (see CommHook): `next` runs once `after` has
  /// completed (not if it failed) on DDP's hook thread, and returns the Work of the step after it, or
  /// nullptr. The result completes with the chain's last step and carries the first error of the chain.
  /// Call it from run() or from this bucket's own continuations, and return the chain's last Work.
  comm::WorkPtr then(const comm::WorkPtr& after, std::function<comm::WorkPtr()> next);
  /// The group continuations issue their collectives on (a hook whose chainsCollectives() is true).
  comm::ProcessGroup& chainGroup() const;

 private:
  friend class DistributedDataParallel;
  std::shared_ptr<detail::HookLane> lane_;
};

/// Decides how a bucket travels. run() is called on autograd's thread as soon as the bucket is complete
/// (buckets in index order, while backward goes on); it starts the communication and returns a Work
/// that completes once bucket.flat holds the averaged gradient. One collective:
///
/// \code
///   comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
///     b.scratch = b.flat.to(at::kHalf);
///     auto sum = pg.allreduce(b.scratch.data_ptr(), b.scratch.numel(), comm::DType::f16, comm::ReduceOp::avg);
///     return b.then(sum, [&b] { b.flat.copy_(b.scratch); return comm::WorkPtr(); });   // decompress
///   }
/// \endcode
///
/// Several dependent collectives (PowerSGD: allreduce P, orthogonalise, allreduce Q; top-k: allgather
/// the sizes, then allgatherv) chain with bucket.then(), never by waiting in run() (that would stall
/// backward). A hook whose continuations issue collectives says so in chainsCollectives(); they issue
/// them on bucket.chainGroup():
///
/// \code
///   bool chainsCollectives() const override { return true; }
///   comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
///     auto p = pg.allreduce(P(b), ...);                                // stage 1, on DDP's group
///     return b.then(p, [&b] {                                          // on DDP's hook thread
///       orthogonalise(P(b));
///       auto q = b.chainGroup().allreduce(Q(b), ...);                  // stage 2
///       return b.then(q, [&b] { b.flat.copy_(P(b).mm(Q(b).t())); return comm::WorkPtr(); });
///     });
///   }
/// \endcode
///
/// Order, the same on every rank whatever the timing: every rank must issue the same collectives in the
/// same order on a group, and ranks finish their first stages in different orders. So first stages go on
/// DDP's group from autograd's thread in bucket order, and every continuation runs on one DDP thread,
/// bucket by bucket in launch order (within a bucket in the order then() was called): bucket k+1's
/// continuations wait until all of bucket k's have run, even if bucket k+1's first stage finished
/// earlier. Continuations issue on a second group of the same ranks (chainGroup(), created by
/// registerCommHook), so that they never race the first stages that autograd's thread issues meanwhile.
class CommHook {
 public:
  virtual ~CommHook() = default;
  /// The hook's name, for logs and errors.
  virtual std::string name() const = 0;
  /// Starts the bucket's communication on pg and returns a Work that completes once bucket.flat holds the
  /// averaged gradient (see the class description).
  virtual comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& bucket) = 0;
  /// true: continuations issue collectives (on bucket.chainGroup()).
  virtual bool chainsCollectives() const { return false; }
};
/// Averages in float16 / bfloat16: half the bytes on the wire, gradients rounded to 16 bits. Where every
/// rank of the group shares memory (the shm transport), converting costs more than the halved bytes save,
/// so float32 buckets travel as they are there and rank 0 says so once on stderr; always: compress anyway.
std::shared_ptr<CommHook> fp16CompressHook(bool always = false);
/// As fp16CompressHook(), in bfloat16.
std::shared_ptr<CommHook> bf16CompressHook(bool always = false);

/// Data parallelism: averages a module's gradients across the ranks of a group while backward runs (see
/// the file's description).
class DistributedDataParallel {
 public:
  /// Collective: broadcasts rank 0's parameters and buffers, builds the buckets and hooks the gradients of
  /// module's parameters that require grad.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<comm::ProcessGroup> pg,
                          DDPOptions options = {});
  /// Removes the gradient hooks; the module keeps its parameters and gradients.
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Broadcasts rank 0's buffers now (broadcast_buffers). Not needed in a training loop (every synced
  /// backward ends with this broadcast); for a forward that follows forwards without a synced backward.
  /// A collective: every rank calls it. An error inside a dtrain::Join scope (a joined rank cannot
  /// shadow it).
  void beforeForward();
  /// forward with beforeForward() first: ddp.forward(model, x) == model->forward(x) after a buffer sync.
  /// The timeline shows it as "forward" (a loop that calls model->forward itself marks it with
  /// DTRAIN_SPAN("forward", "compute")).
  template <typename M, typename... Args>
  auto forward(M& model, Args&&... args) {
    DTRAIN_SPAN("forward", "compute");
    beforeForward();
    return model->forward(std::forward<Args>(args)...);
  }

  /// While the returned guard lives, backward passes only accumulate gradients locally.
  class NoSync {
   public:
    /// Turns gradient synchronisation of d off until the guard's end.
    explicit NoSync(DistributedDataParallel* d) : d_(d) { d_->setSync(false); }
    /// Turns it back on.
    ~NoSync() { d_->setSync(true); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel* d_;
  };
  /// A NoSync guard: `{ auto guard = ddp.noSync(); loss.backward(); }` accumulates gradients locally.
  [[nodiscard]] NoSync noSync() { return NoSync(this); }

  /// Every rank registers the same hook at the same point (a collective when hook->chainsCollectives():
  /// it creates the chain group). nullptr: back to the plain average.
  void registerCommHook(std::shared_ptr<CommHook> hook);

  /// The parameters whose gradients are averaged (those that require grad, each tensor once), in the module's order.
  const std::vector<at::Tensor>& parameters() const;
  /// Their qualified names, in the same order.
  const std::vector<std::string>& parameterNames() const;
  /// Current bucket layout: parameter indices per bucket (for tests and logs).
  std::vector<std::vector<size_t>> bucketLayout() const;
  /// The group the gradients are averaged over.
  comm::ProcessGroup& processGroup() const;

  /// Communication of the last synced backward pass.
  struct Stats {
    double comm_ms = 0;     ///< first bucket launched -> last bucket done
    double exposed_ms = 0;  ///< end of backward -> last bucket done (what backward did not hide)
    /// Payload bytes this process sent from the pass's first gradient to its end (comm::bytesSent():
    /// the buckets, whatever the hook, and the buffer broadcast; 0 on one rank).
    uint64_t bytes_sent = 0;
    /// The share of comm_ms that backward hid: 1 - exposed_ms / comm_ms (0 without communication).
    double hiddenFraction() const { return comm_ms > 0 ? std::max(0.0, 1.0 - exposed_ms / comm_ms) : 0.0; }
  };
  /// The figures of the last synced backward pass.
  Stats lastStats() const;
  /// Bucket-size tuning's state and findings (DDPOptions::tune).
  DDPTuning tuning() const;

  struct Impl;

 private:
  friend class Join;
  void setSync(bool on);
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<std::atomic<Impl*>> owner_;  // shared with the gradient hooks
};

}  // namespace dtrain
